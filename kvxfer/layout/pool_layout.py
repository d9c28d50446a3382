"""Where a pool sits in its arena: ``PoolLayout``, and packing several pools into one buffer."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kvxfer.errors import InvalidSpecError
from kvxfer.layout.fields import PoolKind, non_negative, positive
from kvxfer.layout.specs import PoolSpec
from kvxfer.layout.views import PoolViews, ViewSpec, build_views


@dataclass(frozen=True)
class PoolLayout:
    """A pool spec placed at ``anchor_bytes`` of a raw buffer."""

    spec: PoolSpec
    anchor_bytes: int = 0

    def __post_init__(self) -> None:
        non_negative("anchor_bytes", self.anchor_bytes)
        if self.anchor_bytes % self.spec.alignment:
            raise InvalidSpecError(
                f"anchor_bytes={self.anchor_bytes} is misaligned; expected a multiple of "
                f"{self.spec.alignment} for this pool's dtype"
            )

    @property
    def kind(self) -> PoolKind:
        """What the pool stores."""
        return self.spec.kind

    @property
    def page_bytes(self) -> int:
        """Bytes of one page."""
        return self.spec.page_bytes

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        return self.spec.num_pages

    @property
    def total_bytes(self) -> int:
        """Bytes of the pool's region."""
        return self.spec.total_bytes

    @property
    def end_bytes(self) -> int:
        """One past the pool's last byte in the raw buffer."""
        return self.anchor_bytes + self.total_bytes

    def page_offset(self, page: int) -> int:
        """Byte offset of ``page`` in the raw buffer."""
        return self.anchor_bytes + page * self.page_bytes

    def view_specs(self) -> tuple[ViewSpec, ...]:
        """The views of this pool, with offsets from the start of the raw buffer."""
        return _view_specs(self.spec, self.anchor_bytes)

    def check_fits(self, buffer_bytes: int) -> None:
        """Raise InvalidSpecError unless the pool's region fits a buffer of ``buffer_bytes``."""
        if self.end_bytes > buffer_bytes:
            raise InvalidSpecError(
                f"pool needs bytes [{self.anchor_bytes}, {self.end_bytes}) but the buffer has "
                f"{buffer_bytes} bytes"
            )

    def build_views(self, raw: torch.Tensor) -> PoolViews:
        """Per-layer views of this pool over ``raw``."""
        self.check_fits(raw.numel())
        return build_views(raw, self.view_specs())


@functools.lru_cache(maxsize=256)
def _view_specs(spec: PoolSpec, anchor_bytes: int) -> tuple[ViewSpec, ...]:
    """Views are a pure function of the spec and anchor; every transfer encodes and
    checks them, so build them once (a llama-8B pool has 64)."""
    return spec.view_specs(anchor_bytes)


def pack_arena(specs: list[PoolSpec], alignment: int = 4096) -> tuple[list[PoolLayout], int]:
    """Place several pools one after another in one buffer (a hybrid model's arena).

    Each anchor is rounded up to ``alignment`` bytes (page-aligned by default, so
    every region starts on its own OS page). Returns the layouts and the buffer size.
    """
    positive("alignment", alignment)
    layouts = []
    offset = 0
    for spec in specs:
        align = math.lcm(alignment, spec.alignment)
        offset = -(-offset // align) * align
        layouts.append(PoolLayout(spec, offset))
        offset += spec.total_bytes
    return layouts, offset
