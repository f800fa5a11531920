"""What process_trace.py and visualize_trace.py share: flags, trace-dir lookup, all-or-nothing output files,
and turning bad input into one stderr line with exit code 2."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from .reader import TraceRun, read_trace_dir
from .runs import ChosenRun, choose_run, holds_trace_files
from .schema import TraceError

EXIT_BAD_INPUT = 2
DEFAULT_TRACE_DIR = "traces"


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) and exit code 2."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def number(minimum: float, inclusive: bool = True, finite: bool = False):
    """An argparse type for floats >= minimum (> minimum when not inclusive); NaN always refused."""
    bound = f"{'>=' if inclusive else '>'} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text!r}") from None
        too_small = value < minimum if inclusive else value <= minimum
        if value != value or too_small or (finite and value == float("inf")):
            raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text!r}")
        return value
    return parse


def iteration_choice(text: str) -> int | str:
    if text in ("all", "last"):
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an iteration number, 'last' or 'all', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"iteration must be >= 0, got {value}")
    return value


def base_parser(prog: str, description: str) -> OneLineArgumentParser:
    parser = OneLineArgumentParser(prog=prog, description=description)
    parser.add_argument("run_dir", nargs="?", default=None, metavar="DIR",
                        help="the trace directory, as --trace-dir DIR")
    parser.add_argument("--pipeline_parallel", "--pipeline-parallel", dest="pipeline_parallel", type=positive_int,
                        default=None, help="pipeline-parallel size P of the traced run (default: the trace's own, "
                                           "from the run chosen)")
    parser.add_argument("--model_chunks", "--model-chunks", dest="model_chunks", type=positive_int, default=None,
                        help="model chunks per rank V of the traced run (default: the trace's own)")
    parser.add_argument("--trace-dir", "--trace_dir", dest="trace_dir", default=None,
                        help=f"a run's directory of trace_rank<N>.jsonl files, or a directory of runs (then its "
                             f"newest complete run of the asked shape, 'latest' first; default: ./{DEFAULT_TRACE_DIR})")
    parser.add_argument("--out-dir", "--out_dir", dest="out_dir", default=None,
                        help="where to write the outputs (default: beside the traces, in the run's directory)")
    return parser


def resolve_trace_dir(given: str | None, pipeline_parallel: int | None, model_chunks: int | None) -> ChosenRun:
    """The run to read: under --trace-dir if given, else ./traces, else the current directory when it holds trace
    files (seed usage). A directory of run directories gives its newest complete run of the asked shape."""
    if given is not None:
        return choose_run(Path(given), pipeline_parallel, model_chunks)
    default = Path(DEFAULT_TRACE_DIR)
    if not default.is_dir() and holds_trace_files(Path(".")):
        return choose_run(Path("."), pipeline_parallel, model_chunks)
    if not default.is_dir():
        raise TraceError(f"no trace files: ./{DEFAULT_TRACE_DIR}/ does not exist and the current directory holds no "
                         "trace_rank<N>.jsonl (use --trace-dir)")
    return choose_run(default, pipeline_parallel, model_chunks)


def read_chosen_run(args) -> tuple[TraceRun, Path]:
    """Choose the run (saying which on stdout), read it, and return it with the output directory: --out-dir, else
    the run's own directory, beside its traces. A size not given (P, V) is the chosen run's own, set on args."""
    if args.run_dir is not None:
        if args.trace_dir is not None and Path(args.trace_dir) != Path(args.run_dir):
            raise TraceError(f"two trace directories: {args.run_dir} and --trace-dir {args.trace_dir}; give one")
        args.trace_dir = args.run_dir
    chosen = resolve_trace_dir(args.trace_dir, args.pipeline_parallel, args.model_chunks)
    print(chosen.note)
    run = read_trace_dir(chosen.directory, args.pipeline_parallel, args.model_chunks)
    args.pipeline_parallel, args.model_chunks = run.pipeline_parallel, run.model_chunks
    return run, Path(args.out_dir) if args.out_dir is not None else chosen.directory


def output_stem(pipeline_parallel: int, model_chunks: int) -> str:
    return f"trace_pipeline_{pipeline_parallel}_model_chunks_{model_chunks}"


class OutputSet:
    """Collects outputs as temp files in the out dir and renames them into place only on commit(), so a failure
    leaves no half-written output. Use as a context manager; leftovers are removed on error."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.out_dir = Path(out_dir)
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TraceError(f"{self.out_dir}: cannot create output directory ({exc.strerror})") from None
        self._pending: list[tuple[Path, Path]] = []

    def temp_path(self, final_name: str) -> Path:
        """A fresh temp file path in the out dir that commit() will rename to `final_name`."""
        suffix = Path(final_name).suffix
        try:
            fd, temp = tempfile.mkstemp(prefix=f".{final_name}.", suffix=f".tmp{suffix}", dir=self.out_dir)
        except OSError as exc:
            raise TraceError(f"{self.out_dir}: cannot write ({exc.strerror})") from None
        os.close(fd)
        os.chmod(temp, 0o666 & ~_current_umask())  # mkstemp makes 0600; outputs should be like any new file
        self._pending.append((Path(temp), self.out_dir / final_name))
        return Path(temp)

    def commit(self) -> list[Path]:
        written = []
        for temp, final in self._pending:
            os.replace(temp, final)
            written.append(final)
        self._pending = []
        return written

    def discard(self) -> None:
        for temp, _ in self._pending:
            temp.unlink(missing_ok=True)
        self._pending = []

    def __enter__(self) -> "OutputSet":
        return self

    def __exit__(self, exc_type, *rest) -> None:
        if exc_type is not None:
            self.discard()


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def run_cli(prog: str, main, argv=None) -> int:
    """Run main(argv) -> exit code; bad input becomes `prog: error: ...` on stderr and exit code 2."""
    try:
        return main(argv)
    except TraceError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # e.g. the out dir is not writable
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
