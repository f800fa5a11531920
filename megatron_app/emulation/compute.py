"""Compute emulation: model chunks whose forward and backward are timed waits, on the real runtime code path.

`--emulate-compute FWD_MS,BWD_MS[,JITTER]` swaps the GPT chunks for EmulatedChunk: a tiny MegatronModule that moves
real [seq, mbs, hidden] activations through Megatron's forward_step/backward_step, forward_backward_app and the
transport, but whose compute is a timed wait (blocks, no CPU). So schedules compare at P up to 8 on 2 cores without
CPU contention distorting the result.

Durations come from spec.TaskDurations (megatron_app.sim's own draws), so all schedules and the simulator meet the
same ones. The trainer's wiring (chunks from its flags, its loss function) is megatron_app.train.emulation.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Optional, Sequence, Tuple

import torch

from megatron.core.enums import ModelType
from megatron.core.transformer.module import MegatronModule

from megatron_app import weight_deferral
from megatron_app.devices import model_device
from megatron_app.schedule import Kind

from .spec import TaskDurations
from .wait import emulated_wait


class TimedScale(torch.autograd.Function):
    """y = x * weight; forward waits forward_s, backward waits input_grad_s + weight_grad_s, then returns both
    gradients. In a split backward's B it waits input_grad_s and returns grad_x, leaving grad_weight (after
    weight_grad_s) to W (weight_deferral.py). on_backward(start_s, end_s), when given, is told when a backward ran
    (monotonic seconds)."""

    @staticmethod
    def forward(ctx, x, weight, forward_s: float, input_grad_s: float, weight_grad_s: float = 0.0,
                on_backward=None):
        emulated_wait(forward_s)
        ctx.input_grad_s, ctx.weight_grad_s = input_grad_s, weight_grad_s
        ctx.on_backward = on_backward
        ctx.save_for_backward(x, weight)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        start = time.monotonic()
        x, weight = ctx.saved_tensors

        def weight_gradient():
            emulated_wait(ctx.weight_grad_s)
            return ((grad * x).sum(dim=tuple(range(grad.dim() - 1))),)

        deferred = weight_deferral.defers(ctx)
        if deferred:
            weight_deferral.defer(ctx, weight_gradient, (x, grad))
        emulated_wait(ctx.input_grad_s + (0.0 if deferred else ctx.weight_grad_s))
        grad_x = grad * weight if ctx.needs_input_grad[0] else None
        grad_weight = None if deferred else (grad * x).sum(dim=tuple(range(grad.dim() - 1)))
        if ctx.on_backward is not None:
            ctx.on_backward(start, time.monotonic())
        return grad_x, grad_weight, None, None, None, None


weight_deferral.register(TimedScale._backward_cls, lambda node: (1,) if weight_deferral.leads_to_weight(node, 1)
                         else ())


def tokens_to_activation(tokens: torch.Tensor, hidden_size: int, vocab_size: int) -> torch.Tensor:
    """[mbs, seq] token ids -> a [seq, mbs, hidden] activation (Megatron's layout), cheap and deterministic."""
    scaled = tokens.t().to(torch.float32).div(vocab_size).unsqueeze(-1)
    return scaled.expand(-1, -1, hidden_size).contiguous()


class EmulatedChunk(MegatronModule):
    """One model chunk whose compute is a timed wait. Exposes what the runtime and Megatron's step functions read:
    config, model_type, pre_process/post_process, vp_stage and set_input_tensor."""

    def __init__(self, config, durations: TaskDurations, pp_rank: int, chunk: int, pre_process: bool,
                 post_process: bool, vp_stage: Optional[int], vocab_size: int):
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder
        self.durations = durations
        self.pp_rank = pp_rank
        self.chunk = chunk
        self.pre_process = pre_process
        self.post_process = post_process
        self.vp_stage = vp_stage
        self.vocab_size = vocab_size
        self.weight = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=torch.float32))
        self.input_tensor: Optional[torch.Tensor] = None

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def forward(self, tokens: Optional[torch.Tensor], iteration: int, microbatch: int) -> torch.Tensor:
        if self.pre_process:
            x = tokens_to_activation(tokens, self.config.hidden_size, self.vocab_size)
        else:
            if self.input_tensor is None:
                raise RuntimeError(f"emulated chunk {self.chunk} on pipeline rank {self.pp_rank} got no input tensor")
            x = self.input_tensor
        seconds = self.durations.seconds
        # With a split backward the table holds B and W apart (W is 0 otherwise); the first virtual stage, which
        # does not split, waits both in its B.
        y = TimedScale.apply(x, self.weight,
                             seconds(iteration, self.pp_rank, Kind.FORWARD, self.chunk, microbatch),
                             seconds(iteration, self.pp_rank, Kind.BACKWARD, self.chunk, microbatch),
                             seconds(iteration, self.pp_rank, Kind.WEIGHT, self.chunk, microbatch))
        if self.post_process:
            return y.pow(2).mean(dim=-1).t().contiguous()   # per-token "loss", [mbs, seq] like GPTModel's
        return y


def emulated_forward_step(data_iterator, model: EmulatedChunk, loss_func: Callable):
    """forward_step_func body for emulated chunks: every chunk draws its microbatch's item, which names the
    (iteration, microbatch) whose duration to emulate; loss_func(loss_mask, output) is the trainer's."""
    from megatron.core.utils import get_attr_wrapped_model

    item = next(data_iterator)
    pre_process = get_attr_wrapped_model(model, "pre_process")
    device = model_device(model)
    tokens = item["tokens"].to(device) if pre_process else None
    output = model(tokens, item["iteration"], item["microbatch"])
    return output, lambda out: loss_func(item["loss_mask"].to(device), out)


def emulated_microbatches(num_microbatches: int, micro_batch_size: int, seq_length: int, vocab_size: int,
                          iterations: int,
                          lengths_of: Optional[Callable[[int], Optional[Sequence[int]]]] = None,
                          layouts_of: Optional[Callable[[int], Sequence[Tuple[int, int]]]] = None) -> Iterator[dict]:
    """Items for `iterations` iterations of `num_microbatches`: tokens, loss mask and the (iteration, microbatch).
    lengths_of(iteration), when given, sets each microbatch's sequence length (variable lengths: activations sized
    by tokens); otherwise every microbatch has seq_length tokens. layouts_of(iteration), when given, replaces both:
    the iteration's microbatches as (rows, sequence length) each, their count included (composed microbatches,
    asked for when the iteration's first item is drawn, after the loop planned them)."""
    for iteration in range(iterations):
        if layouts_of is not None:
            layouts = list(layouts_of(iteration))
        else:
            lengths = lengths_of(iteration) if lengths_of is not None else None
            layouts = [(micro_batch_size, seq_length if lengths is None else lengths[microbatch])
                       for microbatch in range(num_microbatches)]
        for microbatch, (rows, length) in enumerate(layouts):
            base = torch.arange(rows * length).view(rows, length)
            yield {"tokens": (base + microbatch) % vocab_size, "loss_mask": torch.ones(rows, length),
                   "iteration": iteration, "microbatch": microbatch}
