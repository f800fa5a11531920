"""Validation of the flags of ``python -m megatron_app.train`` (flags.py declares them) and what they derive.

Everything here runs before torch.distributed starts, so a user mistake costs one line on stderr and
exit status 2, never a traceback or a hung job. Only the device check and the --data-path checks
(megatron-core's dataset reader) import torch; --load's manifest is checked here too, so a checkpoint of
another layout is refused before any rank starts.
"""

from __future__ import annotations

import argparse
import os
from typing import Mapping, Optional, Sequence

from megatron_app.schedule import DEFAULT_POLICY
from megatron_app.schedule.composition import BALANCED, LOADER, PACKED, PLANNED_COMPOSITIONS, default_composition
from megatron_app.schedule.policies import policies_taking

from .flags import (DEFAULT_HYSTERESIS, DEFAULT_INITIAL_LOSS_SCALE, DEFAULT_LOSS_SCALE_WINDOW,  # noqa: F401
                    DEFAULT_MICROBATCHES, DEFAULT_MIN_LOSS_SCALE, DEFAULT_SPLIT, DEFAULT_VOCAB_SIZE, MEGATRON_SCHEDULE,
                    POLICIES, SCHEDULES, UsageError, _FILLED_DEFAULTS, build_parser, counts_samples,
                    lr_schedule_lengths, schedule_dest, schedule_flag, writes_traces)
from .tensorboard_scalars import REQUIREMENTS as TENSORBOARD_REQUIREMENTS, tensorboard_importable


