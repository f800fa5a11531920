"""Command-line flags of ``python -m megatron_app.train`` and their validation.

Everything here runs before torch.distributed starts, so a user mistake costs one line on stderr and
exit status 2, never a traceback or a hung job. Only the device check and the --data-path checks
(megatron-core's dataset reader) import torch; --load's manifest is checked here too, so a checkpoint of
another layout is refused before any rank starts.
"""

from __future__ import annotations

import argparse
import os
from typing import Mapping, Optional, Sequence

from megatron_app.lossy.config import TP_SITES
from megatron_app.schedule import ADAPTIVE_POLICY_NAMES, DEFAULT_POLICY, STATIC_POLICY_NAMES
from megatron_app.schedule.composition import BALANCED, COMPOSITION_NAMES, LOADER, PLANNED_COMPOSITIONS
from megatron_app.schedule.policies import policies_taking

from megatron_app.data.text_tokenizers import TOKENIZER_TYPES

MEGATRON_SCHEDULE = "megatron"   # Megatron-Core's own forward_backward function, not our runtime
SCHEDULES = ("app",) + STATIC_POLICY_NAMES + (MEGATRON_SCHEDULE,)
POLICIES = ADAPTIVE_POLICY_NAMES
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_MICROBATCHES = 8
DEFAULT_VOCAB_SIZE = 1024  # mock data; with --data-path the size comes from the tokenizer or the data
DEFAULT_SPLIT = "949,50,1"
DEFAULT_SLOW_FACTOR = 1.5
DEFAULT_STRAGGLER_FACTOR = 3.0
DEFAULT_EVAL_ITERS = 10
DEFAULT_TRACE_DIR = "traces/"
# Megatron-LM's defaults of its dynamic loss scale (--fp16)
DEFAULT_INITIAL_LOSS_SCALE = 2.0 ** 32
DEFAULT_MIN_LOSS_SCALE = 1.0
DEFAULT_LOSS_SCALE_WINDOW = 1000
DEFAULT_HYSTERESIS = 2


class UsageError(ValueError):
    """A flag combination that cannot run; the message is one line meant for the user."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; we want exactly one line and exit status 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        raise UsageError(message)


class _DefaultsFormatter(argparse.HelpFormatter):
    """--help names every flag's default: argparse's "(default: X)" unless the text already says it; "none" for an
    unset option; nothing for an on/off switch (off unless given)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or action.nargs == 0:
            return text
        shown = "none" if action.default is None else "%(default)s"
        return f"{text} (default: {shown})" if text else f"default: {shown}"


