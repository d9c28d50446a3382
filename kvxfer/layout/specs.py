"""Pool specs: the shapes and dtypes of what a pool stores, and the bytes they take.

A pool is one contiguous region of a raw ``uint8`` buffer, split into pages of
``page_size`` token slots; within a page every layer's blocks sit together, so
one page is one contiguous block of ``page_bytes`` (this is what lets a run of
pages move as one copy)::

    MHA page = [L0_K x ps | L0_V x ps | L1_K x ps | L1_V x ps | ...]
    head-major MHA page = [L0: H0 (K^T hd x ps | V ps x hd) | H1 (...) | ... | L1: ...]
    opaque page = [L0 bytes | L1 bytes | ...]                (what is inside is not described)
    MLA page = [L0_latent x ps | L1_latent x ps | ...]       (MHA, one head, no V)
    Mamba slot = [conv0 x layers | conv1 x layers | ... | temporal x layers]

Each spec derives its views (``view_specs``); the offsets, shapes and strides
are byte-for-byte those of SGLang's page-major layout
(``shared/reference/page_major.py``). The head-major MHA kind is not SGLang's: it
is how vLLM's CPU attention lays out a block (see ``MhaHeadMajorSpec``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxfer.dtypes import itemsize, torch_dtype
from kvxfer.layout.fields import PoolKind, non_negative, positive
from kvxfer.layout.mamba import MambaSpec
from kvxfer.layout.views import ViewRole, ViewSpec


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
class OpaqueSpec:
    """Pages of ``page_size`` token slots whose bytes kvxfer moves but does not describe: each
    layer of a page is ``layer_bytes`` bytes, side by side, laid out as an engine kvxfer has
    no kind for keeps them (vLLM's CPU attention with its AMX kernel, say). Its views are
    the layers' bytes: a worker can copy a layer, not read a head or a slot."""

    layer_num: int
    layer_bytes: int
    page_size: int
    num_pages: int

    kind = PoolKind.OPAQUE
    dtype = "uint8"

    def __post_init__(self) -> None:
        for name in ("layer_num", "layer_bytes", "page_size", "num_pages"):
            positive(name, getattr(self, name))

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: every layer's bytes."""
        return self.layer_num * self.layer_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole pool."""
        return self.num_pages * self.page_bytes

    @property
    def alignment(self) -> int:
        """The byte alignment the pool's anchor must have."""
        return 1

    def view_specs(self, anchor_bytes: int) -> tuple[ViewSpec, ...]:
        """Per layer, its bytes: ``(num_pages, layer_bytes)`` of uint8."""
        return tuple(
            ViewSpec(role=ViewRole.BYTES, index=layer, dtype="uint8",
                     shape=(self.num_pages, self.layer_bytes), stride=(self.page_bytes, 1),
                     offset_bytes=anchor_bytes + layer * self.layer_bytes)
            for layer in range(self.layer_num))


PoolSpec = MhaSpec | MhaHeadMajorSpec | MlaSpec | MambaSpec | OpaqueSpec
