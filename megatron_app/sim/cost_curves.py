"""Task costs measured on a real run, as curves the simulator and the emulation can replay at any pipeline shape.

Emulated compute that waits the planner's own analytic cost (0.7 T + 0.3 S) grades the planner with its own model.
These curves come from a real trace instead: every forward and backward event of a planned run carries the tokens
and squared document tokens it computed on (runtime/executor.py), and a least-squares fit of a + b T + c S per
(kind, role) is taken, where the role of a model chunk is its virtual stage's: `first` (the embedding and its
layers), `last` (its layers, the output layer and the loss) or `middle` (layers only). A middle chunk's fit over its
number of transformer layers is one layer's cost; first and last keep what they add beyond their layers. A chunk of
another shape then costs (layers it holds) x layer + (its role's extra): so a P=2 V=2 trace of an 8-layer model
predicts a P=4 V=2 or P=8 V=2 layout of the same model (more chunks, fewer layers each).

    python -m megatron_app.sim.cost_curves --trace-dir traces/latest --pipeline_parallel 2 --model_chunks 2 \\
        --num-layers 8 --out docs/results/cost_curves/gpt_cpu_p2v2.json

A P=1 V=1 trace has no middle chunk: `--spread-evenly` divides the whole model's fit evenly over its layers
(fit_whole_curves; tools/gpu_check.py's curves).

The simulator takes them with --cost-curves FILE --num-layers L (sim/composition.py).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron_app.schedule import PipelineShape, ScheduleConfigError
from megatron_app.schedule.tasks import KINDS_BY_INDEX, Kind
from megatron_app.trace.model_shape import describe, model_differences

from .costs import DurationTable

ROLES = ("first", "middle", "last")
FITTED_KINDS = ("forward", "backward")
MIN_SAMPLES = 3
OUT_OF_RANGE_FACTOR = 2.0   # replayed microbatch tokens this far beyond the fitted range: say so, once


def role_of(virtual_stage: int, num_virtual_stages: int) -> str:
    if virtual_stage == 0:
        return "first"
    return "last" if virtual_stage == num_virtual_stages - 1 else "middle"


def _fit(samples: Sequence[Tuple[float, float, float]]) -> Tuple[float, float, float]:
    """(a, b, c) of microseconds = a + b T + c S, least squares; non-negative b and c (a smaller model if the
    data cannot tell them apart)."""
    data = np.asarray(samples, dtype=float)
    tokens, squared, micros = data[:, 0], data[:, 1], data[:, 2]
    for columns in ((0, 1, 2), (0, 1), (1,)):
        design = np.stack([np.ones_like(tokens), tokens, squared], axis=1)[:, columns]
        coefficients, *_ = np.linalg.lstsq(design, micros, rcond=None)
        full = [0.0, 0.0, 0.0]
        for column, value in zip(columns, coefficients):
            full[column] = float(value)
        if full[1] >= 0 and full[2] >= 0:
            return full[0], full[1], full[2]
    return 0.0, float(micros.sum() / tokens.sum()), 0.0


@dataclass
class CostCurves:
    """Per kind: one layer's (a, b, c) and what the first and last chunk add beyond their layers, in microseconds."""
    layer: Dict[str, Tuple[float, float, float]]
    first_extra: Dict[str, Tuple[float, float, float]]
    last_extra: Dict[str, Tuple[float, float, float]]
    source: dict                          # where they were measured (trace, shape, layers, samples)

    def chunk_us(self, kind: str, role: str, layers: int, tokens: np.ndarray, squared: np.ndarray) -> np.ndarray:
        a, b, c = self.layer[kind]
        value = layers * (a + b * tokens + c * squared)
        if role in ("first", "last"):
            ea, eb, ec = (self.first_extra if role == "first" else self.last_extra)[kind]
            value = value + ea + eb * tokens + ec * squared
        return np.maximum(value, 0.0)

    def durations(self, shape: PipelineShape, num_layers: int, tokens: Sequence[float],
                  squared: Sequence[float]) -> DurationTable:
        """Every task's microseconds for microbatches of these tokens and squared tokens, on `shape` holding a
        model of num_layers layers split evenly over its P x V chunks."""
        P, V = shape.num_stages, shape.num_chunks
        if num_layers % (P * V):
            raise ScheduleConfigError(f"{num_layers} layers do not split into {P} x {V} chunks")
        layers = num_layers // (P * V)
        t, s = np.asarray(tokens, dtype=float), np.asarray(squared, dtype=float)
        self.warn_out_of_range(t)
        table = np.zeros((P, len(KINDS_BY_INDEX), V, len(t)))
        for rank in range(P):
            for chunk in range(V):
                role = role_of(shape.virtual_stage(rank, chunk), P * V)
                table[rank, Kind.FORWARD.index, chunk] = self.chunk_us("forward", role, layers, t, s)
                table[rank, Kind.BACKWARD.index, chunk] = self.chunk_us("backward", role, layers, t, s)
        return DurationTable(table)

    def out_of_range(self, tokens: np.ndarray) -> Optional[str]:
        """One line when microbatches of `tokens` lie more than OUT_OF_RANGE_FACTOR outside the token range the
        curves were fitted on (the file's source.tokens_range; curves without one are not checked), else None."""
        fitted = self.source.get("tokens_range")
        if not fitted or len(tokens) == 0:
            return None
        low, high = float(fitted[0]), float(fitted[1])
        largest, smallest = float(np.max(tokens)), float(np.min(tokens))
        where = self.source.get("trace_dir") or ", ".join(self.source.get("trace_dirs") or ()) or "its trace"
        if high > 0 and largest > OUT_OF_RANGE_FACTOR * high:
            return (f"{self._name()}: microbatches of up to {largest:,.0f} tokens, {largest / high:.1f}x the largest "
                    f"the curves were fitted on ({low:,.0f}-{high:,.0f} tokens, {where}): their costs are "
                    f"extrapolated, and they hold only for the model that was traced")
        if smallest > 0 and smallest * OUT_OF_RANGE_FACTOR < low:
            return (f"{self._name()}: microbatches of {smallest:,.0f} tokens, {low / smallest:.1f}x below the smallest "
                    f"the curves were fitted on ({low:,.0f}-{high:,.0f} tokens, {where}): their costs are "
                    f"extrapolated")
        return None

    @property
    def model(self) -> Optional[dict]:
        """The traced model's shape (trace/model_shape.py), None for curves fitted before files recorded one."""
        return self.source.get("model")

    def _name(self) -> str:
        return getattr(self, "path", None) or "cost curves"

    def model_mismatch(self, replayed: dict) -> Optional[str]:
        """One line when `replayed` (the model a run replays these curves for) differs from the traced one in any
        field but the layer count (curves are per layer), or when the file records no traced model; else None."""
        traced = self.model
        if traced is None:
            return (f"{self._name()}: the file records no traced model (fitted before curve files recorded one): "
                    f"whether they are this model's costs is not checked")
        differs = model_differences(traced, replayed)
        if not differs:
            return None
        return (f"{self._name()}: replayed for another model than the traced one ({', '.join(differs)}): the task "
                f"costs are the traced model's, not this one's")

    def warn_model(self, replayed: dict) -> None:
        """model_mismatch's line on stderr, once."""
        if getattr(self, "_warned_model", False):
            return
        line = self.model_mismatch(replayed)
        if line is not None:
            self._warned_model = True
            print(line, file=sys.stderr, flush=True)

    def replay_note(self, num_layers: int) -> str:
        """What the simulator replays, in one line: the traced model at num_layers layers (it has no model of its
        own to compare), or that the file names none."""
        traced = self.model
        if traced is None:
            return (f"{self._name()}: the file records no traced model (fitted before curve files recorded one): "
                    f"replayed at {num_layers} layers for whatever model was traced")
        return f"{self._name()}: the traced model ({describe(traced)}) replayed at {num_layers} layers"

    def warn_out_of_range(self, tokens: np.ndarray) -> None:
        """out_of_range's line on stderr, the first time only (these curves replay many iterations)."""
        if getattr(self, "_warned", False):
            return
        line = self.out_of_range(tokens)
        if line is not None:
            self._warned = True
            print(line, file=sys.stderr, flush=True)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "CostCurves":
        try:
            return cls({k: tuple(v) for k, v in data["layer"].items()},
                       {k: tuple(v) for k, v in data["first_extra"].items()},
                       {k: tuple(v) for k, v in data["last_extra"].items()}, dict(data.get("source", {})))
        except (KeyError, TypeError, AttributeError) as error:
            raise ScheduleConfigError(f"not a cost-curves file ({error})") from None

    @classmethod
    def load(cls, path: str) -> "CostCurves":
        try:
            with open(path, encoding="utf-8") as handle:
                curves = cls.from_json(json.load(handle))
        except (OSError, ValueError) as error:
            raise ScheduleConfigError(f"cannot read cost curves {path}: {error}") from None
        curves.path = f"cost curves {path}"   # names the file in its warnings (not written back: not a field)
        return curves


