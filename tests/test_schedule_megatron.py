"""Megatron-Core's static orders and the activation caps derived from them."""

import pytest

from megatron_app.schedule import (Kind, PipelineShape, Task, megatron_interleaved_cap, megatron_order,
                                   megatron_warmup_microbatches)

F, B = Kind.FORWARD, Kind.BACKWARD


def valid_shapes(max_stages=4, max_chunks=3, forward_only=False):
    for P in range(1, max_stages + 1):
        for V in range(1, max_chunks + 1):
            if V > 1 and P == 1:
                continue
            for m in range(1 if V == 1 else P, 3 * P + 1):
                groups = [None] if V == 1 else [n for n in range(P, m + 1) if m % n == 0 or m % n >= P]
                for N in groups:
                    yield PipelineShape(P, V, m, forward_only=forward_only, microbatch_group_size=N)


def warmup_formula(shape, rank):
    """Megatron's warm-up, as its comments state it: P-r-1 for 1F1B, 2(P-r-1) + (V-1)N interleaved, capped."""
    P, V, m, N = shape.num_stages, shape.num_chunks, shape.num_microbatches, shape.microbatch_group_size
    total = V * m
    if shape.forward_only:
        return total
    if P == 1:
        return 0
    warmup = P - rank - 1 if V == 1 else 2 * (P - rank - 1) + (V - 1) * N
    return min(warmup, total)


def reference_order(shape, rank):
    """Megatron's loop structure (warm-up forwards, steady F/B pairs, cool-down backwards) over its schedule table,
    with backward k on chunk V-1-table_chunk[k] for microbatch table_mb[k]."""
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    V = shape.num_chunks
    table = get_schedule_table(shape.num_microbatches, V, shape.microbatch_group_size)
    forwards = [Task(F, chunk, mb) for mb, chunk in table]
    if shape.forward_only:
        return forwards
    backwards = [Task(B, V - 1 - chunk, mb) for mb, chunk in table]
    warmup = warmup_formula(shape, rank)
    order = forwards[:warmup]
    for k in range(len(forwards) - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[len(forwards) - warmup:]


def test_megatron_docstring_example_pp2_vp2_n3_m5():
    # schedules.py / cuda_graphs.py document rank 0's order as 1 1 1 2 2 2 -2 1 -2 1 -2 2 -1 2 -1 -1 -2 -2 -1 -1
    # (k > 0: forward of chunk k-1, -k: backward of chunk k-1).
    documented = [1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1, -2, -2, -1, -1]
    order = megatron_order(PipelineShape(2, 2, 5, microbatch_group_size=3), 0)
    assert [(t.kind, t.chunk) for t in order] == [(F if k > 0 else B, abs(k) - 1) for k in documented]
    assert [t.microbatch for t in order if t.kind is F] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]


def test_plain_1f1b_order_for_one_chunk():
    order = megatron_order(PipelineShape(4, 1, 6), 1)   # warm-up P - r - 1 = 2
    expected = [(F, 0), (F, 1), (F, 2), (B, 0), (F, 3), (B, 1), (F, 4), (B, 2), (F, 5), (B, 3), (B, 4), (B, 5)]
    assert [(t.kind, t.microbatch) for t in order] == expected
    # One stage: Megatron's no-pipelining path runs forward then backward per microbatch.
    single = megatron_order(PipelineShape(1, 1, 3), 0)
    assert [(t.kind, t.microbatch) for t in single] == [(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2)]


@pytest.mark.parametrize("forward_only", [False, True])
def test_orders_match_megatron_loop_structure_on_a_grid(forward_only):
    for shape in valid_shapes(forward_only=forward_only):
        for rank in range(shape.num_stages):
            order = megatron_order(shape, rank)
            assert list(order) == reference_order(shape, rank), (shape, rank)
            assert sorted(order, key=str) == sorted(shape.tasks(rank), key=str)
            assert megatron_warmup_microbatches(shape, rank) == warmup_formula(shape, rank)


def test_caps_follow_megatron_warmup_formula():
    for shape in valid_shapes():
        total = shape.num_chunks * shape.num_microbatches
        for rank in range(shape.num_stages):
            assert megatron_interleaved_cap(shape, rank) == min(warmup_formula(shape, rank) + 1, total), shape


