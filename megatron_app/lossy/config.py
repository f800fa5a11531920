"""What the loss layer should do: model, parameters, traffic, fill, seed, packet size — parsed and checked once.

Flag forms (trainer and launchers):
    --loss-model none | bernoulli | gilbert-elliott | gilbert-elliott:P,R[,1-H[,1-K]] | replay:FILE | python:MOD.OBJ
    --loss-rate X        bernoulli: p; gilbert-elliott (with --burst-length): stationary loss rate; python: the p of
                         the rescale fill
    --burst-length L     gilbert-elliott: mean number of consecutive lost packets (>= 1)
    --loss-on forward,backward,tp    (forward/backward: pipeline activations/gradients; tp: tensor-parallel traffic
                         in both directions, or tp-forward / tp-backward alone)
    --loss-fill zeros|stale|rescale    --loss-seed N    --loss-packet-bytes B
    --loss-tp-sites all | SITE[,SITE...]    which megatron-core modules' tensor-parallel collectives lose packets
                         (TP_SITES; e.g. mappings,layers leaves vocab-parallel cross-entropy exact)

Gilbert-Elliott parameters are netem's `loss gemodel p r 1-h 1-k`, as fractions in [0, 1] (netem takes percent):
p = P(good -> bad), r = P(bad -> good), 1-h = loss probability in the bad state, 1-k = in the good state; omitted
ones default as in netem (r = 1-p, 1-h = 1, 1-k = 0). The burst form is the simple Gilbert model
(1-h = 1, 1-k = 0): r = 1/L, p = rate * r / (1 - rate).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Iterable, Optional, Tuple

from .errors import LossConfigError

MODELS = ("none", "bernoulli", "gilbert-elliott", "replay", "python")
FILLS = ("zeros", "stale", "rescale")
TRAFFIC = ("forward", "backward", "tp", "tp-forward", "tp-backward")  # tp = both tensor-parallel directions
DEFAULT_LOSS_ON = frozenset({"forward", "backward", "tp"})
# names of the megatron-core modules whose tensor-parallel collectives can lose packets (tensor_parallel.SITES maps
# each module to one of these); kept here so flag checks need no torch
TP_SITES = ("mappings", "layers", "cross_entropy", "fused_cross_entropy", "tp_utils", "core_utils")
ALL_TP_SITES = frozenset(TP_SITES)
DEFAULT_PACKET_BYTES = 4096


def _probability(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise LossConfigError(f"{name} must be a probability in [0, 1], got {value!r}")
    return float(value)


def gilbert_from_burst(loss_rate: float, burst_length: float) -> Tuple[float, float, float, float]:
    """(p, r, 1-h, 1-k) of the simple Gilbert model with this stationary loss rate and mean burst length."""
    loss_rate = _probability(loss_rate, "--loss-rate")
    if isinstance(burst_length, bool) or not isinstance(burst_length, (int, float)) or math.isnan(burst_length):
        raise LossConfigError(f"--burst-length must be a number, got {burst_length!r}")
    if burst_length < 1:
        raise LossConfigError(f"--burst-length must be >= 1 packet (a mean run of lost packets), got {burst_length}")
    if loss_rate == 1.0:
        return 1.0, 0.0, 1.0, 0.0  # always in the bad state
    r = 1.0 / burst_length
    p = loss_rate * r / (1.0 - loss_rate)
    if p > 1.0:
        raise LossConfigError(
            f"a loss rate of {loss_rate} with mean burst length {burst_length} is impossible in the Gilbert model: "
            f"the burst length must be at least rate/(1-rate) = {loss_rate / (1 - loss_rate):.3g}")
    return p, r, 1.0, 0.0


def read_loss_pattern(path: str) -> bytes:
    """A recorded pattern: '0' (delivered) and '1' (lost) characters; whitespace and '#' comments are ignored."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise LossConfigError(f"cannot read loss pattern file {path!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise LossConfigError(f"loss pattern file {path!r} is not text (expected 0/1 characters)") from None
    pattern = bytearray()
    for number, line in enumerate(text.splitlines(), start=1):
        for char in line.split("#", 1)[0]:
            if char in "01":
                pattern.append(char == "1")
            elif not char.isspace():
                raise LossConfigError(f"{path}:{number}: unexpected {char!r} in loss pattern (expected 0 or 1)")
    if not pattern:
        raise LossConfigError(f"loss pattern file {path!r} holds no packets (expected 0/1 characters)")
    return bytes(pattern)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    model: str = "none"
    loss_rate: Optional[float] = None
    burst_length: Optional[float] = None
    gilbert: Optional[Tuple[float, float, float, float]] = None  # (p, r, 1-h, 1-k), resolved for gilbert-elliott
    pattern: Optional[bytes] = None                               # replay: 1 = lost
    source: Optional[str] = None                                  # replay file or python MOD.OBJ
    loss_on: frozenset = DEFAULT_LOSS_ON
    fill: str = "zeros"
    seed: int = 0
    packet_bytes: int = DEFAULT_PACKET_BYTES
    tp_sites: frozenset = ALL_TP_SITES  # TP_SITES names whose tensor-parallel traffic loses packets

    @property
    def enabled(self) -> bool:
        return self.model != "none"

    @property
    def pipeline(self) -> bool:
        return self.enabled and bool(self.loss_on & {"forward", "backward"})

    @property
    def tp_forward(self) -> bool:
        return self.enabled and bool(self.loss_on & {"tp", "tp-forward"})

    @property
    def tp_backward(self) -> bool:
        return self.enabled and bool(self.loss_on & {"tp", "tp-backward"})

    @property
    def tensor_parallel(self) -> bool:
        return self.tp_forward or self.tp_backward

    def core_spec(self):
        """The C++ model (megatron_app.transport._shm_tensor_rdma.LossModelSpec); a python model has none (kind NONE)."""
        from megatron_app.transport import loss_injection   # the compiled core: only once a transport is built

        spec = loss_injection.LossModelSpec()
        if self.model == "bernoulli":
            spec.kind, spec.loss_rate = loss_injection.LossModelKind.BERNOULLI, self.loss_rate
        elif self.model == "gilbert-elliott":
            spec.kind = loss_injection.LossModelKind.GILBERT_ELLIOTT
            spec.p, spec.r, spec.bad_loss, spec.good_loss = self.gilbert
        elif self.model == "replay":
            spec.kind, spec.pattern = loss_injection.LossModelKind.REPLAY, list(self.pattern)
        return spec

    def stationary_loss_rate(self) -> Optional[float]:
        """Long-run loss rate of the configured model (None for a python model without --loss-rate)."""
        if self.model == "python":
            return self.loss_rate
        return self.core_spec().stationary_loss_rate()

    def describe(self) -> str:
        if not self.enabled:
            return "loss layer off"
        if self.model == "bernoulli":
            model = f"bernoulli p={self.loss_rate:g}"
        elif self.model == "gilbert-elliott":
            p, r, bad, good = self.gilbert
            model = f"gilbert-elliott p={p:.4g} r={r:.4g} 1-h={bad:g} 1-k={good:g}"
        else:
            model = f"{self.model}:{self.source}"
        rate = self.stationary_loss_rate()
        rate_text = "" if rate is None else f" (stationary loss {rate:.4g})"
        traffic = ",".join(t for t in TRAFFIC if t in self.loss_on)
        if self.tensor_parallel and self.tp_sites != ALL_TP_SITES:
            traffic += f" (tp sites {','.join(site for site in TP_SITES if site in self.tp_sites)})"
        return (f"{model}{rate_text} on {traffic}, fill={self.fill}, packets of {self.packet_bytes} B, "
                f"seed={self.seed}")

    def replace(self, **changes) -> "LossConfig":
        return dataclasses.replace(self, **changes)


def parse_loss_on(text) -> frozenset:
    items = [item.strip() for item in (text.split(",") if isinstance(text, str) else text)]
    unknown = [item for item in items if item not in TRAFFIC]
    if unknown or not items:
        raise LossConfigError(f"--loss-on takes a comma list of {', '.join(TRAFFIC)}; got {text!r}")
    return frozenset(items)


def parse_tp_sites(text) -> frozenset:
    """'all' or a comma list of TP_SITES names (a string or an iterable of names)."""
    items = [item.strip() for item in (text.split(",") if isinstance(text, str) else text)]
    if items == ["all"]:
        return ALL_TP_SITES
    unknown = [item for item in items if item not in TP_SITES]
    if unknown or not items:
        problem = f"unknown site {', '.join(map(repr, unknown))}" if unknown else "no site given"
        raise LossConfigError(f"--loss-tp-sites: {problem}; give all or a comma list of {', '.join(TP_SITES)}")
    return frozenset(items)


def _parse_gilbert_params(text: str) -> Tuple[float, float, float, float]:
    try:
        values = [float(item) for item in text.split(",")]
    except ValueError:
        raise LossConfigError(f"gilbert-elliott parameters must be numbers P,R[,1-H[,1-K]], got {text!r}") from None
    if not 1 <= len(values) <= 4:
        raise LossConfigError(f"gilbert-elliott takes 1 to 4 parameters P,R,1-H,1-K; got {len(values)}")
    names = ("p (good->bad)", "r (bad->good)", "1-h (loss when bad)", "1-k (loss when good)")
    for value, name in zip(values, names):
        _probability(value, f"gilbert-elliott {name}")
    defaults = [None, 1.0 - values[0], 1.0, 0.0]  # netem's defaults for omitted parameters
    return tuple(values + defaults[len(values):])


def make_loss_config(model: str = "none", loss_rate: Optional[float] = None, burst_length: Optional[float] = None,
                     loss_on: Iterable[str] | str = DEFAULT_LOSS_ON, fill: str = "zeros", seed: int = 0,
                     packet_bytes: int = DEFAULT_PACKET_BYTES, tp_sites: Iterable[str] | str = "all") -> LossConfig:
    """Parse and check the flag values; raises LossConfigError with one line naming the problem."""
    if not isinstance(model, str) or not model:
        raise LossConfigError(f"--loss-model must be one of {', '.join(MODELS)} (replay:FILE, python:MOD.OBJ)")
    kind, _, argument = model.partition(":")
    if kind not in MODELS:
        raise LossConfigError(
            f"unknown --loss-model {model!r}; choose none, bernoulli, gilbert-elliott[:P,R,1-H,1-K], replay:FILE "
            "or python:MOD.OBJ")
    if fill not in FILLS:
        raise LossConfigError(f"unknown --loss-fill {fill!r}; choose {', '.join(FILLS)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise LossConfigError(f"--loss-seed must be a non-negative integer, got {seed!r}")
    if isinstance(packet_bytes, bool) or not isinstance(packet_bytes, int) or packet_bytes < 1:
        raise LossConfigError(f"--loss-packet-bytes must be a positive integer, got {packet_bytes!r}")
    if loss_rate is not None:
        loss_rate = _probability(loss_rate, "--loss-rate")
    if burst_length is not None and burst_length < 0:
        raise LossConfigError(f"--burst-length must not be negative, got {burst_length}")
    config = LossConfig(model=kind, loss_rate=loss_rate, burst_length=burst_length, loss_on=parse_loss_on(loss_on),
                        fill=fill, seed=seed, packet_bytes=packet_bytes, tp_sites=parse_tp_sites(tp_sites))
    if config.tp_sites != ALL_TP_SITES and not config.tensor_parallel:
        # a narrowed site list that selects no traffic is a mistake worth one line, not a silent no-op
        if not config.enabled:
            raise LossConfigError("--loss-tp-sites needs a --loss-model")
        raise LossConfigError("--loss-tp-sites applies to tensor-parallel traffic: add tp, tp-forward or tp-backward "
                              "to --loss-on")
    if kind == "none":
        if loss_rate is not None or burst_length is not None:
            raise LossConfigError("--loss-rate / --burst-length need a --loss-model")
        return config
    if kind in ("bernoulli",) or (kind == "gilbert-elliott" and not argument):
        if argument:
            raise LossConfigError(f"--loss-model {kind} takes no ':' parameters")
        if loss_rate is None:
            raise LossConfigError(f"--loss-model {kind} needs --loss-rate")
    if kind == "bernoulli":
        if burst_length is not None:
            raise LossConfigError("--burst-length applies to gilbert-elliott only (bernoulli losses are independent)")
        return config
    if kind == "gilbert-elliott":
        if argument:
            if loss_rate is not None or burst_length is not None:
                raise LossConfigError("give gilbert-elliott either P,R,1-H,1-K or --loss-rate with --burst-length")
            return config.replace(gilbert=_parse_gilbert_params(argument))
        if burst_length is None:
            raise LossConfigError("--loss-model gilbert-elliott needs --burst-length (or gilbert-elliott:P,R,1-H,1-K)")
        return config.replace(gilbert=gilbert_from_burst(loss_rate, burst_length))
    if burst_length is not None:
        raise LossConfigError(f"--burst-length does not apply to --loss-model {kind}")
    if not argument:
        raise LossConfigError(f"--loss-model {kind} needs {'a FILE' if kind == 'replay' else 'MOD.OBJ'}: {kind}:...")
    if kind == "replay":
        if loss_rate is not None:
            raise LossConfigError("--loss-rate does not apply to a replayed pattern (its rate is the file's)")
        return config.replace(pattern=read_loss_pattern(argument), source=argument)
    # python plug-in: import and check it now, so a bad object fails at start-up
    from .plugin import load_plugin

    load_plugin(argument)
    if fill == "rescale" and loss_rate is None:
        raise LossConfigError("--loss-fill rescale with a python model needs --loss-rate (the p of 1/(1-p))")
    return config.replace(source=argument)
