"""vLLM's CPU attention kernels write K and V into a block; print, as JSON, per kernel,
dtype, block size and head size, whether the head-major kind's views read them back exactly.

Run under the vLLM environment by test_block_tiling.py. ``vec`` needs blocks of a multiple
of 32 tokens, so it is not tried at 16; vLLM picks ``vec16`` for head sizes that are a
multiple of 16 but not of 32 (80, 112), so those are tried with it.
"""

from __future__ import annotations

import json
import warnings

import torch

from kvxfer.layout import MhaHeadMajorSpec

warnings.filterwarnings("ignore")
TOKENS, HEADS = 128, 2
#: The head sizes each kernel is tried with.
HEAD_SIZES = {"vec": (64, 128), "vec16": (64, 80, 112)}


def reads_back(isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> bool:
    import vllm._custom_ops as ops

    generator = torch.Generator().manual_seed(block_size)
    key = torch.randn(TOKENS, HEADS, head_dim, generator=generator).to(dtype)
    value = torch.randn(TOKENS, HEADS, head_dim, generator=generator).to(dtype)
    num_blocks = TOKENS // block_size
    # vLLM's CPU cache of one layer, [blocks, heads, block_size, 2 * head_dim], and the
    # views its attention takes of it (cpu_attn.py: K and V as the halves of dim 2).
    cache = torch.zeros(num_blocks, HEADS, block_size, 2 * head_dim, dtype=dtype)
    k_cache, v_cache = cache.view(num_blocks, HEADS, 2 * block_size, head_dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, torch.arange(TOKENS), isa)
    spec = MhaHeadMajorSpec(1, HEADS, head_dim, str(dtype).removeprefix("torch."), block_size,
                            num_blocks)
    k_view, v_view = (v.build(cache.view(torch.uint8).reshape(-1)) for v in spec.view_specs(0))
    return (torch.equal(k_view.flatten(0, 1), key) and torch.equal(v_view.flatten(0, 1), value))


def main() -> None:
    checked = {}
    for isa, head_sizes in HEAD_SIZES.items():
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for block_size in (16, 32, 64, 128):
                if isa == "vec" and block_size % 32:
                    continue
                for head_dim in head_sizes:
                    checked[f"{isa}/{dtype}/{block_size}/{head_dim}"] = reads_back(
                        isa, dtype, block_size, head_dim)
    print(json.dumps(checked))


if __name__ == "__main__":
    main()
