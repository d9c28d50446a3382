"""What a prefill and a decode engine's bytes must agree on before any byte moves: their page layout.

kvxfer moves KV as daemon pages: one page holds ``page_size`` token slots of
``page_heads`` KV heads of every layer, each layer in its own span of the page, laid out as
the engine's attention code lays out a block. What a page holds is ``PageLayout``: dtype,
tokens per page, layer count, KV heads per page and in the model, head size and the
in-block format (``block_format``: how K and V sit inside a block, which on CPU the
attention kernel's instruction set decides, and on GPU the KV cache layout, NHD or HND),
and the sender's tensor-parallel size. It travels in ``kv_transfer_params`` and the
decode side refuses a mismatch (of any field but the TP size), naming every field that
differs. Which model computed the bytes is the other half of compatibility
(``model_identity``).

An engine's block is ``block_size`` slots (``BlockLayout``): one page, or several where
the format says where each slot sits. vLLM's CPU attention with its ``vec`` and ``vec16``
kernels (every x86 CPU without AMX, and any block size not a multiple of 32) keeps a
block head by head, K transposed (measured: both kernels write the same bytes, at block
sizes 16, 32, 64 and 128): the pool kind ``mha_head_major`` describes it, and a block of
``n`` pages holds their slots in order, so engines of different block sizes exchange KV
through pages of a size that divides both (``engine_core.block_tiling``), and engines of
different TP sizes through pages of a number of heads that divides both sides' heads per
rank (``engine_core.head_split``). Other formats
(``amx``, ``neon``, GPU layouts) are moved as opaque bytes (pool kind ``opaque``), a page
per block, and need equal block and TP sizes. The daemon's pool must hold exactly such pages (``check_pool``), and the
engine's KV caches exactly such blocks (``engine_blocks``); ``pool_flag`` writes the
``--pool`` flag of a daemon that does.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from kvxfer.client.engine_core.head_split import HeadSplit
from kvxfer.descriptor import PoolDescriptor
from kvxfer.dtypes import itemsize
from kvxfer.errors import IncompatibleLayoutError, InvalidSpecError
from kvxfer.layout import MhaHeadMajorSpec, OpaqueSpec, PoolKind, PoolSpec

#: The in-block format, and pool kind, of vLLM's CPU attention with the ``vec`` and
#: ``vec16`` kernels: per KV head, K transposed then V.
HEAD_MAJOR = PoolKind.MHA_HEAD_MAJOR.value


@dataclass(frozen=True)
class PageLayout:
    """What one page of an engine's KV holds: ``page_heads`` of the model's
    ``model_kv_heads`` KV heads, for ``page_size`` tokens of every layer. Every field but
    ``tp_size`` (how the sender split the heads over its ranks) must match across the pair."""

    dtype: str
    page_size: int
    num_layers: int
    page_heads: int
    model_kv_heads: int
    head_size: int
    tp_size: int
    block_format: str

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer of a page: K and V of every slot and KV head."""
        return 2 * self.page_heads * self.page_size * self.head_size * itemsize(self.dtype)

    @property
    def split(self) -> HeadSplit:
        """How the engine's ranks hold the model's KV heads, in pages of ``page_heads``."""
        return HeadSplit(self.model_kv_heads, self.tp_size, self.page_heads)

    def as_dict(self) -> dict[str, Any]:
        """The fingerprint as JSON-ready values (what ``kv_transfer_params`` carries)."""
        return asdict(self)

    def bytes_dict(self) -> dict[str, Any]:
        """The fields that say what a page's bytes are (what prompt digests bind): all but
        ``tp_size``."""
        return {k: v for k, v in asdict(self).items() if k != "tp_size"}

    def differences(self, other: PageLayout) -> list[str]:
        """Each field that differs (but ``tp_size``), as "name: ours X, theirs Y"."""
        return [f"{f.name}: ours {getattr(self, f.name)!r}, theirs {getattr(other, f.name)!r}"
                for f in fields(self)
                if f.name != "tp_size" and getattr(self, f.name) != getattr(other, f.name)]