def traced_model(run) -> Optional[dict]:
    """The model shape the run's trace header records (runtime traces from this version on), else None."""
    view = run.pipeline_view()
    return (getattr(view[0].meta, "extra", None) or {}).get("model") if view else None


def fit_curves(run, num_layers: int, skip_iterations: int = 1) -> CostCurves:
    """From a trace run (trace.reader) whose compute events carry `tokens` (and `squared_tokens`)."""
    P, V = run.pipeline_parallel, run.model_chunks
    if P * V < 3:
        raise ScheduleConfigError("fitting needs a middle chunk: at least 3 virtual stages (P x V >= 3)")
    if num_layers % (P * V):
        raise ScheduleConfigError(f"{num_layers} layers do not split into {P} x {V} chunks")
    _check_layers(run, num_layers)
    layers = num_layers // (P * V)
    samples: Dict[Tuple[str, str], List[Tuple[float, float, float]]] = {}
    tokens_seen: List[float] = []
    for rank in run.pipeline_view():
        for iteration in run.iterations()[skip_iterations:]:
            for event in rank.events_of(iteration):
                if event.kind not in FITTED_KINDS or "tokens" not in event.extra:
                    continue
                tokens = float(event.extra["tokens"])
                tokens_seen.append(tokens)
                squared = float(event.extra.get("squared_tokens", tokens * tokens))
                role = role_of(event.chunk * P + rank.meta.pp_rank, P * V)
                samples.setdefault((event.kind, role), []).append((tokens, squared, event.duration))
    missing = [f"{kind} {role}" for kind in FITTED_KINDS for role in ROLES
               if len(samples.get((kind, role), ())) < MIN_SAMPLES]
    if missing:
        raise ScheduleConfigError(f"the trace has too few planned tasks with tokens for: {', '.join(missing)} "
                                  "(run with --variable-seq-lengths or emulated lengths, tracing on)")
    fits = {key: _fit(value) for key, value in samples.items()}
    layer = {kind: tuple(v / layers for v in fits[(kind, "middle")]) for kind in FITTED_KINDS}

    def extra(role):
        return {kind: tuple(f - layers * m for f, m in zip(fits[(kind, role)], layer[kind])) for kind in FITTED_KINDS}

    return CostCurves(layer, extra("first"), extra("last"),
                      _with_model({"trace_dir": str(run.trace_dir), "pipeline_parallel": P, "model_chunks": V,
                                   "num_layers": num_layers,
                                   "samples": {f"{k} {r}": len(v) for (k, r), v in samples.items()},
                                   "tokens_range": [min(tokens_seen), max(tokens_seen)],
                                   **documents_range(run, skip_iterations)}, traced_model(run)))


