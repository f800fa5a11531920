"""Property tests: every policy finishes, runs each task once, respects dependencies and its memory cap, and the
static ones follow Megatron's order — under arbitrary interleavings of rank steps and message deliveries.

The driver here is independent of megatron_app.schedule.drive: each step a seeded random choice runs one rank or
delivers one in-flight message (so messages are delayed and reordered at will), and dependencies are checked
against the virtual-stage arithmetic written out below, not against PipelineShape.
"""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_app.schedule import (POLICY_NAMES, Kind, PipelineShape, RankState, Task, make_policy,
                                   megatron_interleaved_cap, megatron_order, minimum_memory_cap, policies_for)
from megatron_app.schedule.megatron_order import without_fill
from megatron_app.schedule.zero_bubble import zb_h1_order

F, B, W = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT


# ---- oracle: dependencies by virtual-stage arithmetic ---------------------------------------------------------
def producers(shape, rank, task):
    """(rank, kind, chunk, microbatch) keys that must be finished before `task` starts on `rank`."""
    P, last = shape.num_stages, shape.num_virtual_stages - 1
    vs = task.chunk * P + rank
    needs = []
    if task.kind is F and vs > 0:
        needs.append(((vs - 1) % P, F, (vs - 1) // P, task.microbatch))
    if task.kind is B:
        needs.append((rank, F, task.chunk, task.microbatch))
        if vs < last:
            needs.append(((vs + 1) % P, B, (vs + 1) // P, task.microbatch))
    if task.kind is W:
        needs.append((rank, B, task.chunk, task.microbatch))
    return needs


def consumer(shape, rank, task):
    """(rank, task kind, chunk) that receives `task`'s output, or None."""
    P, last = shape.num_stages, shape.num_virtual_stages - 1
    vs = task.chunk * P + rank
    if task.kind is F and vs < last:
        return (vs + 1) % P, F, (vs + 1) // P
    if task.kind is B and vs > 0:
        return (vs - 1) % P, B, (vs - 1) // P
    return None


class Stall(AssertionError):
    pass


def run_adversarially(shape, policies, rng):
    """Run all ranks to completion; returns per-rank orders and peak held activations. Raises Stall on a hang."""
    P = shape.num_stages
    states = [RankState(shape, rank) for rank in range(P)]
    runnable = list(range(P))          # ranks that may have something to run (woken by deliveries)
    in_flight = []                     # (consumer rank, task) messages not yet delivered
    finished = set()
    held = [0] * P
    peak = [0] * P
    while runnable or in_flight:
        choice = rng.randrange(len(runnable) + len(in_flight))
        if choice >= len(runnable):
            rank, task = in_flight.pop(choice - len(runnable))
            states[rank].mark_arrived(task)
            if rank not in runnable:
                runnable.append(rank)
            continue
        rank = runnable[choice]
        task = policies[rank].next(states[rank])
        if task is None:
            runnable.remove(rank)      # sleeps until a delivery for it
            continue
        key = (rank, task.kind, task.chunk, task.microbatch)
        assert key not in finished, f"{task} ran twice on rank {rank}"
        for need in producers(shape, rank, task):
            assert need in finished, f"rank {rank} started {task} before its producer {need} finished"
        states[rank].mark_started(task)
        if task.kind is F:
            held[rank] += 1
            peak[rank] = max(peak[rank], held[rank])
            assert held[rank] <= policies[rank].memory_cap, \
                f"rank {rank} holds {held[rank]} activations > cap {policies[rank].memory_cap} at {task}"
        assert states[rank].activations_held == held[rank]
        states[rank].mark_done(task)
        # an activation is freed by the backward, or by its W when the backward is split
        if task.kind is (W if shape.split_backward else B) or shape.forward_only:
            held[rank] -= 1
        finished.add(key)
        target = consumer(shape, rank, task)
        if target is not None:
            in_flight.append((target[0], Task(target[1], target[2], task.microbatch)))
    if not all(state.finished for state in states):
        raise Stall("schedule stalled:\n" + "\n".join(state.describe() for state in states))
    expected = {(r, t.kind, t.chunk, t.microbatch) for r in range(P) for t in shape.tasks(r)}
    assert finished == expected
    return [state.done_tasks for state in states], peak


def check_policy(shape, name, rng, caps=None):
    policies = [make_policy(name, shape, rank, memory_cap=None if caps is None else caps[rank])
                for rank in range(shape.num_stages)]
    orders, peak = run_adversarially(shape, policies, rng)
    for rank, order in enumerate(orders):
        assert len(order) == len(shape.tasks(rank))
        if name in ("1f1b", "interleaved"):
            assert tuple(order) == megatron_order(shape, rank), f"rank {rank} left Megatron's order"
            assert peak[rank] == megatron_interleaved_cap(shape, rank)
        if name == "zb-h1":
            assert tuple(order) == zb_h1_order(shape, rank), f"rank {rank} left the ZB-H1 order"
        if name == "planned-fixed" and caps is None:   # run-time reordering off: its plan, W's placed as fills
            assert without_fill(order) == without_fill(megatron_order(shape, rank)), f"rank {rank} left its plan"
    return orders


# ---- shapes --------------------------------------------------------------------------------------------------
@st.composite
def shapes(draw, max_stages=8, max_chunks=4):
    P = draw(st.integers(1, max_stages))
    V = 1 if P == 1 else draw(st.integers(1, max_chunks))
    m = draw(st.integers(1 if V == 1 else P, 4 * P))
    N = None
    if V > 1:
        allowed = [n for n in range(P, m + 1) if m % n == 0 or m % n >= P]
        if P not in allowed or draw(st.booleans()):
            N = draw(st.sampled_from(allowed))
    forward_only = draw(st.integers(0, 4)) == 0
    split_backward = not forward_only and draw(st.booleans())
    return PipelineShape(P, V, m, forward_only=forward_only, microbatch_group_size=N, split_backward=split_backward)


def runnable_shape(name, shape):
    """`shape`, narrowed to what policy `name` can run (1f1b: one chunk; zb-h1: a split backward)."""
    if name == "1f1b" and shape.num_chunks > 1:
        shape = PipelineShape(shape.num_stages, 1, shape.num_microbatches, forward_only=shape.forward_only,
                              split_backward=shape.split_backward)
    if name == "zb-h1" and not shape.split_backward:
        shape = PipelineShape(shape.num_stages, shape.num_chunks, shape.num_microbatches,
                              microbatch_group_size=shape.microbatch_group_size, split_backward=True)
    return shape


PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", POLICY_NAMES)
@PROPERTY_SETTINGS
@given(shape=shapes(), seed=st.integers(0, 2**32 - 1))
def test_policy_finishes_under_any_delivery_order(name, shape, seed):
    check_policy(runnable_shape(name, shape), name, random.Random(seed))


@pytest.mark.parametrize("name", ["dfc", "bfc"])
@PROPERTY_SETTINGS
@given(data=st.data(), shape=shapes(max_stages=6), seed=st.integers(0, 2**32 - 1))
def test_adaptive_policy_finishes_under_any_cap_it_accepts(name, data, shape, seed):
    least = minimum_memory_cap(shape)
    caps = [data.draw(st.integers(least, max(least, megatron_interleaved_cap(shape, rank)) + 2), label=f"cap{rank}")
            for rank in range(shape.num_stages)]
    check_policy(shape, name, random.Random(seed), caps)


# ---- deterministic sweep over a small grid --------------------------------------------------------------------
def small_grid():
    for P in range(1, 5):
        for V in range(1, 4):
            if V > 1 and P == 1:
                continue
            for m in range(1 if V == 1 else P, 2 * P + 2):
                for N in ([None] if V == 1 else [n for n in (P, m) if P <= n <= m and (m % n == 0 or m % n >= P)]):
                    # the split backward on every other shape: W's covered without doubling the sweep
                    yield PipelineShape(P, V, m, microbatch_group_size=N, split_backward=(P + V + m) % 2 == 1)


def test_sweep_small_grid_every_policy_tight_and_default_caps():
    count = 0
    for shape in small_grid():
        for name in policies_for(shape):
            for seed in range(2):
                check_policy(shape, name, random.Random(seed))
                if name in ("dfc", "bfc"):
                    tight = [minimum_memory_cap(shape)] * shape.num_stages     # the smallest cap that can finish
                    check_policy(shape, name, random.Random(seed), tight)
                count += 1
    assert count > 300


def test_the_driver_detects_a_stall():
    shape = PipelineShape(2, 1, 2)

    class Never:
        memory_cap = 1

        def next(self, state):
            return None

    with pytest.raises(Stall, match="schedule stalled"):
        run_adversarially(shape, [Never(), Never()], random.Random(0))