@pytest.mark.parametrize("P, V, m, rank, cap", [
    (4, 1, 8, 0, 4), (4, 1, 8, 3, 1), (4, 1, 2, 0, 2),       # 1F1B: P - r, at most m
    (4, 2, 8, 0, 11), (4, 2, 8, 3, 5),                       # 2(P-r-1) + (V-1)P + 1
    (8, 4, 32, 0, 39), (8, 4, 32, 7, 25), (2, 2, 2, 0, 4),   # all in warm-up: V*m
])
def test_known_caps(P, V, m, rank, cap):
    assert megatron_interleaved_cap(PipelineShape(P, V, m), rank) == cap


def test_forward_only_order_is_the_forward_table_and_holds_one_activation():
    shape = PipelineShape(2, 2, 4, forward_only=True)
    order = megatron_order(shape, 1)
    assert [(t.chunk, t.microbatch) for t in order] == [(0, 0), (0, 1), (1, 0), (1, 1),
                                                        (0, 2), (0, 3), (1, 2), (1, 3)]
    assert all(t.kind is F for t in order)
    assert megatron_interleaved_cap(shape, 1) == 1


# ---- identity with megatron-core's own schedule table -------------------------------------------------------------
class _GroupView:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


class _CommunicatorView:
    """The two things get_pp_rank_microbatches reads from a P2PCommunicator, without torch.distributed."""

    def __init__(self, shape, rank):
        self.pp_group = _GroupView(shape.num_stages, rank)
        # None selects the non-interleaved warm-up, as get_forward_backward_func does for V == 1.
        self.virtual_pipeline_model_parallel_size = shape.num_chunks if shape.num_chunks > 1 else None


def megatron_core_order(shape, rank):
    """The order megatron-core's own functions give: warm-up count, schedule table, and the table turned into a
    signed chunk order (+c+1 forward of chunk c, -c-1 backward of chunk c; Megatron pops each chunk's oldest
    stored forward for a backward, so the n-th backward of a chunk is its microbatch n)."""
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    cuda_graphs = pytest.importorskip("megatron.core.transformer.cuda_graphs")
    V = shape.num_chunks
    _, _, warmup, _ = schedules.get_pp_rank_microbatches(
        shape.num_microbatches, V, shape.microbatch_group_size, forward_only=shape.forward_only,
        p2p_communicator=_CommunicatorView(shape, rank))
    table = schedules.get_schedule_table(shape.num_microbatches, V, shape.microbatch_group_size)
    if shape.forward_only:
        return warmup, [Task(F, chunk, mb) for mb, chunk in table]
    forward_microbatches = iter(mb for mb, _ in table)
    next_backward = [0] * V
    order = []
    for code in cuda_graphs.convert_schedule_table_to_order(warmup, V, table):
        if code > 0:
            order.append(Task(F, code - 1, next(forward_microbatches)))
        else:
            chunk = -code - 1
            order.append(Task(B, chunk, next_backward[chunk]))
            next_backward[chunk] += 1
    return warmup, order


@pytest.mark.parametrize("forward_only", [False, True])
def test_pure_orders_are_identical_to_megatron_cores_schedule_table(forward_only):
    """Our own order code against the installed megatron-core, over (P, V, m, microbatch group size)."""
    checked = 0
    for shape in valid_shapes(max_stages=5, max_chunks=4, forward_only=forward_only):
        for rank in range(shape.num_stages):
            warmup, order = megatron_core_order(shape, rank)
            assert megatron_warmup_microbatches(shape, rank) == warmup, (shape, rank)
            assert list(megatron_order(shape, rank)) == order, (shape, rank)
            checked += 1
    assert checked > 500


def test_schedule_package_and_simulator_import_without_torch_or_megatron():
    import subprocess
    import sys

    probe = ("import sys\n"
             "import megatron_app.schedule, megatron_app.sim, megatron_app.trace\n"
             "from megatron_app.schedule import PipelineShape, make_policy\n"
             "from megatron_app.sim import SimConfig, ComputeCosts, simulate\n"
             "shape = PipelineShape(2, 2, 4, split_backward=True)\n"
             "for name in megatron_app.schedule.policies_for(shape):\n"
             "    make_policy(name, shape, 0)\n"
             "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron'))\n"
             "print(loaded[:5])\n"
             "sys.exit(1 if loaded else 0)\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
