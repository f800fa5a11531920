"""tools/visualize_trace.py: the seed-style spreadsheet, the PNG timeline, the column layout, and bad input."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from megatron_app.trace import read_trace_dir
from megatron_app.trace.cli import run_cli
from megatron_app.trace.column_layout import layout_columns
from megatron_app.trace.dependencies import InputSources
from megatron_app.trace.palette import task_rgb
from megatron_app.trace import visualize_trace
from megatron_app.trace.schema import BACKWARD, COMPUTE_KINDS, FORWARD

WHOLE_BACKWARD_KINDS = (FORWARD, BACKWARD)    # the task kinds of a trace without a split backward
from test_trace_synthetic import plan_greedy, producer, write_plan

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tools" / "visualize_trace.py"


def run_tool(capsys, *argv):
    try:
        code = run_cli(visualize_trace.PROG, visualize_trace.main, [str(a) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """P=3 V=2 m=3 traced over two iterations, drawn once for the xlsx/png checks (iteration 1 is drawn)."""
    base = tmp_path_factory.mktemp("drawn")
    plan = plan_greedy(3, 2, 3, duration=lambda r, k, c, i: (10.0 if k == "forward" else 20.0) * (1 + 0.3 * (r == 1)),
                       latency_us=1.0, iterations=2)
    trace_dir = write_plan(base / "traces", plan)
    code = run_cli(visualize_trace.PROG, visualize_trace.main,
                   ["--pipeline_parallel", "3", "--model_chunks", "2", "--trace-dir", str(trace_dir),
                    "--out-dir", str(base / "out")])
    assert code == 0
    return plan, base / "out" / "trace_pipeline_3_model_chunks_2"


def task_cells(sheet, P):
    """{(rank, kind, chunk, mb): (first column, width)} read back from the sheet; kind from the merged width."""
    merged = {(r.min_row, r.min_col): r.max_col - r.min_col + 1 for r in sheet.merged_cells.ranges}
    cells = {}
    for rank in range(P):
        row = 4 + rank
        assert sheet.cell(row=row, column=1).value == f"rank {rank}"
        for col in range(2, sheet.max_column + 1):
            value = sheet.cell(row=row, column=col).value
            if value is None:
                continue
            chunk, mb = map(int, value.split("-"))
            width = merged.get((row, col), 1)
            kind = "backward" if width == 2 else "forward"
            cells[(rank, kind, chunk, mb)] = (col, width)
    return cells


def test_xlsx_rows_labels_merged_backward_cells_and_colours(drawn):
    import openpyxl

    plan, stem = drawn
    book = openpyxl.load_workbook(f"{stem}.xlsx")
    sheet = book["pipeline"]
    info = sheet["A2"].value
    for part in ("pipeline_parallel=3", "model_chunks=2", "microbatches=3", "policy=greedy-backward-first",
                 "iteration=1"):
        assert part in info
    cells = task_cells(sheet, 3)
    expected = {(r, k, c, i) for r in range(3) for k in WHOLE_BACKWARD_KINDS for c in range(2) for i in range(3)}
    assert set(cells) == expected  # every task once, backward cells exactly two columns wide
    fills = {}
    for (rank, kind, chunk, mb), (col, _) in cells.items():
        cell = sheet.cell(row=4 + rank, column=col)
        fills.setdefault((kind, chunk), set()).add(cell.fill.fgColor.rgb[-6:])
    assert all(len(colours) == 1 for colours in fills.values())  # one colour per (kind, chunk)
    colour = {key: colours.pop() for key, colours in fills.items()}
    assert colour[("forward", 0)] != colour[("backward", 0)]
    assert colour[("forward", 0)] != colour[("forward", 1)]  # shaded by chunk
    assert colour[("backward", 0)] != colour[("backward", 1)]
    assert colour[("forward", 1)] == task_rgb("forward", 1, 2)
    legend_labels = [sheet.cell(row=r, column=2).value for r in range(8, 10)]
    assert legend_labels == ["F0", "F1"]
    assert "metrics" in book.sheetnames


def test_xlsx_columns_follow_run_order_and_dependencies(drawn):
    import openpyxl

    plan, stem = drawn
    cells = task_cells(openpyxl.load_workbook(f"{stem}.xlsx")["pipeline"], 3)
    for rank in range(3):
        ordered = plan.of(1, rank)  # wall-clock order on the rank
        columns = [cells[(rank, e.kind, e.chunk, e.microbatch)] for e in ordered]
        assert all(a[0] + a[1] <= b[0] for a, b in zip(columns, columns[1:]))
        for e in ordered:
            source = producer(3, 2, rank, e.kind, e.chunk, e.microbatch)
            if source is not None:
                col, width = cells[source]
                assert cells[(rank, e.kind, e.chunk, e.microbatch)][0] >= col + width


def test_png_is_a_real_timeline(drawn):
    import matplotlib.image

    _, stem = drawn
    path = Path(f"{stem}.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 20_000
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] > 500 and pixels.shape[1] > 1000
    colours = {tuple(round(float(v) * 255) for v in px[:3]) for px in pixels.reshape(-1, pixels.shape[2])[::7]}
    for kind in WHOLE_BACKWARD_KINDS:
        for chunk in range(2):
            rgb = task_rgb(kind, chunk, 2)
            want = tuple(int(rgb[i:i + 2], 16) for i in (0, 2, 4))
            assert want in colours, f"{kind} chunk {chunk} bars missing from the picture"


@settings(max_examples=25, deadline=None)
@given(P=st.integers(1, 4), V=st.integers(1, 3), extra_mb=st.integers(0, 3), seed=st.integers(0, 1000))
def test_layout_places_every_task_after_its_producer_and_its_predecessor(tmp_path_factory, P, V, extra_mb, seed):
    if V > 1 and P == 1:
        V = 1  # Megatron-Core has no interleaving without pipeline parallelism
    m = (P if V > 1 else 1) + extra_mb * (P if V > 1 else 1)
    plan = plan_greedy(P, V, m, duration=lambda r, k, c, i: 1.0 + (seed * 7 + r * 13 + c * 5 + i * 3) % 9,
                       latency_us=seed % 3)
    run = read_trace_dir(write_plan(tmp_path_factory.mktemp("layout"), plan))
    stages = [s.events_of(0, COMPUTE_KINDS) for s in run.pipeline_view()]
    rows = layout_columns(stages, InputSources(P, V, m))
    placed = {(t.event.pp_rank, t.event.kind, t.event.chunk, t.event.microbatch): t for row in rows for t in row}
    assert len(placed) == P * 2 * V * m
    for row in rows:
        assert all(a.column + a.width <= b.column for a, b in zip(row, row[1:]))
        assert [t.event.start for t in row] == sorted(t.event.start for t in row)
    for (rank, kind, chunk, mb), task in placed.items():
        assert task.width == (2 if kind == "backward" else 1)
        source = producer(P, V, rank, kind, chunk, mb)
        if source is not None and source[0] != rank:
            assert task.column >= placed[source].column + placed[source].width


def test_layout_terminates_on_a_causality_violating_trace(tmp_path):
    plan = plan_greedy(2, 1, 2)
    # rank 1 claims to run F1 before F0's producer finished and before its own F0: a cycle in "event order"
    f1 = plan.task(0, 1, "forward", 0, 1)
    f1.start, f1.end = 0.0, 1.0
    run = read_trace_dir(write_plan(tmp_path, plan))
    rows = layout_columns([s.events_of(0, COMPUTE_KINDS) for s in run.pipeline_view()], InputSources(2, 1, 2))
    assert sum(len(r) for r in rows) == 8


@pytest.mark.parametrize("doctor,extra,message", [
    (lambda d: (d / "trace_rank2.jsonl").unlink(), [], r"missing trace_rank2\.jsonl"),
    (None, ["--model_chunks", "1"], r"trace_rank0\.jsonl: trace is from a run with model_chunks=2 \(asked 1\)"),
    (None, ["--iteration", "all"], r"--iteration all is not supported here"),
    (lambda d: (d / "trace_rank1.jsonl").write_text('{"schema_version": "9.0"}\n'),
     [], r"trace_rank1\.jsonl: schema_version 9\.0 is not supported"),
])
def test_bad_input_is_one_line_exit_2_and_no_outputs(tmp_path, capsys, doctor, extra, message):
    trace_dir = write_plan(tmp_path / "traces", plan_greedy(3, 2, 3))
    if doctor is not None:
        doctor(trace_dir)
    args = {"--pipeline_parallel": "3", "--model_chunks": "2", "--trace-dir": str(trace_dir),
            "--out-dir": str(tmp_path / "out")}
    args.update(zip(extra[::2], extra[1::2]))
    code, _, err = run_tool(capsys, *[x for kv in args.items() for x in kv])
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("visualize_trace.py: error: ") and re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_failure_while_writing_leaves_no_half_written_outputs(tmp_path, capsys, monkeypatch):
    trace_dir = write_plan(tmp_path / "traces", plan_greedy(2, 1, 2))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")

    def broken_png(path, *args, **kwargs):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(visualize_trace, "write_timeline_png", broken_png)
    code, _, err = run_tool(capsys, "--pipeline_parallel", 2, "--model_chunks", 1, "--trace-dir", trace_dir,
                            "--out-dir", out)
    assert code == 2 and "No space left on device" in err and err.count("\n") == 1
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]  # no xlsx, no png, no temp files


def test_script_runs_as_a_command(tmp_path):
    trace_dir = write_plan(tmp_path / "traces", plan_greedy(2, 1, 3))
    done = subprocess.run([sys.executable, str(SCRIPT), "--pipeline_parallel", "2", "--model_chunks", "1"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert trace_dir == tmp_path / "traces"
    assert (trace_dir / "trace_pipeline_2_model_chunks_1.xlsx").exists()  # beside the traces, not in the cwd
    assert (trace_dir / "trace_pipeline_2_model_chunks_1.png").exists()


def drawn_figure(tmp_path, monkeypatch, plan, P, V):
    """Draw `plan`'s last iteration and return the matplotlib figure the timeline was saved from."""
    import matplotlib.figure

    figures = []
    save = matplotlib.figure.Figure.savefig

    def keep(self, *args, **kwargs):
        figures.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    trace_dir = write_plan(tmp_path / "traces", plan)
    code = run_cli(visualize_trace.PROG, visualize_trace.main,
                   ["--pipeline_parallel", str(P), "--model_chunks", str(V), "--trace-dir", str(trace_dir),
                    "--out-dir", str(tmp_path / "out")])
    assert code == 0 and len(figures) == 1
    return figures[0]