def _add_flag(parser, *names: str, megatron: Sequence[str] = (), **kwargs) -> None:
    """Accept both ``--a_b`` and ``--a-b`` spellings of every flag, and Megatron-LM's name for it (``megatron``)."""
    spellings = []
    for name in names:
        body = name[2:]
        for variant in (name, "--" + body.replace("_", "-"), "--" + body.replace("-", "_")):
            if variant not in spellings:
                spellings.append(variant)
    parser.add_argument(*spellings, *megatron, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="python -m megatron_app.train",
        description="Train a small Megatron-Core GPT with a chosen pipeline schedule (one process per rank). "
                    "Megatron-LM's names of the flags we share are accepted too (--pipeline-model-parallel-size, "
                    "--train-iters, ...).",
        formatter_class=_DefaultsFormatter,
    )
    layout = parser.add_argument_group("parallel layout")
    _add_flag(layout, "--pipeline_parallel", type=int, default=1, metavar="P", help="pipeline stages",
              megatron=["--pipeline-model-parallel-size"])
    _add_flag(layout, "--model_chunks", type=int, default=None, metavar="V",
              help="model chunks (virtual stages) per pipeline rank (default: 1)",
              megatron=["--num-virtual-stages-per-pipeline-rank", "--virtual-pipeline-model-parallel-size"])
    layout.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None, metavar="L",
                        help="Megatron-LM's other way to give V: L layers per model chunk, so "
                             "V = num_layers / (P x L)")
    _add_flag(layout, "--tensor_parallel", type=int, default=1, metavar="T", help="tensor-parallel size",
              megatron=["--tensor-model-parallel-size"])
    _add_flag(layout, "--data_parallel", type=int, default=None, metavar="D",
              help="data-parallel size (default: WORLD_SIZE / (P*T))")

    model = parser.add_argument_group("model")
    _add_flag(model, "--num-layers", type=int, default=8, help="transformer layers, split over P x V chunks")
    _add_flag(model, "--hidden-size", type=int, default=64, help="model width")
    _add_flag(model, "--num-attention-heads", type=int, default=4, help="attention heads")
    _add_flag(model, "--seq-length", type=int, default=64, help="tokens per sequence")
    _add_flag(model, "--vocab-size", type=int, default=None,
              help=f"total vocabulary, end-of-document token included (default: {DEFAULT_VOCAB_SIZE} on mock data; "
                   "with --data-path the tokenizer's or the data's size, padded like Megatron)")
    _add_flag(model, "--hidden-dropout", type=float, default=0.0, metavar="P",
              help="dropout after attention and MLP, keyed by (seed, iteration, microbatch, layer) so every schedule, P "
                   "and V draws the same masks (default: %(default)s; Megatron-LM's is 0.1)")
    _add_flag(model, "--attention-dropout", type=float, default=0.0, metavar="P",
              help="dropout on attention probabilities, keyed the same way (default: %(default)s; Megatron-LM's is 0.1)")
    _add_flag(model, "--make-vocab-size-divisible-by", type=int, default=128, metavar="N",
              help="pad a derived vocabulary size to a multiple of N x tensor_parallel (Megatron's rule)")

    train = parser.add_argument_group("training")
    _add_flag(train, "--micro-batch-size", type=int, default=2, help="sequences per microbatch")
    _add_flag(train, "--global-batch-size", type=int, default=None,
              help=f"sequences per iteration (default: {DEFAULT_MICROBATCHES} microbatches per data-parallel rank)")
    _add_flag(train, "--iters", type=int, default=5, help="iterations to train, counted from 1 as in the log",
              megatron=["--train-iters"])
    _add_flag(train, "--seed", type=int, default=1234, help="seeds the model, data order and dropout")
    _add_flag(train, "--lr", type=float, default=1e-3, help="Adam's learning rate (constant)")
    _add_flag(train, "--data-path", nargs="+", default=None, metavar="PREFIX",
              help="Megatron indexed dataset prefix(es) [weight prefix ...]; default: mock data")
    _add_flag(train, "--variable-seq-lengths", action="store_true",
              help="one document per sample (not fixed-length windows), truncated at --seq-length; --composition "
                   "says how documents form microbatches; needs --data-path; implies --calculate-per-token-loss")
    _add_flag(train, "--composition", choices=COMPOSITION_NAMES, default=None,
              help="with --variable-seq-lengths (or emulated lengths), which documents of the global batch form each "
                   "microbatch: loader (the loader's microbatches, padded to their longest document; the default under "
                   "--schedule megatron), packed (the same documents concatenated in one row, no padding), "
                   "dp-balanced (the loader's order packed "
                   "up to a token budget as Megatron-LM's DpBalancedScheduler does, its packs dealt across "
                   "data-parallel replicas; a reference), balanced (cost-balanced packing planned together with the "
                   "order, documents moved between data-parallel replicas by predicted cost and learnt speed; the "
                   "default under our schedule), "
                   "balanced-local (the same within each replica's own share)")
    _add_flag(train, "--no-replica-speeds", action="store_true",
              help="balanced: plan every data-parallel replica as equally fast (default: learn each replica's speed "
                   "from its measured against its predicted time and give a slower one less work)")
    _add_flag(train, "--plan-ahead", action="store_true",
              help="balanced: plan each iteration's global batch in a worker process while the previous one trains "
                   "(the rank that plans starts one more process); a late plan falls back to planning in line")
    _add_flag(train, "--documents-per-microbatch", type=int, default=1, metavar="K",
              help="with --emulate-lengths-file: each loader microbatch holds K documents (the iteration draws "
                   "microbatches x K documents, composed by --composition); default 1")
    _add_flag(train, "--calculate-per-token-loss", action="store_true",
              help="Megatron's per-token loss: gradients are divided by the global batch's token count instead of "
                   "averaging per-microbatch means (the result does not depend on how samples form microbatches)")
    _add_flag(train, "--split", default=None, metavar="TRAIN,VALID,TEST",
              help=f"document shares of the splits of each --data-path dataset (default: {DEFAULT_SPLIT})")
    _add_flag(train, "--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
              help="with --vocab-file/--merge-file or --tokenizer-json: the vocabulary size comes from it")
    _add_flag(train, "--vocab-file", default=None, help="GPT-2 vocab.json (vocabulary size only)")
    _add_flag(train, "--merge-file", default=None, help="GPT-2 merges.txt")
    _add_flag(train, "--tokenizer-json", default=None, help="a Hugging Face tokenizer.json (vocabulary size only)")
    _add_flag(train, "--device", choices=DEVICES, default="auto",
              help="auto: one CUDA device per rank when there is one, else the CPU")
    train.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
                        help="stop the run, with one line naming the iteration and rank, on the first iteration "
                             "whose loss or gradients are not finite (NaN or inf); --no-check-for-nan-in-loss-and-grad "
                             "keeps going (Megatron-LM's flags; default: stop)")
    _add_flag(train, "--distributed-timeout-minutes", type=int, default=10,
              help="how long a collective (e.g. the data-parallel all-reduce) waits for a rank that died on another "
                   "host before it fails (default: %(default)s, as Megatron-LM's)")

    precision = parser.add_argument_group("mixed precision (Megatron-LM's flags and rules)")
    _add_flag(precision, "--bf16", action="store_true",
              help="bf16 parameters, activations and pipeline tensors; fp32 main parameters, optimizer state, "
                   "gradient accumulation and data-parallel all-reduce (Megatron's mixed-precision optimizer)")
    _add_flag(precision, "--fp16", action="store_true",
              help="fp16 parameters, activations and pipeline tensors; fp32 main parameters and optimizer state; "
                   "the loss is scaled (dynamically unless --loss-scale) and an iteration whose gradients overflow "
                   "is skipped")
    _add_flag(precision, "--loss-scale", type=float, default=None, metavar="S",
              help="a constant loss scale (a power of two) for --fp16 or --bf16 (default: dynamic under --fp16, none "
                   "under --bf16)")
    _add_flag(precision, "--initial-loss-scale", type=float, default=None, metavar="S",
              help=f"--fp16's dynamic loss scale: where it starts (default: {DEFAULT_INITIAL_LOSS_SCALE:.0f} = 2^32)")
    _add_flag(precision, "--min-loss-scale", type=float, default=None, metavar="S",
              help=f"--fp16's dynamic loss scale: its floor (default: {DEFAULT_MIN_LOSS_SCALE})")
    _add_flag(precision, "--loss-scale-window", type=int, default=None, metavar="N",
              help=f"--fp16's dynamic loss scale: doubled after N iterations without overflow "
                   f"(default: {DEFAULT_LOSS_SCALE_WINDOW})")
    _add_flag(precision, "--hysteresis", type=int, default=None, metavar="N",
              help=f"--fp16's dynamic loss scale: halved at the N-th overflow since the last growth "
                   f"(default: {DEFAULT_HYSTERESIS})")
    _add_flag(precision, "--accumulate-allreduce-grads-in-fp32", action="store_true",
              help="--fp16: accumulate gradients over microbatches and all-reduce them in fp32 (always so under "
                   "--bf16, as in Megatron-LM; default under --fp16: in fp16)")

    sched = parser.add_argument_group("schedule")
    _add_flag(sched, "--schedule", choices=SCHEDULES, default="app",
              help=f"app: adaptive runtime; {'/'.join(STATIC_POLICY_NAMES)}: static orders run by the runtime; "
                   f"{MEGATRON_SCHEDULE}: Megatron-Core's own forward_backward function")
    _add_flag(sched, "--policy", choices=POLICIES, default=None,
              help=f"task policy of --schedule app (default: {DEFAULT_POLICY}); the other schedules run their own "
                   "order and refuse it")
    _add_flag(sched, "--memory-factor", type=float, default=None, metavar="X",
              help="policy planned (and planned-fixed): activation bytes a rank may hold, x what Megatron's interleaved "
                   "order holds for the same microbatches (default 1.0)")
    _add_flag(sched, "--schedule-file", default=None, metavar="CSV",
              help="run these per-rank action lists instead of a policy: torch.distributed.pipelining's "
                   "compute-only format, one row per pipeline rank, actions like 0F1 / 4I2 / 4W2 / 0B1")
    _add_flag(sched, "--split-backward", action="store_true",
              help="run each backward as an input-gradient task (sent upstream at once) and a later weight-gradient "
                   "task that the schedule places in idle time; needed by --schedule zb-h1")

    emulation = parser.add_argument_group("compute emulation (timed waits instead of the model)")
    _add_flag(emulation, "--emulate-compute", default=None, metavar="FWD_MS,BWD_MS[,JITTER]",
              help="each chunk's forward/backward of a microbatch waits this long instead of computing")
    _add_flag(emulation, "--emulate-lengths-file", default=None, metavar="LENGTHS",
              help="variable-length microbatches: each iteration draws every microbatch's sequence length from this "
                   "file (one token count per line, e.g. tools/corpus_lengths.py's) with --seed, as megatron_app.sim "
                   "--lengths-file does; tasks take the simulator's cost of that length and activations are sized by "
                   "it; the schedule is told the lengths")
    _add_flag(emulation, "--slow-rank", type=int, default=None, metavar="R", help="pipeline rank R runs slower")
    _add_flag(emulation, "--emulate-cost-curves", default=None, metavar="FILE",
              help="with --emulate-lengths-file and composed microbatches: each task waits the cost fitted on a real "
                   "trace (python -m megatron_app.sim.cost_curves), spread over --num-layers, instead of the "
                   "simulator's analytic cost")
    _add_flag(emulation, "--slow-replica", type=int, default=None, metavar="R",
              help="every rank of data-parallel replica R runs slower (a slower device or node)")
    _add_flag(emulation, "--slow-factor", type=float, default=None, metavar="F",
              help=f"slowdown of --slow-rank or --slow-replica (default: {DEFAULT_SLOW_FACTOR})")
    _add_flag(emulation, "--straggler-prob", type=float, default=0.0, metavar="P",
              help="each task independently takes --straggler-factor times longer with probability P")
    _add_flag(emulation, "--straggler-factor", type=float, default=None, metavar="K",
              help=f"how much longer a straggling task takes (default: {DEFAULT_STRAGGLER_FACTOR})")
    _add_flag(emulation, "--link-delay", action="append", default=None, metavar="A-B:START_MS-END_MS:DELAY_MS",
              help="messages between pipeline ranks A and B sent START..END ms into each iteration arrive DELAY_MS "
                   "late; give it several times for several links or windows (the simulator's --slow-link, a "
                   "slowdown FACTOR, is another thing)")
    _add_flag(emulation, "--slow-link", default=None, help=argparse.SUPPRESS)   # refused: the simulator's flag

    evaluation = parser.add_argument_group("evaluation")
    _add_flag(evaluation, "--eval-interval", type=int, default=None, metavar="N",
              help="every N iterations, report the validation loss (forward only, through the chosen schedule)")
    _add_flag(evaluation, "--eval-iters", type=int, default=None, metavar="K",
              help=f"with --eval-interval: global batches per evaluation; every evaluation reads the same first K "
                   f"(default: {DEFAULT_EVAL_ITERS})")

    ckpt = parser.add_argument_group("checkpoints")
    _add_flag(ckpt, "--save", default=None, metavar="DIR",
              help="save model, optimizer, RNG and data position here (every --save-interval and at the end)")
    _add_flag(ckpt, "--save-interval", type=int, default=None, metavar="N", help="save every N iterations")
    _add_flag(ckpt, "--load", default=None, metavar="DIR",
              help="resume from DIR's latest checkpoint (or DIR itself when it is one iteration's directory); "
                   "a DIR with no checkpoint yet starts from scratch")
    _add_flag(ckpt, "--allow-data-change-on-resume", action="store_true",
              help="resume --load's checkpoint although --data-path or --variable-seq-lengths differ from its own "
                   "(otherwise refused: the run would silently read other samples)")
    _add_flag(ckpt, "--exit-interval", type=int, default=None, metavar="N",
              help="stop after an iteration that is a multiple of N (saving first when --save is given)")

    lossy = parser.add_argument_group("packet loss (lossy-network research; see megatron_app/lossy/config.py)")
    _add_flag(lossy, "--loss-model", default="none", metavar="MODEL",
              help="none | bernoulli | gilbert-elliott[:P,R,1-H,1-K] | replay:FILE | python:MOD.OBJ")
    _add_flag(lossy, "--loss-rate", type=float, default=None, metavar="P",
              help="bernoulli: loss probability; gilbert-elliott: stationary loss rate (with --burst-length)")
    _add_flag(lossy, "--burst-length", type=float, default=None, metavar="L",
              help="gilbert-elliott: mean number of consecutive lost packets (>= 1)")
    _add_flag(lossy, "--loss-on", default="forward,backward,tp", metavar="TRAFFIC",
              help="comma list: forward, backward (pipeline), tp (tensor-parallel), tp-forward, tp-backward")
    _add_flag(lossy, "--loss-fill", default="zeros", metavar="FILL",
              help="what a lost packet becomes: zeros | stale (last value there) | rescale (zeros, survivors / (1-p))")
    _add_flag(lossy, "--loss-seed", type=int, default=None, metavar="N", help="seed of the loss models (default --seed)")
    _add_flag(lossy, "--loss-packet-bytes", type=int, default=4096, metavar="B", help="packet size")
    _add_flag(lossy, "--loss-tp-sites", default="all", metavar="SITES",
              help="which megatron-core modules' tensor-parallel collectives lose packets: all, or a comma list of "
                   f"{', '.join(TP_SITES)} (e.g. mappings,layers keeps vocab-parallel cross-entropy exact)")

    out = parser.add_argument_group("output")
    _add_flag(out, "--trace-dir", default=None, metavar="DIR",
              help=f"where each run's per-rank traces go, one directory per run (default: {DEFAULT_TRACE_DIR})")
    _add_flag(out, "--no-trace", action="store_true", help="write no trace files")
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
    "make_vocab_size_divisible_by", "distributed_timeout_minutes", "eval_interval", "eval_iters", "save_interval",
    "exit_interval", "num_layers_per_virtual_pipeline_stage", "loss_scale_window", "hysteresis",
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
        if getattr(args, dest) is not None and getattr(args, dest) < 1:
            raise UsageError(f"{_flag(dest)} must be a positive integer, got {getattr(args, dest)}")
    if args.seed < 0:
        raise UsageError(f"--seed must be non-negative, got {args.seed}")
    if not args.lr > 0:
        raise UsageError(f"--lr must be positive, got {args.lr}")
    for dest in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, dest) < 1.0:
            raise UsageError(f"{_flag(dest)} must be in [0, 1), got {getattr(args, dest)}")


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


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _tokenizer_vocab_size(args: argparse.Namespace) -> Optional[int]:
    if not (args.vocab_file or args.merge_file or args.tokenizer_json or args.tokenizer_type):
        return None
    from megatron_app.data.text_tokenizers import TokenizerError, load_tokenizer

    try:
        return load_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                              tokenizer_json=args.tokenizer_json).vocab_size
    except TokenizerError as exc:
        raise UsageError(str(exc)) from None


