"""Message tags: 64-bit ints naming (direction, virtual microbatch, iteration). Layout is defined by the core."""

import enum

from ._core import core


class Direction(enum.IntEnum):
    FORWARD = core.DIRECTION_FORWARD
    BACKWARD = core.DIRECTION_BACKWARD
    CONTROL = core.DIRECTION_CONTROL


MAX_TAG = (1 << 64) - 1
# csrc/shm_tensor_rdma/core/tag.h: | direction (4 bits) | iteration (28 bits) | virtual microbatch (32 bits) |
_DIRECTION_SHIFT = 64 - 4


def _non_negative_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def make_tag(direction: Direction, virtual_microbatch: int, iteration: int = 0) -> int:
    """A 64-bit tag; ValueError if a field does not fit (microbatch < 2**32, iteration < 2**28)."""
    # Called for every message: the common, valid call goes straight to the core (which checks the upper bounds).
    if (type(direction) is Direction and type(virtual_microbatch) is int and type(iteration) is int
            and virtual_microbatch >= 0 and iteration >= 0):
        return core.make_tag(direction, virtual_microbatch, iteration)
    try:
        direction = Direction(direction)
    except ValueError:
        raise ValueError(f"unknown direction {direction!r}; use a megatron_app.transport.Direction") from None
    return core.make_tag(
        int(direction),
        _non_negative_int(virtual_microbatch, "virtual_microbatch"),
        _non_negative_int(iteration, "iteration"),
    )


def split_tag(tag: int) -> tuple[Direction, int, int]:
    """(direction, virtual_microbatch, iteration) of a tag made by make_tag."""
    direction, microbatch, iteration = core.split_tag(validate_tag(tag))
    return Direction(direction), microbatch, iteration


def describe_tag(tag: int) -> str:
    """'tag FORWARD vmb=5 iter=0' (or 'tag 0x...' for tags not made by make_tag)."""
    return core.describe_tag(validate_tag(tag))


def validate_tag(tag) -> int:
    tag = _non_negative_int(tag, "tag")
    if tag > MAX_TAG:
        raise ValueError(f"tag {tag} does not fit in 64 bits")
    return tag


def direction_code_of(tag: int) -> int:
    """The raw direction field of any 64-bit tag (a Direction value for tags made by make_tag; any other value
    for foreign tags, where split_tag raises). Called per received message, so no validation."""
    return tag >> _DIRECTION_SHIFT
