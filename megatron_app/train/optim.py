"""Optimizer and the end-of-iteration gradient finalisation.

Megatron-Core's optimizer (get_megatron_optimizer) needs chunks wrapped in its
DistributedDataParallel, whose grad buffers are allocated with ``torch.cuda.current_device()`` and
so cannot exist on CPU. We therefore use torch.optim.Adam on plain ``param.grad`` and do the
data-parallel all-reduce in ``finalize_model_grads``, which the schedules call through
``config.finalize_model_grads_func`` after the last backward (the same hook Megatron uses). The
same path runs on CUDA, so CPU and GPU runs use identical arithmetic.

Mixed precision (--bf16 / --fp16) follows Megatron's DistributedDataParallel with
``grad_reduce_in_fp32`` and its Float16OptimizerWithFloat16Params step for step, on either device (theirs refuses
CPU tensors by type name and allocates on ``torch.cuda``): each half-precision parameter gets a ``main_grad`` (fp32
under --bf16 or --accumulate-allreduce-grads-in-fp32) that a hook adds every microbatch's gradient into, so
accumulation over microbatches and the data-parallel all-reduce run in that precision; Adam steps fp32 main copies
of the parameters (its state fp32 too) and the step copies them back into the model. The loss scale is Megatron's
own grad scaler (dynamic under --fp16 unless --loss-scale): the schedules scale the loss through
``config.grad_scale_func`` as in Megatron, the step unscales, and an iteration whose gradients overflow on any
model-parallel rank is skipped everywhere.

Both optimizers are AdamW as Megatron-Core falls back to it without Transformer Engine or Apex (torch.optim.AdamW:
decoupled weight decay; with --weight-decay 0 the same steps as Adam), biases and 1-D parameters without weight decay
(Megatron-Core's default rule, wd_mult 0), and both clip as Megatron's optimizers do under --clip-grad: after the
gradients are final (reduced, unscaled, checked), the global L2 norm over the model-parallel group, counting a
tensor-parallel duplicate once (Megatron's get_grad_norm_fp32 and its duplicate rule), scales them by
clip / (norm + 1e-6) when that is below 1. The learning rate and weight decay of each step: lr_schedule.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core import parallel_state
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from megatron_app.runtime.layout import data_parallel_group, embedding_group, pipeline_group

from .names import unwrap_chunk

from .flags import completed


def trainable(model: List[torch.nn.Module]) -> List[torch.nn.Parameter]:
    return [p for chunk in model for p in chunk.parameters() if p.requires_grad]


@dataclass(frozen=True)
class AdamSettings:
    """What the optimizer flags ask (Megatron-LM's meaning); lr is the schedule's peak (lr_schedule.py sets each
    step's)."""

    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 0.0       # 0: no clipping

    @classmethod
    def from_args(cls, args) -> "AdamSettings":
        from .lr_schedule import end_weight_decay

        args = completed(args)
        # the largest decay the run reaches decides the groups (lr_schedule sets each step's)
        return cls(args.lr, end_weight_decay(args), (args.adam_beta1, args.adam_beta2), args.adam_eps,
                   args.clip_grad)

    def adamw(self, groups) -> torch.optim.AdamW:
        return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


def param_groups(chunks: List[torch.nn.Module], weight_decay: float) -> List[dict]:
    """The trainable parameters in groups: one group without weight decay (the layout a checkpoint without it has);
    with it, Megatron-Core's default rule: biases and 1-D parameters (norms) get none (wd_mult 0, which the
    scheduler multiplies in)."""
    named = [(name, param) for chunk in chunks for name, param in chunk.named_parameters() if param.requires_grad]
    if not weight_decay:
        return [{"params": [param for _, param in named], "wd_mult": 1.0}]
    decayed = [param for name, param in named if not (name.endswith(".bias") or param.dim() == 1)]
    exempt = [param for name, param in named if name.endswith(".bias") or param.dim() == 1]
    return [group for group in ({"params": decayed, "wd_mult": 1.0}, {"params": exempt, "wd_mult": 0.0})
            if group["params"]]


class GlobalNormClipper:
    """Megatron's clip_grad_norm for one model's parameters: the L2 norm of every model-parallel rank's gradients (a
    tensor-parallel duplicate or a shared parameter counted once, decided once here), all of them scaled by
    max_norm / (norm + 1e-6) when that is below 1."""

    def __init__(self, model_params: List[torch.nn.Parameter], max_norm: float):
        self.max_norm = max_norm
        self._counted = [param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param)
                         for param in model_params]
        self._group = parallel_state.get_model_parallel_group() if parallel_state.model_parallel_is_initialized() \
            else None

    def __call__(self, grads: List[Optional[torch.Tensor]]) -> float:
        """Clips ``grads`` (grads[i] belongs to model_params[i]; None: no gradient) in place; returns the norm before
        clipping."""
        from .cpu_compat import CudaDeviceToCpu

        present = [grad for grad in grads if grad is not None]
        counted = [grad for grad, counts in zip(grads, self._counted) if counts and grad is not None]
        # One tensor of per-parameter norms (one kernel, as torch's clip_grad_norm_): without Apex or Transformer
        # Engine Megatron's fallback would read every parameter's norm to the host, a device sync each on CUDA.
        per_parameter = [torch.stack(torch._foreach_norm(counted))] if counted else []
        # get_grad_norm_fp32 makes its buffers with device='cuda'; on CPU they go to the CPU.
        on_cuda = bool(present) and present[0].device.type == "cuda"
        with contextlib.nullcontext() if on_cuda else CudaDeviceToCpu():
            norm = float(get_grad_norm_fp32(per_parameter, grad_stats_parallel_group=self._group))
        coefficient = self.max_norm / (norm + 1.0e-6)
        if coefficient < 1.0:
            torch._foreach_mul_(present, coefficient)   # Megatron's clip_grad_by_total_norm_fp32 (it asserts CUDA)
        return norm


class Fp32Optimizer:
    """AdamW on the fp32 parameters' own gradients, clipped first under --clip-grad (Megatron's FP32Optimizer)."""

    def __init__(self, chunks: List[torch.nn.Module], settings: AdamSettings):
        self.model_params = trainable(chunks)
        self.optimizer = settings.adamw(param_groups(chunks, settings.weight_decay))
        self.clip = GlobalNormClipper(self.model_params, settings.clip_grad) if settings.clip_grad > 0.0 else None
        self.grad_norm: Optional[float] = None

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> bool:
        if self.clip is not None:
            self.grad_norm = self.clip([param.grad for param in self.model_params])
        self.optimizer.step()
        return True

    def report(self) -> dict:
        """For the iteration line and the JSON log: the gradients' norm before clipping (under --clip-grad)."""
        return {} if self.grad_norm is None else {"grad_norm": self.grad_norm}

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def model_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """A parameter's accumulated gradient: its ``main_grad`` under mixed precision (Megatron's DDP keeps it there),
    else ``.grad``."""
    return param.main_grad if hasattr(param, "main_grad") else param.grad


@dataclass(frozen=True)
class MixedPrecision:
    """What --bf16 / --fp16 and the loss-scale flags ask of the optimizer (Megatron-LM's meaning)."""

    accumulate_in_fp32: bool             # main_grad fp32 (always under bf16), else in the parameters' precision
    loss_scale: Optional[float] = None   # a constant scale
    dynamic: Optional[dict] = None       # DynamicGradScaler's arguments (fp16 without --loss-scale)

    @classmethod
    def from_args(cls, args) -> Optional["MixedPrecision"]:
        args = completed(args)
        precision = args.precision
        if precision == "fp32":
            return None
        dynamic = None
        if precision == "fp16" and args.loss_scale is None:
            dynamic = {"initial_scale": args.initial_loss_scale, "min_scale": args.min_loss_scale,
                       "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": args.loss_scale_window,
                       "hysteresis": args.hysteresis}
        return cls(bool(args.accumulate_allreduce_grads_in_fp32) or precision == "bf16", args.loss_scale, dynamic)

    def grad_scaler(self, device: torch.device):
        """Megatron's grad scaler for this run (None: no loss scale), its tensors on ``device``."""
        from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

        from .cpu_compat import CudaDeviceToCpu

        if self.loss_scale is None and self.dynamic is None:
            return None
        # The scalers create their tensors with device='cuda'; on CPU that is sent to the CPU.
        with CudaDeviceToCpu() if device.type != "cuda" else contextlib.nullcontext():
            if self.dynamic is not None:
                return DynamicGradScaler(**self.dynamic)
            return ConstantGradScaler(self.loss_scale)


def _accumulate_main_grad(param: torch.nn.Parameter) -> None:
    """Megatron DDP's gradient hook: add this microbatch's gradient into main_grad, and free it."""
    param.main_grad.add_(param.grad)
    param.grad = None


def attach_main_grads(params: List[torch.nn.Parameter], mixed: "MixedPrecision") -> list:
    """Give each parameter a zeroed ``main_grad`` (fp32 when the run accumulates in fp32, else the parameter's
    precision) and the hook that adds each microbatch's gradient into it; returns the hooks' handles."""
    grad_dtype = torch.float32 if mixed.accumulate_in_fp32 else None
    hooks = []
    for param in params:
        param.main_grad = torch.zeros_like(param, dtype=grad_dtype or param.dtype)
        hooks.append(param.register_post_accumulate_grad_hook(_accumulate_main_grad))
    return hooks


def skipped_for_overflow(optimizer) -> bool:
    """Megatron's loss-scale rule at a step of an optimizer with a grad_scaler (None: no loss scale) and an
    _unscale_and_check: unscale and check its gradients, update the scale, count an overflowing iteration as skipped.
    Returns whether this step is skipped. Also clears the step's report (its norm, whether it was skipped)."""
    optimizer.last_step_skipped = False
    optimizer.grad_norm = None
    if optimizer.grad_scaler is None:
        return False
    found_inf = optimizer._unscale_and_check()
    optimizer.grad_scaler.update(found_inf)
    if found_inf:
        optimizer.skipped_iterations += 1
        optimizer.last_step_skipped = True
    return found_inf


def saved_grad_scaler(grad_scaler) -> dict:
    """Megatron's grad scaler's state, its tensors copied (what restore_grad_scaler takes back)."""
    return {key: value.detach().clone() if torch.is_tensor(value) else value
            for key, value in grad_scaler.state_dict().items()}


def restore_grad_scaler(grad_scaler, saved: dict) -> None:
    """Megatron's grad scaler from a saved state (its own load_state_dict moves the scale with .cuda(): not on
    CPU)."""
    grad_scaler._scale = saved["scale"].to(grad_scaler.scale.device)
    if hasattr(grad_scaler, "_growth_tracker"):
        grad_scaler._growth_tracker = saved["growth_tracker"]
        grad_scaler._hysteresis_tracker = saved["hysteresis_tracker"]


class MixedPrecisionOptimizer:
    """Adam on fp32 main copies of half-precision parameters (Megatron's Float16OptimizerWithFloat16Params), with
    main_grad accumulation (its DistributedDataParallel). Also what the log reports: the loss scale and the iterations
    skipped for an overflow."""

    def __init__(self, chunks: List[torch.nn.Module], settings: AdamSettings, mixed: MixedPrecision):
        self.model_params = trainable(chunks)
        self.main_params = [param.detach().clone().float() for param in self.model_params]
        main_of = {id(param): main for param, main in zip(self.model_params, self.main_params)}
        groups = param_groups(chunks, settings.weight_decay)
        self.optimizer = settings.adamw([{**group, "params": [main_of[id(p)] for p in group["params"]]}
                                         for group in groups])
        self.clip = GlobalNormClipper(self.model_params, settings.clip_grad) if settings.clip_grad > 0.0 else None
        self.grad_norm: Optional[float] = None
        self.grad_scaler = mixed.grad_scaler(self.model_params[0].device)
        self._hooks = attach_main_grads(self.model_params, mixed)
        self.skipped_iterations = 0
        self.last_step_skipped = False

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def get_loss_scale(self) -> float:
        return 1.0 if self.grad_scaler is None else float(self.grad_scaler.scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``config.grad_scale_func``: the schedules' backward starts from loss x scale (Megatron's scale_loss)."""
        return self.grad_scaler.scale * loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param, main in zip(self.model_params, self.main_params):
            param.main_grad.zero_()
            param.grad = None
            main.grad = None

    @torch.no_grad()
    def step(self) -> bool:
        """Megatron's step: main grads from main_grad, unscaled and checked for overflow (the iteration is skipped,
        and the scale updated, when any model-parallel rank overflowed), Adam on the fp32 main parameters, then the
        model's parameters from them. Returns whether the step was taken."""
        for param, main in zip(self.model_params, self.main_params):
            main.grad = param.main_grad.float()
            param.grad = None
        if skipped_for_overflow(self):
            return False
        if self.clip is not None:
            self.grad_norm = self.clip([main.grad for main in self.main_params])
        self.optimizer.step()
        for param, main in zip(self.model_params, self.main_params):
            param.copy_(main)
        return True

    def _unscale_and_check(self) -> bool:
        grads = [main.grad for main in self.main_params]
        found_inf = torch.zeros(1, dtype=torch.float, device=grads[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf,
                                                         self.grad_scaler.inv_scale.to(grads[0].device))
        if dist.is_initialized():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=parallel_state.get_model_parallel_group())
        return bool(found_inf.item() > 0)

    def report(self) -> dict:
        """For the iteration line and the JSON log."""
        return {"loss_scale": self.get_loss_scale(), "skipped_iterations": self.skipped_iterations,
                "skipped": self.last_step_skipped, **({} if self.grad_norm is None else {"grad_norm": self.grad_norm})}

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict(),
                 "fp32_from_fp16_params": [main.detach().clone() for main in self.main_params],
                 "skipped_iterations": self.skipped_iterations}
        if self.grad_scaler is not None:
            state["grad_scaler"] = saved_grad_scaler(self.grad_scaler)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for main, saved in zip(self.main_params, state["fp32_from_fp16_params"]):
                main.copy_(saved)
        self.skipped_iterations = int(state.get("skipped_iterations", 0))
        if self.grad_scaler is not None and "grad_scaler" in state:
            restore_grad_scaler(self.grad_scaler, state["grad_scaler"])


