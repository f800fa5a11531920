"""Import megatron-core with its fused kernels compiled at their first call, not their import.

megatron-core binds ``megatron.core.jit.jit_fuser = torch.compile`` and decorates a dozen fusions with it while its
package imports. torch.compile compiles lazily anyway, but the decorator alone imports TorchDynamo and Inductor:
about 1 s of every rank's start-up (a third of its imports on CPU), spent whether or not a fusion ever runs (ours run
none on CPU). Here jit_fuser is bound to a decorator that calls the real torch.compile the first time the function is
called: the same compiled function from then on, and the same code path on a GPU.
"""

from __future__ import annotations

import functools
import sys
import types


def compile_on_first_call(compile_function):
    """A torch.compile stand-in for decorating plain functions: `compile_function(fn, **options)` runs at fn's first
    call. Anything else (a module, a call without a function) goes to `compile_function` at once."""

    def decorate(model=None, **options):
        if model is None:                    # @torch.compile(options...) form
            return lambda function: decorate(function, **options)
        if not isinstance(model, types.FunctionType):
            return compile_function(model, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = compile_function(model, **options)
            return compiled(*args, **kwargs)

        return call

    return decorate


def import_megatron_core() -> None:
    """Import megatron-core (once per process) with jit_fuser compiling on first call. A process that imported it
    before keeps what it has."""
    if "megatron.core.jit" in sys.modules:
        return
    import torch

    real_compile = torch.compile
    torch.compile = compile_on_first_call(real_compile)
    try:
        import megatron.core.jit  # noqa: F401 - binds jit_fuser to the stand-in; the package's fusions import here
    finally:
        torch.compile = real_compile
