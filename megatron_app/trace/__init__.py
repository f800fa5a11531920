"""Per-rank tracing and the trace reader shared by the analysis tools.

Importing this package is cheap (no torch, matplotlib or openpyxl): the runtime imports it on every rank.
The analysis modules (metrics, causality, chrome, column_layout, xlsx_sheet, timeline_plot) are imported by
the tools only.
"""

from .reader import RankTrace, TraceRun, read_trace_dir
from .schema import KNOWN_KINDS, SCHEMA_VERSION, TraceError, TraceEvent, TraceMeta, trace_file_name
from .tracer import Tracer

__all__ = [
    "KNOWN_KINDS",
    "SCHEMA_VERSION",
    "RankTrace",
    "TraceError",
    "TraceEvent",
    "TraceMeta",
    "TraceRun",
    "Tracer",
    "read_trace_dir",
    "trace_file_name",
]