def _check_data_path(args: argparse.Namespace) -> int:
    """Megatron's convention: an odd-length list is prefixes, an even-length one WEIGHT PREFIX pairs.
    Checks each dataset (see indexed_data.check_blend); returns the largest token id in the data."""
    items = args.data_path
    if len(items) % 2 == 0:
        for weight in items[0::2]:
            try:
                float(weight)
            except ValueError:
                raise UsageError(f"--data-path weight {weight!r} is not a number "
                                 "(give one PREFIX, or WEIGHT PREFIX pairs)") from None
    from megatron_app.data.indexed_data import DataError, check_blend

    try:
        return check_blend(items, args.split, need_validation=args.eval_interval is not None)
    except DataError as exc:
        raise UsageError(str(exc)) from None


def _resolve_vocab_size(args: argparse.Namespace) -> None:
    """--vocab-size given: it must cover the tokenizer and every token id of the data. Not given: the
    tokenizer's size (or the data's largest id + 1), padded to a multiple of make_vocab_size_divisible_by x T
    as Megatron does; the mock-data default otherwise."""
    needed = _tokenizer_vocab_size(args) or 0
    source = "the tokenizer's vocabulary" if needed else ""
    if args.data_path is not None:
        largest = _check_data_path(args)
        if largest + 1 > needed:
            needed, source = largest + 1, f"the data's largest token id {largest} + 1"
    if args.vocab_size is not None:
        if args.vocab_size < needed:
            raise UsageError(f"--vocab-size {args.vocab_size} is smaller than {source} ({needed})")
        return
    if not needed:
        args.vocab_size = DEFAULT_VOCAB_SIZE
        return
    args.vocab_size = _round_up(needed, args.make_vocab_size_divisible_by * args.tensor_parallel)


