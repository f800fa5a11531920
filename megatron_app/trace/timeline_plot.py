"""PNG timeline of one iteration in true time: a Gantt row per pipeline rank (idle gaps visible), the computing
ratio (busy fraction in a sliding window) and, when the trace has sends that take time, the sending window (sends
in flight) per rank."""

from __future__ import annotations

from .intervals import busy_fraction, concurrency_steps, interval_deltas, max_level_per_bin
from .metrics import IterationMetrics
from .palette import task_rgb, text_rgb
from .reader import RankTrace
from .schema import BACKWARD, COMPUTE_KINDS, FORWARD, SEND, WAIT, WEIGHT

_BINS = 400
_FIGURE_WIDTH_IN = 14.0
_DPI = 110
_LABEL_FONT_PT = 7
_CHAR_PX = 0.62 * _LABEL_FONT_PT * _DPI / 72    # a digit or '-' of the label font, in pixels
_LABEL_MARGIN_PX = 3.0


def write_timeline_png(path, stages: list[RankTrace], iteration: int, info: dict, metrics: IterationMetrics) -> None:
    """stages[r]: the rank file of pipeline rank r. Times are drawn in milliseconds from the iteration's start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    model_chunks = int(info["model_chunks"])
    origin = metrics.start_us
    span_ms = max(metrics.makespan_us / 1e3, 1e-6)
    num_ranks = len(stages)
    events = [stage.events_of(iteration) for stage in stages]
    # A simulated run's sends take no time unless it models the links: no sending window to draw then.
    with_sends = any(e.kind == SEND and e.end > e.start for row in events for e in row)
    gantt_height = 0.45 * num_ranks + 1.0
    strip_height = 0.18 * num_ranks + 0.9
    heights = [gantt_height, strip_height] + ([strip_height] if with_sends else [])
    fig, axes = plt.subplots(len(heights), 1, sharex=True, figsize=(_FIGURE_WIDTH_IN, sum(heights) + 1.0),
                             dpi=_DPI, gridspec_kw={"height_ratios": heights}, layout="constrained")
    gantt, ratio = axes[0], axes[1]

    labelled = []
    for rank, row in enumerate(events):
        for event in row:
            start_ms = (event.start - origin) / 1e3
            width_ms = event.duration / 1e3
            if event.kind in COMPUTE_KINDS:
                colour = "#" + task_rgb(event.kind, event.chunk, model_chunks)
                gantt.barh(rank, width_ms, left=start_ms, height=0.8, color=colour, edgecolor="#333333",
                           linewidth=0.4)
                labelled.append((rank, start_ms, width_ms, event))
            elif event.kind == WAIT:
                gantt.barh(rank + 0.47, width_ms, left=start_ms, height=0.12, color="#BBBBBB", linewidth=0)
    gantt.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
    gantt.set_ylim(num_ranks - 0.4, -0.6)  # rank 0 at the top
    gantt.set_xlim(0, span_ms)
    bound = "n/a" if metrics.lower_bound_us is None else f"{metrics.lower_bound_us / 1e3:.2f} ms"
    ratio_text = "n/a" if metrics.makespan_over_lower_bound is None else f"{metrics.makespan_over_lower_bound:.3f}"
    fig.suptitle("  ".join(f"{k}={v}" for k, v in info.items())
                 + f"\nmakespan {metrics.makespan_us / 1e3:.2f} ms, lower bound {bound} (x bound {ratio_text}), "
                 f"mean bubble {metrics.mean_bubble_ratio:.1%}", fontsize=9)
    kinds_present = [kind for kind in (FORWARD, BACKWARD, WEIGHT)
                     if kind != WEIGHT or any(e.kind == WEIGHT for row in events for e in row)]
    legend = [Patch(color="#" + task_rgb(kind, c, model_chunks), label=f"{kind[0].upper()} chunk {c}")
              for kind in kinds_present for c in range(model_chunks)]
    legend.append(Patch(color="#BBBBBB", label="waiting for input"))
    # Above the timeline, in one row: a legend at the side would push the colour bars below away from their panels.
    gantt.legend(handles=legend, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(legend), fontsize=7,
                 frameon=False, title="label: chunk-microbatch, or the microbatch alone where the block is narrow",
                 title_fontsize=7, alignment="left")

    # Per-rank heat strips (rank 0 on top, like the Gantt): readable for many ranks and for sends far shorter
    # than a pixel, where overlaid line plots are not.
    window_ms = _ratio_window_ms(stages, iteration, span_ms)
    edges = [span_ms * i / _BINS for i in range(_BINS + 1)]
    centres = [(lo + hi) / 2 for lo, hi in zip(edges, edges[1:])]
    busy_rows, send_rows = [], []
    for row in events:
        busy = [((e.start - origin) / 1e3, (e.end - origin) / 1e3) for e in row if e.kind in COMPUTE_KINDS]
        busy_rows.append(busy_fraction(busy, [t - window_ms / 2 for t in centres], window_ms))
        sends = [((e.start - origin) / 1e3, (e.end - origin) / 1e3) for e in row if e.kind == SEND]
        send_rows.append(max_level_per_bin(concurrency_steps(interval_deltas(sends)), edges))
    extent = (0.0, span_ms, num_ranks - 0.5, -0.5)
    image = ratio.imshow(busy_rows, aspect="auto", extent=extent, cmap="viridis", vmin=0.0, vmax=1.0,
                         interpolation="nearest")
    fig.colorbar(image, ax=ratio, pad=0.01, fraction=0.03, aspect=10, label="busy fraction")
    ratio.set_title(f"computing ratio per rank (sliding window {window_ms:.2f} ms)", fontsize=8, loc="left")
    if with_sends:
        sending = axes[2]
        peak_sends = max(1, max((max(row) for row in send_rows), default=0))
        cmap = plt.get_cmap("Blues", peak_sends + 1)
        image = sending.imshow(send_rows, aspect="auto", extent=extent, cmap=cmap, vmin=-0.5,
                               vmax=peak_sends + 0.5, interpolation="nearest")
        fig.colorbar(image, ax=sending, pad=0.01, fraction=0.03, aspect=10, ticks=range(peak_sends + 1),
                     label="in flight")
        sending.set_title("sending window per rank (sends posted and not yet completed)", fontsize=8, loc="left")
    for ax in axes[1:]:
        ax.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)], fontsize=7)
    axes[-1].set_xlabel("time since the iteration's first task (ms)")
    axes[-1].set_xlim(0, span_ms)
    gantt.grid(axis="x", alpha=0.3)

    # Labels last, once the layout has fixed the timeline's width: each block gets the longest label that fits.
    fig.canvas.draw()
    px_per_ms = gantt.get_window_extent().width / span_ms
    for rank, start_ms, width_ms, event in labelled:
        text = block_label(event, width_ms * px_per_ms)
        if text:
            gantt.text(start_ms + width_ms / 2, rank, text, ha="center", va="center", fontsize=_LABEL_FONT_PT,
                       color="#" + text_rgb(event.kind, event.chunk, model_chunks), clip_on=True)
    fig.savefig(path, dpi=_DPI, format="png")
    plt.close(fig)


def block_label(event, width_px: float) -> str:
    """The longest of 'chunk-microbatch' and 'microbatch' (the colour tells the chunk) that fits a block this many
    pixels wide, or '' when neither does."""
    for text in (event.label, str(event.microbatch)):
        if width_px >= _CHAR_PX * len(text) + _LABEL_MARGIN_PX:
            return text
    return ""


def _ratio_window_ms(stages: list[RankTrace], iteration: int, span_ms: float) -> float:
    """Wide enough to smooth over a few tasks, narrow enough to show the warm-up and cool-down ramps."""
    durations = sorted(e.duration / 1e3 for s in stages for e in s.events_of(iteration, COMPUTE_KINDS))
    median = durations[len(durations) // 2] if durations else span_ms / 20
    return min(span_ms / 4, max(span_ms / 40, 3 * median))
