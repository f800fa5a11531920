"""Train the tiny GPT under packet loss and compare with the lossless run.

    python tools/loss_sweep.py [--out-dir loss_sweep] [--iters 80] [--quick] [--markdown]
                               [--rates 0.01,0.05,0.1] [--traffic pipeline,tp,...] [--models bernoulli,...]
                               [--num-layers 4]

Grid: loss rates 0, 1%, 5%, 10% x (bernoulli, gilbert-elliott with mean burst --burst-length) x traffic:
  pipeline       P=2, --loss-on forward,backward (activations and gradients between the stages);
  tp             T=2, --loss-on tp on every tensor-parallel site except vocab-parallel cross-entropy
                 (--loss-tp-sites without cross_entropy / fused_cross_entropy): the layers' own traffic;
  tp_all_sites   T=2, --loss-on tp on all sites ("tp (T=2) incl. cross-entropy" in the table). Cross-entropy's
                 all-reduces (max logit, predicted logit, sum of exponentials: one packet each per microbatch) can
                 turn the loss itself into NaN or -inf when lost (a zeroed sum of exponentials gives log 0 under the
                 zeros fill); such runs print as "diverged (NaN at iter k)".
Every run starts from the same seed and data, so differences come from the loss alone; both tp groups share one
lossless run. Writes <out-dir>/loss_sweep.json and loss_sweep.png (loss curves; non-finite points are left out) and
prints the table of final loss (mean of the last --tail iterations) against the lossless run of the same layout.
--quick: 0 and 10%, bernoulli only, 4 iterations (a smoke test). --num-layers 8 is the trainer's default model size
(the 4-layer default keeps the README's first table reproducible); --rates, --traffic and --models narrow or widen
the grid, e.g. a pipeline-only sweep down to where learning resumes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]   # the checkout: run_single.sh runs each point
from megatron_app.lossy.config import TP_SITES
from megatron_app.trace.runs import LATEST

RATES = (0.0, 0.01, 0.05, 0.10)
MODELS = ("bernoulli", "gilbert-elliott")
CROSS_ENTROPY_SITES = ("cross_entropy", "fused_cross_entropy")
PIPELINE_LAYOUT = ["--pipeline_parallel", "2", "--model_chunks", "1"]
TP_LAYOUT = ["--pipeline_parallel", "1", "--model_chunks", "1", "--tensor_parallel", "2"]
TRAFFIC = {  # name -> (layout flags, loss-placement flags, label in the table and the plot)
    "pipeline": (PIPELINE_LAYOUT, ["--loss-on", "forward,backward"], "pipeline (P=2)"),
    "tp": (TP_LAYOUT, ["--loss-on", "tp", "--loss-tp-sites",
                       ",".join(site for site in TP_SITES if site not in CROSS_ENTROPY_SITES)],
           "tp (T=2), cross-entropy exact"),
    "tp_all_sites": (TP_LAYOUT, ["--loss-on", "tp", "--loss-tp-sites", "all"], "tp (T=2) incl. cross-entropy"),
}
SHARED_BASELINE = {"tp_all_sites": "tp"}  # same layout, so the same lossless run
DEFAULT_NUM_LAYERS = 4
MODEL_FLAGS = ["--num-layers", str(DEFAULT_NUM_LAYERS), "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
               "--micro-batch-size", "2", "--global-batch-size", "16"]


class SweepError(Exception):
    pass


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="loss_sweep", help="where the JSON, the PNG and the run logs go")
    parser.add_argument("--iters", type=int, default=None, help="iterations per run (default 80; 4 with --quick)")
    parser.add_argument("--tail", type=int, default=10, help="final loss = mean of the last TAIL iterations")
    parser.add_argument("--burst-length", type=float, default=4.0, help="gilbert-elliott mean burst (packets)")
    parser.add_argument("--fill", default="zeros", choices=("zeros", "stale", "rescale"))
    parser.add_argument("--packet-bytes", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--quick", action="store_true", help="0 and 10%% bernoulli only, few iterations")
    parser.add_argument("--markdown", action="store_true",
                        help="also print the change of final loss per traffic, model and rate as a Markdown table")
    parser.add_argument("--rates", default=None, metavar="R1,R2,...",
                        help="loss rates in (0, 1) (default 0.01,0.05,0.1; 0.1 with --quick); 0 always runs")
    parser.add_argument("--traffic", default=",".join(TRAFFIC), metavar="NAMES",
                        help=f"comma list of {', '.join(TRAFFIC)} (default: all)")
    parser.add_argument("--models", default=None, metavar="NAMES",
                        help=f"comma list of {', '.join(MODELS)} (default: both; bernoulli with --quick)")
    parser.add_argument("--num-layers", type=int, default=DEFAULT_NUM_LAYERS,
                        help=f"transformer layers of the tiny GPT (default {DEFAULT_NUM_LAYERS}; the trainer's own "
                             "default is 8)")
    args = parser.parse_args(argv)
    if args.iters is None:
        args.iters = 4 if args.quick else 80
    if args.iters < 1 or args.tail < 1:
        parser.error("--iters and --tail must be positive")
    if args.burst_length < 1:
        parser.error(f"--burst-length must be >= 1 packet, got {args.burst_length}")
    if args.num_layers < 1:
        parser.error(f"--num-layers must be positive, got {args.num_layers}")
    args.traffic = _names(parser, "--traffic", args.traffic, TRAFFIC)
    args.models = _names(parser, "--models", args.models, MODELS) if args.models else (
        ("bernoulli",) if args.quick else MODELS)
    args.rates = _rates(parser, args.rates) if args.rates else ((0.10,) if args.quick else RATES[1:])
    return args


def _names(parser, flag: str, text: str, known) -> tuple:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        parser.error(f"{flag} takes a comma list of {', '.join(known)}, got '{text}'")
    return names


def _rates(parser, text: str) -> tuple:
    try:
        rates = tuple(sorted({float(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        parser.error(f"--rates takes a comma list of numbers between 0 and 1, got '{text}'")
    if not rates or not all(0 < rate < 1 for rate in rates):
        parser.error(f"--rates takes a comma list of numbers between 0 and 1 (exclusive), got '{text}'")
    return rates


def model_flags(num_layers: int) -> list:
    flags = list(MODEL_FLAGS)
    flags[flags.index("--num-layers") + 1] = str(num_layers)
    return flags


def grid(args) -> list:
    """(traffic, model, rate) of every run; rate 0 is one lossless run per layout."""
    runs = []
    for traffic in (name for name in TRAFFIC if name in args.traffic):
        baseline = SHARED_BASELINE.get(traffic)
        if baseline is None or baseline not in args.traffic:
            runs.append((baseline or traffic, "none", 0.0))
        runs.extend((traffic, model, rate) for model in args.models for rate in args.rates)
    return runs


def run_name(traffic: str, model: str, rate: float) -> str:
    return f"{traffic}_{model}_{rate:g}"


def trainer_flags(args, traffic: str, model: str, rate: float, log_json: Path, trace_dir: Path) -> list:
    """One sweep run's run_single.sh flags. The sweep measures divergence itself (summarize_losses), so a non-finite
    loss must not stop the run: the trainer's NaN check is off."""
    layout, placement, _ = TRAFFIC[traffic]
    flags = layout + model_flags(args.num_layers) + ["--iters", str(args.iters), "--seed", str(args.seed),
                                                     "--log-json", str(log_json), "--trace-dir", str(trace_dir),
                                                     "--no-check-for-nan-in-loss-and-grad"]
    if model != "none":
        flags += ["--loss-model", model, "--loss-rate", str(rate), *placement, "--loss-fill", args.fill,
                  "--loss-packet-bytes", str(args.packet_bytes)]
        if model == "gilbert-elliott":
            flags += ["--burst-length", str(args.burst_length)]
    return flags