_POSITIVE_INT_FLAGS = (
    "pipeline_parallel", "model_chunks", "tensor_parallel", "num_layers", "hidden_size",
    "num_attention_heads", "seq_length", "vocab_size", "micro_batch_size", "iters",
    "make_vocab_size_divisible_by", "distributed_timeout_minutes", "eval_interval", "eval_iters", "save_interval",
    "exit_interval", "num_layers_per_virtual_pipeline_stage", "loss_scale_window", "hysteresis", "log_interval",
    "max_position_embeddings",
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


def _resolve_device(requested: str, check_only: bool) -> str:
    """The ranks ask torch; a launcher's --check-config asks the build and the driver without importing it (the
    ranks' answer decides what runs, and they validate again)."""
    from megatron_app.device_choice import DeviceUnavailable, cuda_available_without_torch, resolve_device_type

    def cuda_available() -> bool:
        answer = cuda_available_without_torch() if check_only else None
        if answer is None:
            import torch

            answer = torch.cuda.is_available()
        return answer

    try:
        return resolve_device_type(requested, cuda_available)
    except DeviceUnavailable as error:
        raise UsageError(str(error)) from None


def _check_scalars(args: argparse.Namespace) -> None:
    for dest in _POSITIVE_INT_FLAGS:
        if getattr(args, dest) is not None and getattr(args, dest) < 1:
            raise UsageError(f"{_flag(dest)} must be a positive integer, got {getattr(args, dest)}")
    if args.seed < 0:
        raise UsageError(f"--seed must be non-negative, got {args.seed}")
    if not args.lr > 0:
        raise UsageError(f"--lr must be positive, got {args.lr}")
    if args.exit_duration_in_mins is not None and not args.exit_duration_in_mins > 0:
        raise UsageError(f"--exit-duration-in-mins must be positive, got {args.exit_duration_in_mins}")
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


def _check_architecture(args: argparse.Namespace) -> None:
    """Megatron-LM's architecture flags and its derived defaults: the MLP's width (SwiGLU's 2/3 x 4h rounded down to
    a multiple of 64, as Megatron-LM does), the query groups (every head its own without --group-query-attention)."""
    T, heads = args.tensor_parallel, args.num_attention_heads
    if args.transformer_impl != "local":
        raise UsageError("--transformer-impl transformer_engine: Transformer Engine's layers are not supported yet "
                         "(docs/gpu.md, \"Limits on a GPU\"); --transformer-impl local, the default, runs "
                         "Megatron-Core's own layers")
    if args.attention_backend not in ("auto", "local"):
        raise UsageError(f"--attention-backend {args.attention_backend} picks Transformer Engine's kernels, which are "
                         "not supported yet; `auto` or `local` run our core attention")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    elif args.max_position_embeddings < args.seq_length:
        raise UsageError(f"--max-position-embeddings {args.max_position_embeddings} must be at least --seq-length "
                         f"{args.seq_length} (Megatron-LM's rule)")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size
        if args.ffn_hidden_size < 1:
            raise UsageError(f"--swiglu at --hidden-size {args.hidden_size}: Megatron-LM's MLP width rounds to 0; "
                             "give --ffn-hidden-size")
    if args.ffn_hidden_size < 1 or args.ffn_hidden_size % T:
        raise UsageError(f"--ffn-hidden-size {args.ffn_hidden_size} must be a positive multiple of "
                         f"tensor_parallel({T})")
    for dest in ("norm_epsilon", "init_method_std"):
        if not getattr(args, dest) > 0:
            raise UsageError(f"{_flag(dest)} must be positive, got {getattr(args, dest)}")
    if args.num_query_groups is not None and not args.group_query_attention:
        raise UsageError("--num-query-groups takes effect with --group-query-attention (Megatron-LM's rule): give both")
    if args.group_query_attention:
        groups = args.num_query_groups
        if groups is None or groups < 1 or heads % groups or groups % T:
            raise UsageError(f"--group-query-attention needs --num-query-groups G that divides --num-attention-heads "
                             f"{heads} and that tensor_parallel({T}) divides, got {groups}")
    else:
        args.num_query_groups = heads
    if args.position_embedding_type != "rope":
        for dest, default in (("rotary_base", 10000), ("rotary_percent", 1.0)):
            if getattr(args, dest) != default:
                raise UsageError(f"{_flag(dest)} shapes rotary embeddings: give --position-embedding-type rope")
    elif not 0.0 < args.rotary_percent <= 1.0 or args.rotary_base < 1:
        raise UsageError(f"--rotary-percent must be in (0, 1] and --rotary-base positive, got {args.rotary_percent} "
                         f"and {args.rotary_base}")


_SAMPLE_COUNTS = {"lr_decay_samples": "lr_decay_iters", "lr_warmup_samples": "lr_warmup_iters",
                  "lr_wsd_decay_samples": "lr_wsd_decay_iters"}


def _refuse_mixed_training_length(args: argparse.Namespace) -> None:
    """Megatron-LM's rules, before defaults fill in: the run's length and its schedule in iterations or in samples,
    not both; a sample count only with --train-samples."""
    def given(dest: str) -> bool:   # an explicit zero warm-up is Megatron-LM's default, allowed either way
        return getattr(args, dest) is not None and not (dest.startswith("lr_warmup") and getattr(args, dest) == 0)

    if args.train_samples is None:
        for dest in _SAMPLE_COUNTS:
            if given(dest):
                raise UsageError(f"{_flag(dest)} counts the schedule in samples: give --train-samples N instead of "
                                 "--train-iters, or the schedule in iterations")
        return
    if args.iters is not None:
        raise UsageError("--train-samples and --train-iters (--iters) both give the run's length: drop one")
    for samples, iterations in _SAMPLE_COUNTS.items():
        if given(iterations):
            raise UsageError(f"--train-samples counts the schedule in samples: give {_flag(samples)} instead of "
                             f"{_flag(iterations)}")


def _resolve_training_length_in_samples(args: argparse.Namespace) -> None:
    """--train-samples: the run's iterations, N // global batch as Megatron-LM counts them. The schedule stays in
    samples (flags.lr_schedule_samples hands them to Megatron's scheduler as given)."""
    if args.train_samples is None:
        return
    if args.train_samples < 1:
        raise UsageError(f"--train-samples must be positive, got {args.train_samples}")
    args.iters = args.train_samples // args.global_batch_size
    if args.iters < 1:
        raise UsageError(f"--train-samples {args.train_samples} is less than one global batch "
                         f"({args.global_batch_size} samples)")


def _check_recompute(args: argparse.Namespace) -> None:
    """Megatron-LM's activation recomputation flags: --recompute-activations means selective; full needs a method and
    a layer count, selective takes modules; a flag nothing would read is refused (Megatron-LM ignores some silently,
    and lets --recompute-activations override --recompute-granularity full)."""
    if args.recompute_activations:
        if args.recompute_granularity == "full":
            raise UsageError("--recompute-activations means --recompute-granularity selective (Megatron-LM's rule) and "
                             "would override --recompute-granularity full: give one of them")
        args.recompute_granularity = "selective"
    granularity = args.recompute_granularity
    if granularity is not None and getattr(args, "emulate_compute", False):
        raise UsageError("--recompute-granularity recomputes the model's activations; --emulate-compute runs no "
                         "model: drop one")
    if granularity != "full":
        for dest in ("recompute_method", "recompute_num_layers"):
            if getattr(args, dest) is not None:
                raise UsageError(f"{_flag(dest)} takes effect with --recompute-granularity full (Megatron-LM "
                                 f"ignores it otherwise): give both")
    if granularity != "selective" and args.recompute_modules is not None:
        raise UsageError("--recompute-modules takes effect with --recompute-granularity selective or "
                         "--recompute-activations: give one of them")
    if granularity == "full":
        layers_per_stage = args.num_layers // args.pipeline_parallel
        if args.recompute_method is None or args.recompute_num_layers is None:
            raise UsageError("--recompute-granularity full needs --recompute-method uniform|block and "
                             "--recompute-num-layers N (Megatron-Core's rule)")
        if not 1 <= args.recompute_num_layers <= layers_per_stage:
            raise UsageError(f"--recompute-num-layers must be between 1 and the layers of a pipeline stage "
                             f"({layers_per_stage}), got {args.recompute_num_layers}")
        layers_per_chunk = layers_per_stage // args.model_chunks
        if args.recompute_method == "uniform" and layers_per_chunk % args.recompute_num_layers:
            raise UsageError(f"--recompute-method uniform: --recompute-num-layers {args.recompute_num_layers} must "
                             f"divide the {layers_per_chunk} layers of a model chunk (Megatron-Core recomputes them "
                             "in groups of that many)")
    if granularity == "selective":
        args.recompute_modules = list(dict.fromkeys(args.recompute_modules or ["core_attn"]))
        if "layernorm" in args.recompute_modules:
            raise UsageError("--recompute-modules layernorm: Megatron-Core recomputes norms with Transformer Engine's "
                             "FP8 state, which --transformer-impl local lacks: recompute core_attn or mlp")
        if "mlp" in args.recompute_modules and not args.disable_bias_linear:
            raise UsageError("--recompute-modules mlp needs --disable-bias-linear: Megatron-Core's recomputed MLP "
                             "hands back its output bias, which recurses without end in the backward pass")


def _read_synthetic_microbatches(args: argparse.Namespace) -> None:
    """--synthetic-microbatches FILE -> args.synthetic_plan (a SyntheticPlan; None without the flag): the file
    readable and consistent, its documents the global batch, packed and variable-length, no other data."""
    path = getattr(args, "synthetic_microbatches", None)
    args.synthetic_plan = None
    if path is None:
        return
    from megatron_app.data.synthetic_documents import SyntheticPlanError, check_against, read_plan

    flag = f"--synthetic-microbatches {path}"
    for dest in ("data_path", "emulate_compute", "emulate_lengths_file", "eval_interval"):
        if getattr(args, dest, None):
            raise UsageError(f"{flag} is the run's data: drop {_flag(dest)}")
    if getattr(args, "composition", None) not in (None, PACKED):
        raise UsageError(f"{flag} gives packed microbatches: drop --composition {args.composition}")
    try:
        plan = read_plan(path)
        check_against(plan, args.seq_length)
    except SyntheticPlanError as error:
        raise UsageError(f"{flag}: {error}") from None
    documents = plan.documents_per_iteration
    if args.global_batch_size is None:
        args.global_batch_size = documents
    elif args.global_batch_size != documents:
        raise UsageError(f"{flag}: its iterations hold {documents} documents, not --global-batch-size "
                         f"{args.global_batch_size}")
    args.synthetic_plan = plan
    args.variable_seq_lengths = True
    args.composition = PACKED


def _check_synthetic_layout(args: argparse.Namespace) -> None:
    """Every iteration's microbatches on one replica, in counts this pipeline runs."""
    plan = getattr(args, "synthetic_plan", None)
    if plan is None:
        return
    flag = f"--synthetic-microbatches {args.synthetic_microbatches}"
    if args.data_parallel != 1:
        raise UsageError(f"{flag} gives one replica's microbatches: run it with data_parallel 1 "
                         f"(got {args.data_parallel})")
    from megatron_app.schedule import PipelineShape, ScheduleConfigError

    for number, iteration in enumerate(plan.iterations, 1):
        try:
            PipelineShape(args.pipeline_parallel, args.model_chunks, len(iteration))
        except ScheduleConfigError as error:
            raise UsageError(f"{flag}: iteration {number}'s {len(iteration)} microbatches: {error}") from None


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
        found = find_checkpoint(args.load, args.save)
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
    _refuse_unread_profiling_and_collector_options(args)
    if getattr(args, "trace_dir", None) is not None:
        if getattr(args, "no_trace", False):
            raise UsageError("--no-trace writes no trace: drop --trace-dir")
        if args.schedule == MEGATRON_SCHEDULE:
            raise UsageError("--schedule megatron runs Megatron-Core's own schedule, which writes no trace: drop "
                             "--trace-dir")
    for dest, default in _FILLED_DEFAULTS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, default)
    args.policy = running_policy_name(args)