def _check_checkpointing(args: argparse.Namespace) -> None:
    """Refuse a --load checkpoint of another layout or model before any rank starts."""
    if args.save_interval is not None and args.save is None:
        raise UsageError("--save-interval needs --save DIR")
    if args.load is None:
        return
    from .checkpoint_manifest import CheckpointError, check_compatible, find_checkpoint

    try:
        found = find_checkpoint(args.load)
        if found is not None:
            check_compatible(found, args)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None


def _resolve_virtual_stages(args: argparse.Namespace) -> None:
    """V from --model_chunks (or Megatron-LM's --num-virtual-stages-per-pipeline-rank), or from Megatron-LM's
    --num-layers-per-virtual-pipeline-stage L as num_layers / (P x L); 1 when neither is given."""
    layers_per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if layers_per_stage is None:
        args.model_chunks = 1 if args.model_chunks is None else args.model_chunks
        return
    P = args.pipeline_parallel
    if args.num_layers % (P * layers_per_stage):
        raise UsageError(f"--num-layers-per-virtual-pipeline-stage {layers_per_stage}: --num-layers {args.num_layers} "
                         f"is not divisible by pipeline_parallel({P}) x {layers_per_stage}")
    chunks = args.num_layers // (P * layers_per_stage)
    if args.model_chunks is not None and args.model_chunks != chunks:
        raise UsageError(f"--model_chunks {args.model_chunks} and --num-layers-per-virtual-pipeline-stage "
                         f"{layers_per_stage} disagree (that is {chunks} chunks per rank): give one of them")
    args.model_chunks = chunks