def train_once(args, out_dir: Path, traffic: str, model: str, rate: float) -> dict:
    name = run_name(traffic, model, rate)
    log_json = out_dir / f"{name}.json"
    trace_dir = out_dir / f"{name}_trace"
    flags = trainer_flags(args, traffic, model, rate, log_json, trace_dir)
    env = dict(os.environ, LOG_DIR=str(out_dir / f"{name}_logs"), OMP_NUM_THREADS="1")
    start = time.perf_counter()
    with open(out_dir / f"{name}.log", "w", encoding="utf-8") as log:
        done = subprocess.run(["bash", str(REPO / "run_single.sh"), *flags], cwd=REPO, env=env, stdout=log,
                              stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise SweepError(f"run {name} failed (exit {done.returncode}); see {out_dir / (name + '.log')}")
    losses = [entry["loss"] for entry in json.loads(log_json.read_text())["iterations"]]
    packets, lost = observed_loss(trace_dir)
    return {"traffic": traffic, "model": model, "rate": rate, **summarize_losses(losses, args.tail),
            "packets": packets, "lost": lost, "observed_rate": lost / packets if packets else 0.0,
            "seconds": time.perf_counter() - start}


def summarize_losses(losses: list, tail: int) -> dict:
    """losses (non-finite ones as None, so the JSON stays standard), final_loss (None once a loss was NaN or
    infinite) and diverged ({"iteration", "value"} of the first non-finite loss, or None)."""
    diverged = next(({"iteration": number, "value": "NaN" if math.isnan(loss) else str(loss)}
                     for number, loss in enumerate(losses, start=1) if not math.isfinite(loss)), None)
    final_loss = None if diverged else sum(losses[-tail:]) / len(losses[-tail:])
    return {"losses": [loss if math.isfinite(loss) else None for loss in losses], "final_loss": final_loss,
            "diverged": diverged}


def observed_loss(trace_dir: Path) -> tuple:
    """Packets sent and lost over all ranks, from the trace's `loss` events (of the run trace_dir/latest points to:
    each sweep run has a trace root of its own)."""
    packets = lost = 0
    for path in sorted((trace_dir / LATEST).glob("trace_rank*.jsonl")):
        with open(path, encoding="utf-8") as handle:
            next(handle, None)  # header
            for line in handle:
                event = json.loads(line)
                if event.get("kind") == "loss":
                    packets += event["extra"]["packets"]
                    lost += event["extra"]["lost"]
    return packets, lost


def add_baseline(results: list) -> None:
    """lossless_final_loss, delta and relative of every run (delta/relative None when either side diverged)."""
    lossless = {r["traffic"]: r["final_loss"] for r in results if r["model"] == "none"}
    for result in results:
        base = lossless[SHARED_BASELINE.get(result["traffic"], result["traffic"])]
        result["lossless_final_loss"] = base
        comparable = result["final_loss"] is not None and base is not None
        result["delta"] = result["final_loss"] - base if comparable else None
        result["relative"] = result["final_loss"] / base - 1.0 if comparable else None


def outcome(result: dict) -> Optional[str]:
    """'diverged (NaN at iter 7)' for a run whose loss stopped being finite, else None."""
    if result["diverged"] is None:
        return None
    return f"diverged ({result['diverged']['value']} at iter {result['diverged']['iteration']})"


def percent(rate: float) -> str:
    """0.1 -> '10%', 0.005 -> '0.5%' (the rates of a fine sweep stay apart)."""
    return f"{rate * 100:.3g}%"


def table_rows(results: list) -> list:
    header = ["traffic", "model", "rate", "observed", "final loss", "lossless", "delta", "rel"]
    rows = [header]
    for r in results:
        row = [TRAFFIC[r["traffic"]][2], r["model"], percent(r["rate"]), f"{r['observed_rate']:.2%}"]
        base = "-" if r["lossless_final_loss"] is None else f"{r['lossless_final_loss']:.4f}"
        if r["diverged"] is not None:
            row += [outcome(r), base, "-", "-"]
        else:
            row += [f"{r['final_loss']:.4f}", base,
                    "-" if r["delta"] is None else f"{r['delta']:+.4f}",
                    "-" if r["relative"] is None else f"{r['relative']:+.2%}"]
        rows.append(row)
    return rows


def print_table(results: list) -> None:
    rows = table_rows(results)
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        cells = [cell.ljust(width) if column < 2 else cell.rjust(width)
                 for column, (cell, width) in enumerate(zip(row, widths))]
        print("  ".join(cells).rstrip())


def markdown_table(results: list) -> str:
    """Change of final loss against the lossless run, one row per traffic and model, one column per rate."""
    rates = sorted({r["rate"] for r in results if r["model"] != "none"})
    lines = ["| traffic | model | " + " | ".join(percent(rate) for rate in rates) + " |",
             "|---|---|" + "---|" * len(rates)]
    for traffic in TRAFFIC:
        for model in MODELS:
            cells = {r["rate"]: r for r in results if r["traffic"] == traffic and r["model"] == model}
            if not cells:
                continue
            text = [relative_change(cells[rate]) if rate in cells else "" for rate in rates]
            lines.append(f"| {TRAFFIC[traffic][2]} | {model} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def relative_change(result: dict) -> str:
    if result["relative"] is None:
        return outcome(result) or "-"
    return f"{result['relative']:+.1%}"


def plot(results: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traffics = [traffic for traffic in TRAFFIC if any(r["traffic"] == traffic for r in results)]
    lossless = {r["traffic"]: r for r in results if r["model"] == "none"}
    figure, axes = plt.subplots(1, len(traffics), figsize=(6.0 * len(traffics), 4.5), squeeze=False)
    styles = {"none": "-", "bernoulli": "--", "gilbert-elliott": ":"}
    for axis, traffic in zip(axes[0], traffics):
        base = lossless.get(SHARED_BASELINE.get(traffic, traffic))
        for r in ([base] if base else []) + [r for r in results if r["traffic"] == traffic and r["model"] != "none"]:
            label = "lossless" if r["model"] == "none" else f"{r['model']} {percent(r['rate'])}"
            if r["diverged"] is not None:
                label += f": {outcome(r)}"
            points = [(number, loss) for number, loss in enumerate(r["losses"], start=1) if loss is not None]
            (line,) = axis.plot([x for x, _ in points], [y for _, y in points], styles[r["model"]], label=label,
                                linewidth=2.0 if r["model"] == "none" else 1.2)
            if r["diverged"] is not None and points:  # where the curve stops: the last finite loss
                axis.plot(*points[-1], "x", color=line.get_color(), markersize=8)
        axis.set_title(f"{TRAFFIC[traffic][2]} traffic", fontsize=10)
        axis.set_xlabel("iteration")
        axis.set_ylabel("training loss")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle("Tiny GPT under packet loss")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    started = time.perf_counter()
    try:
        for traffic, model, rate in grid(args):
            print(f"[loss_sweep] {run_name(traffic, model, rate)} ...", file=sys.stderr, flush=True)
            results.append(train_once(args, out_dir, traffic, model, rate))
    except SweepError as exc:
        print(f"loss_sweep.py: error: {exc}", file=sys.stderr)
        return 1
    add_baseline(results)
    print_table(results)
    if args.markdown:
        print(markdown_table(results))
    settings = {key: getattr(args, key) for key in ("iters", "tail", "burst_length", "fill", "packet_bytes", "seed",
                                                    "num_layers")}
    traffic = {name: {"flags": layout + placement, "label": label}
               for name, (layout, placement, label) in TRAFFIC.items()}
    (out_dir / "loss_sweep.json").write_text(json.dumps(
        {"settings": settings, "model_flags": model_flags(args.num_layers), "traffic": traffic, "runs": results,
         "wall_seconds": time.perf_counter() - started}, indent=1, allow_nan=False))
    plot(results, out_dir / "loss_sweep.png")
    print(f"wrote {out_dir / 'loss_sweep.json'} and {out_dir / 'loss_sweep.png'} "
          f"({len(results)} runs, {time.perf_counter() - started:.0f} s)")
    return 0

