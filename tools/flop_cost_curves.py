#!/usr/bin/env python3
"""Cost curves from a GPT's FLOP count, their time per FLOP calibrated on a P=1 trace's task sums.

Where a trace's task times are not the device's per task (host-timed CUDA: a task's span ends where the host next
waits, so a task absorbs queued work of the tasks before it), a fit per task smears the costs between neighbours and
flattens them (a large constant, a small or no attention term). At P=1 every forward ends in the loss's
synchronisation, so the sum of a kind's task times over an iteration is the device's time for that kind to within
the queue at the iteration's ends. This writes curves (sim/cost_curves.py's format, for `python -m megatron_app.sim
--cost-curves FILE --num-layers L`) whose *shape* is the model's FLOP count and whose *scale* is that sum:

  a layer's forward, per microbatch of T tokens and S = sum of its attention rows' squared lengths:
      linear  2 x (4 h^2 + 2 h f) FLOPs a token      (QKV, projection, two MLP matmuls; f = FFN width, 4h default)
      square  4 h FLOPs a squared token              (QK^T and AV over the whole square, as Megatron's local
                                                      DotProductAttention computes them; memory-bound softmax and
                                                      masking are not counted)
  the output layer (last chunk): 2 h x vocab FLOPs a token; the embedding: a lookup, 0.
  backward: 2 x the forward's FLOPs.
  --attention-scale 0.5: a causal kernel's attention (half the square), for the kernels packed documents get on CUDA.

Per kind, seconds per FLOP = the trace's summed task time of that kind / the FLOPs of those tasks (iterations after
the first): the curves reproduce the trace's totals per kind, not its single tasks. No constant term: a kernel
launch's host time is the simulator's --host-ms.

    python tools/flop_cost_curves.py --trace-dir TRACE_P1 --hidden-size 2048 --num-layers 8 --vocab-size 1024 \\
        --out docs/results/cost_curves/gpt_h200_h2048_l8_flops_p1cal.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_app.schedule import ScheduleConfigError  # noqa: E402
from megatron_app.sim.cost_curves import FITTED_KINDS, CostCurves, traced_model, whole_model_samples  # noqa: E402
from megatron_app.trace.model_shape import model_differences  # noqa: E402

BACKWARD_OVER_FORWARD_FLOPS = 2.0


def flops_per_layer(hidden: int, ffn: int, attention_scale: float = 1.0):
    """(FLOPs a token, FLOPs a squared token) of one transformer layer's forward; attention_scale 0.5: a causal
    kernel that skips the masked half of the square."""
    return 2.0 * (4 * hidden * hidden + 2 * hidden * ffn), 4.0 * hidden * attention_scale


def calibrate(run, num_layers: int, hidden: int, ffn: int, vocab: int, skip_iterations: int = 1,
              attention_scale: float = 1.0) -> dict:
    """Per kind: summed task microseconds, summed FLOPs, and the achieved TFLOP/s, over a P=1 V=1 run's tasks."""
    if run.pipeline_parallel * run.model_chunks != 1:
        raise SystemExit("flop_cost_curves: calibrate on a P=1 V=1 trace (its task sums are the device's time)")
    per_token, per_square = flops_per_layer(hidden, ffn, attention_scale)
    sums = {kind: {"us": 0.0, "flops": 0.0, "tasks": 0} for kind in FITTED_KINDS}
    try:
        samples = whole_model_samples(run, skip_iterations, "the trace")
    except ScheduleConfigError as error:
        raise SystemExit(f"flop_cost_curves: {error}") from None
    for kind, found in samples.items():
        factor = 1.0 if kind == "forward" else BACKWARD_OVER_FORWARD_FLOPS
        for tokens, squared, micros in found:
            forward = num_layers * (per_token * tokens + per_square * squared) + 2.0 * hidden * vocab * tokens
            sums[kind]["us"] += micros
            sums[kind]["flops"] += factor * forward
            sums[kind]["tasks"] += 1
    for entry in sums.values():
        entry["tflops"] = entry["flops"] / entry["us"] / 1e6
    return sums


