#!/usr/bin/env python3
"""Train the tiny GPT under packet loss and compare with the lossless run.

    python tools/loss_sweep.py [--out-dir loss_sweep] [--iters 80] [--quick]

Grid: loss rates 0, 1%, 5%, 10% x (bernoulli, gilbert-elliott with mean burst --burst-length) x (pipeline traffic:
P=2 with --loss-on forward,backward; tensor-parallel traffic: T=2 with --loss-on tp). Every run starts from the same
seed and data, so differences come from the loss alone. Writes <out-dir>/loss_sweep.json and loss_sweep.png (loss
curves) and prints the table of final loss (mean of the last --tail iterations) against the lossless run of the
same traffic. --quick: 0 and 10%, bernoulli only, 4 iterations (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RATES = (0.0, 0.01, 0.05, 0.10)
MODELS = ("bernoulli", "gilbert-elliott")
TRAFFIC = {  # name -> (layout flags, --loss-on)
    "pipeline": (["--pipeline_parallel", "2", "--model_chunks", "1"], "forward,backward"),
    "tp": (["--pipeline_parallel", "1", "--model_chunks", "1", "--tensor_parallel", "2"], "tp"),
}
MODEL_FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
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
    args = parser.parse_args(argv)
    if args.iters is None:
        args.iters = 4 if args.quick else 80
    if args.iters < 1 or args.tail < 1:
        parser.error("--iters and --tail must be positive")
    if args.burst_length < 1:
        parser.error(f"--burst-length must be >= 1 packet, got {args.burst_length}")
    return args


def grid(args) -> list:
    """(traffic, model, rate) of every run; rate 0 is one lossless run per traffic."""
    rates = (0.0, 0.10) if args.quick else RATES
    models = ("bernoulli",) if args.quick else MODELS
    runs = []
    for traffic in TRAFFIC:
        runs.append((traffic, "none", 0.0))
        runs.extend((traffic, model, rate) for model in models for rate in rates if rate > 0)
    return runs


def run_name(traffic: str, model: str, rate: float) -> str:
    return f"{traffic}_{model}_{rate:g}"


def train_once(args, out_dir: Path, traffic: str, model: str, rate: float) -> dict:
    name = run_name(traffic, model, rate)
    layout, loss_on = TRAFFIC[traffic]
    log_json = out_dir / f"{name}.json"
    trace_dir = out_dir / f"{name}_trace"
    flags = layout + MODEL_FLAGS + ["--iters", str(args.iters), "--seed", str(args.seed), "--log-json", str(log_json),
                                    "--trace-dir", str(trace_dir)]
    if model != "none":
        flags += ["--loss-model", model, "--loss-rate", str(rate), "--loss-on", loss_on, "--loss-fill", args.fill,
                  "--loss-packet-bytes", str(args.packet_bytes)]
        if model == "gilbert-elliott":
            flags += ["--burst-length", str(args.burst_length)]
    env = dict(os.environ, LOG_DIR=str(out_dir / f"{name}_logs"), OMP_NUM_THREADS="1")
    start = time.perf_counter()
    with open(out_dir / f"{name}.log", "w", encoding="utf-8") as log:
        done = subprocess.run(["bash", str(REPO / "run_single.sh"), *flags], cwd=REPO, env=env, stdout=log,
                              stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise SweepError(f"run {name} failed (exit {done.returncode}); see {out_dir / (name + '.log')}")
    losses = [entry["loss"] for entry in json.loads(log_json.read_text())["iterations"]]
    packets, lost = observed_loss(trace_dir)
    return {"traffic": traffic, "model": model, "rate": rate, "losses": losses,
            "final_loss": sum(losses[-args.tail:]) / len(losses[-args.tail:]),
            "packets": packets, "lost": lost, "observed_rate": lost / packets if packets else 0.0,
            "seconds": time.perf_counter() - start}


def observed_loss(trace_dir: Path) -> tuple:
    """Packets sent and lost over all ranks, from the trace's `loss` events."""
    packets = lost = 0
    for path in sorted(trace_dir.glob("trace_rank*.jsonl")):
        with open(path, encoding="utf-8") as handle:
            next(handle, None)  # header
            for line in handle:
                event = json.loads(line)
                if event.get("kind") == "loss":
                    packets += event["extra"]["packets"]
                    lost += event["extra"]["lost"]
    return packets, lost


def add_baseline(results: list) -> None:
    lossless = {r["traffic"]: r["final_loss"] for r in results if r["model"] == "none"}
    for result in results:
        base = lossless[result["traffic"]]
        result["lossless_final_loss"] = base
        result["delta"] = result["final_loss"] - base
        result["relative"] = result["final_loss"] / base - 1.0


def print_table(results: list) -> None:
    print(f"{'traffic':<9} {'model':<16} {'rate':>6} {'observed':>9} {'final loss':>11} {'lossless':>9} "
          f"{'delta':>8} {'rel':>7}")
    for r in results:
        print(f"{r['traffic']:<9} {r['model']:<16} {r['rate']:>6.0%} {r['observed_rate']:>9.2%} "
              f"{r['final_loss']:>11.4f} {r['lossless_final_loss']:>9.4f} {r['delta']:>+8.4f} {r['relative']:>+7.2%}")


def plot(results: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traffics = list(dict.fromkeys(r["traffic"] for r in results))
    figure, axes = plt.subplots(1, len(traffics), figsize=(6.5 * len(traffics), 4.5), squeeze=False)
    styles = {"none": "-", "bernoulli": "--", "gilbert-elliott": ":"}
    for axis, traffic in zip(axes[0], traffics):
        for r in (r for r in results if r["traffic"] == traffic):
            label = "lossless" if r["model"] == "none" else f"{r['model']} {r['rate']:.0%}"
            axis.plot(range(1, len(r["losses"]) + 1), r["losses"], styles[r["model"]], label=label,
                      linewidth=2.0 if r["model"] == "none" else 1.2)
        axis.set_title(f"{'pipeline (P=2)' if traffic == 'pipeline' else 'tensor-parallel (T=2)'} traffic")
        axis.set_xlabel("iteration")
        axis.set_ylabel("training loss")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle("Tiny GPT under packet loss")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for traffic, model, rate in grid(args):
            print(f"[loss_sweep] {run_name(traffic, model, rate)} ...", file=sys.stderr, flush=True)
            results.append(train_once(args, out_dir, traffic, model, rate))
    except SweepError as exc:
        print(f"loss_sweep.py: error: {exc}", file=sys.stderr)
        return 1
    add_baseline(results)
    print_table(results)
    settings = {key: getattr(args, key) for key in ("iters", "tail", "burst_length", "fill", "packet_bytes", "seed")}
    (out_dir / "loss_sweep.json").write_text(json.dumps({"settings": settings, "model_flags": MODEL_FLAGS,
                                                         "runs": results}, indent=1))
    plot(results, out_dir / "loss_sweep.png")
    print(f"wrote {out_dir / 'loss_sweep.json'} and {out_dir / 'loss_sweep.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
