"""The seed's spreadsheet picture: one row per pipeline rank, each task a coloured `chunk-microbatch` cell."""

from __future__ import annotations

from dataclasses import asdict

from .column_layout import BACKWARD_WIDTH, FORWARD_WIDTH, PlacedTask
from .metrics import IterationMetrics
from .palette import task_rgb, text_rgb
from .schema import BACKWARD, FORWARD, WEIGHT

FIRST_TASK_COLUMN = 2  # column A holds the rank labels
TITLE_ROW, INFO_ROW, STEP_ROW, FIRST_RANK_ROW = 1, 2, 3, 4


def write_pipeline_xlsx(path, rows: list[list[PlacedTask]], info: dict, metrics: IterationMetrics | None) -> None:
    """rows[r]: placed tasks of pipeline rank r (rank 0 is drawn at the top). `info` goes in the header line."""
    from openpyxl import Workbook
    from openpyxl.styles import Alignment, Border, Font, PatternFill, Side
    from openpyxl.utils import get_column_letter

    model_chunks = int(info["model_chunks"])
    thin = Side(style="thin", color="808080")
    border = Border(left=thin, right=thin, top=thin, bottom=thin)
    centre = Alignment(horizontal="center", vertical="center")

    def paint(cell, kind, chunk, text):
        cell.value = text
        cell.fill = PatternFill("solid", fgColor=task_rgb(kind, chunk, model_chunks))
        cell.font = Font(size=9, bold=kind == BACKWARD, color=text_rgb(kind, chunk, model_chunks))
        cell.alignment = centre
        cell.border = border

    def put_task(row, column, kind, chunk, text, width):
        paint(sheet.cell(row=row, column=column), kind, chunk, text)
        if width > 1:
            for extra in range(1, width):  # borders of merged cells live on every covered cell
                sheet.cell(row=row, column=column + extra).border = border
            sheet.merge_cells(start_row=row, start_column=column, end_row=row, end_column=column + width - 1)

    book = Workbook()
    sheet = book.active
    sheet.title = "pipeline"
    # Printed or exported to PDF, the whole pipeline fits one landscape page instead of being cut into strips.
    sheet.page_setup.orientation = "landscape"
    sheet.sheet_properties.pageSetUpPr.fitToPage = True
    sheet.page_setup.fitToWidth = 1
    sheet.page_setup.fitToHeight = 1
    sheet.cell(row=TITLE_ROW, column=1, value="MegatronAPP pipeline trace").font = Font(bold=True, size=12)
    sheet.cell(row=INFO_ROW, column=1, value="   ".join(f"{k}={v}" for k, v in info.items()))

    last_column = max((t.column + t.width for row in rows for t in row), default=0)
    for step in range(last_column):
        cell = sheet.cell(row=STEP_ROW, column=FIRST_TASK_COLUMN + step, value=step + 1)
        cell.font = Font(size=7, color="808080")
        cell.alignment = centre
    for rank, placed in enumerate(rows):
        row = FIRST_RANK_ROW + rank
        sheet.cell(row=row, column=1, value=f"rank {rank}").font = Font(bold=True)
        for task in placed:
            put_task(row, FIRST_TASK_COLUMN + task.column, task.event.kind, task.event.chunk, task.event.label,
                     task.width)

    split = any(t.event.kind == WEIGHT for row in rows for t in row)    # a split backward's W tasks
    legend_row = FIRST_RANK_ROW + len(rows) + 1
    sheet.cell(row=legend_row, column=1, value="legend").font = Font(bold=True)
    for chunk in range(model_chunks):
        row = legend_row + chunk
        put_task(row, FIRST_TASK_COLUMN, FORWARD, chunk, f"F{chunk}", FORWARD_WIDTH)
        sheet.cell(row=row, column=FIRST_TASK_COLUMN + 1, value=f"forward, chunk {chunk}")
        put_task(row, FIRST_TASK_COLUMN + 5, BACKWARD, chunk, f"B{chunk}", BACKWARD_WIDTH)
        sheet.cell(row=row, column=FIRST_TASK_COLUMN + 5 + BACKWARD_WIDTH, value=f"backward, chunk {chunk}")
        if split:
            put_task(row, FIRST_TASK_COLUMN + 11, WEIGHT, chunk, f"W{chunk}", FORWARD_WIDTH)
            sheet.cell(row=row, column=FIRST_TASK_COLUMN + 12, value=f"weight gradient, chunk {chunk}")
    note_row = legend_row + model_chunks
    sheet.cell(row=note_row, column=1, value="cell label = chunk-microbatch; columns follow computation order and "
                                             "dependencies (a task is right of its input's producer), not time")

    sheet.column_dimensions["A"].width = 9
    for step in range(max(last_column, 12)):
        sheet.column_dimensions[get_column_letter(FIRST_TASK_COLUMN + step)].width = 4.5
    sheet.freeze_panes = sheet.cell(row=FIRST_RANK_ROW, column=FIRST_TASK_COLUMN)

    if metrics is not None:
        _write_metrics_sheet(book.create_sheet("metrics"), metrics)
    book.save(path)


def _write_metrics_sheet(sheet, metrics: IterationMetrics) -> None:
    summary = [("iteration", metrics.iteration), ("microbatches", metrics.microbatches),
               ("makespan_us", metrics.makespan_us), ("lower_bound_us", metrics.lower_bound_us),
               ("makespan_over_lower_bound", metrics.makespan_over_lower_bound),
               ("ideal_us", metrics.ideal_us), ("makespan_over_ideal", metrics.makespan_over_ideal),
               ("mean_bubble_ratio", metrics.mean_bubble_ratio), ("iteration_time_us", metrics.iteration_time_us)]
    for row, (name, value) in enumerate(summary, start=1):
        sheet.cell(row=row, column=1, value=name)
        sheet.cell(row=row, column=2, value=value)
    header_row = len(summary) + 2
    ranks = [asdict(r) for r in metrics.ranks]
    columns = list(ranks[0]) if ranks else []
    for col, name in enumerate(columns, start=1):
        sheet.cell(row=header_row, column=col, value=name)
    for offset, rank in enumerate(ranks, start=1):
        for col, name in enumerate(columns, start=1):
            sheet.cell(row=header_row + offset, column=col, value=rank[name])