def curves_from_flops(sums: dict, hidden: int, ffn: int, vocab: int, source: dict,
                      attention_scale: float = 1.0) -> CostCurves:
    per_token, per_square = flops_per_layer(hidden, ffn, attention_scale)
    layer, last, first = {}, {}, {}
    for kind in FITTED_KINDS:
        factor = 1.0 if kind == "forward" else BACKWARD_OVER_FORWARD_FLOPS
        us_per_flop = sums[kind]["us"] / sums[kind]["flops"]
        layer[kind] = (0.0, factor * per_token * us_per_flop, factor * per_square * us_per_flop)
        last[kind] = (0.0, factor * 2.0 * hidden * vocab * us_per_flop, 0.0)
        first[kind] = (0.0, 0.0, 0.0)
    return CostCurves(layer, first, last, source)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_app.trace.reader import read_trace_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace-dir", required=True, help="a P=1 V=1 run's trace directory (the calibration)")
    parser.add_argument("--hidden-size", type=int, required=True)
    parser.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    parser.add_argument("--num-layers", type=int, required=True, help="the traced model's transformer layers")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--skip-iterations", type=int, default=1, help="warm-up iterations left out (default 1)")
    parser.add_argument("--attention-scale", type=float, default=1.0,
                        help="the attention term's share of the whole square: 1.0 (default) as Megatron's local "
                             "DotProductAttention computes it, 0.5 for a causal kernel that skips the masked half")
    parser.add_argument("--note", default="", help="provenance written into the file's source")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    ffn = args.ffn_hidden_size or 4 * args.hidden_size
    run = read_trace_dir(args.trace_dir, 1, 1)
    flagged = {"num_layers": args.num_layers, "hidden_size": args.hidden_size, "ffn_hidden_size": ffn,
               "vocab_size": args.vocab_size}
    traced = traced_model(run)    # the trace header's (traces written before it recorded one: the flags')
    differs = [] if traced is None else model_differences(traced, flagged) + (
        [f"num_layers {traced['num_layers']} -> {args.num_layers}"] if traced.get("num_layers") not in
        (None, args.num_layers) else [])
    if differs:
        raise SystemExit("flop_cost_curves: the flags describe another model than the traced one "
                         f"({', '.join(differs)}): give the traced model's sizes")
    sums = calibrate(run, args.num_layers, args.hidden_size, ffn, args.vocab_size, args.skip_iterations,
                     args.attention_scale)
    per_token, per_square = flops_per_layer(args.hidden_size, ffn, args.attention_scale)
    source = {"fit": "FLOP count, time per FLOP calibrated per kind on a P=1 trace's task sums "
                     "(tools/flop_cost_curves.py)",
              "trace_dir": str(args.trace_dir), "num_layers": args.num_layers, "hidden_size": args.hidden_size,
              "ffn_hidden_size": ffn, "vocab_size": args.vocab_size, "skip_iterations": args.skip_iterations,
              "layer_forward_flops": {"per_token": per_token, "per_squared_token": per_square},
              "attention_scale": args.attention_scale,
              "backward_over_forward_flops": BACKWARD_OVER_FORWARD_FLOPS,
              "calibration": {kind: {"tasks": s["tasks"], "summed_ms": s["us"] / 1e3,
                                     "achieved_tflops": s["tflops"]} for kind, s in sums.items()},
              "note": args.note, "model": traced or flagged}
    curves = curves_from_flops(sums, args.hidden_size, ffn, args.vocab_size, source, args.attention_scale)
    Path(args.out).write_text(json.dumps(curves.to_json(), indent=1))
    for kind in FITTED_KINDS:
        _, b, c = curves.layer[kind]
        print(f"{kind}: {sums[kind]['tasks']} tasks, {sums[kind]['us'] / 1e3:.1f} ms, "
              f"{sums[kind]['tflops']:.1f} TFLOP/s achieved; a layer {b:.4f} us/token + {c:.3e} us/token^2, "
              f"output layer {curves.last_extra[kind][1]:.4f} us/token")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
