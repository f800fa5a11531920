"""Loss on pipeline traffic (activations forward, gradients backward) of the runtime's Transport.

Built-in models run inside the transport's C++ receive path (a LossInjector attached with
Transport.attach_loss_injector: one stream per sending peer and direction, applied where every backend publishes a
complete message). A python plug-in runs on the receiving thread when the runtime takes a message
(PluginLossTransport, a TransportWrapper whose arrival filter applies it). Either way only payload bytes change.

The trainer calls configure() before the first forward_backward and registers attach_configured_loss() as a
transport wrapper of the runtime (megatron_app.runtime.add_transport_wrapper), which calls it on the transport it
creates.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from megatron_app.transport import Direction, direction_code_of, loss_injection
from megatron_app.transport.protocol import PipelineTransport, TransportWrapper

from .config import LossConfig
from .plugin import PluginLossModel, load_plugin
from .stats import LinkLossStats, direction_name, from_core
from .tensors import TensorLoss, element_table

_PIPELINE_SALT = 0x50495045  # keeps plug-in pipeline streams apart from tensor-parallel ones

_configured: Optional[LossConfig] = None
_attached: Optional["PipelineLoss"] = None


def configure(config: Optional[LossConfig]) -> None:
    """Loss for transports created from now on in this process (None: none)."""
    global _configured
    _configured = config if config is not None and config.pipeline else None


def attach_configured_loss(transport: Optional[PipelineTransport]) -> Optional[PipelineTransport]:
    """Returns the transport the runtime should use: `transport` with the configured loss attached (a proxy for a
    python plug-in), or `transport` itself when no loss is configured."""
    global _attached
    if _configured is None or transport is None:
        return transport
    _attached = PipelineLoss(transport, _configured)
    return _attached.transport


def current_pipeline_loss() -> Optional["PipelineLoss"]:
    return _attached


def reset() -> None:
    """Forget the configuration and the attached loss (tests, and the end of a training run)."""
    global _configured, _attached
    _configured, _attached = None, None


class PipelineLoss:
    """The loss layer of one Transport."""

    def __init__(self, transport, config: LossConfig, plugin: Optional[PluginLossModel] = None):
        self.config = config
        self.rank = transport.rank
        forward, backward = "forward" in config.loss_on, "backward" in config.loss_on
        if config.model == "python":
            plugin = plugin or load_plugin(config.source)
        if plugin is None:
            self.injector = loss_injection.LossInjector(
                config.core_spec(), fill=config.fill, packet_bytes=config.packet_bytes, seed=config.seed,
                local_rank=transport.rank, forward=forward, backward=backward, element_types=element_table())
            transport.attach_loss_injector(self.injector)
            self.transport = transport
        else:
            self.injector = None
            self.transport = PluginLossTransport(transport, config, plugin, forward, backward)

    def stats(self) -> List[LinkLossStats]:
        if self.injector is None:
            return self.transport.loss_stats()
        return [from_core(entry, "pipeline", f"{entry['source']}->{entry['destination']}",
                          direction_name(entry["direction"]), source=entry["source"])
                for entry in self.injector.stats()]


class PluginLossTransport(TransportWrapper):
    """A Transport whose received forward/backward tensors pass through a python plug-in (everything else is the
    wrapped transport's)."""

    def __init__(self, transport: PipelineTransport, config: LossConfig, plugin: PluginLossModel, forward: bool,
                 backward: bool):
        super().__init__(transport)
        self._config = config
        self._plugin = plugin
        self._directions = {int(direction) for direction, on in ((Direction.FORWARD, forward),
                                                                 (Direction.BACKWARD, backward)) if on}
        self._streams: Dict[Tuple[int, int], TensorLoss] = {}

    def filter_arrival(self, peer: int, tag: int, tensor):
        direction = direction_code_of(tag)
        if direction in self._directions:
            stream = self._streams.get((peer, direction))
            if stream is None:
                stream = self._streams[(peer, direction)] = TensorLoss(
                    self._config, [_PIPELINE_SALT, peer, self.rank, direction], plugin=self._plugin)
            tensor = stream(tensor, family=loss_injection.stale_family_of(tag), inplace=True)
        return tensor

    def loss_stats(self) -> List[LinkLossStats]:
        return [from_core(stream.stats(), "pipeline", f"{peer}->{self.rank}", direction_name(direction),
                          source=peer)
                for (peer, direction), stream in sorted(self._streams.items())]
