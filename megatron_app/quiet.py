"""The third-party warnings our entry points silence, declared once.

megatron-core warns on import that Apex and Transformer Engine are missing (four times) and torch / megatron emit
deprecation notices about their own internals: expected on CPU and not the user's to act on. Entry points (the
trainer, the simulator, the launchers' checks) call silence_third_party_warnings() first; library code does not.
"""

from __future__ import annotations

import warnings

_KNOWN_HARMLESS = (
    # (message regex, category, module regex)
    (r".*(Apex|Transformer Engine).*not installed.*", UserWarning, ""),
    (r"", UserWarning, r"megatron\."),
    (r"", DeprecationWarning, r"(megatron|torch)\."),
    (r"", FutureWarning, r"(megatron|torch)\."),
)


def silence_third_party_warnings() -> None:
    for message, category, module in _KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