def _given(value) -> bool:
    """Whether an option was given: not its unset default (None, or False for a switch). A 0 was given
    (`0 in (None, False)` is True in Python)."""
    return value is not None and value is not False


def _refuse_without(args: argparse.Namespace, switch: str, options: Mapping[str, str]) -> None:
    """Each option (dest -> its flag; None until given) given without the switch is refused: alone, Megatron-LM
    ignores it."""
    if getattr(args, switch, False):
        return
    given = [flag for dest, flag in options.items() if getattr(args, dest, None) is not None]
    if given:
        raise UsageError(f"{given[0]} takes effect with {_flag(switch)} (alone, Megatron-LM ignores it): give both")


_PROFILING_OPTIONS = {dest: _flag(dest) for dest in ("use_pytorch_profiler", "profile_step_start", "profile_step_end",
                                                     "profile_ranks")}
_COLLECTOR_OPTIONS = {"manual_gc_interval": "--manual-gc-interval", "manual_gc_eval": "--no-manual-gc-eval"}


def _refuse_unread_profiling_and_collector_options(args: argparse.Namespace) -> None:
    _refuse_without(args, "profile", _PROFILING_OPTIONS)
    _refuse_without(args, "manual_gc", _COLLECTOR_OPTIONS)
    if getattr(args, "manual_gc_interval", None) is not None and args.manual_gc_interval < 0:
        raise UsageError(f"--manual-gc-interval must be >= 0 (0: no collection between iterations), got "
                         f"{args.manual_gc_interval}")


