"""Pool specs: the shapes and dtypes of what a pool stores, and the bytes they take.

A pool is one contiguous region of a raw ``uint8`` buffer, split into pages of
``page_size`` token slots; within a page every layer's blocks sit together, so
one page is one contiguous block of ``page_bytes`` (this is what lets a run of
pages move as one copy)::

    MHA page = [L0_K x ps | L0_V x ps | L1_K x ps | L1_V x ps | ...]
    head-major MHA page = [L0: H0 (K^T hd x ps | V ps x hd) | H1 (...) | ... | L1: ...]
    MLA page = [L0_latent x ps | L1_latent x ps | ...]       (MHA, one head, no V)
    Mamba slot = [conv0 x layers | conv1 x layers | ... | temporal x layers]

Each spec derives its views (``view_specs``); the offsets, shapes and strides
are byte-for-byte those of SGLang's page-major layout
(``shared/reference/page_major.py``). The head-major MHA kind is not SGLang's: it
is how vLLM's CPU attention lays out a block (see ``MhaHeadMajorSpec``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from kvxfer.dtypes import itemsize, torch_dtype
from kvxfer.errors import InvalidSpecError
from kvxfer.layout.views import ViewRole, ViewSpec


class PoolKind(enum.Enum):
    """What a pool stores."""

    MHA = "mha"
    MHA_HEAD_MAJOR = "mha_head_major"
    MLA = "mla"
    MAMBA = "mamba"


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


def _shape(name: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not value:
        raise InvalidSpecError(f"{name}={value!r} must be a non-empty list of positive integers")
    return tuple(positive(f"{name}[{i}]", int_) for i, int_ in enumerate(value))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


class _TokenPaged:
    """What MHA and MLA pools share: pages of ``page_size`` token slots, one dtype."""

    dtype: str
    page_size: int
    num_pages: int

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token slot across all layers."""
        raise NotImplementedError

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: ``page_size`` slots of every layer."""
        return self.page_size * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole pool."""
        return self.num_pages * self.page_bytes

    @property
    def alignment(self) -> int:
        """The byte alignment the pool's anchor must have."""
        return itemsize(self.dtype)


@dataclass(frozen=True)
class MhaSpec(_TokenPaged):
    """Multi-head (GQA) attention KV: per layer a K and a V row per token slot."""

    layer_num: int
    head_num: int
    head_dim: int
    v_head_dim: int
    dtype: str
    page_size: int
    num_pages: int

    kind = PoolKind.MHA

    def __post_init__(self) -> None:
        for name in ("layer_num", "head_num", "head_dim", "v_head_dim", "page_size", "num_pages"):
            positive(name, getattr(self, name))
        torch_dtype(self.dtype)

    @property
    def k_row_bytes(self) -> int:
        """Bytes of one token's K row in one layer (all heads)."""
        return self.head_num * self.head_dim * itemsize(self.dtype)

    @property
    def v_row_bytes(self) -> int:
        """Bytes of one token's V row in one layer (all heads)."""
        return self.head_num * self.v_head_dim * itemsize(self.dtype)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token slot across all layers, K and V."""
        return self.layer_num * (self.k_row_bytes + self.v_row_bytes)

    def view_specs(self, anchor_bytes: int) -> tuple[ViewSpec, ...]:
        """Per-layer K and V views, in layer order (K0, V0, K1, V1, ...)."""
        size = itemsize(self.dtype)
        page_elems = self.page_bytes // size
        views = []
        for layer in range(self.layer_num):
            k_base = anchor_bytes + layer * self.page_size * (self.k_row_bytes + self.v_row_bytes)
            v_base = k_base + self.page_size * self.k_row_bytes
            views.append(
                ViewSpec(
                    role=ViewRole.K,
                    index=layer,
                    dtype=self.dtype,
                    shape=(self.num_pages, self.page_size, self.head_num, self.head_dim),
                    stride=(page_elems, self.k_row_bytes // size, self.head_dim, 1),
                    offset_bytes=k_base,
                )
            )
            views.append(
                ViewSpec(
                    role=ViewRole.V,
                    index=layer,
                    dtype=self.dtype,
                    shape=(self.num_pages, self.page_size, self.head_num, self.v_head_dim),
                    stride=(page_elems, self.v_row_bytes // size, self.v_head_dim, 1),
                    offset_bytes=v_base,
                )
            )
        return tuple(views)


@dataclass(frozen=True)
class MhaHeadMajorSpec(_TokenPaged):
    """Multi-head (GQA) attention KV laid out head by head, as vLLM's CPU attention keeps a
    block (its ``LBHNC`` cache layout; the ``vec`` and ``vec16`` kernels write the same
    bytes): within a page, per layer, per KV head, K dim-major (``head_dim`` rows of
    ``page_size`` slots: K transposed), then V slot-major (``page_size`` rows of
    ``head_dim``). One layer's run of heads is one contiguous run of a page, and a block
    of ``n * page_size`` slots in this layout holds ``n`` pages' slots in order (its views
    at ``page_size = n * page_size`` say where)."""

    layer_num: int
    head_num: int
    head_dim: int
    dtype: str
    page_size: int
    num_pages: int

    kind = PoolKind.MHA_HEAD_MAJOR

    def __post_init__(self) -> None:
        for name in ("layer_num", "head_num", "head_dim", "page_size", "num_pages"):
            positive(name, getattr(self, name))
        torch_dtype(self.dtype)

    @property
    def head_bytes(self) -> int:
        """Bytes of one KV head of one layer in a page: its K and its V."""
        return 2 * self.page_size * self.head_dim * itemsize(self.dtype)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token slot across all layers, K and V."""
        return self.layer_num * 2 * self.head_num * self.head_dim * itemsize(self.dtype)

    def view_specs(self, anchor_bytes: int) -> tuple[ViewSpec, ...]:
        """Per-layer K and V views, in layer order (K0, V0, K1, V1, ...), each
        ``(num_pages, page_size, heads, head_dim)`` like an MHA pool's."""
        size = itemsize(self.dtype)
        page_elems = self.page_bytes // size
        head_elems = self.head_bytes // size
        views = []
        for layer in range(self.layer_num):
            k_base = anchor_bytes + layer * self.head_num * self.head_bytes
            v_base = k_base + self.head_dim * self.page_size * size
            views.append(ViewSpec(
                role=ViewRole.K, index=layer, dtype=self.dtype,
                shape=(self.num_pages, self.page_size, self.head_num, self.head_dim),
                stride=(page_elems, 1, head_elems, self.page_size), offset_bytes=k_base))
            views.append(ViewSpec(
                role=ViewRole.V, index=layer, dtype=self.dtype,
                shape=(self.num_pages, self.page_size, self.head_num, self.head_dim),
                stride=(page_elems, self.head_dim, head_elems, 1), offset_bytes=v_base))
        return tuple(views)


