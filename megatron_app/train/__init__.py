"""Megatron-Core GPT training driver (CPU and CUDA): ``python -m megatron_app.train --help``.

Modules: args (flags), init (distributed + RNG), model (GPTModel chunks, CPU attention spec),
weights/names/sharding (layout-independent init and parameter names), data (mock / indexed GPT
data; documents and their collation live in megatron_app.data), composed_data (each global
batch's microbatches as a composition forms them), data_schedule (wrap_data_iterator for loops of your own),
document_dropout (dropout keyed by document), step (forward_step), optim (Adam + DP gradient sync), forward_backward (schedule choice),
dumps (gradient and weight dumps by global name), report (loss/log), loop (the iterations).
"""

from megatron_app.quiet import silence_third_party_warnings

# Before megatron-core is imported: it warns on import that Apex / Transformer Engine are absent (expected on CPU).
silence_third_party_warnings()