def _refuse_ignored_options(args: argparse.Namespace) -> None:
    """An option the chosen mode would not use is refused in one line, not silently dropped; then the defaults of
    the options that are left unset (None, so that a given one can be told from a default) are filled in."""
    policy = getattr(args, "policy", None)
    if policy is not None and (args.schedule != "app" or getattr(args, "schedule_file", None) is not None):
        runs = (f"the action lists of --schedule-file {args.schedule_file}" if getattr(args, "schedule_file", None)
                else f"the fixed order of --schedule {args.schedule}")
        raise UsageError(f"--policy {policy} chooses the task policy of --schedule app; this run follows {runs}: "
                         "drop --policy")
    if getattr(args, "slow_link", None) is not None:
        raise UsageError("--slow-link is the simulator's flag (a slowdown FACTOR); the trainer delays a link's "
                         "messages with --link-delay A-B:START_MS-END_MS:DELAY_MS")
    if getattr(args, "slow_factor", None) is not None and getattr(args, "slow_rank", None) is None \
            and getattr(args, "slow_replica", None) is None:
        raise UsageError("--slow-factor needs --slow-rank R or --slow-replica R (what it slows)")
    if getattr(args, "straggler_factor", None) is not None and not getattr(args, "straggler_prob", 0.0):
        raise UsageError("--straggler-factor needs --straggler-prob P > 0 (how often a task straggles)")
    if getattr(args, "eval_iters", None) is not None and getattr(args, "eval_interval", None) is None:
        raise UsageError("--eval-iters needs --eval-interval N (no evaluation runs without it)")
    if getattr(args, "split", None) is not None and getattr(args, "data_path", None) is None:
        raise UsageError("--split needs --data-path (mock data has no splits)")
    if getattr(args, "trace_dir", None) is not None:
        if getattr(args, "no_trace", False):
            raise UsageError("--no-trace writes no trace: drop --trace-dir")
        if args.schedule == MEGATRON_SCHEDULE:
            raise UsageError("--schedule megatron runs Megatron-Core's own schedule, which writes no trace: drop "
                             "--trace-dir")
    for dest, default in (("slow_factor", DEFAULT_SLOW_FACTOR), ("straggler_factor", DEFAULT_STRAGGLER_FACTOR),
                          ("eval_iters", DEFAULT_EVAL_ITERS), ("split", DEFAULT_SPLIT),
                          ("trace_dir", DEFAULT_TRACE_DIR)):
        if getattr(args, dest, None) is None:
            setattr(args, dest, default)
    args.policy = running_policy_name(args)