def finalize_model_grads(model: List[torch.nn.Module], num_tokens: Optional[torch.Tensor] = None,
                         pg_collection=None, force_all_reduce: Optional[bool] = False) -> None:
    """Megatron's finalize_model_grads contract without its DDP: average (or, with per-token loss,
    sum then divide by the global token count) every gradient over the data-parallel group.

    With tied embedding and output weights (Megatron-LM's default) the pipeline's first and last stage each hold a
    copy of the weight, and their gradients are summed over the embedding group first, as Megatron's
    _allreduce_word_embedding_grads does, so both copies take the same step. Sequence parallelism is off, so there is
    no layernorm all-reduce to do.
    """
    params = trainable(model)
    for param in params:
        if model_grad(param) is None:  # every DP rank must contribute a tensor of the same layout
            param.grad = torch.zeros_like(param)
    _sum_tied_embedding_grads(model, pg_collection)
    dp_group = data_parallel_group(pg_collection, with_context_parallel=True)
    dp_size = dist.get_world_size(dp_group)

    if num_tokens is not None:
        pp_group = pipeline_group(pg_collection=pg_collection)
        dist.broadcast(num_tokens, src=dist.get_process_group_ranks(pp_group)[-1], group=pp_group)
        dist.all_reduce(num_tokens, group=dp_group)
        scale = 1.0 / max(int(num_tokens.item()), 1)
    else:
        scale = 1.0 / dp_size

    if dp_size == 1 and scale == 1.0:
        return
    grads = [model_grad(p) for p in params]   # main_grad under mixed precision: reduced in its precision
    flat = _flatten_dense_tensors(grads)  # one collective instead of one per parameter
    if dp_size > 1:
        dist.all_reduce(flat, group=dp_group)
    flat.mul_(scale)
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)


def tied_embedding_copy(chunk: torch.nn.Module) -> Optional[torch.nn.Parameter]:
    """The chunk's copy of a tied embedding and output weight that another pipeline stage holds too: the first
    stage's word embedding or the last stage's output weight. None when the chunk holds none, or holds both ends
    (one pipeline stage: one parameter, whose gradient already sums both uses)."""
    module = unwrap_chunk(chunk)
    if not getattr(module, "share_embeddings_and_output_weights", False) or module.pre_process == module.post_process:
        return None
    return module.shared_embedding_or_output_weight()


def _sum_tied_embedding_grads(model: List[torch.nn.Module], pg_collection=None) -> None:
    copies = [weight for weight in map(tied_embedding_copy, model) if weight is not None]
    if not copies:
        return
    group = embedding_group(pg_collection)
    if group is None or dist.get_world_size(group) == 1:
        return
    for weight in copies:
        dist.all_reduce(model_grad(weight), group=group)
