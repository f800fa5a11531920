"""Megatron-Core GPT training driver (CPU and CUDA): ``python -m megatron_app.train --help``.

Modules: args (flags), init (distributed + RNG), model (GPTModel chunks, CPU attention spec),
weights/names/sharding (layout-independent init and parameter names), data (mock / indexed GPT
data), step (forward_step), optim (Adam + DP gradient sync), forward_backward (schedule choice),
dumps (gradient and weight dumps by global name), report (loss/log), loop (the iterations).
"""

from megatron_app.quiet import silence_third_party_warnings

# Before megatron-core is imported: it warns on import that Apex / Transformer Engine are absent (expected on CPU).
silence_third_party_warnings()
