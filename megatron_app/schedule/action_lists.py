"""Per-rank orders from action lists in torch.distributed.pipelining's format: run one of torch's schedules (or a
hand-written order) in our runtime, so two orders compare runtime against runtime.

The format is torch's compute-only one (a schedule's pipeline_order; PipelineScheduleMulti._dump_csv): one list per
pipeline rank, each action "{stage}{type}{microbatch}" with type F (forward), I (input-gradient backward), W
(weight-gradient backward) or B (whole backward); an empty action is a bubble and is skipped. Stage s is chunk s // P
on rank s % P (torch's loop placement, Megatron's interleaving). With a split backward I is our B and W our W, and a
whole B is our B followed at once by its W; without, only F and B may appear. Each rank's list must hold each of its
tasks exactly once, and the lists together must complete: that is checked on the logical driver (driver.py), so a
set of lists that would hang is refused before any rank starts.
"""

from __future__ import annotations

import re
from typing import List, Sequence, Tuple

from .errors import ScheduleConfigError, ScheduleStallError
from .shape import PipelineShape
from .static_order import StaticOrderPolicy, make_static
from .tasks import Kind, Task

# The policy name a schedule file's lists run under: the runtime's banner, the trace and the trainer's config line.
ACTION_LISTS = "action-lists"
_ACTION = re.compile(r"^(\d+)([FIWB])(\d+)$")


def parse_action(text: str) -> Tuple[int, str, int]:
    """"4I2" -> (stage 4, "I", microbatch 2); ScheduleConfigError for anything else."""
    match = _ACTION.match(text.strip())
    if match is None:
        raise ScheduleConfigError(f"action {text!r} is not '<stage><F|I|W|B><microbatch>' (torch's compute-only "
                                  f"format)")
    return int(match.group(1)), match.group(2), int(match.group(3))


def rank_order(shape: PipelineShape, rank: int, actions: Sequence[str]) -> Tuple[Task, ...]:
    """One rank's actions as our tasks (module doc)."""
    P = shape.num_stages
    order: List[Task] = []
    for text in actions:
        if not text or not text.strip():
            continue       # a bubble
        stage, kind, microbatch = parse_action(text)
        if stage >= shape.num_virtual_stages or stage % P != rank:
            raise ScheduleConfigError(f"rank {rank}'s action {text!r}: stage {stage} is not on rank {rank} "
                                      f"(stage s runs on rank s % {P}, {shape.num_virtual_stages} stages)")
        if microbatch >= shape.num_microbatches:
            raise ScheduleConfigError(f"rank {rank}'s action {text!r}: microbatch {microbatch} is outside "
                                      f"0..{shape.num_microbatches - 1}")
        chunk = stage // P
        if kind in "IW" and not shape.split_backward:
            raise ScheduleConfigError(f"rank {rank}'s action {text!r} splits the backward: run with "
                                      f"--split-backward")
        if kind == "F":
            order.append(Task(Kind.FORWARD, chunk, microbatch))
        elif kind in "IB":
            order.append(Task(Kind.BACKWARD, chunk, microbatch))
        if (kind == "W") or (kind == "B" and shape.split_backward):
            order.append(Task(Kind.WEIGHT, chunk, microbatch))
    expected = sorted(shape.tasks(rank), key=_key)
    if sorted(order, key=_key) != expected:
        missing = set(expected) - set(order)
        extra = [task for task in order if order.count(task) > 1 or task not in expected]
        detail = f"missing {sorted(missing, key=_key)[0]}" if missing else f"{extra[0]} twice"
        raise ScheduleConfigError(f"rank {rank}'s actions must hold each of its {len(expected)} tasks once: "
                                  f"{detail}")
    return tuple(order)


def orders_from_action_lists(shape: PipelineShape, lists: Sequence[Sequence[str]]) -> Tuple[Tuple[Task, ...], ...]:
    """Every rank's order; refuses lists that do not fit the shape or would hang (module doc)."""
    from .driver import drive

    if len(lists) != shape.num_stages:
        raise ScheduleConfigError(f"need one action list per pipeline rank ({shape.num_stages}), got {len(lists)}")
    orders = tuple(rank_order(shape, rank, actions) for rank, actions in enumerate(lists))
    try:
        drive(shape, [StaticOrderPolicy(shape, rank, shape.num_chunks * shape.num_microbatches, "action lists",
                                        order) for rank, order in enumerate(orders)])
    except ScheduleStallError:
        raise ScheduleConfigError("the action lists cannot complete: run together, every rank would wait for an "
                                  "input that never comes") from None
    return orders


def make_action_list_policy(shape: PipelineShape, rank: int, lists: Sequence[Sequence[str]],
                            memory_cap=None) -> StaticOrderPolicy:
    """A static policy running rank `rank`'s list (all lists are checked together)."""
    return make_static(ACTION_LISTS, orders_from_action_lists(shape, lists)[rank], shape, rank, memory_cap)


def _key(task: Task):
    return task.kind.value, task.chunk, task.microbatch
