"""tools/bench_schedule.py's output: the rows table, the composition rows' table, the target checks, the bar chart
and the machine description its JSON carries."""

from __future__ import annotations

import os
import platform


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def format_table(rows) -> str:
    header = (f"{'scenario':<18} {'schedule':<42} {'iter ms':>8} {'bubble':>7} {'sim ms':>7} {'sim err':>8} "
              f"{'bound ms':>8} {'replay err':>10} {'own bound':>9}  peak activations per rank"
              + ("  [peak tokens per rank; sim]" if any(row.peak_tokens for row in rows) else ""))
    lines = [header, "-" * len(header)]
    previous = None
    for row in rows:
        if previous is not None and row.scenario != previous:
            lines.append("")
        previous = row.scenario
        lines.append(f"{row.scenario:<18} {row.label:<42} {row.iteration_ms:>8.1f} {row.bubble_ratio:>7.1%} "
                     f"{_fmt(row.sim_ms, '7.1f'):>7} {_fmt(row.sim_error, '+8.1%'):>8} {_fmt(row.bound_ms, '8.1f'):>8} "
                     f"{_fmt(row.replay_error, '+10.1%'):>10} {_fmt(row.own_bound_error, '+9.1%'):>9}  "
                     f"{','.join(map(str, row.peak_activations))}"
                     + (f"  [{','.join(map(str, row.peak_tokens))}; {','.join(map(str, row.sim_peak_tokens or []))}]"
                        if row.peak_tokens else ""))
    return "\n".join(lines)


def format_composition_rows(rows) -> str:
    """The composition rows' own columns; x baseline = the scenario's loader-padded row (Megatron's order)."""
    header = (f"{'scenario':<18} {'composition row':<48} {'m':>5} {'iter ms':>8} {'x base':>7} {'sim ms':>7} "
              f"{'sim err':>8} {'own bound':>9} {'padding':>8} {'tokens/base':>11} {'plan ms':>8}  "
              "peak activation tokens per rank")
    lines = [header, "-" * len(header)]
    for row in rows:
        base = next((r for r in rows if r.scenario == row.scenario and r.key == "loader-padded"), None)
        speedup = None if base is None else base.iteration_ms / row.iteration_ms
        lines.append(f"{row.scenario:<18} {row.label:<48} {row.num_microbatches:>5.1f} {row.iteration_ms:>8.1f} "
                     f"{_fmt(speedup, '7.3f'):>7} {_fmt(row.sim_ms, '7.1f'):>7} {_fmt(row.sim_error, '+8.1%'):>8} "
                     f"{_fmt(row.own_bound_error, '+9.1%'):>9} {row.padding_share:>8.1%} "
                     f"{_fmt(row.peak_tokens_over_base, '11.3f'):>11} {_fmt(row.planning_ms, '8.1f'):>8}  "
                     f"{','.join(map(str, row.peak_tokens))}")
    return "\n".join(lines)


def format_checks(checks) -> str:
    lines = ["targets:"]
    for check in checks:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[check.passed]
        lines.append(f"  [{verdict}] {check.scenario}: {check.target}: {check.measured}")
    return "\n".join(lines)


def write_png(rows, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(row.scenario for row in rows))
    labels = list(dict.fromkeys(row.label for row in rows))
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(max(8, 2.2 * len(scenarios)), 5.5))
    colors = plt.get_cmap("tab10")
    for j, label in enumerate(labels):
        xs, ys, sims = [], [], []
        for i, scenario in enumerate(scenarios):
            row = next((r for r in rows if r.scenario == scenario and r.label == label), None)
            if row is not None:
                xs.append(i + (j - (len(labels) - 1) / 2) * width)
                ys.append(row.iteration_ms)
                sims.append(row.sim_ms)
        ax.bar(xs, ys, width, label=label, color=colors(j % 10))
        sim_points = [(x, s) for x, s in zip(xs, sims) if s is not None]
        if sim_points:
            ax.hlines([p[1] for p in sim_points], [p[0] - width / 2 for p in sim_points],
                      [p[0] + width / 2 for p in sim_points], colors="black", zorder=3)
    for i, scenario in enumerate(scenarios):
        bound = next((r.bound_ms for r in rows if r.scenario == scenario and r.model_chunks == max(
            x.model_chunks for x in rows)), None)
        if bound is not None:
            ax.hlines(bound, i - 0.45, i + 0.45, colors="red", linestyles="dashed", zorder=4)
    ax.set_xticks(range(len(scenarios)))
    ax.set_xticklabels(scenarios)
    ax.set_ylabel("iteration time, ms (median)")
    ax.set_title(title + "\nblack tick: simulator prediction; red dashes: lower bound", fontsize=10)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.07))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine() -> dict:
    import torch

    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
