"""One directory per run under a trace root, a `latest` pointer, and finding the newest complete run.

    traces/                       the root (--trace-dir, default traces/)
      20261123-131502_single4242x1763900102/   one run: trace_rank<N>.jsonl, and the tools' outputs beside them
      latest -> 20261123-131502_single4242x1763900102

A run directory's name starts with its UTC start time, so names sort by age. The trainer's rank 0 points `latest`
at its run when the run starts; a run that died is still `latest`, and the tools then read the newest complete run
instead and say so. Pure Python and cheap: the tools only read each file's first and last line to choose.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from .schema import CLOSED, TraceError

LATEST = "latest"
_RUN_NAME_RE = re.compile(r"^\d{8}-\d{6}_")
_FILE_RE = re.compile(r"^trace_rank(\d+)\.jsonl$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def new_run_name(run_id: str, now: float | None = None) -> str:
    """'<UTC yyyymmdd-hhmmss>_<run id>': sortable by start time, unique per job."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    safe_id = _UNSAFE.sub("-", run_id).strip("-") or "run"
    return f"{stamp}_{safe_id}"


def point_latest(root: str | os.PathLike, run_name: str) -> None:
    """Make root/latest a relative link to root/run_name, replacing any older one in one step."""
    root = Path(root)
    temp = root / f".{LATEST}.{os.getpid()}"
    temp.unlink(missing_ok=True)
    os.symlink(run_name, temp)
    os.replace(temp, root / LATEST)


def holds_trace_files(directory: Path) -> bool:
    return directory.is_dir() and any(_FILE_RE.match(p.name) for p in directory.iterdir())


@dataclass(frozen=True)
class RunSummary:
    """What the first and last line of each rank file say about one run directory."""

    directory: Path
    pipeline_parallel: int | None
    model_chunks: int | None
    run_id: str
    problem: str | None  # None: every rank file is present and was closed by its tracer

    def mismatch(self, pipeline_parallel: int | None, model_chunks: int | None) -> str | None:
        """None when the run has the asked shape (a size not asked, None, matches any)."""
        if pipeline_parallel in (None, self.pipeline_parallel) and model_chunks in (None, self.model_chunks):
            return None
        return f"it is a pipeline_parallel={self.pipeline_parallel}, model_chunks={self.model_chunks} run"


def summarize_run(directory: Path) -> RunSummary:
    """Headers and closing lines only: enough to choose a run without parsing every event."""
    files = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _FILE_RE.match(p.name)))
    if not files:
        return RunSummary(directory, None, None, "", "no trace files")
    headers, unclosed = [], []
    for rank, path in files:
        first, last = _first_and_last_line(path)
        try:
            header = json.loads(first)
            closing = json.loads(last) if last else {}
        except (json.JSONDecodeError, TypeError):
            return RunSummary(directory, None, None, "", f"{path.name} is damaged or cut short")
        if not isinstance(header, dict) or not isinstance(closing, dict):
            return RunSummary(directory, None, None, "", f"{path.name} is not a trace file")
        headers.append(header)
        if closing.get("kind") != CLOSED and _closes_files(header):
            unclosed.append(rank)
    first = headers[0]
    sizes = [first.get(key) or 1 for key in ("pipeline_parallel", "tensor_parallel", "data_parallel")]
    expected = sizes[0] * sizes[1] * sizes[2]
    problem = None
    if len(files) < expected:
        problem = f"{len(files)} of {expected} rank files"
    elif unclosed:
        listed = ", ".join(map(str, unclosed[:4])) + (" ..." if len(unclosed) > 4 else "")
        problem = f"rank(s) {listed} did not finish (still running, or the run failed)"
    return RunSummary(directory, first.get("pipeline_parallel"), first.get("model_chunks"),
                      str(first.get("run_id") or ""), problem)


def _closes_files(header: dict) -> bool:
    """Files of schema 1.2 and later end with a `closed` line; older ones cannot say, and count as finished."""
    major, _, minor = str(header.get("schema_version", "")).partition(".")
    return major.isdigit() and minor.isdigit() and (int(major), int(minor)) >= (1, 2)


def _first_and_last_line(path: Path) -> tuple[str, str]:
    with open(path, "rb") as handle:
        first = handle.readline().decode("utf-8", "replace")
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(max(0, size - 65536))
        lines = handle.read().decode("utf-8", "replace").split("\n")
    if len(lines) < 2 or lines[-1] != "":
        return first, "{"  # cut mid-line: not JSON, reported as damaged or cut short
    return first, lines[-2]


@dataclass(frozen=True)
class ChosenRun:
    directory: Path
    note: str  # one line saying which run was read and why


def _shape(pipeline_parallel: int | None, model_chunks: int | None) -> str:
    """The asked shape in words, for messages ("" when none was asked)."""
    asked = [f"{name}={value}" for name, value in (("pipeline_parallel", pipeline_parallel),
                                                   ("model_chunks", model_chunks)) if value is not None]
    return " " + ", ".join(asked) if asked else ""


def choose_run(root: Path, pipeline_parallel: int | None, model_chunks: int | None) -> ChosenRun:
    """The run directory the tools read under `root`.

    `root` holding trace files itself is one run (a simulator output, or a run directory given directly). Otherwise
    the newest complete run of the asked shape among root/latest and the run directories, newest first.
    """
    if not root.is_dir():
        raise TraceError(f"{root}: trace directory does not exist")
    if holds_trace_files(root):
        return ChosenRun(root, f"reading {root}")
    latest = _latest_run(root)
    runs = sorted((d for d in root.iterdir() if d.is_dir() and not d.is_symlink() and holds_trace_files(d)),
                  key=_age_key, reverse=True)
    if latest is not None:
        runs = [latest] + [d for d in runs if d.resolve() != latest.resolve()]
    if not runs:
        raise TraceError(f"{root}: no trace files and no run directories (run with tracing on, or give --trace-dir)")
    skipped = []
    for directory in runs:
        summary = summarize_run(directory)
        reason = summary.problem or summary.mismatch(pipeline_parallel, model_chunks)
        if reason is None:
            which = "latest run" if directory == latest else "newest complete run"
            if skipped:
                which = f"newest complete{_shape(pipeline_parallel, model_chunks)} run"
            note = f"reading {directory} ({which}{', run id ' + summary.run_id if summary.run_id else ''})"
            if skipped:
                note += f"; skipped {_describe(skipped[0])}" + (f" and {len(skipped) - 1} more" if len(skipped) > 1
                                                                 else "")
            return ChosenRun(directory, note)
        skipped.append((directory, reason, directory == latest))
    raise TraceError(f"{root}: no complete{_shape(pipeline_parallel, model_chunks)} run ({_describe(skipped[0])})")


def _latest_run(root: Path) -> Path | None:
    """root/latest's run directory, spelled under root (as the user gave it) when the link is relative."""
    link = root / LATEST
    if not link.is_symlink() or not link.resolve().is_dir():
        return None
    target = Path(os.readlink(link))
    return link.resolve() if target.is_absolute() or len(target.parts) != 1 else root / target


def _describe(skipped: tuple) -> str:
    directory, reason, is_latest = skipped
    return f"{'the latest run ' if is_latest else ''}{directory.name}: {reason}"


def _age_key(directory: Path) -> tuple:
    """Run directories by their start-time names; anything else by modification time."""
    if _RUN_NAME_RE.match(directory.name):
        return (1, directory.name)
    return (0, f"{directory.stat().st_mtime:020.6f}")
