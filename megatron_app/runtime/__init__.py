"""The Megatron-compatible runtime that executes a schedule policy."""

from .executor import PipelineStallError, forward_backward_app
from .microbatch_lengths import set_microbatch_lengths, take_microbatch_lengths
from .install import add_arguments, install, install_from_args, is_installed, uninstall
from .session import current_tracer, shutdown
from .settings import AppConfigError, AppSettings

__all__ = [
    "AppConfigError", "AppSettings", "PipelineStallError", "add_arguments", "current_tracer", "forward_backward_app",
    "install", "install_from_args", "is_installed", "set_microbatch_lengths", "shutdown",
    "take_microbatch_lengths", "uninstall",
]
