"""Pool descriptors: what another process needs to rebuild identical views of a pool.

A ``PoolDescriptor`` is a named ``PoolLayout`` plus the list of its views
(dtype, shape, element strides, byte offset). It round-trips losslessly through
the ``kvxfer.v1.PoolDescriptor`` message (``kvxfer.wire.codec``), which checks
the views carried on the wire against the ones the spec derives.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from kvxfer.errors import IncompatibleLayoutError, InvalidSpecError
from kvxfer.layout import PoolKind, PoolLayout, PoolSpec, PoolViews, ViewSpec, build_views


@dataclass(frozen=True)
class PoolDescriptor:
    """A named pool: its layout in a raw buffer and the views built over it."""

    name: str
    layout: PoolLayout

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidSpecError("pool name is empty; expected a non-empty name")

    @property
    def kind(self) -> PoolKind:
        """What the pool stores."""
        return self.layout.kind

    @property
    def spec(self) -> PoolSpec:
        """The pool's spec (shapes, dtypes, page_size, num_pages)."""
        return self.layout.spec

    @property
    def page_bytes(self) -> int:
        """Bytes of one page."""
        return self.layout.page_bytes

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        return self.layout.num_pages

    @property
    def views(self) -> tuple[ViewSpec, ...]:
        """Every view of the pool, with absolute byte offsets."""
        return self.layout.view_specs()

    def build_views(self, raw: torch.Tensor) -> PoolViews:
        """Per-layer views over ``raw``, the buffer the pool lives in."""
        self.layout.check_fits(raw.numel())
        return build_views(raw, self.views)


def check_compatible(src: PoolDescriptor, dst: PoolDescriptor) -> None:
    """Raise IncompatibleLayoutError unless pages of ``src`` can be copied into ``dst`` as is.

    Two pools are compatible when every spec field but the page count matches
    (so their pages hold the same tensors at the same offsets). The message
    names the first field that differs.
    """
    if src.kind != dst.kind:
        raise IncompatibleLayoutError(
            f"pool kinds differ: source {src.name!r} is {src.kind.value}, destination "
            f"{dst.name!r} is {dst.kind.value}"
        )
    skip = {"num_pages", "num_slots"}
    for field in fields(src.spec):
        if field.name in skip:
            continue
        a, b = getattr(src.spec, field.name), getattr(dst.spec, field.name)
        if a != b:
            raise IncompatibleLayoutError(
                f"{field.name} differs: source pool {src.name!r} has {a}, destination pool "
                f"{dst.name!r} has {b}"
            )
    if src.page_bytes != dst.page_bytes:
        raise IncompatibleLayoutError(
            f"page_bytes differs: source {src.page_bytes}, destination {dst.page_bytes}"
        )
