"""Task colours shared by the spreadsheet and the timeline: forward blue, backward orange, weight gradient (split
backward) green, darker per chunk."""

from __future__ import annotations

import colorsys

from .schema import BACKWARD, FORWARD, WEIGHT

_HUES = {FORWARD: 0.58, BACKWARD: 0.07, WEIGHT: 0.33}
_SATURATION = {FORWARD: 0.65, BACKWARD: 0.85, WEIGHT: 0.55}
_OTHER_HUE, _OTHER_SATURATION = 0.80, 0.45     # a task kind with no colour of its own yet: violet, never a KeyError
_LIGHTEST, _DARKEST = 0.80, 0.40


def _lightness(chunk: int, model_chunks: int) -> float:
    if model_chunks <= 1:
        return (_LIGHTEST + _DARKEST) / 2
    return _LIGHTEST - (_LIGHTEST - _DARKEST) * chunk / (model_chunks - 1)


def task_rgb(kind: str, chunk: int, model_chunks: int) -> str:
    """Hex "RRGGBB" (no '#') for a forward/backward task of `chunk`: lighter for low chunks, darker for high."""
    r, g, b = colorsys.hls_to_rgb(_HUES.get(kind, _OTHER_HUE), _lightness(chunk, model_chunks),
                                  _SATURATION.get(kind, _OTHER_SATURATION))
    return "".join(f"{round(c * 255):02X}" for c in (r, g, b))


def text_rgb(kind: str, chunk: int, model_chunks: int) -> str:
    """Black text on light cells, white on dark ones."""
    return "FFFFFF" if _lightness(chunk, model_chunks) < 0.6 else "000000"