def running_policy_name(args: argparse.Namespace) -> str:
    """The one name of what orders the tasks, for the config line, the banner and the trace alike: the adaptive
    policy under --schedule app, the static order's name, the action lists of --schedule-file, or megatron."""
    if getattr(args, "schedule_file", None) is not None:
        from megatron_app.schedule.action_lists import ACTION_LISTS

        return ACTION_LISTS
    if args.schedule == "app":
        return getattr(args, "policy", None) or DEFAULT_POLICY
    return args.schedule


def validate(args: argparse.Namespace, environ: Mapping[str, str]) -> argparse.Namespace:
    """Check flag combinations; derive world_size, data_parallel, vocab_size, num_microbatches and the device."""
    _check_scalars(args)
    _resolve_virtual_stages(args)
    _refuse_ignored_options(args)
    _derive_layout(args, environ)
    _resolve_vocab_size(args)
    _check_model_split(args)
    _derive_microbatches(args)
    args.device = _resolve_device(args.device)
    if args.schedule == "megatron" and args.pipeline_parallel > 1 and args.device == "cpu":
        raise UsageError(
            "--schedule megatron with --pipeline_parallel > 1 needs CUDA (Megatron's p2p code is CUDA-only); "
            "use --schedule app|interleaved|1f1b on CPU")
    _check_precision(args)   # before the checkpoint check, which compares precisions
    _check_checkpointing(args)
    _check_variable_lengths(args)
    _check_planned_composition_options(args)
    _check_emulation(args)
    _check_loss(args)
    _check_memory_factor(args)
    _check_split_backward(args)
    _check_schedule_file(args)
    _check_outputs(args)
    return args


def _check_outputs(args: argparse.Namespace) -> None:
    """Every path the run will write, now rather than at its first write (output_paths.py)."""
    from .output_paths import OutputPathError, check_outputs

    try:
        check_outputs(args, tracing=not args.no_trace and args.schedule != MEGATRON_SCHEDULE)
    except OutputPathError as exc:
        raise UsageError(str(exc)) from None


