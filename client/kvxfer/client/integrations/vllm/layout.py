"""What a prefill and a decode engine's bytes must agree on before any byte moves: their block layout.

kvxfer moves a vLLM block as opaque bytes: one block, all layers, is one
page-major kvxfer page (layer ``l`` of the page holds layer ``l``'s block, as
the engine's attention code lays it out). So the two engines must lay blocks
out identically: dtype, block size, layer count, KV heads, head size,
tensor-parallel size and the in-block format (``block_format``: how K and V sit
inside a block, which on CPU the attention kernel's instruction set decides, and
on GPU the KV cache layout, NHD or HND). ``BlockLayout`` is that description; it
travels in ``kv_transfer_params`` and the decode side refuses a mismatch, naming
every field that differs. Which model computed the bytes is the other half of
compatibility (``model_identity``). The daemon's pool must hold exactly such
pages (``check_pool``), and the engine's KV caches exactly such blocks
(``engine_blocks``); ``pool_flag`` writes the ``--pool`` flag of a daemon that does.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from kvxfer.descriptor import PoolDescriptor
from kvxfer.dtypes import itemsize
from kvxfer.errors import IncompatibleLayoutError, InvalidSpecError
from kvxfer.layout import MhaSpec


@dataclass(frozen=True)
class BlockLayout:
    """How one engine lays out a KV block (every field must match across the pair)."""

    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_size: int
    block_format: str

    @property
    def block_bytes(self) -> int:
        """Bytes of one layer's block: K and V of every slot and KV head."""
        return 2 * self.num_kv_heads * self.block_size * self.head_size * itemsize(self.dtype)

    def as_dict(self) -> dict[str, Any]:
        """The fingerprint as JSON-ready values (what ``kv_transfer_params`` carries)."""
        return asdict(self)

    def differences(self, other: BlockLayout) -> list[str]:
        """Each field that differs, as "name: ours X, theirs Y"."""
        return [f"{f.name}: ours {getattr(self, f.name)!r}, theirs {getattr(other, f.name)!r}"
                for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


def check_pool(layout: BlockLayout, pool: PoolDescriptor) -> None:
    """Raise IncompatibleLayoutError unless ``pool``'s pages are this engine's blocks."""
    spec = pool.spec
    wanted = {
        "page_size": (spec.page_size, layout.block_size),
        "layer_num": (getattr(spec, "layer_num", None), layout.num_layers),
        "page_bytes": (pool.page_bytes, layout.num_layers * layout.block_bytes),
    }
    wrong = [f"{name} is {have}, the engine needs {need}"
             for name, (have, need) in wanted.items() if have != need]
    if wrong:
        raise IncompatibleLayoutError(
            f"pool {pool.name!r} does not hold this engine's KV blocks: {'; '.join(wrong)}. "
            f"Serve it with --pool {pool_flag(layout, pool.name, pool.num_pages)}")


def pool_flag(layout: BlockLayout, name: str, num_pages: int) -> str:
    """The ``kvxfer serve --pool`` value of a pool whose pages are this engine's blocks."""
    return (f"name={name},kind=mha,layer_num={layout.num_layers},head_num={layout.num_kv_heads},"
            f"head_dim={layout.head_size},v_head_dim={layout.head_size},dtype={layout.dtype},"
            f"page_size={layout.block_size},num_pages={num_pages}")


def model_dtype(model_dir: str) -> str:
    """The dtype a Hugging Face model directory's config.json names (what ``--dtype`` and the
    pool must use); InvalidSpecError if it is not one vLLM serves on CPU."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise InvalidSpecError(f"{model_dir}: dtype {dtype!r} is not one vLLM serves here")
    return dtype


def model_pool_flag(model_dir: str, name: str, block_size: int, num_pages: int,
                    tp: int = 1) -> str:
    """The ``--pool`` value for a Hugging Face model directory (its config.json), without
    vLLM; with tensor parallelism a page is one rank's block (its share of the KV heads)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    if kv_heads % tp:
        raise InvalidSpecError(f"{model_dir}: {kv_heads} KV heads do not split over {tp} ranks")
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    dtype = model_dtype(model_dir)
    layout = BlockLayout(dtype, block_size, config["num_hidden_layers"], kv_heads // tp,
                         head_dim, tp, "")
    MhaSpec(layout.num_layers, layout.num_kv_heads, head_dim, head_dim, dtype, block_size,
            num_pages)  # validates
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