def panel_titles(figure):
    return [ax.get_title(loc="left") for ax in figure.axes if ax.get_title(loc="left")]


def test_timeline_leaves_out_the_sending_window_when_sends_take_no_time(tmp_path, monkeypatch):
    """A simulated run over free links has sends of zero duration: an empty panel says nothing."""
    free = drawn_figure(tmp_path / "free", monkeypatch, plan_greedy(2, 2, 4, latency_us=0.0), 2, 2)
    assert [t.split(" ")[0] for t in panel_titles(free)] == ["computing"]
    timed = drawn_figure(tmp_path / "timed", monkeypatch, plan_greedy(2, 2, 4, latency_us=3.0), 2, 2)
    assert [t.split(" ")[0] for t in panel_titles(timed)] == ["computing", "sending"]


def test_timeline_colour_bars_sit_beside_their_panels_and_labels_fit_their_blocks(tmp_path, monkeypatch):
    plan = plan_greedy(4, 2, 8, duration=lambda r, k, c, i: 40.0 if (r, k, i) == (1, "backward", 3) else 3.0,
                       latency_us=1.0)
    figure = drawn_figure(tmp_path, monkeypatch, plan, 4, 2)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(figure).get_renderer()      # the closed figure's canvas no longer draws
    figure.draw(renderer)
    gantt, *_ = figure.axes
    panels = [ax for ax in figure.axes if ax.get_title(loc="left")]
    colour_bars = [ax for ax in figure.axes if ax is not gantt and ax not in panels]
    assert len(panels) == len(colour_bars) == 2
    for panel, bar in zip(panels, colour_bars):
        gap_px = bar.get_window_extent().x0 - panel.get_window_extent().x1
        assert 0 <= gap_px < 30, f"colour bar {gap_px:.0f} px from its panel"
    assert gantt.get_legend().get_window_extent().y0 >= gantt.get_window_extent().y1 - 1   # above, not beside
    blocks = [p.get_window_extent() for p in gantt.patches if p.get_height() > 0.5]      # tasks, not waits
    labels = [t for t in gantt.texts if t.get_text()]
    assert labels, "the wide block carries a label"
    for text in labels:
        box = text.get_window_extent(renderer)
        centre = ((box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2)
        (block,) = [b for b in blocks if b.contains(*centre)]
        assert box.width <= block.width, f"label {text.get_text()!r} overflows its block"
    assert "1-3" in [t.get_text() for t in labels]       # the one wide backward: chunk-microbatch
