"""The rows tools/bench_schedule.py can run: one per policy of the registry, our split-backward and torch rows, and
the composition rows (issue 23). A row is data: which system runs it, with which schedule and policy."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional

from megatron_app.schedule import POLICIES
from megatron_app.schedule.composition import BALANCED, DP_BALANCED, LOADER, PACKED


@dataclass(frozen=True)
class ScheduleRow:
    label: str
    system: str                   # "app" (our runtime) or "torch"
    schedule: str                 # the trainer's --schedule, or torch's schedule class
    policy: Optional[str]         # the trainer's --policy (None: dfc)
    single_chunk: bool            # one chunk per rank, each task V times longer (the same model)
    sim_policy: Optional[str]     # the simulator's policy for the sim column (None: none)


@dataclass(frozen=True)
class CompositionRow:
    label: str
    order: str                    # the schedule key whose order runs it
    composition: str              # which documents form each microbatch (schedule.composition)


def _runtime_schedules() -> Dict[str, ScheduleRow]:
    """One row per policy of the registry: adaptive rules run as the `app` schedule, static orders (Megatron-Core's,
    and ZB-H1 with a split backward) as schedules of their own."""
    rows = {}
    for name, entry in POLICIES.items():
        if entry.split_only:
            rows[name] = ScheduleRow(f"{name} split backward (our runtime)", "app", name, "dfc", False, name)
            continue
        if entry.static:
            label = f"Megatron {name}{' V=1' if entry.single_chunk else ''} (our runtime)"
            rows[name] = ScheduleRow(label, "app", name, "dfc", entry.single_chunk, name)
        else:
            rows[name] = ScheduleRow(f"APP {name}", "app", "app", name, False, name)
    return rows


# torch's interleaved zero-bubble action lists (bench/torch_action_lists.py) run by our runtime (--schedule-file)
TORCH_ZB_ORDER = "torch-zb-order"
# Rows that run each backward as B + W (--split-backward): every split-only registry entry, and adaptive split.
SPLIT_BACKWARD_KEYS = frozenset({"app-adaptive-split", "app-planned-split", TORCH_ZB_ORDER,
                                 *(name for name, e in POLICIES.items() if e.split_only)})
SCHEDULES: Dict[str, ScheduleRow] = {
    **_runtime_schedules(),
    "app-adaptive-split": ScheduleRow("APP adaptive, split backward", "app", "app", "adaptive", False, "adaptive"),
    "app-planned-split": ScheduleRow("APP planned, split backward", "app", "app", "planned", False, "planned"),
    TORCH_ZB_ORDER: ScheduleRow("torch ZeroBubble order (our runtime)", "app", "app", None, False, None),
    "torch-1f1b": ScheduleRow("torch Schedule1F1B V=1", "torch", "torch-1F1B", None, True, "1f1b"),
    "torch-interleaved": ScheduleRow("torch ScheduleInterleaved1F1B", "torch", "torch-Interleaved1F1B", None, False,
                                     "interleaved"),
    "torch-zb": ScheduleRow("torch ScheduleInterleavedZeroBubble", "torch", "torch-InterleavedZeroBubble", None,
                            False, None),
}
COMPOSITION_ROWS: Dict[str, CompositionRow] = {
    "loader-padded": CompositionRow("Megatron interleaved, loader groups padded", "interleaved", LOADER),
    "loader-packed": CompositionRow("Megatron interleaved, loader groups packed", "interleaved", PACKED),
    "dp-balanced": CompositionRow("Megatron interleaved, DpBalanced-style packer", "interleaved", DP_BALANCED),
    "balanced": CompositionRow("APP planned, balanced composition", "planned", BALANCED),
}
# A composition row runs as its order's row under its own label.
SCHEDULES.update({key: replace(SCHEDULES[row.order], label=row.label) for key, row in COMPOSITION_ROWS.items()})
DEFAULT_SCHEDULE_KEYS = [key for key in SCHEDULES if key not in COMPOSITION_ROWS]
# The row of Megatron-Core's interleaved order: the baseline of the targets and of the torch rows' sim column.
MEGATRON_ROW = "interleaved"


def runs_torch(keys) -> bool:
    return any(SCHEDULES[key].system == "torch" for key in keys)
