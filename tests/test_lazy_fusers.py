"""megatron-core's jit_fuser compiles at a fusion's first call instead of importing TorchDynamo while megatron-core
imports (megatron_app/lazy_fusers.py): about 1 s of every rank's start-up."""

import subprocess
import sys
from pathlib import Path

import torch

from megatron_app.lazy_fusers import compile_on_first_call

REPO = Path(__file__).resolve().parents[1]


class RecordingCompile:
    def __init__(self):
        self.calls = []

    def __call__(self, model, **options):
        self.calls.append((model, options))
        return lambda *args, **kwargs: ("compiled", model(*args, **kwargs))


def add(a, b=1):
    """adds"""
    return a + b


def test_a_function_is_compiled_once_at_its_first_call_with_its_options():
    compile_function = RecordingCompile()
    decorate = compile_on_first_call(compile_function)
    plain, with_options = decorate(add), decorate(mode="max-autotune")(add)
    assert compile_function.calls == []                     # decorating compiles nothing
    assert plain(2) == ("compiled", 3) and plain(2, b=5) == ("compiled", 7)
    assert compile_function.calls == [(add, {})]            # once, then the compiled function is reused
    assert with_options(1) == ("compiled", 2)
    assert compile_function.calls[-1] == (add, {"mode": "max-autotune"})
    assert plain.__name__ == "add" and plain.__doc__ == "adds" and plain.__wrapped__ is add


def test_anything_but_a_plain_function_is_compiled_at_once():
    compile_function = RecordingCompile()
    module = torch.nn.Linear(2, 2)
    compile_on_first_call(compile_function)(module)
    assert compile_function.calls == [(module, {})]


def test_megatron_imports_without_dynamo_and_its_fusions_still_compute():
    """In a fresh process: after import_megatron_core, TorchDynamo is not loaded, torch.compile is what it was,
    jit_fuser is the stand-in, and a fusion decorated with it goes through torch.compile at its first call and
    computes what the same code computes eagerly. (torch.compile is wrapped to record its calls and to compile with
    the eager backend: Inductor's C++ build would add 15 s here.)"""
    code = """
import sys, torch
real = torch.compile
compiled = []
def recording_compile(model, **options):
    compiled.append(model.__name__)
    return real(model, backend="eager", **options)
torch.compile = recording_compile
from megatron_app.lazy_fusers import import_megatron_core
import_megatron_core()
import megatron.core.jit as jit
assert "torch._dynamo" not in sys.modules, "dynamo was imported"
assert torch.compile is recording_compile and jit.jit_fuser is not recording_compile and compiled == []
from megatron.core.fusions.fused_bias_gelu import bias_gelu
bias, y = torch.randn(8), torch.randn(4, 8)
assert torch.allclose(bias_gelu(bias, y), bias_gelu.__wrapped__(bias, y), atol=1e-6)
assert compiled == ["bias_gelu"] and "torch._dynamo" in sys.modules
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_importing_the_runtime_first_spares_dynamo_too():
    """`from megatron_app.runtime import ...` before megatron-core (a user's loop, a rank script) imports megatron-core
    through import_megatron_core: no TorchDynamo, and jit_fuser is the stand-in."""
    code = """
import sys, torch
from megatron_app.runtime.exit_grace import let_collective_threads_finish_at_exit
import megatron.core.jit as jit
assert "torch._dynamo" not in sys.modules, "dynamo was imported"
assert jit.jit_fuser is not torch.compile
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