def _check_schedule_file(args: argparse.Namespace) -> None:
    """--schedule-file: readable, and its lists fit this pipeline and complete (one line otherwise)."""
    if args.schedule_file is None:
        return
    if args.schedule != "app":
        raise UsageError(f"--schedule-file replaces the schedule: drop --schedule {args.schedule}")
    from megatron_app.runtime.settings import AppConfigError, read_action_lists
    from megatron_app.schedule import PipelineShape, ScheduleConfigError
    from megatron_app.schedule.action_lists import orders_from_action_lists

    try:
        orders_from_action_lists(PipelineShape(args.pipeline_parallel, args.model_chunks, args.num_microbatches,
                                               split_backward=args.split_backward),
                                 read_action_lists(args.schedule_file))
    except (AppConfigError, ScheduleConfigError) as error:
        raise UsageError(f"--schedule-file {args.schedule_file}: {error}") from None


def _check_precision(args: argparse.Namespace) -> None:
    """--bf16 / --fp16 and the loss-scale flags (Megatron-LM's rules): one precision; a flag that nothing would read is
    refused; bf16 always accumulates and all-reduces gradients in fp32. Sets args.precision ('fp32' | 'bf16' |
    'fp16') and fills the dynamic loss scale's defaults under --fp16."""
    bf16, fp16 = getattr(args, "bf16", False), getattr(args, "fp16", False)
    if bf16 and fp16:
        raise UsageError("--bf16 and --fp16 are two precisions: give one of them")
    args.precision = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    dynamic = {"initial_loss_scale": DEFAULT_INITIAL_LOSS_SCALE, "min_loss_scale": DEFAULT_MIN_LOSS_SCALE,
               "loss_scale_window": DEFAULT_LOSS_SCALE_WINDOW, "hysteresis": DEFAULT_HYSTERESIS}
    if not (bf16 or fp16):
        for dest in ("loss_scale", *dynamic, "accumulate_allreduce_grads_in_fp32"):
            if getattr(args, dest, None) not in (None, False):
                raise UsageError(f"{_flag(dest)} applies to --fp16 or --bf16 only (this run trains in fp32)")
        return
    for dest in ("loss_scale", "initial_loss_scale", "min_loss_scale"):
        value = getattr(args, dest, None)
        if value is not None and not value > 0:
            raise UsageError(f"{_flag(dest)} must be positive, got {value}")
    if getattr(args, "emulate_compute", None) is not None:
        raise UsageError(f"--{args.precision} sets the model's precision; --emulate-compute replaces the model: drop one")
    dynamic_given = [dest for dest in dynamic if getattr(args, dest, None) is not None]
    if dynamic_given and (bf16 or getattr(args, "loss_scale", None) is not None):
        raise UsageError(f"{_flag(dynamic_given[0])} sets --fp16's dynamic loss scale; "
                         + ("--bf16 has none (--loss-scale S gives it a constant one)" if bf16
                            else "--loss-scale makes the scale constant: drop one of them"))
    if fp16 and getattr(args, "loss_scale", None) is None:
        for dest, default in dynamic.items():
            if getattr(args, dest, None) is None:
                setattr(args, dest, default)
        if args.min_loss_scale > args.initial_loss_scale:
            raise UsageError(f"--min-loss-scale {args.min_loss_scale} is above --initial-loss-scale "
                             f"{args.initial_loss_scale}")
    if bf16:
        args.accumulate_allreduce_grads_in_fp32 = True   # Megatron-LM: bf16 needs fp32 accumulation and all-reduce


def _check_split_backward(args: argparse.Namespace) -> None:
    from megatron_app.schedule import POLICIES

    if not args.split_backward:
        if args.schedule in POLICIES and POLICIES[args.schedule].split_only:
            raise UsageError(f"--schedule {args.schedule} needs --split-backward")
        return
    if args.schedule == MEGATRON_SCHEDULE:
        raise UsageError("--split-backward needs a megatron_app schedule (not --schedule megatron)")


def _check_memory_factor(args: argparse.Namespace) -> None:
    if args.memory_factor is None:
        return
    if not args.memory_factor >= 1.0:
        raise UsageError(f"--memory-factor must be >= 1 (x Megatron's peak activation bytes), got {args.memory_factor}")
    takers = policies_taking("memory_factor")
    if args.schedule != "app" or args.policy not in takers:
        raise UsageError(f"--memory-factor applies to --policy {' or '.join(takers)} (under --schedule app) only")


def _check_planned_composition_options(args: argparse.Namespace) -> None:
    """--plan-ahead and --no-replica-speeds act on a planned composition only: refused where nothing reads them."""
    composition = getattr(args, "composition", None)
    for dest, allowed in (("plan_ahead", PLANNED_COMPOSITIONS), ("no_replica_speeds", (BALANCED,))):
        if getattr(args, dest, False) and composition not in allowed:
            raise UsageError(f"{_flag(dest)} applies to --composition {' or '.join(allowed)} only "
                             f"(this run composes {composition or 'nothing'})")