def _check_profiling(args: argparse.Namespace) -> None:
    """Megatron-LM's profiling flags (profiling.py), once the layout and device are known."""
    if not args.profile:
        return
    start, end = args.profile_step_start, args.profile_step_end
    if start < 0 or end <= start:
        raise UsageError(f"--profile-step-start {start} and --profile-step-end {end}: profiling needs "
                         "0 <= start < end (steps counted from 0)")
    if start >= args.iters:
        raise UsageError(f"--profile-step-start {start}: a run of --iters {args.iters} has steps 0..{args.iters - 1} "
                         "(the log's iterations 1..N): nothing would be profiled")
    outside = [rank for rank in args.profile_ranks if not 0 <= rank < args.world_size]
    if outside:
        raise UsageError(f"--profile-ranks {outside[0]}: this run has global ranks 0..{args.world_size - 1}")
    if not args.use_pytorch_profiler:
        if args.device != "cuda":
            raise UsageError("--profile without --use-pytorch-profiler marks nsys's CUDA capture range: on "
                             f"--device {args.device} add --use-pytorch-profiler")
    elif args.tensorboard_dir is None and not writes_traces(args):
        raise UsageError("--use-pytorch-profiler writes into the run's trace directory: give --tensorboard-dir DIR "
                         "(this run writes no traces)")


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
    _read_synthetic_microbatches(args)   # before the batch size is derived: the file says it
    _resolve_virtual_stages(args)
    _refuse_mixed_training_length(args)
    _refuse_ignored_options(args)
    _derive_layout(args, environ)
    _resolve_vocab_size(args)
    _check_model_split(args)
    _check_architecture(args)
    _check_recompute(args)
    _check_synthetic_layout(args)
    _derive_microbatches(args)
    _resolve_training_length_in_samples(args)
    args.device = _resolve_device(args.device, check_only=args.check_config)
    if args.schedule == "megatron" and args.pipeline_parallel > 1 and args.device == "cpu":
        raise UsageError(
            "--schedule megatron with --pipeline_parallel > 1 needs CUDA (Megatron's p2p code is CUDA-only); "
            "use --schedule app|interleaved|1f1b on CPU")
    _check_precision(args)   # before the checkpoint check, which compares precisions
    _check_optimizer(args)
    _check_checkpointing(args)
    _check_variable_lengths(args)
    _check_planned_composition_options(args)
    _check_emulation(args)
    _check_loss(args)
    _check_memory_factor(args)
    _check_split_backward(args)
    _check_schedule_file(args)
    _check_profiling(args)
    _check_tensorboard(args)
    _check_outputs(args)
    return args


