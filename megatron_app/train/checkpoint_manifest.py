"""Where checkpoints live on disk and how a complete one is recognised (no torch here: the flag checks use it).

    SAVE_DIR/latest_iteration.txt              the newest complete checkpoint's iteration, written last
    SAVE_DIR/iter_0000020/manifest.json        iteration, layout, model shape, files; written after every rank file
    SAVE_DIR/iter_0000020/model_optim_rng_pp000_tp00.pt    one per (pipeline rank, tensor rank)

A directory without manifest.json is an unfinished save and is never loaded. Every file is written under a
temporary name and renamed into place, so a reader sees either the old file or the whole new one.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Optional

from .flags import completed, counts_samples, lr_schedule_lengths

SCHEMA = "megatron_app.checkpoint/1"
MANIFEST = "manifest.json"
TRACKER = "latest_iteration.txt"
LAYOUT_KEYS = ("pipeline_parallel", "model_chunks", "tensor_parallel")
MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size")
# The architecture flags, with the value a manifest from before they were recorded stands for.
ARCHITECTURE_DEFAULTS = {"normalization": "LayerNorm", "swiglu": False, "ffn_hidden_size": None,
                         "disable_bias_linear": False, "num_query_groups": None,
                         "position_embedding_type": "learned_absolute",
                         "untie_embeddings_and_output_weights": True,   # untied always, before it was recorded
                         "max_position_embeddings": None}   # --seq-length before it was recorded (check_compatible)
# What the run reads: resuming with other data or another length mode changes results without an error, so it is
# refused unless --allow-data-change-on-resume says the change is meant.
DATA_KEYS = ("data_path", "variable_seq_lengths", "synthetic_microbatches")
DATA_OVERRIDE_FLAG = "--allow-data-change-on-resume"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used for this run; the message is one line meant for the user."""


RANK_FILE_STEM = "model_optim_rng_"
_ITERATION_DIR = re.compile(r"^iter_\d{7}$")


def iteration_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def rank_file_name(pp_rank: int, tp_rank: int) -> str:
    return f"{RANK_FILE_STEM}pp{pp_rank:03d}_tp{tp_rank:02d}.pt"