def _check_variable_lengths(args: argparse.Namespace) -> None:
    """Variable-length samples are whole documents of an indexed dataset; they need per-token loss."""
    documents = getattr(args, "documents_per_microbatch", 1)
    emulated = bool(getattr(args, "emulate_lengths_file", None))
    composition = getattr(args, "composition", None)
    if documents < 1:
        raise UsageError(f"--documents-per-microbatch must be >= 1, got {documents}")
    if documents > 1 and not emulated:
        raise UsageError("--documents-per-microbatch needs --emulate-lengths-file (emulated documents to compose)")
    if not getattr(args, "variable_seq_lengths", False):
        if composition is not None and not emulated:
            raise UsageError("--composition needs --variable-seq-lengths (it regroups whole documents) or emulated "
                             "lengths (--emulate-lengths-file)")
        if (documents > 1 or composition not in (None, LOADER)) and args.schedule == MEGATRON_SCHEDULE:
            raise UsageError("composed microbatches are planned by megatron_app's runtime: use --schedule app, "
                             "interleaved or 1f1b, not megatron")
        args.composition = composition or LOADER
        return
    # balanced: at or above packed in every real-compute row and well above it emulated (BENCHMARKS.md, "Microbatch
    # composition"; docs/variable-lengths.md says why); Megatron's own schedule keeps Megatron's own layout.
    args.composition = composition or (LOADER if args.schedule == MEGATRON_SCHEDULE else BALANCED)
    if args.composition in PLANNED_COMPOSITIONS and args.schedule == MEGATRON_SCHEDULE:
        raise UsageError(f"--composition {args.composition} needs our schedule (--schedule app|interleaved|1f1b): the plan "
                         "comes from its runtime")
    if args.data_path is None:
        raise UsageError("--variable-seq-lengths needs --data-path (one document per sample; mock data has no "
                         "documents; tools/make_corpus.py builds a real corpus)")
    args.calculate_per_token_loss = True


def _check_loss(args: argparse.Namespace) -> None:
    """--loss-* flags -> args.loss_config (a megatron_app.lossy.LossConfig), or one line on what is wrong."""
    from megatron_app.lossy.config import LossConfigError
    from megatron_app.lossy.training import loss_config_from_args

    try:
        args.loss_config = loss_config_from_args(args)
    except LossConfigError as exc:
        raise UsageError(str(exc)) from None
    if args.loss_config.pipeline and args.schedule == "megatron" and args.pipeline_parallel > 1:
        raise UsageError("pipeline packet loss (--loss-on forward/backward) needs megatron_app's transport: "
                         "use --schedule app|interleaved|1f1b, or --loss-on tp")


def _check_emulation(args: argparse.Namespace) -> None:
    """The emulation flags parse, fit the pipeline, and come with --emulate-compute."""
    from megatron_app.schedule import PipelineShape, ScheduleConfigError

    from megatron_app.emulation import SlowLink, spec_from_args

    emulating = getattr(args, "emulate_compute", None) is not None
    if not emulating:
        for dest, default in (("slow_rank", None), ("slow_replica", None), ("emulate_cost_curves", None), ("straggler_prob", 0.0),
                              ("link_delay", None),
                              ("emulate_lengths_file", None)):
            if getattr(args, dest, default) != default:
                raise UsageError(f"{_flag(dest)} needs --emulate-compute")
        return
    for dest in ("data_path", "eval_interval"):
        if getattr(args, dest, None) is not None:
            raise UsageError(f"--emulate-compute replaces the model and its data; drop {_flag(dest)}")
    slow_replica = getattr(args, "slow_replica", None)
    if slow_replica is not None:
        if args.slow_rank is not None:
            raise UsageError("--slow-replica and --slow-rank share --slow-factor: give one of them")
        if not 0 <= slow_replica < args.data_parallel:
            raise UsageError(f"--slow-replica {slow_replica} is not a replica of --data_parallel {args.data_parallel}")
    try:
        spec = spec_from_args(args)
        spec.check_shape(PipelineShape(args.pipeline_parallel, args.model_chunks, args.num_microbatches))
        for text in getattr(args, "link_delay", None) or ():
            SlowLink.parse_delay(text).check_ranks(args.pipeline_parallel)
    except ScheduleConfigError as exc:
        raise UsageError(str(exc)) from None


def parse_args(argv: Optional[Sequence[str]] = None,
               environ: Optional[Mapping[str, str]] = None) -> argparse.Namespace:
    """Parse and validate; raises UsageError with a one-line message on any mistake."""
    args = build_parser().parse_args(argv)
    return validate(args, os.environ if environ is None else environ)
