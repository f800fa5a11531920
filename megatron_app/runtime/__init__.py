"""The Megatron-compatible runtime that executes a schedule policy."""

from megatron_app.lazy_fusers import import_megatron_core

import_megatron_core()   # before the modules below import it: its fusions then compile at first call (lazy_fusers)

from .call_contract import ContractAssertionError, ContractRuntimeError, ContractTypeError
from .executor import MEGATRON_ENTRY_POINTS, PipelineStallError, forward_backward_app
from .microbatch_lengths import set_microbatch_lengths, take_microbatch_lengths
from .keyed_randomness import disable_keyed_randomness, enable_keyed_randomness, set_iteration
from .install import add_arguments, install, install_from_args, is_installed, uninstall
from .job import (AppJob, add_transport_wrapper, current_job, current_tracer, peer_failures, remove_transport_wrapper,
                  shutdown)
from .settings import AppConfigError, AppSettings

__all__ = [
    "AppConfigError", "AppJob", "AppSettings", "ContractAssertionError", "ContractRuntimeError", "ContractTypeError",
    "MEGATRON_ENTRY_POINTS", "PipelineStallError", "add_arguments", "add_transport_wrapper",
    "current_job", "current_tracer", "disable_keyed_randomness", "enable_keyed_randomness", "forward_backward_app",
    "install", "install_from_args", "is_installed", "peer_failures", "remove_transport_wrapper", "set_iteration",
    "set_microbatch_lengths", "shutdown", "take_microbatch_lengths", "uninstall",
]
