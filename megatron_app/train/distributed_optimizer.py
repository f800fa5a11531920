"""--use-distributed-optimizer: Megatron's distributed optimizer (ZeRO stage 1) on either device.

Each data-parallel rank keeps the fp32 main parameters and Adam's two moments of one contiguous 1/D of the model's
parameters (all of a pipeline and tensor rank's trainable parameters flattened in one order, cut into D equal
shards, as Megatron cuts its gradient buffer), steps only those, and the updated shards are all-gathered back into
every replica's parameters. Under --bf16 that is 12 of the 18 bytes a parameter takes without it spread over D; in fp32
the parameters are their own main copies, and Adam's 8 of 16 bytes are spread.

What differs from Megatron's (whose buffers are allocated on ``torch.cuda`` and need its DDP, optim.py says why we
have neither): the gradients are all-reduced as without the option (finalize_model_grads), not reduce-scattered, so
the traffic is the all-reduce's and every rank holds whole gradients; each rank then reads its shard of them. The
arithmetic is the unsharded optimizer's, element for element (Adam is elementwise); the clipping norm and the
overflow check add up the shards' parts across the data-parallel group, then across the model-parallel group.

A checkpoint holds the optimizer unsharded (data-parallel rank 0 gathers the shards and writes it), so a run can
resume under another data-parallel size; every rank then takes its own shard of it. The step's all-gather holds a
window of every shard at a time beside this rank's own shard; the checkpoint's gather puts each whole unsharded
tensor in data-parallel rank 0's host memory (what it writes).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import itertools

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from megatron_app.runtime.layout import data_parallel_group

from .optim import (AdamSettings, MixedPrecision, attach_main_grads, model_grad, param_groups, restore_grad_scaler,
                    saved_grad_scaler, skipped_for_overflow, trainable)


_WINDOW = 1 << 24   # elements of each shard all-gathered at once (D x 32 MiB in bf16): the step's transient memory


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that this rank's shard holds: elements [start, end) of the flattened parameter,
    at ``offset`` in the shard."""
    index: int      # the parameter's position in the optimizer's model_params
    start: int
    end: int
    offset: int


def shard_pieces(numels: Sequence[int], dp_rank: int, dp_size: int) -> Tuple[List[Piece], int]:
    """This rank's pieces of parameters of ``numels`` elements, flattened in order and cut into ``dp_size`` shards
    of equal size (the last one padded), and that size."""
    shard_size = max(1, math.ceil(sum(numels) / dp_size))
    low, high = dp_rank * shard_size, (dp_rank + 1) * shard_size
    pieces, offset = [], 0
    for index, numel in enumerate(numels):
        start, end = max(low, offset), min(high, offset + numel)
        if start < end:
            pieces.append(Piece(index, start - offset, end - offset, start - low))
        offset += numel
    return pieces, shard_size


