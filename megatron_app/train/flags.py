"""The trainer's command line: every flag of ``python -m megatron_app.train``, its default and its help (the
parser), and completed(), which gives hand-built args the same defaults. Validation lives in args.py.
"""

from __future__ import annotations

import argparse
import functools
from typing import Mapping, Sequence

from megatron_app.device_choice import DEVICE_CHOICES
from megatron_app.lossy.config import TP_SITES
from megatron_app.schedule import ADAPTIVE_POLICY_NAMES, DEFAULT_POLICY, STATIC_POLICY_NAMES
from megatron_app.schedule.composition import COMPOSITION_NAMES, default_composition

from megatron_app.data.text_tokenizers import TOKENIZER_TYPES

MEGATRON_SCHEDULE = "megatron"   # Megatron-Core's own forward_backward function, not our runtime
SCHEDULES = ("app",) + STATIC_POLICY_NAMES + (MEGATRON_SCHEDULE,)
POLICIES = ADAPTIVE_POLICY_NAMES
DEFAULT_MICROBATCHES = 8
DEFAULT_VOCAB_SIZE = 1024  # mock data; with --data-path the size comes from the tokenizer or the data
DEFAULT_SPLIT = "949,50,1"
DEFAULT_SLOW_FACTOR = 1.5
DEFAULT_STRAGGLER_FACTOR = 3.0
DEFAULT_EVAL_ITERS = 10
DEFAULT_ITERS = 5
DEFAULT_TRACE_DIR = "traces/"
DEFAULT_PROFILE_STEPS = (10, 12)   # Megatron-LM's --profile-step-start / --profile-step-end
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")   # Megatron's choices for a dense GPT (no MoE, no MLA)
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")   # Megatron-LM's
LR_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WEIGHT_DECAY_INCR_STYLES = ("constant", "linear", "cosine")
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
    _add_flag(model, "--max-position-embeddings", type=int, default=None, metavar="N",
              help="the learned position embeddings' table size, at least --seq-length (Megatron-LM's flag; "
                   "default: --seq-length)")
    _add_flag(model, "--attention-softmax-in-fp32", action="store_true",
              help="accepted for Megatron-LM's scripts, with no effect: Megatron applies it to its own unfused "
                   "softmax; our core attention runs torch's fused attention kernels, which keep their own "
                   "accumulation, and computes the softmax in fp32 where it applies dropout itself")
    _add_flag(model, "--attention-backend", choices=("auto", "local", "flash", "fused", "unfused"), default="auto",
              help="Megatron-LM's choice of attention kernels: `auto` and `local` run our core attention (torch's "
                   "fused scaled-dot-product attention, per document when packed); `flash`, `fused` and `unfused` "
                   "are Transformer Engine's and refused")
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
    # Megatron-LM's architecture flags (a Llama-shaped model: --normalization RMSNorm --swiglu --disable-bias-linear
    # --group-query-attention --num-query-groups G --position-embedding-type rope)
    _add_flag(model, "--normalization", choices=NORMALIZATIONS, default="LayerNorm", help="the layers' norm")
    _add_flag(model, "--norm-epsilon", type=float, default=1e-5, metavar="EPS", help="the norms' epsilon")
    _add_flag(model, "--swiglu", action="store_true",
              help="gated MLP with SiLU (SwiGLU); --ffn-hidden-size then defaults to Megatron-LM's 2/3 x 4h, rounded "
                   "down to a multiple of 64")
    _add_flag(model, "--ffn-hidden-size", type=int, default=None, metavar="N",
              help="the MLP's hidden width (default: 4 x --hidden-size, or SwiGLU's as above)")
    _add_flag(model, "--disable-bias-linear", action="store_true", help="no biases in the linear layers")
    _add_flag(model, "--group-query-attention", action="store_true",
              help="grouped-query attention: --num-query-groups key/value heads shared by the query heads")
    _add_flag(model, "--num-query-groups", type=int, default=None, metavar="G",
              help="with --group-query-attention: key/value head groups (divides the heads and tensor_parallel "
                   "divides it)")
    _add_flag(model, "--position-embedding-type", choices=POSITION_EMBEDDINGS, default="learned_absolute",
              help="learned absolute position embeddings, or rotary (RoPE: positions restart at each packed "
                   "document)")
    _add_flag(model, "--init-method-std", type=float, default=0.02, metavar="STD",
              help="the weights' initial standard deviation (the output projections' scaled by depth, as Megatron "
                   "does)")
    _add_flag(model, "--untie-embeddings-and-output-weights", action="store_true",
              help="separate weights for the input embedding and the output layer (without it they are one "
                   "weight, as in Megatron-LM; the pipeline's last stage then holds a copy kept equal to the first's)")
    _add_flag(model, "--transformer-impl", choices=("local", "transformer_engine"), default="local",
              help="Megatron-LM's choice of layer implementation: `local` (Megatron-Core's own layers with our "
                   "attention over packed documents, on CPU and CUDA); `transformer_engine` is refused (not "
                   "supported yet; Megatron-LM's default)")
    _add_flag(model, "--rotary-base", type=int, default=10000, metavar="B", help="RoPE's base")
    _add_flag(model, "--rotary-percent", type=float, default=1.0, metavar="F",
              help="RoPE: the share of each head's dimensions rotated")

    train = parser.add_argument_group("training")
    _add_flag(train, "--micro-batch-size", type=int, default=2, help="sequences per microbatch")
    _add_flag(train, "--global-batch-size", type=int, default=None,
              help=f"sequences per iteration (default: {DEFAULT_MICROBATCHES} microbatches per data-parallel rank)")
    _add_flag(train, "--iters", type=int, default=None,
              help=f"iterations to train, counted from 1 as in the log (default: {DEFAULT_ITERS})",
              megatron=["--train-iters"])
    _add_flag(train, "--train-samples", type=int, default=None, metavar="N",
              help="Megatron-LM's sample-based length instead of --train-iters: N // --global-batch-size iterations; "
                   "the learning-rate schedule then counts samples (--lr-decay-samples, --lr-warmup-samples, "
                   "--lr-wsd-decay-samples)")
    _add_flag(train, "--seed", type=int, default=1234, help="seeds the model, data order and dropout")
    _add_flag(train, "--lr", type=float, default=1e-3,
              help="Adam's learning rate (the peak of a --lr-decay-style schedule)")
    _add_flag(train, "--data-path", nargs="+", default=None, metavar="PREFIX",
              help="Megatron indexed dataset prefix(es) [weight prefix ...]; default: mock data")
    _add_flag(train, "--synthetic-microbatches", default=None, metavar="FILE",
              help="instead of --data-path: documents of random tokens whose every iteration's microbatches FILE "
                   "gives as document lengths (JSON {\"iterations\": [[[L, L], [L]], ...]}; python -m "
                   "megatron_app.data.synthetic_documents writes a sweep), packed, iterations repeating; every "
                   "iteration holds --global-batch-size documents; implies --variable-seq-lengths; for profiling a "
                   "model over chosen compositions (cost curves)")
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
    _add_flag(train, "--device", choices=DEVICE_CHOICES, default="auto",
              help="auto: one CUDA device per rank when there is one, else the CPU")
    train.add_argument("--check-for-nan-in-loss-and-grad", action=argparse.BooleanOptionalAction, default=True,
                        help="stop the run, with one line naming the iteration and rank, on the first iteration "
                             "whose loss or gradients are not finite (NaN or inf); --no-check-for-nan-in-loss-and-grad "
                             "keeps going (Megatron-LM's flags; default: stop)")
    _add_flag(train, "--distributed-timeout-minutes", type=int, default=10,
              help="how long a collective (e.g. the data-parallel all-reduce) waits for a rank that died on another "
                   "host before it fails (default: %(default)s, as Megatron-LM's)")

    recompute = parser.add_argument_group("activation recomputation (Megatron-LM's flags; megatron_app/runtime/"
                                          "recompute_randomness.py)")
    _add_flag(recompute, "--recompute-activations", action="store_true",
              help="Megatron-LM's short form of --recompute-granularity selective")
    _add_flag(recompute, "--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, default=None,
              help="keep fewer activations and recompute them in the backward pass: `full` reruns whole layers "
                   "(needs --recompute-method and --recompute-num-layers), `selective` reruns the --recompute-modules "
                   "of every layer; dropout masks are redrawn equal, so the gradients do not change")
    _add_flag(recompute, "--recompute-method", choices=RECOMPUTE_METHODS, default=None,
              help="--recompute-granularity full: `uniform` recomputes every group of --recompute-num-layers layers "
                   "of a model chunk from its input; `block` recomputes the first --recompute-num-layers layers of "
                   "each model chunk and keeps the rest")
    _add_flag(recompute, "--recompute-num-layers", type=int, default=None, metavar="N",
              help="--recompute-granularity full: the layers of a group (uniform) or recomputed per chunk (block)")
    _add_flag(recompute, "--recompute-modules", nargs="+", choices=RECOMPUTE_MODULES, default=None, metavar="MODULE",
              help="--recompute-granularity selective: which parts of each layer to recompute, of "
                   f"{', '.join(RECOMPUTE_MODULES)} (default: core_attn)")

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

    optimizer = parser.add_argument_group(
        "optimizer (Megatron-LM's flags and meaning; our defaults keep a constant-lr Adam without clipping)")
    _add_flag(optimizer, "--clip-grad", type=float, default=0.0, metavar="NORM",
              help="clip the gradients to this global L2 norm over every rank's parameters, tensor-parallel copies "
                   "counted once (0: no clipping; Megatron-LM's default is 1.0)")
    _add_flag(optimizer, "--use-distributed-optimizer", action="store_true",
              help="Megatron's distributed optimizer (ZeRO-1): each data-parallel rank keeps the fp32 main parameters "
                   "and Adam state of 1/D of the parameters, and the updated shards are all-gathered (gradients "
                   "are still all-reduced); checkpoints hold the optimizer unsharded")
    _add_flag(optimizer, "--weight-decay", type=float, default=0.0, metavar="WD",
              help="decoupled weight decay (AdamW), none on biases and 1-D parameters as in Megatron-Core "
                   "(Megatron-LM's default is 0.01)")
    _add_flag(optimizer, "--start-weight-decay", type=float, default=None, metavar="WD",
              help="with --weight-decay-incr-style linear or cosine: the decay's first value")
    _add_flag(optimizer, "--end-weight-decay", type=float, default=None, metavar="WD",
              help="with --weight-decay-incr-style linear or cosine: its value at the last iteration")
    _add_flag(optimizer, "--weight-decay-incr-style", choices=WEIGHT_DECAY_INCR_STYLES, default="constant",
              help="how the weight decay goes from --start-weight-decay to --end-weight-decay over --iters")
    _add_flag(optimizer, "--adam-beta1", type=float, default=0.9, metavar="B1", help="Adam's beta1")
    _add_flag(optimizer, "--adam-beta2", type=float, default=0.999, metavar="B2", help="Adam's beta2")
    _add_flag(optimizer, "--adam-eps", type=float, default=1e-8, metavar="EPS", help="Adam's epsilon")
    _add_flag(optimizer, "--lr-decay-style", choices=LR_DECAY_STYLES, default="constant",
              help="the learning rate after warm-up, from --lr to --min-lr over --lr-decay-iters (Megatron-Core's "
                   "OptimizerParamScheduler; Megatron-LM's default is linear)")
    _add_flag(optimizer, "--lr-decay-iters", type=int, default=None, metavar="N",
              help="iterations of the decay (default: --iters)")
    _add_flag(optimizer, "--lr-wsd-decay-iters", type=int, default=None, metavar="N",
              help="WSD (warm-up, stable, decay): the last N iterations of --lr-decay-iters anneal the lr")
    _add_flag(optimizer, "--lr-wsd-decay-style", choices=LR_WSD_DECAY_STYLES, default=None,
              help="WSD: how the anneal falls to --min-lr (default: exponential, as in Megatron-LM)")
    _add_flag(optimizer, "--lr-warmup-iters", type=int, default=None, metavar="N",
              help="iterations of linear warm-up from --lr-warmup-init to --lr (default: 0)")
    _add_flag(optimizer, "--lr-warmup-fraction", type=float, default=None, metavar="F",
              help="the warm-up as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)")
    _add_flag(optimizer, "--lr-decay-samples", type=int, default=None, metavar="N",
              help="with --train-samples: samples of the decay (default: --train-samples)")
    _add_flag(optimizer, "--lr-warmup-samples", type=int, default=None, metavar="N",
              help="with --train-samples: samples of linear warm-up (default: 0, or --lr-warmup-fraction's share)")
    _add_flag(optimizer, "--lr-wsd-decay-samples", type=int, default=None, metavar="N",
              help="with --train-samples: WSD's anneal, in samples")
    _add_flag(optimizer, "--lr-warmup-init", type=float, default=0.0, metavar="LR", help="where warm-up starts")
    _add_flag(optimizer, "--min-lr", type=float, default=0.0, metavar="LR", help="where the decay ends")
    _add_flag(optimizer, "--override-opt-param-scheduler", action="store_true",
              help="resuming: this run's learning-rate flags replace the checkpoint's schedule (otherwise a "
                   "changed schedule is refused)", megatron=["--override-opt_param-scheduler"])
    _add_flag(optimizer, "--use-checkpoint-opt-param-scheduler", action="store_true",
              help="resuming: keep the checkpoint's schedule whatever this run's learning-rate flags say",
              megatron=["--use-checkpoint-opt_param-scheduler"])

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
    _add_flag(ckpt, "--exit-signal-handler", action="store_true",
              help="on SIGTERM (SLURM's before a job's time limit; torchrun passes it on) finish the iteration, save "
                   "it when --save is given and stop, every rank after the same iteration, as Megatron-LM does")
    _add_flag(ckpt, "--exit-duration-in-mins", type=float, default=None, metavar="M",
              help="stop after the first iteration that ends M minutes or more after the run began (saving first "
                   "when --save is given), every rank at the same one, as Megatron-LM does: for a job's time limit")

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
    _add_flag(out, "--log-interval", type=int, default=1, metavar="N",
              help="print one iteration line every N iterations (and after the last), its loss and time averaged "
                   "over them, as Megatron-LM does (default: every iteration; Megatron-LM's is 100); --log-json "
                   "keeps every iteration")
    _add_flag(out, "--dump-grads", default=None, metavar="DIR",
              help="save each rank's gradients of iteration 1 (before the optimizer step)")
    _add_flag(out, "--dump-weights", default=None, metavar="DIR",
              help="save each rank's weights after the last iteration")
    _add_flag(out, "--check-config", action="store_true",
              help="only validate the flags for WORLD_SIZE ranks (launchers run this before starting ranks)")

    collector = parser.add_argument_group("garbage collection (Megatron-LM's flags; megatron_app/train/manual_gc.py)")
    _add_flag(collector, "--manual-gc", action="store_true",
              help="Python's garbage collector runs only between iterations, at the same points on every rank: "
                   "before the first, every --manual-gc-interval, around evaluations")
    _add_flag(collector, "--manual-gc-interval", type=int, default=None, metavar="N",
              help="with --manual-gc: collect after every N-th iteration (default 0: never between iterations)")
    _add_flag(collector, "--no-manual-gc-eval", action="store_false", dest="manual_gc_eval", default=None,
              help="with --manual-gc: no collection around evaluations")

    profiling = parser.add_argument_group("profiling (Megatron-LM's flags; megatron_app/train/profiling.py)")
    _add_flag(profiling, "--profile", action="store_true",
              help="profile steps [--profile-step-start, --profile-step-end) (counted from 0: the defaults are the "
                   "log's iterations 11-12): with --use-pytorch-profiler, else nsys's capture range (CUDA)")
    _add_flag(profiling, "--profile-step-start", type=int, default=None, metavar="N",
              help=f"first profiled step (default {DEFAULT_PROFILE_STEPS[0]})")
    _add_flag(profiling, "--profile-step-end", type=int, default=None, metavar="N",
              help=f"profiling ends before this step (default {DEFAULT_PROFILE_STEPS[1]})")
    _add_flag(profiling, "--use-pytorch-profiler", action="store_true", default=None,
              help="torch.profiler: one Chrome/Perfetto trace per profiled rank (TensorBoard's profiler reads it)")
    _add_flag(profiling, "--profile-ranks", type=int, nargs="+", default=None, metavar="R",
              help="global ranks to profile (default 0)")
    _add_flag(profiling, "--tensorboard-dir", default=None, metavar="DIR",
              help="TensorBoard scalars of each iteration (Megatron-LM's tags: lm loss, learning-rate, grad-norm, "
                   "...; needs requirements-tensorboard.txt); --use-pytorch-profiler's traces also go there "
                   "(default: profile/ in the run's trace directory)")
    return parser


