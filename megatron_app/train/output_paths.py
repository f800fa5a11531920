"""Where a run will write, checked before any rank starts (args.validate, hence the launchers' --check-config).

Each output flag's path must be creatable and writable now: a directory flag (--save, --trace-dir, --dump-grads,
--dump-weights) names a directory or a place where one can be made, a file flag (--log-json) a file whose directory
exists or can be made (it is written beside itself, then renamed over). --save must also have room for one
checkpoint of this model (an estimate from the flags: fp32 weights and Adam's two moments). Writability is tried, not
read from the mode bits (root passes those on /proc and on read-only mounts): a probe directory is made and removed
in the closest existing directory. Nothing else is created: a mistyped path must not leave directories behind.
Standard library only.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional

MIB = 1 << 20
# fp32 weights + Adam's exp_avg and exp_avg_sq, per parameter (checkpoint.py saves the model and the Adam state).
CHECKPOINT_BYTES_PER_PARAMETER = 12


class OutputPathError(ValueError):
    """A path the run could not write; the message is one line naming the flag."""


def _nearest_existing(path: str) -> str:
    """`path` itself when it exists, else its closest existing ancestor."""
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def _writable(directory: str) -> Optional[str]:
    """None when a directory can be made (and removed) in `directory`, else why not."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".megatron_app-probe-", dir=directory))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _check_creatable(flag: str, path: str, what: str) -> str:
    """The existing directory where `path` (missing) would be created, which must be a writable directory."""
    anchor = _nearest_existing(path)
    if not os.path.isdir(anchor):
        raise OutputPathError(f"{flag} {path}: cannot create the {what} there: {anchor} is not a directory")
    reason = _writable(anchor)
    if reason is not None:
        raise OutputPathError(f"{flag} {path}: cannot create the {what} there: {anchor} is not writable ({reason})")
    return anchor


def check_output_dir(flag: str, path: str) -> str:
    """A directory the run will write into: an existing writable directory, or creatable. Returns the existing
    directory the files' file system is measured at."""
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise OutputPathError(f"{flag} {path}: exists and is not a directory")
        reason = _writable(path)
        if reason is not None:
            raise OutputPathError(f"{flag} {path}: the directory is not writable ({reason})")
        return path
    return _check_creatable(flag, path, "directory")


def check_output_file(flag: str, path: str) -> None:
    """A file the run will write (beside itself first, then renamed over): not a directory, and its directory
    writable or creatable."""
    if os.path.isdir(path):
        raise OutputPathError(f"{flag} {path}: is a directory, not a file")
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.lexists(directory):
        if not os.path.isdir(directory):
            raise OutputPathError(f"{flag} {path}: {directory} is not a directory")
        reason = _writable(directory)
        if reason is not None:
            raise OutputPathError(f"{flag} {path}: its directory {directory} is not writable ({reason})")
        return
    _check_creatable(flag, path, "file")


def gpt_parameter_count(num_layers: int, hidden: int, vocab: int, seq_length: int) -> int:
    """Parameters of the trainer's GPT (learnt positions, 4h MLP, biases), the output layer counted apart from the
    embedding: what a pipelined run stores even when they are tied (the last stage keeps a copy)."""
    per_layer = 12 * hidden * hidden + 13 * hidden
    return 2 * vocab * hidden + seq_length * hidden + num_layers * per_layer + 2 * hidden


def checkpoint_bytes(args) -> int:
    """About what one checkpoint of this model takes on disk (all ranks' files together)."""
    return CHECKPOINT_BYTES_PER_PARAMETER * gpt_parameter_count(args.num_layers, args.hidden_size, args.vocab_size,
                                                                args.seq_length)


def check_room(flag: str, path: str, anchor: str, needed: int, free: Optional[int] = None) -> None:
    """`needed` bytes must fit on the file system holding `anchor` (`free`: measured there when None)."""
    if free is None:
        try:
            free = shutil.disk_usage(anchor).free
        except OSError:
            return   # nothing to measure: the first save names what fails
    if free < needed:
        raise OutputPathError(f"{flag} {path}: one checkpoint of this model needs about {needed / MIB:.1f} MiB, and "
                              f"only {free / MIB:.1f} MiB are free there")


def check_outputs(args, tracing: bool) -> None:
    """Every output of the run, from the validated flags (OutputPathError, one line, on the first problem)."""
    if tracing:
        check_output_dir("--trace-dir", args.trace_dir)
    if args.log_json:
        check_output_file("--log-json", args.log_json)
    for flag, path in (("--dump-grads", args.dump_grads), ("--dump-weights", args.dump_weights),
                       ("--tensorboard-dir", getattr(args, "tensorboard_dir", None))):
        if path:
            check_output_dir(flag, path)
    if args.save:
        anchor = check_output_dir("--save", args.save)
        if args.emulate_compute is None:
            check_room("--save", args.save, anchor, checkpoint_bytes(args))
