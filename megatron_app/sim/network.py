"""Communication cost model: per-link latency and bandwidth, the tensor size, slow-link windows, and the state that
serialises sends on each link.

A link is one ordered pair of ranks (src -> dst). Sends on one link go out one after another in posting order
(FIFO): a transfer occupies the link for bytes / bandwidth and reaches dst `latency` later; the latency of one
transfer overlaps the transmission of the next (a pipelined wire). Different links never slow each other.
Within a slow-link window, a transfer that starts in [start, end) takes `factor` times longer (latency and
transmission alike). src == dst (P == 1) hands over locally at no cost.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Dict, Set, Tuple

from megatron_app.schedule import PipelineShape, ScheduleConfigError

from .checks import check_number

_SLOW_LINK_RE = re.compile(r"^(\d+)-(\d+):([0-9.eE+]+)-([0-9.eE+]+):([0-9.eE+]+)$")
US_PER_MS = 1000.0


@dataclass(frozen=True)
class SlowLink:
    """The one slow-link concept of the package (simulator, compute emulation, benchmarks): both directions between
    rank_a and rank_b are slow during [start_us, end_us): a message starting then takes `factor` times longer and
    arrives `delay_us` later. Times count from a reference the user picks: the simulation's start for the
    simulator's --slow-link (a factor), each iteration's start for the trainer's --link-delay (a delay)."""

    rank_a: int
    rank_b: int
    start_us: float
    end_us: float
    factor: float = 1.0
    delay_us: float = 0.0

    def __post_init__(self):
        for name in ("rank_a", "rank_b"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ScheduleConfigError(f"slow link {name} must be a rank number >= 0, got {value!r}")
        if self.rank_a == self.rank_b:
            raise ScheduleConfigError(f"slow link {self.rank_a}-{self.rank_b} joins a rank to itself")
        check_number("slow link start", self.start_us, 0.0)
        check_number("slow link end", self.end_us, self.start_us, inclusive=False)
        check_number("slow link factor", self.factor, 1.0)
        check_number("slow link delay", self.delay_us, 0.0)

    @classmethod
    def parse(cls, text: str) -> "SlowLink":
        """'A-B:START_MS-END_MS:FACTOR', e.g. '1-2:0-500:4' (times in simulated milliseconds)."""
        a, b, start_ms, end_ms, factor = _parse_window(text, "slow link", "FACTOR", "1-2:0-500:4")
        return cls(a, b, start_ms * US_PER_MS, end_ms * US_PER_MS, factor=factor)

    @classmethod
    def parse_delay(cls, text: str) -> "SlowLink":
        """The trainer's --link-delay 'A-B:START_MS-END_MS:DELAY_MS', e.g. '1-2:0-300:12' (ms into each iteration)."""
        a, b, start_ms, end_ms, delay_ms = _parse_window(text, "--link-delay", "DELAY_MS", "1-2:0-300:12")
        return cls(a, b, start_ms * US_PER_MS, end_ms * US_PER_MS, delay_us=delay_ms * US_PER_MS)

    def joins(self, src: int, dst: int) -> bool:
        return {src, dst} == {self.rank_a, self.rank_b}

    def is_slow(self, src: int, dst: int, time_us: float) -> bool:
        return self.joins(src, dst) and self.start_us <= time_us < self.end_us

    def factor_at(self, src: int, dst: int, time_us: float) -> float:
        return self.factor if self.is_slow(src, dst, time_us) else 1.0

    def delay_at_us(self, src: int, dst: int, time_us: float) -> float:
        return self.delay_us if self.is_slow(src, dst, time_us) else 0.0

    def check_ranks(self, num_stages: int) -> None:
        for rank in (self.rank_a, self.rank_b):
            if rank >= num_stages:
                raise ScheduleConfigError(f"--link-delay rank {rank} is outside 0..{num_stages - 1}")

    def __str__(self) -> str:
        effect = self.delay_us / US_PER_MS if self.delay_us and self.factor == 1.0 else self.factor
        return f"{self.rank_a}-{self.rank_b}:{self.start_us / US_PER_MS:g}-{self.end_us / US_PER_MS:g}:{effect:g}"


def _parse_window(text: str, what: str, effect: str, example: str) -> Tuple[int, int, float, float, float]:
    match = _SLOW_LINK_RE.match(str(text).strip())
    if match is None:
        raise ScheduleConfigError(f"{what} {text!r} is not A-B:START_MS-END_MS:{effect} (e.g. {example})")
    a, b, start, end, value = match.groups()
    try:
        start_ms, end_ms, number = float(start), float(end), float(value)
    except ValueError:
        raise ScheduleConfigError(f"{what} {text!r} has a malformed number") from None
    if int(a) == int(b):
        raise ScheduleConfigError(f"{what} {text!r} joins a rank to itself")
    if not end_ms > start_ms:
        raise ScheduleConfigError(f"{what} {text!r}: the window must end after it starts "
                                  f"({end_ms:g} ms <= {start_ms:g} ms)")
    return int(a), int(b), start_ms, end_ms, number


def pipeline_links(shape: PipelineShape) -> Set[Tuple[int, int]]:
    """The ordered rank pairs that carry tensors: r -> r+1 (activations) and r -> r-1 (gradients), plus the wrap
    between the last and first rank when there are several model chunks."""
    P, wrap = shape.num_stages, shape.num_chunks > 1
    links = set()
    for rank in range(P):
        if rank + 1 < P or wrap:
            links.add((rank, (rank + 1) % P))
        if rank > 0 or wrap:
            links.add((rank, (rank - 1) % P))
    return {(a, b) for a, b in links if a != b}


@dataclass(frozen=True)
class LinkCosts:
    """latency_us per transfer, gbps = gigabits per second (inf: transmission is free), tensor_bytes per message."""

    latency_us: float = 0.0
    gbps: float = math.inf
    tensor_bytes: int = 0
    slow_links: Tuple[SlowLink, ...] = ()

    def __post_init__(self):
        check_number("link latency_us", self.latency_us, 0.0)
        if not (isinstance(self.gbps, (int, float)) and not isinstance(self.gbps, bool) and self.gbps > 0
                and not math.isnan(self.gbps)):
            raise ScheduleConfigError(f"link gbps must be a number > 0 (inf for free transmission), got {self.gbps!r}")
        if isinstance(self.tensor_bytes, bool) or not isinstance(self.tensor_bytes, int) or self.tensor_bytes < 0:
            raise ScheduleConfigError(f"tensor_bytes must be an int >= 0, got {self.tensor_bytes!r}")
        object.__setattr__(self, "slow_links", tuple(self.slow_links))
        for slow in self.slow_links:
            if slow.delay_us:   # a fixed delay per iteration is the emulation's rule (emulation.SlowLinkNetwork)
                raise ScheduleConfigError(f"slow link {slow}: the simulator's links take a factor, not a delay")

    @property
    def transmit_us(self) -> float:
        """Time one message occupies a link: bytes * 8 / (gbps * 1e3 bits per microsecond)."""
        return 0.0 if math.isinf(self.gbps) else self.tensor_bytes * 8 / (self.gbps * 1e3)

    @property
    def min_transfer_us(self) -> float:
        """Fastest possible post-to-arrival time of one message (no queueing, no slow window)."""
        return self.latency_us + self.transmit_us

    def check_shape(self, shape: PipelineShape) -> None:
        used = pipeline_links(shape)
        for slow in self.slow_links:
            if max(slow.rank_a, slow.rank_b) >= shape.num_stages:
                raise ScheduleConfigError(f"slow link {slow} names a rank outside 0..{shape.num_stages - 1}")
            if (slow.rank_a, slow.rank_b) not in used:
                wrap = ", and last to first" if shape.num_chunks > 1 else ""
                raise ScheduleConfigError(f"slow link {slow} carries no pipeline traffic (tensors flow only "
                                          f"between neighbouring ranks{wrap})")


class Network:
    """Per-simulation link state: when each link is free to start the next transmission."""

    def __init__(self, costs: LinkCosts):
        self.costs = costs
        self._free_at: Dict[Tuple[int, int], float] = {}

    def send(self, src: int, dst: int, posted_us: float) -> Tuple[float, float]:
        """Post one message at posted_us; returns (transmission start, arrival at dst)."""
        if src == dst:
            return posted_us, posted_us
        start = max(posted_us, self._free_at.get((src, dst), posted_us))
        factor = max((slow.factor_at(src, dst, start) for slow in self.costs.slow_links), default=1.0)
        transmit = self.costs.transmit_us * factor
        self._free_at[(src, dst)] = start + transmit
        return start, start + transmit + self.costs.latency_us * factor