@dataclass(frozen=True)
class BlockLayout:
    """How one engine lays out a KV block: ``block_size`` slots of its rank's
    ``num_kv_heads`` KV heads (of the model's ``model_kv_heads``; 0: ``num_kv_heads *
    tp_size``), made of pages of ``page_size`` slots (0: one page per block) and
    ``page_heads`` heads (0: all the rank's); InvalidSpecError unless pages tile blocks in a
    format that says where each slot and head sits (``HEAD_MAJOR``), or are the blocks."""

    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_size: int
    block_format: str
    page_size: int = 0
    model_kv_heads: int = 0
    page_heads: int = 0

    def __post_init__(self) -> None:
        for name, default in (("page_size", self.block_size), ("page_heads", self.num_kv_heads),
                              ("model_kv_heads", self.num_kv_heads * self.tp_size)):
            if getattr(self, name) == 0:
                object.__setattr__(self, name, default)
        if self.page_size < 1 or self.block_size % self.page_size:
            raise InvalidSpecError(f"page_size={self.page_size} must divide the engine's "
                                   f"block_size={self.block_size}")
        if self.page.split.rank_heads != self.num_kv_heads:
            raise InvalidSpecError(
                f"{self.model_kv_heads} KV heads over {self.tp_size} ranks are "
                f"{self.page.split.rank_heads} per rank, not {self.num_kv_heads}")
        tiled = self.page_size != self.block_size or self.page_heads != self.num_kv_heads
        if tiled and self.block_format != HEAD_MAJOR:
            raise InvalidSpecError(
                f"pages of {self.page_size} slots and {self.page_heads} KV heads are not the "
                f"engine's blocks ({self.block_size} slots, {self.num_kv_heads} heads), but its "
                f"in-block format {self.block_format!r} does not say where each slot and head "
                f"sits (only {HEAD_MAJOR!r} does): leave page_size and page_heads unset")

    @property
    def page(self) -> PageLayout:
        """What one of this engine's pages holds (what the other engine must match)."""
        return PageLayout(self.dtype, self.page_size, self.num_layers, self.page_heads,
                          self.model_kv_heads, self.head_size, self.tp_size, self.block_format)

    @property
    def token_pages_per_block(self) -> int:
        """Token pages (of ``page_size`` slots) in one block."""
        return self.block_size // self.page_size

    @property
    def groups(self) -> int:
        """Head groups (of ``page_heads`` heads) in one block: pages per token page."""
        return self.num_kv_heads // self.page_heads

    @property
    def pages_per_block(self) -> int:
        """Pages in one block."""
        return self.token_pages_per_block * self.groups

    @property
    def block_bytes(self) -> int:
        """Bytes of one layer's block: K and V of every slot and KV head."""
        return self.pages_per_block * self.page.layer_bytes

    def as_dict(self) -> dict[str, Any]:
        """Its page's fingerprint (what ``kv_transfer_params`` carry): an engine's block size
        is its own."""
        return self.page.as_dict()

    def differences(self, other: PageLayout) -> list[str]:
        """Each field of the page layouts that differs, as "name: ours X, theirs Y"."""
        return self.page.differences(other)


def pool_spec(layout: BlockLayout, num_pages: int) -> PoolSpec:
    """The spec of a pool of ``num_pages`` pages of this engine's layout: head-major MHA
    for ``HEAD_MAJOR`` blocks; for another format, opaque pages of a block's bytes per
    layer (moved whole: kvxfer does not know where a head or a slot sits in them)."""
    if layout.block_format == HEAD_MAJOR:
        return MhaHeadMajorSpec(layout.num_layers, layout.page_heads, layout.head_size,
                                layout.dtype, layout.page_size, num_pages)
    return OpaqueSpec(layout.num_layers, layout.page.layer_bytes, layout.page_size, num_pages)


def cpu_block_format(cache_layout: str, kernel: str, cache_dtype: str) -> str:
    """The ``block_format`` of a vLLM CPU engine whose KV cache layout is ``cache_layout``
    (``LBHNC``), attention kernel ``kernel`` (``vec``, ``vec16``, ``amx``, ``neon``, ...)
    and cache dtype ``cache_dtype`` (``auto``: the model's): ``HEAD_MAJOR`` where kvxfer
    knows the bytes (``vec`` and ``vec16`` write the same, unquantized), else the layout
    and the kernel's name (bytes moved whole)."""
    if cache_layout == "LBHNC" and kernel in ("vec", "vec16") and cache_dtype == "auto":
        return HEAD_MAJOR
    return f"{cache_layout}/cpu-{kernel}"


