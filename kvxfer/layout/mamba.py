"""The Mamba pool spec: recurrent state (conv states and a temporal state) per request slot."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvxfer.dtypes import itemsize, torch_dtype
from kvxfer.errors import InvalidSpecError
from kvxfer.layout.fields import PoolKind, contiguous_strides, positive, shape_of
from kvxfer.layout.views import ViewRole, ViewSpec


@dataclass(frozen=True)
class MambaSpec:
    """Mamba-like recurrent state: conv states and a temporal (SSM) state per slot.

    Slot-granular: ``page_size`` is always 1 and a page is one request's slot.
    """

    layer_num: int
    conv_state_shapes: tuple[tuple[int, ...], ...]
    conv_dtype: str
    temporal_state_shape: tuple[int, ...]
    temporal_dtype: str
    num_slots: int

    kind = PoolKind.MAMBA

    def __post_init__(self) -> None:
        positive("layer_num", self.layer_num)
        positive("num_slots", self.num_slots)
        if not isinstance(self.conv_state_shapes, (tuple, list)) or not self.conv_state_shapes:
            raise InvalidSpecError(
                f"conv_state_shapes={self.conv_state_shapes!r} must be a non-empty list of shapes"
            )
        shapes = tuple(
            shape_of(f"conv_state_shapes[{i}]", s) for i, s in enumerate(self.conv_state_shapes)
        )
        object.__setattr__(self, "conv_state_shapes", shapes)
        object.__setattr__(
            self, "temporal_state_shape", shape_of("temporal_state_shape", self.temporal_state_shape)
        )
        torch_dtype(self.conv_dtype, field="conv_dtype")
        torch_dtype(self.temporal_dtype, field="temporal_dtype")
        for name, size in (
            ("conv_dtype", itemsize(self.conv_dtype)),
            ("temporal_dtype", itemsize(self.temporal_dtype)),
        ):
            if self.slot_bytes % size:
                raise InvalidSpecError(
                    f"misaligned mamba spec: slot_bytes={self.slot_bytes} is not a multiple of "
                    f"the {name} itemsize {size}"
                )
        if self._temporal_offset % itemsize(self.temporal_dtype):
            raise InvalidSpecError(
                f"misaligned mamba spec: the temporal region starts at byte "
                f"{self._temporal_offset} of a slot, not a multiple of the temporal_dtype "
                f"itemsize {itemsize(self.temporal_dtype)}"
            )

    @property
    def page_size(self) -> int:
        """Always 1: Mamba state is per request slot."""
        return 1

    @property
    def num_pages(self) -> int:
        """A slot is a page."""
        return self.num_slots

    @property
    def _conv_bytes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) * itemsize(self.conv_dtype) for s in self.conv_state_shapes)

    @property
    def _temporal_offset(self) -> int:
        return self.layer_num * sum(self._conv_bytes)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot across all layers, conv and temporal."""
        temporal = math.prod(self.temporal_state_shape) * itemsize(self.temporal_dtype)
        return self._temporal_offset + self.layer_num * temporal

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (one slot)."""
        return self.slot_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole pool."""
        return self.num_slots * self.slot_bytes

    @property
    def alignment(self) -> int:
        """The byte alignment the pool's anchor must have (both dtypes)."""
        return math.lcm(itemsize(self.conv_dtype), itemsize(self.temporal_dtype))

    def view_specs(self, anchor_bytes: int) -> tuple[ViewSpec, ...]:
        """One view per conv state, then the temporal view, each ``(layers, slots, *inner)``."""
        views = []
        offset = 0
        conv_size = itemsize(self.conv_dtype)
        for i, (shape, nbytes) in enumerate(zip(self.conv_state_shapes, self._conv_bytes)):
            views.append(
                ViewSpec(
                    role=ViewRole.CONV,
                    index=i,
                    dtype=self.conv_dtype,
                    shape=(self.layer_num, self.num_slots, *shape),
                    stride=(nbytes // conv_size, self.slot_bytes // conv_size)
                    + contiguous_strides(shape),
                    offset_bytes=anchor_bytes + offset,
                )
            )
            offset += self.layer_num * nbytes
        size = itemsize(self.temporal_dtype)
        shape = self.temporal_state_shape
        views.append(
            ViewSpec(
                role=ViewRole.TEMPORAL,
                index=0,
                dtype=self.temporal_dtype,
                shape=(self.layer_num, self.num_slots, *shape),
                stride=(math.prod(shape), self.slot_bytes // size) + contiguous_strides(shape),
                offset_bytes=anchor_bytes + offset,
            )
        )
        return tuple(views)
