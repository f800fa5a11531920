"""The Megatron-style forward step handed to a forward_backward function.

``forward_step(data_iterator, model) -> (output_tensor, loss_func)``; on the last stage
``loss_func(output_tensor)`` returns megatron-core 0.16's triple
``(loss_sum, num_tokens, {'lm loss': tensor([loss_sum, num_tokens])})``. With
``config.calculate_per_token_loss == False`` the schedule divides loss_sum by num_tokens and by the
number of microbatches before backward (schedules.forward_step_calc_loss).
"""

from __future__ import annotations

from functools import partial
from typing import Iterator, Optional

import torch

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.utils import get_attr_wrapped_model

from megatron_app.devices import model_device

from .attention import packed_documents
from .data import move_batch
from megatron_app.data.document_data import CU_SEQLENS


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked sum of per-token losses, token count, and the pair Megatron reports as 'lm loss'."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss_sum.detach().view(1), num_tokens.detach().view(1).float()])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(data_iterator: Optional[Iterator[dict]], model: torch.nn.Module):
    """Run one microbatch through one chunk.

    A chunk draws a batch only when it needs one: the first stage for tokens, the last for labels
    and loss mask. Middle chunks take their input from ``set_input_tensor`` (done by the schedule).
    """
    return _forward(data_iterator, model, every_chunk=False)


def packed_forward_step(data_iterator: Optional[Iterator[dict]], model: torch.nn.Module):
    """forward_step for packed microbatches: every chunk draws its batch, since every layer's attention needs the
    documents' bounds (cu_seqlens)."""
    return _forward(data_iterator, model, every_chunk=True)


def _forward(data_iterator, model, every_chunk: bool):
    pre_process = get_attr_wrapped_model(model, "pre_process")
    post_process = get_attr_wrapped_model(model, "post_process")
    batch = host_batch = None
    if pre_process or post_process or every_chunk:
        if data_iterator is None:
            raise ValueError("this chunk needs data but got no data iterator")
        device = model_device(model)
        host_batch = next(data_iterator)
        batch = move_batch(host_batch, device)

    tokens = batch["tokens"] if pre_process else None
    position_ids = batch["position_ids"] if pre_process else None
    labels = batch["labels"] if post_process else None
    packed_seq_params = packed_seq_params_of(batch, host_batch) if batch is not None else None
    # Only packed batches pass the keyword: a model (or stand-in) that knows no packing keeps working.
    packed = {} if packed_seq_params is None else {"packed_seq_params": packed_seq_params}
    output_tensor = model(tokens, position_ids, None, labels=labels, **packed)
    loss_mask = batch["loss_mask"] if post_process else None
    return output_tensor, partial(loss_func, loss_mask)


def packed_seq_params_of(batch: dict, host_batch: Optional[dict] = None) -> Optional[PackedSeqParams]:
    """Megatron's PackedSeqParams for a packed batch (None for a padded one). 'sbhd': our core attention takes the
    row as [t, 1, heads, dim]; the model's learned absolute positions come from the restarting position ids.
    The bounds are read as ints from ``host_batch`` (the batch before it moved to the device): no device sync."""
    bounds = batch.get(CU_SEQLENS)
    if bounds is None:
        return None
    host_bounds = (host_batch or batch)[CU_SEQLENS]
    return packed_documents(tuple(host_bounds.cpu().tolist()), bounds)
