"""Command-line flags of ``python -m megatron_app.train`` and their validation.

Everything here runs before torch.distributed starts, so a user mistake costs one line on stderr and
exit status 2, never a traceback or a hung job. Only the device check imports torch.
"""

from __future__ import annotations

import argparse
import os
from typing import Mapping, Optional, Sequence

SCHEDULES = ("app", "interleaved", "1f1b", "megatron")
POLICIES = ("dfc", "bfc", "adaptive")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_MICROBATCHES = 8


class UsageError(ValueError):
    """A flag combination that cannot run; the message is one line meant for the user."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; we want exactly one line and exit status 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise UsageError(message)


def _add_flag(parser, *names: str, **kwargs) -> None:
    """Accept both ``--a_b`` and ``--a-b`` spellings of every flag."""
    spellings = []
    for name in names:
        body = name[2:]
        for variant in (name, "--" + body.replace("_", "-"), "--" + body.replace("-", "_")):
            if variant not in spellings:
                spellings.append(variant)
    parser.add_argument(*spellings, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="python -m megatron_app.train",
        description="Train a small Megatron-Core GPT with a chosen pipeline schedule (one process per rank).",
    )
    layout = parser.add_argument_group("parallel layout")
    _add_flag(layout, "--pipeline_parallel", type=int, default=1, metavar="P", help="pipeline stages")
    _add_flag(layout, "--model_chunks", type=int, default=1, metavar="V",
              help="model chunks (virtual stages) per pipeline rank")
    _add_flag(layout, "--tensor_parallel", type=int, default=1, metavar="T", help="tensor-parallel size")
    _add_flag(layout, "--data_parallel", type=int, default=None, metavar="D",
              help="data-parallel size (default: WORLD_SIZE / (P*T))")

    model = parser.add_argument_group("model")
    _add_flag(model, "--num-layers", type=int, default=8)
    _add_flag(model, "--hidden-size", type=int, default=64)
    _add_flag(model, "--num-attention-heads", type=int, default=4)
    _add_flag(model, "--seq-length", type=int, default=64)
    _add_flag(model, "--vocab-size", type=int, default=1024, help="total vocabulary, end-of-document token included")

    train = parser.add_argument_group("training")
    _add_flag(train, "--micro-batch-size", type=int, default=2)
    _add_flag(train, "--global-batch-size", type=int, default=None,
              help=f"sequences per iteration (default: {DEFAULT_MICROBATCHES} microbatches per data-parallel rank)")
    _add_flag(train, "--iters", type=int, default=5)
    _add_flag(train, "--seed", type=int, default=1234)
    _add_flag(train, "--lr", type=float, default=1e-3)
    _add_flag(train, "--data-path", nargs="+", default=None, metavar="PREFIX",
              help="Megatron indexed dataset prefix(es) [weight prefix ...]; default: mock data")
    _add_flag(train, "--device", choices=DEVICES, default="auto")

    sched = parser.add_argument_group("schedule")
    _add_flag(sched, "--schedule", choices=SCHEDULES, default="app",
              help="app: adaptive runtime; interleaved/1f1b: static orders run by the runtime; "
                   "megatron: Megatron-Core's own forward_backward function")
    _add_flag(sched, "--policy", choices=POLICIES, default="dfc", help="task policy of the app schedule")

    out = parser.add_argument_group("output")
    _add_flag(out, "--trace-dir", default="traces/")
    _add_flag(out, "--no-trace", action="store_true")
    _add_flag(out, "--log-json", default=None, metavar="FILE", help="per-iteration loss/time/throughput")
    _add_flag(out, "--dump-grads", default=None, metavar="DIR",
              help="save each rank's gradients of iteration 1 (before the optimizer step)")
    _add_flag(out, "--dump-weights", default=None, metavar="DIR",
              help="save each rank's weights after the last iteration")
    _add_flag(out, "--check-config", action="store_true",
              help="only validate the flags for WORLD_SIZE ranks (launchers run this before starting ranks)")
    return parser


_POSITIVE_INT_FLAGS = (
    "pipeline_parallel", "model_chunks", "tensor_parallel", "num_layers", "hidden_size",
    "num_attention_heads", "seq_length", "vocab_size", "micro_batch_size", "iters",
)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _world_size(environ: Mapping[str, str]) -> int:
    raw = environ.get("WORLD_SIZE", "1")
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"WORLD_SIZE={raw!r} is not an integer") from None
    if value < 1:
        raise UsageError(f"WORLD_SIZE={value} must be at least 1")
    return value


def _resolve_device(requested: str) -> str:
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but no CUDA device is available")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def _check_scalars(args: argparse.Namespace) -> None:
    for dest in _POSITIVE_INT_FLAGS:
        if getattr(args, dest) < 1:
            raise UsageError(f"{_flag(dest)} must be a positive integer, got {getattr(args, dest)}")
    if args.seed < 0:
        raise UsageError(f"--seed must be non-negative, got {args.seed}")
    if not args.lr > 0:
        raise UsageError(f"--lr must be positive, got {args.lr}")


def _derive_layout(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """world_size from the launcher; data_parallel from it unless given; P*T*D must equal it."""
    P, T = args.pipeline_parallel, args.tensor_parallel
    world = _world_size(environ)
    if args.data_parallel is None:
        if world % (P * T):
            raise UsageError(
                f"WORLD_SIZE={world} is not divisible by pipeline_parallel({P}) x tensor_parallel({T}) = {P * T}")
        args.data_parallel = world // (P * T)
    D = args.data_parallel
    if D < 1:
        raise UsageError(f"--data_parallel must be a positive integer, got {D}")
    if P * T * D != world:
        raise UsageError(
            f"WORLD_SIZE={world} does not match pipeline_parallel({P}) x tensor_parallel({T}) x "
            f"data_parallel({D}) = {P * T * D}")
    if world > 1 and "MASTER_ADDR" not in environ and not args.check_config:
        raise UsageError(f"WORLD_SIZE={world} but MASTER_ADDR is not set: launch one process per rank with torchrun")
    args.world_size = world


def _check_model_split(args: argparse.Namespace) -> None:
    P, V, T = args.pipeline_parallel, args.model_chunks, args.tensor_parallel
    if V > 1 and P == 1:
        raise UsageError(f"--model_chunks {V} needs --pipeline_parallel > 1")
    if args.num_layers % (P * V):
        raise UsageError(
            f"--num-layers {args.num_layers} is not divisible by pipeline_parallel({P}) x model_chunks({V}) = {P * V}")
    if args.hidden_size % args.num_attention_heads:
        raise UsageError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads}")
    if args.num_attention_heads % T:
        raise UsageError(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by tensor_parallel({T})")
    if args.vocab_size < 2:
        raise UsageError(f"--vocab-size must be at least 2, got {args.vocab_size}")
    if args.vocab_size % T:
        raise UsageError(f"--vocab-size {args.vocab_size} is not divisible by tensor_parallel({T})")


def _derive_microbatches(args: argparse.Namespace) -> None:
    """m = GBS / (MBS * D), which must be whole; with V > 1 also a multiple of P (Megatron's rule)."""
    P, V, D = args.pipeline_parallel, args.model_chunks, args.data_parallel
    per_microbatch = args.micro_batch_size * D
    if args.global_batch_size is None:
        args.global_batch_size = DEFAULT_MICROBATCHES * per_microbatch
    if args.global_batch_size < 1 or args.global_batch_size % per_microbatch:
        raise UsageError(
            f"--global-batch-size {args.global_batch_size} is not a positive multiple of "
            f"micro_batch_size({args.micro_batch_size}) x data_parallel({D}) = {per_microbatch}")
    m = args.global_batch_size // per_microbatch
    if V > 1 and m % P:
        # Megatron's interleaved schedule runs microbatches in groups of P per virtual stage.
        raise UsageError(
            f"with --model_chunks {V}, the number of microbatches (global_batch_size / (micro_batch_size x "
            f"data_parallel) = {m}) must be a multiple of pipeline_parallel({P})")
    args.num_microbatches = m


def validate(args: argparse.Namespace, environ: Mapping[str, str]) -> argparse.Namespace:
    """Check flag combinations; derive world_size, data_parallel, num_microbatches and the device."""
    _check_scalars(args)
    _derive_layout(args, environ)
    _check_model_split(args)
    _derive_microbatches(args)
    args.device = _resolve_device(args.device)
    if args.schedule == "megatron" and args.pipeline_parallel > 1 and args.device == "cpu":
        raise UsageError(
            "--schedule megatron with --pipeline_parallel > 1 needs CUDA (Megatron's p2p code is CUDA-only); "
            "use --schedule app|interleaved|1f1b on CPU")
    if args.data_path is not None:
        _check_data_path(args.data_path)
    return args


def _check_data_path(items: Sequence[str]) -> None:
    """Megatron's convention: an odd-length list is prefixes, an even-length one WEIGHT PREFIX pairs."""
    prefixes = items
    if len(items) % 2 == 0:
        weights, prefixes = items[0::2], items[1::2]
        for weight in weights:
            try:
                float(weight)
            except ValueError:
                raise UsageError(f"--data-path weight {weight!r} is not a number "
                                 "(give one PREFIX, or WEIGHT PREFIX pairs)") from None
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            if not os.path.isfile(prefix + suffix):
                raise UsageError(f"--data-path: {prefix + suffix} does not exist")


def parse_args(argv: Optional[Sequence[str]] = None,
               environ: Optional[Mapping[str, str]] = None) -> argparse.Namespace:
    """Parse and validate; raises UsageError with a one-line message on any mistake."""
    args = build_parser().parse_args(argv)
    return validate(args, os.environ if environ is None else environ)
