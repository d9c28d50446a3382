"""What every pool spec is built from: the kinds' names and the checks of their fields."""

from __future__ import annotations

import enum

from kvxfer.errors import InvalidSpecError


class PoolKind(enum.Enum):
    """What a pool stores."""

    MHA = "mha"
    MHA_HEAD_MAJOR = "mha_head_major"
    MLA = "mla"
    MAMBA = "mamba"
    OPAQUE = "opaque"


def positive(name: str, value: object) -> int:
    """``value`` if it is an integer above 0; raises InvalidSpecError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidSpecError(f"{name}={value!r} must be a positive integer")
    return value


def non_negative(name: str, value: object) -> int:
    """``value`` if it is an integer of 0 or more; raises InvalidSpecError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidSpecError(f"{name}={value!r} must be a non-negative integer")
    return value


def shape_of(name: str, value: object) -> tuple[int, ...]:
    """``value`` as a shape: a non-empty sequence of positive integers (InvalidSpecError)."""
    if not isinstance(value, (tuple, list)) or not value:
        raise InvalidSpecError(f"{name}={value!r} must be a non-empty list of positive integers")
    return tuple(positive(f"{name}[{i}]", int_) for i, int_ in enumerate(value))


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The element strides of a contiguous tensor of ``shape``."""
    strides = []
    acc = 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))