# Options whose flag defaults to None (so that a given one can be told from a default) and the value an unset one
# takes once the refusals have run; and what validate() derives for a run that gives none of the flags it reads.
_FILLED_DEFAULTS = {"iters": DEFAULT_ITERS,
                    "slow_factor": DEFAULT_SLOW_FACTOR, "straggler_factor": DEFAULT_STRAGGLER_FACTOR,
                    "eval_iters": DEFAULT_EVAL_ITERS, "split": DEFAULT_SPLIT, "trace_dir": DEFAULT_TRACE_DIR,
                    "profile_step_start": DEFAULT_PROFILE_STEPS[0], "profile_step_end": DEFAULT_PROFILE_STEPS[1],
                    "profile_ranks": (0,), "use_pytorch_profiler": False, "manual_gc_interval": 0,
                    "manual_gc_eval": True}
_DERIVED_DEFAULTS = {"precision": "fp32", "composition": default_composition(planned_by_our_runtime=False),
                     "synthetic_plan": None}


@functools.lru_cache(maxsize=None)
def _parser_defaults() -> Mapping[str, object]:
    return {action.dest: action.default for action in build_parser()._actions
            if action.default is not argparse.SUPPRESS}


def counts_samples(args) -> bool:
    """Whether the run's length and schedule are counted in samples (Megatron-LM's --train-samples), not iterations."""
    return completed(args).train_samples is not None


