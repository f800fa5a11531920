"""The loss layer in the trainer: flags -> LossConfig at start-up, pipeline + tensor-parallel loss for the run,
statistics logged and traced at each iteration end. The trainer hands `wrap_transport` to the runtime
(megatron_app.runtime.add_transport_wrapper) and the runtime's tracer to end_iteration."""

from __future__ import annotations

from typing import Optional

from .config import LossConfig, make_loss_config
from .stats import LossReporter


def loss_config_from_args(args) -> LossConfig:
    """The --loss-* flags as a LossConfig (LossConfigError on a bad value). --loss-seed defaults to --seed."""
    seed = args.loss_seed if args.loss_seed is not None else args.seed
    return make_loss_config(args.loss_model, loss_rate=args.loss_rate, burst_length=args.burst_length,
                            loss_on=args.loss_on, fill=args.loss_fill, seed=seed,
                            packet_bytes=args.loss_packet_bytes, tp_sites=args.loss_tp_sites)


class TrainingLossLayer:
    """Start before the first iteration; end_iteration() after each; close() at the end (restores Megatron)."""

    def __init__(self, config: LossConfig, tensor_parallel_size: int, rank: int, log=print):
        from . import pipeline

        self.config = config
        self.integration = None
        pipeline.configure(config)
        sources = [lambda: (loss.stats() if (loss := pipeline.current_pipeline_loss()) is not None else [])]
        if config.tensor_parallel and tensor_parallel_size > 1:
            from .tensor_parallel import LossyMegatronIntegration

            self.integration = LossyMegatronIntegration(config, forward=config.tp_forward,
                                                        backward=config.tp_backward, rank=rank,
                                                        sites=config.tp_sites).enable()
            sources.append(self.integration.stats)
        self.reporter = LossReporter(sources, rank, log)
        if rank == 0:
            log(f"[lossy] {config.describe()}")

    def wrap_transport(self, transport, pp_global_ranks=None):
        """A runtime transport wrapper: the transport with the configured pipeline loss attached."""
        from . import pipeline

        return pipeline.attach_configured_loss(transport)

    def end_iteration(self, iteration: int, tracer=None) -> None:
        """Log this iteration's loss statistics (and record them in `tracer`, the runtime's, when given)."""
        self.reporter.end_iteration(iteration, tracer)

    def close(self) -> None:
        from . import pipeline

        if self.integration is not None:
            self.integration.disable()
        pipeline.reset()


def start_loss_layer(args, rank: int, log=print) -> Optional[TrainingLossLayer]:
    """The run's loss layer, or None when --loss-model is none."""
    config = getattr(args, "loss_config", None)
    if config is None or not config.enabled:
        return None
    return TrainingLossLayer(config, args.tensor_parallel, rank, log)