def _check_tensorboard(args: argparse.Namespace) -> None:
    """--tensorboard-dir's scalars (tensorboard_scalars.py) need the optional tensorboard package; without it the
    directory still takes --use-pytorch-profiler's traces (which need no package), and the run says so."""
    if getattr(args, "tensorboard_dir", None) is None or tensorboard_importable():
        return
    if not getattr(args, "use_pytorch_profiler", False):
        raise UsageError("--tensorboard-dir writes TensorBoard scalars, which need the tensorboard package: "
                         f"pip install -r {TENSORBOARD_REQUIREMENTS}")
    args.tensorboard_scalars_note = (f"--tensorboard-dir {args.tensorboard_dir} gets the profiler's traces only: "
                                     f"its scalars need the tensorboard package (pip install -r "
                                     f"{TENSORBOARD_REQUIREMENTS})")


def _check_outputs(args: argparse.Namespace) -> None:
    """Every path the run will write, now rather than at its first write (output_paths.py)."""
    from .output_paths import OutputPathError, check_outputs

    try:
        check_outputs(args, tracing=writes_traces(args))
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
            if _given(getattr(args, dest, None)):
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


def _check_optimizer(args: argparse.Namespace) -> None:
    """Adam's, clipping's and the learning-rate schedule's flags (Megatron-LM's meaning and the rules its
    OptimizerParamScheduler asserts), each in one line; a flag the chosen schedule would not read is refused."""
    for dest in ("clip_grad", "weight_decay", "lr_warmup_init", "min_lr", "start_weight_decay", "end_weight_decay"):
        if getattr(args, dest) is not None and not getattr(args, dest) >= 0.0:
            raise UsageError(f"{_flag(dest)} must be >= 0, got {getattr(args, dest)}")
    if args.weight_decay_incr_style == "constant":
        for dest in ("start_weight_decay", "end_weight_decay"):
            if getattr(args, dest) is not None:
                raise UsageError(f"{_flag(dest)} shapes a changing weight decay: give --weight-decay-incr-style "
                                 "linear or cosine (or --weight-decay alone for a constant one)")
    else:
        if args.start_weight_decay is None or args.end_weight_decay is None:
            raise UsageError(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay "
                             "and --end-weight-decay")
        if args.end_weight_decay < args.start_weight_decay:
            raise UsageError(f"--end-weight-decay {args.end_weight_decay} is below --start-weight-decay "
                             f"{args.start_weight_decay} (Megatron's schedule only increases it)")
        if args.weight_decay:
            raise UsageError("--weight-decay is a constant decay; --weight-decay-incr-style takes --start-weight-decay "
                             "and --end-weight-decay instead: drop it")
    for dest in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(args, dest) < 1.0:
            raise UsageError(f"{_flag(dest)} must be in [0, 1), got {getattr(args, dest)}")
    if not args.adam_eps > 0.0:
        raise UsageError(f"--adam-eps must be positive, got {args.adam_eps}")
    # The schedule's lengths in the run's unit: --lr-*-iters, or --lr-*-samples under --train-samples.
    unit, length_flag = ("samples", "--train-samples") if counts_samples(args) else ("iterations", "--iters")
    given = {what: getattr(args, schedule_dest(args, what)) for what in ("decay", "warmup", "wsd_decay")}
    style = args.lr_decay_style
    if given["decay"] is not None and given["decay"] < 1:
        raise UsageError(f"{schedule_flag(args, 'decay')} must be a positive integer, got {given['decay']}")
    if given["warmup"] is not None and args.lr_warmup_fraction is not None:
        raise UsageError(f"{schedule_flag(args, 'warmup')} and --lr-warmup-fraction both give the warm-up: drop one")
    if given["warmup"] is not None and given["warmup"] < 0:
        raise UsageError(f"{schedule_flag(args, 'warmup')} must be >= 0, got {given['warmup']}")
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction < 1.0:
        raise UsageError(f"--lr-warmup-fraction must be in [0, 1), got {args.lr_warmup_fraction}")
    if style == "constant":
        for flag, value in ((schedule_flag(args, "decay"), given["decay"]), ("--min-lr", args.min_lr)):
            if value:
                raise UsageError(f"{flag} shapes a decay; --lr-decay-style constant has none (give linear, "
                                 "cosine or inverse-square-root)")
    if style == "WSD":
        if given["wsd_decay"] is None:
            raise UsageError(f"--lr-decay-style WSD needs {schedule_flag(args, 'wsd_decay')} N (the anneal at the "
                             "decay's end)")
        args.lr_wsd_decay_style = args.lr_wsd_decay_style or "exponential"
    else:
        for flag, value in ((schedule_flag(args, "wsd_decay"), given["wsd_decay"]),
                            ("--lr-wsd-decay-style", args.lr_wsd_decay_style)):
            if value is not None:
                raise UsageError(f"{flag} shapes WSD's anneal: give --lr-decay-style WSD")
    if args.min_lr > args.lr:
        raise UsageError(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    warmup, decay, wsd = lr_schedule_lengths(args)
    if not warmup and args.lr_warmup_init:
        raise UsageError(f"--lr-warmup-init is where a warm-up starts; give {schedule_flag(args, 'warmup')} or "
                         "--lr-warmup-fraction")
    if args.lr_warmup_init > args.lr:
        raise UsageError(f"--lr-warmup-init {args.lr_warmup_init} is above --lr {args.lr}")
    if warmup and warmup >= decay:
        raise UsageError(f"the warm-up ({warmup:g} {unit}) must end before {schedule_flag(args, 'decay')} ({decay}, "
                         f"default {length_flag})")
    if style == "WSD" and not 0 < wsd <= decay - warmup:
        raise UsageError(f"{schedule_flag(args, 'wsd_decay')} {wsd} must be 1..{decay - warmup:g} (the decay's "
                         f"{decay} {unit}, default {length_flag}, after the warm-up's {warmup:g})")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise UsageError("--override-opt-param-scheduler takes this run's schedule, "
                         "--use-checkpoint-opt-param-scheduler the checkpoint's: give one")
    for dest in ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"):
        if getattr(args, dest) and not args.load:
            raise UsageError(f"{_flag(dest)} applies when resuming (--load)")


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
    from megatron_app.schedule import ScheduleConfigError
    from megatron_app.schedule.planned import check_memory_factor

    try:
        check_memory_factor(args.memory_factor)
    except ScheduleConfigError:
        raise UsageError(f"--memory-factor must be >= 1 (x Megatron's peak activation bytes), "
                         f"got {args.memory_factor}") from None
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
        args.composition = composition or default_composition(planned_by_our_runtime=False)
        return
    # Megatron's own schedule keeps Megatron's own layout.
    args.composition = composition or default_composition(planned_by_our_runtime=args.schedule != MEGATRON_SCHEDULE)
    if args.composition in PLANNED_COMPOSITIONS and args.schedule == MEGATRON_SCHEDULE:
        raise UsageError(f"--composition {args.composition} needs our schedule (--schedule app|interleaved|1f1b): the plan "
                         "comes from its runtime")
    if args.data_path is None and getattr(args, "synthetic_plan", None) is None:
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
