"""The compiled core's loss-emulation types, for the loss layer (megatron_app.lossy).

LossInjector runs a loss model inside the transport's receive path (Transport.attach_loss_injector); LossChannel
applies one to a tensor the caller owns (tensor-parallel collectives, python plug-ins). stale_family_of(tag) names
the stream whose previous message the "stale" fill reuses.
"""

from ._core import core

LossModelSpec = core.LossModelSpec
LossModelKind = core.LossModelKind
LossInjector = core.LossInjector
LossChannel = core.LossChannel
ElementKind = core.ElementKind


def stale_family_of(tag: int) -> int:
    return core.stale_family_of(tag)


__all__ = ["ElementKind", "LossChannel", "LossInjector", "LossModelKind", "LossModelSpec", "stale_family_of"]