def fit_whole_curves(run, num_layers: int, skip_iterations: int = 1) -> CostCurves:
    """From one P=1 V=1 trace at one depth: the whole model's fit per kind divided evenly over its layers, nothing
    counted to the first or last chunk. One depth cannot tell a layer from the embedding, output layer and loss,
    so they are spread over the layers with it: honest only where they are a small
    share of the model's work (say how small: e.g. the output layer's 2 x hidden x vocab FLOPs a token against
    24 x hidden^2 a layer)."""
    if run.pipeline_parallel * run.model_chunks != 1:
        raise ScheduleConfigError(f"spreading evenly takes a P=1 V=1 run, got P={run.pipeline_parallel} "
                                  f"V={run.model_chunks} (fit it by chunk roles instead)")
    _check_layers(run, num_layers)
    samples = whole_model_samples(run, skip_iterations, "the trace")
    layer = {kind: tuple(v / num_layers for v in _fit(found)) for kind, found in samples.items()}
    zero = {kind: (0.0, 0.0, 0.0) for kind in FITTED_KINDS}
    tokens_seen = [t for found in samples.values() for t, _, _ in found]
    return CostCurves(layer, dict(zero), dict(zero),
                      _with_model({"fit": "whole model (P=1 V=1) spread evenly over its layers",
                                   "trace_dir": str(run.trace_dir), "num_layers": num_layers,
                                   "samples": {kind: len(found) for kind, found in samples.items()},
                                   "tokens_range": [min(tokens_seen), max(tokens_seen)],
                                   **documents_range(run, skip_iterations)}, traced_model(run)))


def whole_model_samples(run, skip_iterations: int, name: str) -> Dict[str, List[Tuple[float, float, float]]]:
    """Per fitted kind, (tokens, squared tokens, microseconds) of a P=1 V=1 run's tasks after skip_iterations."""
    samples: Dict[str, List[Tuple[float, float, float]]] = {kind: [] for kind in FITTED_KINDS}
    for rank in run.pipeline_view():
        for iteration in run.iterations()[skip_iterations:]:
            for event in rank.events_of(iteration):
                if event.kind in FITTED_KINDS and "tokens" in event.extra:
                    tokens = float(event.extra["tokens"])
                    samples[event.kind].append(
                        (tokens, float(event.extra.get("squared_tokens", tokens * tokens)), event.duration))
    short = [kind for kind, found in samples.items() if len(found) < MIN_SAMPLES]
    if short:
        raise ScheduleConfigError(f"{name} has too few tasks with tokens for: {', '.join(short)} "
                                  "(run with --variable-seq-lengths, tracing on)")
    return samples