@dataclass(frozen=True)
class MlaSpec(_TokenPaged):
    """DeepSeek-style compressed KV: one latent row (kv_lora_rank + rope dim) per token per layer.

    Laid out exactly as an MHA pool with one head of ``kv_lora_rank +
    qk_rope_head_dim`` and no V block, which is how SGLang stores MLA pages.
    """

    layer_num: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: str
    page_size: int
    num_pages: int

    kind = PoolKind.MLA

    def __post_init__(self) -> None:
        for name in ("layer_num", "kv_lora_rank", "page_size", "num_pages"):
            positive(name, getattr(self, name))
        non_negative("qk_rope_head_dim", self.qk_rope_head_dim)
        torch_dtype(self.dtype)

    @property
    def latent_dim(self) -> int:
        """Elements of one latent row: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's latent row in one layer."""
        return self.latent_dim * itemsize(self.dtype)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token slot across all layers."""
        return self.layer_num * self.row_bytes

    def view_specs(self, anchor_bytes: int) -> tuple[ViewSpec, ...]:
        """Per-layer latent views ``(num_pages, page_size, 1, latent_dim)``."""
        size = itemsize(self.dtype)
        return tuple(
            ViewSpec(
                role=ViewRole.LATENT,
                index=layer,
                dtype=self.dtype,
                shape=(self.num_pages, self.page_size, 1, self.latent_dim),
                stride=(self.page_bytes // size, self.row_bytes // size, self.latent_dim, 1),
                offset_bytes=anchor_bytes + layer * self.page_size * self.row_bytes,
            )
            for layer in range(self.layer_num)
        )


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
            _shape(f"conv_state_shapes[{i}]", s) for i, s in enumerate(self.conv_state_shapes)
        )
        object.__setattr__(self, "conv_state_shapes", shapes)
        object.__setattr__(
            self, "temporal_state_shape", _shape("temporal_state_shape", self.temporal_state_shape)
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
                    + _contiguous_strides(shape),
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
                stride=(math.prod(shape), self.slot_bytes // size) + _contiguous_strides(shape),
                offset_bytes=anchor_bytes + offset,
            )
        )
        return tuple(views)


PoolSpec = MhaSpec | MhaHeadMajorSpec | MlaSpec | MambaSpec
