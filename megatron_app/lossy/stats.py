"""Loss statistics per link and direction: packets sent and lost, observed rate, burst-length histogram; per
iteration deltas, one log line per rank and iteration, and `loss` events in the trace."""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Iterable, List, Optional

from megatron_app.trace.schema import LOSS

LOSS_EVENT = LOSS  # trace event kind (schema 1.1)


@dataclasses.dataclass(frozen=True)
class LinkLossStats:
    traffic: str             # "pipeline" or "tp"
    link: str                # "0->1" for pipeline links; "tp:layers.all_gather@rank0" (group:site.collective)
    direction: str           # "forward" (activations) or "backward" (gradients)
    packets: int
    lost: int
    bursts: Dict[int, int]   # length of a run of consecutive lost packets -> runs (finished ones)
    open_burst: int = 0      # run of losses still going on when counted
    source: Optional[int] = None

    @property
    def key(self) -> tuple:
        return self.traffic, self.link, self.direction

    @property
    def observed_rate(self) -> float:
        return self.lost / self.packets if self.packets else 0.0

    @property
    def mean_burst_length(self) -> float:
        runs = sum(self.bursts.values())
        return sum(length * count for length, count in self.bursts.items()) / runs if runs else 0.0

    def minus(self, earlier: Optional["LinkLossStats"]) -> "LinkLossStats":
        """What happened since `earlier` (None: everything)."""
        if earlier is None:
            return self
        bursts = {length: count - earlier.bursts.get(length, 0) for length, count in self.bursts.items()}
        return dataclasses.replace(self, packets=self.packets - earlier.packets, lost=self.lost - earlier.lost,
                                   bursts={length: count for length, count in bursts.items() if count})

    def as_dict(self) -> dict:
        return {"traffic": self.traffic, "link": self.link, "direction": self.direction, "packets": self.packets,
                "lost": self.lost, "observed_rate": self.observed_rate, "mean_burst_length": self.mean_burst_length,
                "bursts": {str(length): count for length, count in sorted(self.bursts.items())}}


def from_core(entry: dict, traffic: str, link: str, direction: str, source: Optional[int] = None) -> LinkLossStats:
    """A LinkLossStats from a core stats dict ({packets, lost, bursts, open_burst})."""
    return LinkLossStats(traffic=traffic, link=link, direction=direction, packets=int(entry["packets"]),
                         lost=int(entry["lost"]), bursts={int(k): int(v) for k, v in entry["bursts"].items()},
                         open_burst=int(entry["open_burst"]), source=source)


def direction_name(code: int) -> str:
    """Name of a tag direction code (transport.Direction: forward or backward)."""
    from megatron_app.transport import Direction   # the compiled core: loaded only once statistics exist

    return "forward" if code == Direction.FORWARD else "backward"


StatsSource = Callable[[], Iterable[LinkLossStats]]


class LossReporter:
    """Collects every source's statistics at each iteration end; logs and traces what changed since the last."""

    def __init__(self, sources: List[StatsSource], rank: int, log: Callable[[str], None] = print):
        self._sources = sources
        self._rank = rank
        self._log = log
        self._previous: Dict[tuple, LinkLossStats] = {}
        self.history: List[dict] = []  # per iteration: {"iteration", "links": [as_dict...]}

    def snapshot(self) -> List[LinkLossStats]:
        return [stats for source in self._sources for stats in source()]

    def end_iteration(self, iteration: int, tracer=None) -> List[LinkLossStats]:
        """Deltas of `iteration` (1-based); tracer: a megatron_app.trace.Tracer (or None)."""
        current = self.snapshot()
        deltas = [stats.minus(self._previous.get(stats.key)) for stats in current]
        self._previous = {stats.key: stats for stats in current}
        deltas = [delta for delta in deltas if delta.packets]
        if not deltas:
            return deltas
        self.history.append({"iteration": iteration, "links": [delta.as_dict() for delta in deltas]})
        packets = sum(delta.packets for delta in deltas)
        lost = sum(delta.lost for delta in deltas)
        links = "; ".join(f"{d.traffic} {d.link} {d.direction} {d.lost}/{d.packets}" for d in deltas)
        self._log(f"[lossy] rank {self._rank} iteration {iteration}: lost {lost}/{packets} packets "
                  f"({100.0 * lost / packets:.2f}%): {links}")
        if tracer is not None and tracer.enabled:
            now = tracer.now_us()
            for delta in deltas:
                tracer.record(LOSS_EVENT, now, now, iteration=iteration, peer=delta.source,
                              traffic=delta.traffic, link=delta.link, direction=delta.direction,
                              packets=delta.packets, lost=delta.lost, rate=round(delta.observed_rate, 6),
                              bursts={str(k): v for k, v in sorted(delta.bursts.items())})
        return deltas