def documents_range(run, skip_iterations: int) -> dict:
    """{"documents_range": [fewest, most]} documents a fitted microbatch held (a packed task's `documents`), or {}
    when the trace does not say (padded microbatches, older traces)."""
    counts = [event.extra["documents"] for rank in run.pipeline_view()
              for iteration in run.iterations()[skip_iterations:] for event in rank.events_of(iteration)
              if event.kind in FITTED_KINDS and "documents" in event.extra]
    return {"documents_range": [min(counts), max(counts)]} if counts else {}


def _check_layers(run, num_layers: int) -> None:
    """The layer count a fit is told must be the traced model's, where its trace records one: a layer's cost is the
    chunk's divided by its layers."""
    traced = (traced_model(run) or {}).get("num_layers")
    if traced is not None and traced != num_layers:
        raise ScheduleConfigError(f"the trace is of a {traced}-layer model, not {num_layers} layers: fit it with "
                                  f"--num-layers {traced}")


def _with_model(source: dict, model: Optional[dict]) -> dict:
    """The curves' source with the traced model's shape, when the trace recorded one."""
    if model is not None:
        source["model"] = dict(model)
    return source


def summary(curves: CostCurves) -> str:
    """The curves in words, with their units: a task of a microbatch of T tokens whose documents' squared lengths
    sum to S costs, in microseconds, (its layers) x (a + b T + c S) plus its chunk's extra."""
    lines = ["per task, in microseconds, for a microbatch of T tokens whose documents' squared lengths sum to S:"]
    for kind in FITTED_KINDS:
        a, b, c = curves.layer[kind]
        first, last = curves.first_extra[kind], curves.last_extra[kind]
        lines.append(f"{kind}: each layer {a:.1f} + {b:.4f} T + {c:.3e} S us; the first chunk adds {first[0]:.1f} + "
                     f"{first[1]:.4f} T us, the last {last[0]:.1f} + {last[1]:.4f} T us")
    model = curves.model
    lines.append(f"traced model: {describe(model)}" if model is not None else
                 "traced model: not recorded (a trace written before trace headers recorded it)")
    fitted = curves.source.get("tokens_range")
    documents = curves.source.get("documents_range")
    if fitted:
        held = f", {documents[0]}-{documents[1]} documents each" if documents else ""
        lines.append(f"fitted on microbatches of {fitted[0]:,.0f}-{fitted[1]:,.0f} tokens{held} (replaying lengths "
                     f"more than {OUT_OF_RANGE_FACTOR:.0f}x outside that range is warned of)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_app.trace.cli import EXIT_BAD_INPUT, OneLineArgumentParser
    from megatron_app.trace.reader import read_trace_dir
    from megatron_app.trace.schema import TraceError

    parser = OneLineArgumentParser(prog="python -m megatron_app.sim.cost_curves", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace-dir", required=True, help="one run's trace directory")
    parser.add_argument("--pipeline_parallel", "--pipeline-parallel", dest="pipeline_parallel", type=int, required=True)
    parser.add_argument("--model_chunks", "--model-chunks", dest="model_chunks", type=int, default=1)
    parser.add_argument("--num-layers", type=int, required=True, help="the traced model's transformer layers")
    parser.add_argument("--out", required=True, help="write the curves here (JSON)")
    parser.add_argument("--spread-evenly", "--spread_evenly", action="store_true",
                        help="a P=1 V=1 trace at one depth: the whole model's fit divided evenly over its layers "
                             "(embedding, output layer and loss spread with them: for models where they are small)")
    parser.add_argument("--note", default=None, help="provenance written into the file's source (machine, run, caveats)")
    args = parser.parse_args(argv)
    try:
        run = read_trace_dir(args.trace_dir, args.pipeline_parallel, args.model_chunks)
        if args.spread_evenly:
            curves = fit_whole_curves(run, args.num_layers)
        elif args.pipeline_parallel * args.model_chunks == 1:
            raise ScheduleConfigError("a P=1 V=1 trace has no middle chunk: fit it with --spread-evenly")
        else:
            curves = fit_curves(run, args.num_layers)
    except (ScheduleConfigError, TraceError, ValueError, OSError) as error:
        print(f"cost_curves: {error}")
        return EXIT_BAD_INPUT
    if args.note:
        curves.source["note"] = args.note
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(curves.to_json(), handle, indent=1)
    print(summary(curves))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
