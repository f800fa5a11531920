"""What a rank receives from each torch.distributed collective, and lossy stand-ins for those collectives.

A stand-in runs the real collective, then hands the pieces this rank received to `deliver(pieces, place)`, which
passes them through a loss stream in place; `place` names the line that called the collective (what stale fill
needs: cross-entropy's three same-sized all-reduces are three different places). Pieces are what crossed the
network: the whole result of an all-reduce or a reduce-scatter (every element mixes in remote data), but only the
other ranks' parts of an all-gather or an all-to-all (a rank's own part never leaves it). With async_op=True the
pieces are delivered when the caller waits.

`module_view(real, overrides)` is a copy of a module with some names replaced: a megatron module whose global `torch`
is such a view sees `torch.distributed.all_reduce` as the stand-in, and everything else as the real torch.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import zlib
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

Piece = Tuple[torch.Tensor, int]  # (received tensor, index of the rank in the group it came from; 0 for reductions)


def _whole(tensor, group) -> List[Piece]:
    return [(tensor, 0)]


def _chunks_of_others(output, group) -> List[Piece]:
    """An all-gather's output: equal first-dimension chunks, one per rank in group order."""
    if not output.is_contiguous():
        return [(output, 0)]
    own, size = group.rank(), group.size()
    chunks = output.view(-1).chunk(size)
    return [(chunk, index) for index, chunk in enumerate(chunks) if index != own]


def _list_of_others(tensors, group) -> List[Piece]:
    own = group.rank()
    return [(tensor, index) for index, tensor in enumerate(tensors) if index != own]


def _splits_of_others(output, split_sizes, group) -> List[Piece]:
    """An all-to-all's output: first-dimension splits (equal without split sizes), one per source rank."""
    size = group.size()
    sizes = list(split_sizes) if split_sizes else [output.shape[0] // size] * size
    own = group.rank()
    return [(part, index) for index, part in enumerate(torch.split(output, sizes, dim=0)) if index != own]


# torch.distributed function -> (collective, argument names of what it delivers, how to cut that into pieces)
RECEIVERS: Dict[str, Tuple[str, Tuple[str, ...], Callable]] = {
    "all_reduce": ("all_reduce", ("tensor",), _whole),
    "reduce_scatter": ("reduce_scatter", ("output",), _whole),
    "reduce_scatter_tensor": ("reduce_scatter", ("output",), _whole),
    "_reduce_scatter_base": ("reduce_scatter", ("output",), _whole),
    "reduce_scatter_single": ("reduce_scatter", ("output",), _whole),
    "all_gather": ("all_gather", ("tensor_list",), _list_of_others),
    "all_gather_into_tensor": ("all_gather", ("output_tensor",), _chunks_of_others),
    "_all_gather_base": ("all_gather", ("output_tensor",), _chunks_of_others),
    "all_gather_single": ("all_gather", ("output_tensor",), _chunks_of_others),
    "all_to_all": ("all_to_all", ("output_tensor_list",), _list_of_others),
    "all_to_all_single": ("all_to_all", ("output", "output_split_sizes"), _splits_of_others),
}


def wrapped_collectives() -> Dict[str, Callable]:
    """name -> the real torch.distributed function, for those of RECEIVERS this torch has."""
    return {name: getattr(dist, name) for name in RECEIVERS if callable(getattr(dist, name, None))}


class _DeliverOnWait:
    """An async collective's handle: the pieces arrive (and lose packets) when the caller waits."""

    def __init__(self, work, deliver: Callable[[], None]):
        self._work = work
        self._deliver = deliver

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        deliver, self._deliver = self._deliver, None
        if deliver is not None:
            deliver()
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


def lossy_collective(name: str, original: Callable, route: Callable) -> Callable:
    """A stand-in for torch.distributed.<name>.

    route(collective, group) -> deliver(pieces, place) or None: None runs the real collective untouched (a group or
    a direction without loss); otherwise deliver is called on the received pieces once they are there, with place a
    32-bit id of the calling line.
    """
    collective, delivered, cut = RECEIVERS[name]
    signature = inspect.signature(original)

    @functools.wraps(original)
    def lossy(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        group = arguments.get("group")
        deliver = route(collective, group) if group is not None else None
        if deliver is None:
            return original(*args, **kwargs)
        caller = sys._getframe(1)
        place = zlib.crc32(f"{caller.f_code.co_filename}:{caller.f_lineno}".encode())
        result = original(*args, **kwargs)
        receive = functools.partial(deliver, cut(*(arguments.get(key) for key in delivered), group), place)
        if arguments.get("async_op"):
            return _DeliverOnWait(result, receive) if result is not None else receive()
        receive()
        return result

    return lossy


def module_view(real: types.ModuleType, overrides: Dict[str, object]) -> types.ModuleType:
    """A module object holding `real`'s names, with `overrides` in their place.

    A plain module (not a proxy class) so that attribute lookups cost what they cost on the real module and
    torch.compile treats it as a module; names `real` gains later are found through a module __getattr__.
    """
    view = types.ModuleType(real.__name__, real.__doc__)
    view.__dict__.update(vars(real))
    view.__dict__.update(overrides)
    view.__dict__["__getattr__"] = functools.partial(getattr, real)
    return view