def describe_layout(values: dict) -> str:
    return " ".join(f"{key}={values[key]}" for key in LAYOUT_KEYS)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """Write a sibling temporary file, flush it to disk, rename it over ``path``."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def manifest_for(args, iteration: int, consumed_samples: int, files) -> dict:
    values = vars(completed(args))
    return {
        "schema": SCHEMA,
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "layout": {key: values[key] for key in LAYOUT_KEYS + ("data_parallel",)},
        "model": {**{key: values[key] for key in MODEL_KEYS}, "precision": values["precision"],
                  **{key: values[key] for key in ARCHITECTURE_DEFAULTS}},
        "training": {"global_batch_size": args.global_batch_size, "micro_batch_size": args.micro_batch_size,
                     "seed": args.seed, "iters": args.iters, **data_identity(args),
                     "lr_schedule": schedule_identity(args),
                     "use_distributed_optimizer": bool(values["use_distributed_optimizer"])},
        "files": sorted(files),
    }


def schedule_identity(args) -> dict:
    """The learning-rate schedule and weight decay a run trains with (what a resumed run must agree on); the decay's
    length and floor only where there is a decay (a constant lr may go on past the --iters it was saved with)."""
    args = completed(args)
    warmup, decay, wsd = lr_schedule_lengths(args)
    identity = {"lr": args.lr, "lr_decay_style": args.lr_decay_style, "lr_warmup_iters": warmup,
                "lr_warmup_init": args.lr_warmup_init, "weight_decay": args.weight_decay}
    if counts_samples(args):   # the lengths below are samples (absent: iterations, as every run before it was kept)
        identity["schedule_counts"] = "samples"
    if args.weight_decay_incr_style != "constant":
        identity.update(weight_decay_incr_style=args.weight_decay_incr_style,
                        start_weight_decay=args.start_weight_decay, end_weight_decay=args.end_weight_decay)
    if args.lr_decay_style != "constant":
        identity.update(lr_decay_iters=decay, min_lr=args.min_lr)
    if args.lr_decay_style == "WSD":
        identity.update(lr_wsd_decay_iters=wsd, lr_wsd_decay_style=args.lr_wsd_decay_style)
    return identity


# How a schedule field reads as the flag that sets it.
_SCHEDULE_FLAGS = {"lr": "--lr", "lr_decay_style": "--lr-decay-style", "lr_warmup_iters": "--lr-warmup-iters",
                   "lr_warmup_init": "--lr-warmup-init", "weight_decay": "--weight-decay",
                   "lr_decay_iters": "--lr-decay-iters", "min_lr": "--min-lr",
                   "lr_wsd_decay_iters": "--lr-wsd-decay-iters", "lr_wsd_decay_style": "--lr-wsd-decay-style",
                   "weight_decay_incr_style": "--weight-decay-incr-style",
                   "start_weight_decay": "--start-weight-decay", "end_weight_decay": "--end-weight-decay"}


def _check_schedule(found: "FoundCheckpoint", args) -> None:
    """A resumed run keeps its checkpoint's learning-rate schedule unless one of the two flags says otherwise (a
    manifest from before schedules were recorded trained at a constant --lr: that alone is compared)."""
    if args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return
    here = schedule_identity(args)
    # such a manifest did not record its --lr either: only the rest of a constant schedule is compared
    saved = found.manifest.get("training", {}).get("lr_schedule") or {
        "lr": here["lr"], "lr_decay_style": "constant", "lr_warmup_iters": 0, "lr_warmup_init": 0.0,
        "weight_decay": 0.0}
    for key, flag in _SCHEDULE_FLAGS.items():
        if saved.get(key) != here.get(key):
            shown = "none" if saved.get(key) is None else saved[key]
            raise CheckpointError(
                f"checkpoint {found.directory} was trained with {flag} {shown} but this run has "
                f"{'none' if here.get(key) is None else here[key]}; give --override-opt-param-scheduler to use this "
                "run's learning-rate flags or --use-checkpoint-opt-param-scheduler to keep the checkpoint's")


def _absolute_data_path(items):
    """--data-path with each prefix made absolute (a resume from another directory names the same files); the
    weights of a WEIGHT PREFIX list stay as given."""
    if items is None:
        return None
    items = [str(item) for item in items]
    weighted = len(items) % 2 == 0  # Megatron's convention: an even-length list is WEIGHT PREFIX pairs
    return [item if weighted and index % 2 == 0 else os.path.abspath(item) for index, item in enumerate(items)]


def data_identity(args) -> dict:
    synthetic = completed(args).synthetic_microbatches
    return {"data_path": _absolute_data_path(args.data_path),
            "variable_seq_lengths": bool(completed(args).variable_seq_lengths),
            "synthetic_microbatches": None if synthetic is None else os.path.abspath(synthetic)}


def _describe_data(key: str, value) -> str:
    if key == "data_path":
        return "--data-path " + (" ".join(str(item) for item in value) if value else "(mock data)")
    if key == "synthetic_microbatches":
        return f"--synthetic-microbatches {value}" if value else "no --synthetic-microbatches"
    return f"--variable-seq-lengths {'on' if value else 'off'}"


def commit(save_dir: str, manifest: dict) -> None:
    """Make a save visible: its manifest (all rank files must exist), then the tracker. Rank 0 only."""
    directory = iteration_dir(save_dir, manifest["iteration"])
    missing = [name for name in manifest["files"] if not os.path.isfile(os.path.join(directory, name))]
    if missing:
        raise CheckpointError(f"cannot commit {directory}: rank files missing: {', '.join(missing)}")
    write_atomic(os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1).encode())
    write_atomic(os.path.join(save_dir, TRACKER), f"{manifest['iteration']}\n".encode())


@dataclass(frozen=True)
class FoundCheckpoint:
    directory: str
    manifest: dict

    @property
    def iteration(self) -> int:
        return int(self.manifest["iteration"])

    @property
    def consumed_samples(self) -> int:
        return int(self.manifest["consumed_samples"])


def _read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointError(f"{directory} has no {MANIFEST}: its save never finished; it cannot be loaded")
    try:
        with open(path) as handle:
            manifest = json.load(handle)
        schema = manifest["schema"]
        for key in ("iteration", "consumed_samples", "layout", "model", "files"):
            manifest[key]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a megatron_app checkpoint manifest ({exc})") from None
    name, _, version = str(schema).partition("/")
    if (name, version.split(".")[0]) != tuple(SCHEMA.split("/")):
        raise CheckpointError(f"{path} has schema {schema!r}; this version reads {SCHEMA}")
    return manifest


def find_checkpoint(load_dir: str, save_dir: Optional[str] = None) -> Optional[FoundCheckpoint]:
    """The checkpoint ``--load DIR`` means: DIR itself when it holds a manifest (one iteration's directory),
    else the iteration DIR's tracker names; None when DIR has neither (nothing saved there yet), or does not exist
    yet but is the run's --save directory too (Megatron-LM's `--save DIR --load DIR`: the first run starts fresh)."""
    if not os.path.isdir(load_dir):
        if save_dir is not None and not os.path.exists(load_dir) and \
                os.path.abspath(load_dir) == os.path.abspath(save_dir):
            return None
        raise CheckpointError(f"--load {load_dir} is not a directory (one that is also --save may not exist yet)")
    if os.path.isfile(os.path.join(load_dir, MANIFEST)):
        return FoundCheckpoint(load_dir, _read_manifest(load_dir))
    tracker = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(tracker):
        if _ITERATION_DIR.match(os.path.basename(os.path.normpath(load_dir))) or \
                any(name.startswith(RANK_FILE_STEM) for name in os.listdir(load_dir)):
            _read_manifest(load_dir)  # one iteration's directory without its manifest: refused, not skipped
        return None
    with open(tracker) as handle:
        text = handle.read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker} should hold an iteration number, found {text[:40]!r}")
    directory = iteration_dir(load_dir, int(text))
    return FoundCheckpoint(directory, _read_manifest(directory))


def check_compatible(found: FoundCheckpoint, args) -> None:
    """Refuse a checkpoint of another parallel layout or model shape (resharding is not supported)."""
    values = vars(completed(args))
    saved = found.manifest["layout"]
    here = {key: values[key] for key in LAYOUT_KEYS}
    if any(saved.get(key) != here[key] for key in LAYOUT_KEYS):
        raise CheckpointError(
            f"checkpoint {found.directory} was saved with {describe_layout(saved)} but this run has "
            f"{describe_layout(here)}; resume with the checkpoint's layout")
    for key in MODEL_KEYS:
        if found.manifest["model"].get(key) != values[key]:
            raise CheckpointError(
                f"checkpoint {found.directory} has {key}={found.manifest['model'].get(key)} but this run has "
                f"--{key.replace('_', '-')} {values[key]}")
    for key, default in ARCHITECTURE_DEFAULTS.items():
        saved_value = found.manifest["model"].get(key, default)
        if key == "max_position_embeddings" and saved_value is None:   # before it was recorded: the sequence's
            saved_value = found.manifest["model"].get("seq_length")
        here_value = values[key]
        if default is None and None in (saved_value, here_value):   # derived (4h, --seq-length, ...): not recorded,
            continue                                                # or a driver's args validate() did not fill
        if saved_value != here_value:
            raise CheckpointError(
                f"checkpoint {found.directory} has {key}={saved_value} but this run has "
                f"--{key.replace('_', '-')} {here_value}")
    # The optimizer's state differs (fp32 main parameters and the loss scale under --bf16 / --fp16): refused, as the
    # layout is. Manifests from before precision was recorded are fp32's.
    saved_precision, precision = found.manifest["model"].get("precision", "fp32"), values["precision"]
    if saved_precision != precision:
        flag = {"fp32": "neither --bf16 nor --fp16"}.get(precision, f"--{precision}")
        raise CheckpointError(f"checkpoint {found.directory} was trained in {saved_precision} but this run has {flag}; "
                              f"resume in {saved_precision}")
    _check_schedule(found, completed(args))
    saved_training = found.manifest.get("training", {})
    # The optimizer's state is saved in its own form (unsharded either way, but not interchangeable yet).
    saved_distributed = bool(saved_training.get("use_distributed_optimizer", False))
    if saved_distributed != bool(values["use_distributed_optimizer"]):
        raise CheckpointError(f"checkpoint {found.directory} was saved {'with' if saved_distributed else 'without'} "
                              f"--use-distributed-optimizer; resume {'with' if saved_distributed else 'without'} it")
    here_data = data_identity(args)
    for key in DATA_KEYS:
        if key not in saved_training or values["allow_data_change_on_resume"]:
            continue  # a manifest from before the key was recorded, or a change the user asked for
        saved = (_absolute_data_path(saved_training[key]) if key == "data_path" else saved_training[key]
                 if key == "synthetic_microbatches" else bool(saved_training[key]))
        if saved != here_data[key]:
            raise CheckpointError(
                f"checkpoint {found.directory} was trained with {_describe_data(key, saved)} but this run has "
                f"{_describe_data(key, here_data[key])}; resume with the same, or pass {DATA_OVERRIDE_FLAG}")
    if found.iteration >= args.iters:
        length = f"--train-samples {args.train_samples} make {args.iters} iterations" if counts_samples(args) else \
            f"--iters is {args.iters}"
        raise CheckpointError(f"checkpoint {found.directory} is at iteration {found.iteration}, and {length}: nothing "
                              f"left to train (raise {'--train-samples' if counts_samples(args) else '--iters'})")