def _group_size_and_rank(group) -> Tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class DistributedOptimizer:
    """AdamW over this data-parallel rank's shard of fp32 main parameters (fp32 or mixed-precision models alike);
    the same interface as optim.Fp32Optimizer and MixedPrecisionOptimizer."""

    state_dict_is_collective = True   # every replica calls state_dict (it gathers the shards)

    def __init__(self, chunks: List[torch.nn.Module], settings: AdamSettings, mixed: Optional[MixedPrecision]):
        self.model_params = trainable(chunks)
        dtypes = {param.dtype for param in self.model_params}
        if len(dtypes) != 1:
            raise ValueError(f"--use-distributed-optimizer needs the parameters in one precision, not {dtypes}")
        self.group = data_parallel_group(with_context_parallel=True)
        self.dp_size, self.dp_rank = _group_size_and_rank(self.group)
        self.numel = sum(param.numel() for param in self.model_params)
        self.pieces, self.shard_size = shard_pieces([param.numel() for param in self.model_params], self.dp_rank,
                                                    self.dp_size)
        # This rank's fp32 main parameters: its pieces of the model's parameters.
        # In fp32 a view of the parameter itself (the step updates it in place), else an fp32 copy.
        self.main_params = [self._main_of(self.model_params[piece.index], piece) for piece in self.pieces]
        self._starts = list(itertools.accumulate((param.numel() for param in self.model_params), initial=0))
        group_of = {}
        groups = param_groups(chunks, settings.weight_decay)
        for number, group in enumerate(groups):
            group_of.update({id(param): number for param in group["params"]})
        self.optimizer = settings.adamw([
            {**{key: value for key, value in group.items() if key != "params"},
             "params": [main for piece, main in zip(self.pieces, self.main_params)
                        if group_of[id(self.model_params[piece.index])] == number]}
            for number, group in enumerate(groups)])
        self.max_norm = settings.clip_grad
        self._counted = [param_is_not_shared(self.model_params[piece.index])
                         and param_is_not_tensor_parallel_duplicate(self.model_params[piece.index])
                         for piece in self.pieces]
        self.mixed = mixed
        self.grad_scaler = mixed.grad_scaler(self.model_params[0].device) if mixed is not None else None
        if mixed is not None:
            self._hooks = attach_main_grads(self.model_params, mixed)
        self.grad_norm: Optional[float] = None
        self.skipped_iterations = 0
        self.last_step_skipped = False

    @staticmethod
    def _flat(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view(-1)

    def _main_of(self, param: torch.nn.Parameter, piece: Piece) -> torch.Tensor:
        part = self._flat(param.data)[piece.start:piece.end]
        return part if param.dtype == torch.float32 else part.float().clone()

    def _bytes_per_element(self) -> int:
        """What the optimizer keeps for one parameter: Adam's two fp32 moments, and an fp32 main copy of a
        half-precision parameter."""
        return 8 if self.model_params[0].dtype == torch.float32 else 12

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def held_elements(self) -> int:
        """How many parameters' main copies and moments this rank holds (about numel / D)."""
        return sum(piece.end - piece.start for piece in self.pieces)

    def describe(self) -> str:
        """One line for the start of the log: what this rank holds."""
        mib = self._bytes_per_element() / 2 ** 20
        return (f"distributed optimizer: this rank keeps the fp32 main parameters and Adam state of "
                f"{self.held_elements():,} of its {self.numel:,} parameters ({self.held_elements() * mib:.1f} MiB instead of "
                f"{self.numel * mib:.1f}; data-parallel size {self.dp_size})")

    def get_loss_scale(self) -> float:
        return 1.0 if self.grad_scaler is None else float(self.grad_scaler.scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.grad_scaler.scale * loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.model_params:
            param.grad = None
            if self.mixed is not None:
                param.main_grad.zero_()
        for main in self.main_params:
            main.grad = None

    @torch.no_grad()
    def step(self) -> bool:
        """The unsharded optimizer's step on this rank's shard, then every replica's parameters from all shards.
        Returns whether the step was taken (an overflow under a loss scale skips it on every rank)."""
        for piece, main in zip(self.pieces, self.main_params):
            main.grad = self._flat(model_grad(self.model_params[piece.index]))[piece.start:piece.end].float()
        if self.mixed is not None:
            for param in self.model_params:
                param.grad = None
        if skipped_for_overflow(self):
            return False
        if self.max_norm > 0.0:
            self.grad_norm = self._clip()
        self.optimizer.step()
        self._gather_parameters()
        return True

    def _sum_over_replicas_and_model(self, value: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.dp_size > 1:
            dist.all_reduce(value, op=op, group=self.group)
        if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
            dist.all_reduce(value, op=op, group=parallel_state.get_model_parallel_group())
        return value

    def _grads(self) -> List[torch.Tensor]:
        return [main.grad for main in self.main_params]

    def _device(self) -> torch.device:
        return self.model_params[0].device

    def _unscale_and_check(self) -> bool:
        found_inf = torch.zeros(1, dtype=torch.float, device=self._device())
        grads = self._grads()
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf,
                                                             self.grad_scaler.inv_scale.to(self._device()))
        return bool(self._sum_over_replicas_and_model(found_inf, dist.ReduceOp.MAX).item() > 0)

    def _clip(self) -> float:
        """Megatron's clip_grad_norm over the shards: the squares of the counted pieces summed over the replicas'
        shards and the model-parallel ranks; every piece scaled by max_norm / (norm + 1e-6) when that is below 1."""
        counted = [grad for grad, counts in zip(self._grads(), self._counted) if counts]
        squares = torch.zeros(1, dtype=torch.float, device=self._device())
        if counted:
            squares += torch.stack(torch._foreach_norm(counted)).square().sum()
        norm = float(self._sum_over_replicas_and_model(squares).sqrt().item())
        coefficient = self.max_norm / (norm + 1.0e-6)
        if coefficient < 1.0 and self.main_params:
            torch._foreach_mul_(self._grads(), coefficient)
        return norm

    def _shard_of(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """This rank's pieces laid out as its shard (zeros in the padding)."""
        shard = torch.zeros(self.shard_size, dtype=dtype, device=self._device())
        for piece, tensor in zip(self.pieces, tensors):
            shard[piece.offset:piece.offset + piece.end - piece.start] = tensor
        return shard

    def _gather_parameters(self) -> None:
        """Every replica's updated shard, in the model's precision, copied into the parameters a window of each shard
        at a time."""
        shard = self._shard_of(self.main_params, self.model_params[0].dtype)
        if self.dp_size == 1:
            self._copy_into_parameters(0, shard[:self.numel])
            return
        for low in range(0, self.shard_size, _WINDOW):
            window = shard[low:low + _WINDOW]
            gathered = torch.empty(self.dp_size * len(window), dtype=window.dtype, device=window.device)
            dist.all_gather(list(gathered.split(len(window))), window, group=self.group)
            for replica, values in enumerate(gathered.split(len(window))):
                start = replica * self.shard_size + low
                self._copy_into_parameters(start, values[:max(0, min(len(values), self.numel - start))])

    def _copy_into_parameters(self, start: int, values: torch.Tensor) -> None:
        """values into the model's flattened parameters from element ``start`` on."""
        done = 0
        index = bisect.bisect_right(self._starts, start) - 1
        while done < len(values):
            param = self.model_params[index]
            within = start + done - self._starts[index]
            take = min(param.numel() - within, len(values) - done)
            self._flat(param.data)[within:within + take].copy_(values[done:done + take])
            done += take
            index += 1

    def report(self) -> dict:
        """For the iteration line and the JSON log, as the unsharded optimizers report."""
        report = {} if self.grad_norm is None else {"grad_norm": self.grad_norm}
        if self.mixed is not None:
            report.update(loss_scale=self.get_loss_scale(), skipped_iterations=self.skipped_iterations,
                          skipped=self.last_step_skipped)
        return report

    # ---- checkpoints: the optimizer unsharded, gathered on data-parallel rank 0 -----------------------------------
    def _moments(self, name: str) -> List[torch.Tensor]:
        return [self.optimizer.state.get(main, {}).get(name, torch.zeros_like(main)) for main in self.main_params]

    def _host_group(self):
        """A gloo group over the replicas for the checkpoint's host tensors: the run's own on CPU, Megatron's gloo copy
        of it under NCCL."""
        if dist.get_backend(self.group) == "gloo":
            return self.group
        return parallel_state.get_data_parallel_group_gloo(with_context_parallel=True)

    def _unsharded(self, pieces: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
        """The whole flat tensor on the host of data-parallel rank 0 (None elsewhere): a collective over the replicas,
        gathered straight into its place in the result."""
        shard = self._shard_of(pieces, torch.float32).cpu()
        if self.dp_size == 1:
            return shard[:self.numel]
        group = self._host_group()
        full = torch.empty(self.dp_size * self.shard_size) if self.dp_rank == 0 else None
        dist.gather(shard, list(full.split(self.shard_size)) if full is not None else None,
                    dst=dist.get_global_rank(group, 0), group=group)
        return full[:self.numel] if full is not None else None

    def state_dict(self) -> Optional[dict]:
        """Collective over the data-parallel group; the state on its rank 0, None on the others."""
        steps = [float(self.optimizer.state.get(main, {}).get("step", 0.0)) for main in self.main_params]
        kept = (("exp_avg", self._moments("exp_avg")), ("exp_avg_sq", self._moments("exp_avg_sq")))
        if self.model_params[0].dtype != torch.float32:   # fp32 main parameters are the model's, saved with it
            kept = (("main_params", self.main_params),) + kept
        unsharded = {name: self._unsharded(pieces) for name, pieces in kept}
        if self.dp_rank != 0:
            return None
        state = {"distributed": {"numel": self.numel, "step": max(steps, default=0.0), **unsharded},
                 "param_groups": [{key: value for key, value in group.items() if key != "params"}
                                  for group in self.optimizer.param_groups],
                 "skipped_iterations": self.skipped_iterations}
        if self.grad_scaler is not None:
            state["grad_scaler"] = saved_grad_scaler(self.grad_scaler)
        return state

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("distributed") if isinstance(state, dict) else None
        if saved is None:
            raise ValueError("the checkpoint's optimizer is not a distributed optimizer's")
        if saved["numel"] != self.numel:
            raise ValueError(f"the checkpoint's optimizer holds {saved['numel']} parameters, this rank's model "
                             f"{self.numel}")
        if len(state["param_groups"]) != len(self.optimizer.param_groups):
            raise ValueError(f"the checkpoint's optimizer has {len(state['param_groups'])} parameter groups, this "
                             f"run's {len(self.optimizer.param_groups)}")
        low = self.dp_rank * self.shard_size
        with torch.no_grad():
            for piece, main in zip(self.pieces, self.main_params):
                where = slice(low + piece.offset, low + piece.offset + piece.end - piece.start)
                if "main_params" in saved:
                    main.copy_(saved["main_params"][where])
                if saved["step"] > 0:
                    self.optimizer.state[main] = {
                        "step": torch.tensor(float(saved["step"])),
                        "exp_avg": saved["exp_avg"][where].to(main.device).clone(),
                        "exp_avg_sq": saved["exp_avg_sq"][where].to(main.device).clone()}
        for group, saved_group in zip(self.optimizer.param_groups, state["param_groups"]):
            group.update({key: value for key, value in saved_group.items() if key != "params"})
        self.skipped_iterations = int(state.get("skipped_iterations", 0))
        if self.grad_scaler is not None and "grad_scaler" in state:
            restore_grad_scaler(self.grad_scaler, state["grad_scaler"])