def schedule_dest(args, what: str) -> str:
    """The option that gives the schedule's ``what`` (decay, warmup, wsd_decay) in the run's unit."""
    return f"lr_{what}_{'samples' if counts_samples(args) else 'iters'}"


def schedule_flag(args, what: str) -> str:
    return "--" + schedule_dest(args, what).replace("_", "-")


def lr_schedule_lengths(args) -> tuple:
    """(warm-up, decay, WSD anneal or None) of the learning-rate schedule in the run's unit (samples under
    --train-samples, else iterations), as Megatron-LM derives them: the decay over --lr-decay-* (default: the run's
    length), the warm-up --lr-warmup-* or --lr-warmup-fraction x the decay."""
    args = completed(args)
    if counts_samples(args):
        decay, warmup, wsd = args.lr_decay_samples or args.train_samples, args.lr_warmup_samples, \
            args.lr_wsd_decay_samples
    else:
        decay, warmup, wsd = args.lr_decay_iters or args.iters, args.lr_warmup_iters, args.lr_wsd_decay_iters
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return warmup or 0, decay, wsd


def lr_schedule_samples(args) -> tuple:
    """lr_schedule_lengths in samples, what Megatron's scheduler counts (an iteration is the global batch); and the
    samples over which an increasing weight decay rises (the run's)."""
    args = completed(args)
    per_unit = 1 if counts_samples(args) else args.global_batch_size
    warmup, decay, wsd = lr_schedule_lengths(args)
    run = args.train_samples if counts_samples(args) else args.iters * args.global_batch_size
    return warmup * per_unit, decay * per_unit, None if wsd is None else wsd * per_unit, run


def writes_traces(args) -> bool:
    """Whether the run writes trace files: not under --no-trace, nor under Megatron's own schedule (it has no
    tracer). The runtime's own encoding of "no traces" is AppSettings.trace_dir None."""
    return not args.no_trace and args.schedule != MEGATRON_SCHEDULE


def completed(args):
    """``args`` as parse_args would hold them: drivers that build args by hand (tests, embedding scripts) may leave
    options out, and each one left out takes its default here (the flag's, then what validate() fills in or derives
    for an unset flag), so the readers of ``args`` state no default of their own. Fills ``args`` in place."""
    given = vars(args)
    for dest, default in {**_parser_defaults(), **_FILLED_DEFAULTS, **_DERIVED_DEFAULTS}.items():
        if dest not in given:
            setattr(args, dest, default)
    return args