def model_head_size(config: dict[str, Any]) -> int:
    """A Hugging Face config's attention head size."""
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def check_pool(layout: BlockLayout, pool: PoolDescriptor) -> None:
    """Raise IncompatibleLayoutError unless ``pool``'s pages are this engine's pages."""
    want = pool_spec(layout, pool.num_pages)
    have = pool.spec
    if type(have) is not type(want):
        wrong = [f"kind is {have.kind.value}, the engine needs {want.kind.value}"]
    else:
        wrong = [f"{f.name} is {getattr(have, f.name)!r}, the engine needs {getattr(want, f.name)!r}"
                 for f in fields(want) if getattr(have, f.name) != getattr(want, f.name)]
    if wrong:
        raise IncompatibleLayoutError(
            f"pool {pool.name!r} does not hold this engine's KV pages: {'; '.join(wrong)}. "
            f"Serve it with --pool {pool_flag(layout, pool.name, pool.num_pages)}")


def pool_flag(layout: BlockLayout, name: str, num_pages: int) -> str:
    """The ``kvxfer serve --pool`` value of a pool whose pages are this engine's pages."""
    spec = pool_spec(layout, num_pages)
    values = ",".join(f"{f.name}={getattr(spec, f.name)}" for f in fields(spec))
    return f"name={name},kind={spec.kind.value},{values}"


def model_dtype(model_dir: str) -> str:
    """The dtype a Hugging Face model directory's config.json names (what ``--dtype`` and the
    pool must use); InvalidSpecError if it is not one vLLM serves on CPU."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise InvalidSpecError(f"{model_dir}: dtype {dtype!r} is not one vLLM serves here")
    return dtype


def model_pool_flag(model_dir: str, name: str, block_size: int, num_pages: int,
                    tp: int = 1, page_size: int = 0, block_format: str = HEAD_MAJOR,
                    page_heads: int = 0) -> str:
    """The ``--pool`` value for a Hugging Face model directory (its config.json), without
    vLLM, for engines of blocks of ``block_format`` (default: vLLM's CPU attention with its
    ``vec`` or ``vec16`` kernel; ``deploy.engine_block_format`` asks vLLM which this machine
    runs) in pages of ``page_size`` (0: a block); with tensor parallelism a page is one
    rank's share of the KV heads, or ``page_heads`` of them (0: all)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    rank_heads = HeadSplit(kv_heads, tp, 1).rank_heads
    head_dim = model_head_size(config)
    dtype = model_dtype(model_dir)
    layout = BlockLayout(dtype, block_size, config["num_hidden_layers"], rank_heads,
                         head_dim, tp, block_format, page_size, kv_heads, page_heads)
    return pool_flag(layout, name, num_pages)


def _layer_index(name: str) -> int:
    found = re.search(r"layers\.(\d+)\.", name)
    if found is None:
        raise IncompatibleLayoutError(f"cannot tell which layer {name!r} is (no 'layers.N.')")
    return int(found.group(1))


def as_blocks(kv_layer: torch.Tensor) -> torch.Tensor:
    """A layer's KV tensor as ``[num_blocks, block_bytes]`` bytes, sharing its memory."""
    return kv_layer.view(torch.uint8).reshape(kv_layer.shape[0], -1)


def engine_blocks(kv_caches: dict[str, torch.Tensor],
                  layout: BlockLayout) -> dict[str, torch.Tensor]:
    """vLLM's per-layer KV caches as blocks of bytes (``as_blocks``), by layer name in
    layer order; IncompatibleLayoutError unless they are ``layout``'s layers of contiguous
    blocks of its ``block_bytes``."""
    names = sorted(kv_caches, key=_layer_index)
    if len(names) != layout.num_layers:
        raise IncompatibleLayoutError(f"vLLM registered {len(names)} KV layers; the model has "
                                      f"{layout.num_layers}")
    for name in names:
        kv = kv_caches[name]
        block_bytes = kv[0].numel() * kv.element_size()
        if not kv.is_contiguous() or block_bytes != layout.block_bytes:
            raise IncompatibleLayoutError(
                f"layer {name}'s KV cache {tuple(kv.shape)} is not blocks of "
                f"{layout.block_bytes} contiguous bytes (it has {block_bytes}); kvxfer needs "
                "each block's bytes together")
    return {name: as_blocks(kv_caches[name]) for name in names}
