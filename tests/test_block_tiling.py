"""Engine blocks of several pages (``engine_core.block_tiling``) and the head-major kind.

Tokens written into one engine's blocks through the kind's own views (the spec at
``page_size = block_size``), copied out into pages and into another engine's blocks of
another size, read back the same through that engine's views, for every token-paged kind.
And the head-major kind's views read what vLLM's CPU attention kernels write
(``vllm_block_format.py``, under the vLLM environment).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm_env import vllm_python

from kvxfer.client.engine_core.block_tiling import BlockTiling, Places
from kvxfer.client.engine_core.page_segments import layer_spans, page_segments
from kvxfer.client.engine_core.paged_blocks import PageRows
from kvxfer.errors import IncompatibleLayoutError
from kvxfer.layout import MambaSpec, MhaHeadMajorSpec, MhaSpec, MlaSpec, PoolLayout, build_views

HERE = Path(__file__).resolve().parent


def one_layer_blocks(spec: MhaSpec | MhaHeadMajorSpec | MlaSpec, block_size: int,
                     num_blocks: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """An engine's second layer: ``[num_blocks, block_bytes]`` bytes inside one allocation of
    every layer (as vLLM allocates them), and the kind's views of it."""
    block = dataclasses.replace(spec, layer_num=1, page_size=block_size, num_pages=num_blocks)
    layers = torch.zeros(3, num_blocks, block.page_bytes, dtype=torch.uint8)
    blocks = layers[1]
    return blocks, [v.build(blocks.reshape(-1)) for v in block.view_specs(0)]


def token_values(views: list[torch.Tensor], block_ids: list[int], tokens: int) -> list[torch.Tensor]:
    """Each view's rows of a request's first ``tokens`` tokens, in token order."""
    return [torch.cat([v[b] for b in block_ids])[:tokens].clone() for v in views]


def as_bytes(values: torch.Tensor) -> torch.Tensor:
    """``values``' bytes (random bytes hold NaNs, which no two tensors' values equal)."""
    return values.contiguous().view(torch.uint8)


specs = st.one_of(
    st.builds(MhaHeadMajorSpec, layer_num=st.integers(1, 3), head_num=st.integers(1, 3),
              head_dim=st.sampled_from([2, 4, 8]), dtype=st.sampled_from(["bfloat16", "float32"]),
              page_size=st.sampled_from([1, 2, 4]), num_pages=st.just(64)),
    st.builds(MhaSpec, layer_num=st.integers(1, 3), head_num=st.integers(1, 3),
              head_dim=st.sampled_from([2, 4]), v_head_dim=st.sampled_from([2, 4]),
              dtype=st.just("float16"), page_size=st.sampled_from([1, 2, 4]), num_pages=st.just(64)),
    st.builds(MlaSpec, layer_num=st.integers(1, 3), kv_lora_rank=st.sampled_from([4, 8]),
              qk_rope_head_dim=st.sampled_from([0, 2]), dtype=st.just("bfloat16"),
              page_size=st.sampled_from([1, 2, 4]), num_pages=st.just(64)))


@settings(max_examples=60, deadline=None)
@given(spec=specs, ratios=st.tuples(st.integers(1, 4), st.integers(1, 4)),
       tokens=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_tokens_cross_between_engines_of_other_block_sizes_through_pages(
        spec: MhaSpec | MhaHeadMajorSpec | MlaSpec, ratios: tuple[int, int], tokens: int,
        seed: int) -> None:
    layout = PoolLayout(spec, 0)
    raw = torch.zeros(spec.total_bytes, dtype=torch.uint8)
    pages = list(range(63, 63 - -(-tokens // spec.page_size), -1))  # any order
    sizes = [r * spec.page_size for r in ratios]
    generator = torch.Generator().manual_seed(seed)
    for layer in range(spec.layer_num):
        src_bytes, src_views = one_layer_blocks(spec, sizes[0], 48)
        src_bytes.copy_(torch.randint(0, 256, src_bytes.shape, generator=generator,
                                      dtype=torch.uint8))
        dst_bytes, dst_views = one_layer_blocks(spec, sizes[1], 48)
        src_ids = list(range(47, 47 - -(-tokens // sizes[0]), -1))  # any order
        dst_ids = list(range(-(-tokens // sizes[1])))
        src = BlockTiling(layout, sizes[0])
        dst = BlockTiling(layout, sizes[1])
        src.copy_out(raw, layer, src_bytes, Places.of(src_ids, src.per_block, 0, len(pages)),
                     pages)
        dst.copy_in(raw, layer, dst_bytes, pages,
                    Places.of(dst_ids, dst.per_block, 0, len(pages)))
        want = token_values(src_views, src_ids, tokens)
        got = token_values(dst_views, dst_ids, tokens)
        assert all(torch.equal(as_bytes(w), as_bytes(g))
                   for w, g in zip(want, got, strict=True)), (layer, sizes)
        pool = build_views(raw, layout.view_specs())
        pool_k = pool.k[layer] if pool.k else pool.latent[layer]
        assert torch.equal(as_bytes(pool_k[pages].flatten(0, 1)[:tokens]),
                           as_bytes(want[0]))  # the pool's own views read the tokens


def test_a_block_of_one_page_is_the_page_byte_for_byte() -> None:
    """Where blocks are pages, an engine copies whole layer spans (``PageRows``); tiling by
    one gives the same bytes, so both paths agree."""
    spec = MhaHeadMajorSpec(3, 2, 8, "bfloat16", 4, 8)
    layout = PoolLayout(spec, 0)
    blocks, _ = one_layer_blocks(spec, 4, 5)
    blocks.copy_(torch.randint(0, 256, blocks.shape, dtype=torch.uint8))
    by_span, by_tiling = (torch.zeros(spec.total_bytes, dtype=torch.uint8) for _ in range(2))
    spans = layer_spans(layout)
    PageRows(by_span, layout).copy_out(spans[1], blocks, [4, 0, 2], [7, 1, 3])
    BlockTiling(layout, 4).copy_out(by_tiling, 1, blocks, Places.of([4, 0, 2], 1, 0, 3),
                                    [7, 1, 3])
    assert torch.equal(by_span, by_tiling) and by_span.any()


def test_a_head_major_page_keeps_each_layer_together_but_not_each_view() -> None:
    spec = MhaHeadMajorSpec(2, 3, 4, "float16", 2, 4)
    layout = PoolLayout(spec, 128)
    per_layer = spec.page_bytes // 2
    assert layer_spans(layout) == ((0, per_layer), (per_layer, per_layer))
    with pytest.raises(IncompatibleLayoutError, match="not contiguous"):
        page_segments(layout)


def test_blocks_that_do_not_split_into_pages_or_pools_without_slots_are_refused() -> None:
    spec = MhaHeadMajorSpec(1, 1, 4, "float16", 4, 4)
    with pytest.raises(IncompatibleLayoutError, match="blocks of 6 slots do not split into "
                                                      "the pool's pages of 4"):
        BlockTiling(PoolLayout(spec, 0), 6)
    mamba = MambaSpec(1, ((4, 2),), "float16", (2, 2), "float32", 4)
    with pytest.raises(IncompatibleLayoutError, match="mamba pool's pages are not token slots"):
        BlockTiling(PoolLayout(mamba, 0), 2)
    with pytest.raises(IncompatibleLayoutError, match="5 pages for 4 places"):
        BlockTiling(PoolLayout(spec, 0), 8).copy_out(
            torch.zeros(spec.total_bytes, dtype=torch.uint8), 0,
            torch.zeros(4, 2 * 8 * 4 * 2, dtype=torch.uint8), Places.of([0, 1], 2, 0, 4),
            [0, 1, 2, 3, 0])
    with pytest.raises(IncompatibleLayoutError, match="blocks of 3 KV heads do not split"):
        BlockTiling(PoolLayout(dataclasses.replace(spec, head_num=2), 0), 4, block_heads=3)


def test_the_head_major_views_read_what_vllms_cpu_attention_writes() -> None:
    """vLLM's own ``cpu_attn_reshape_and_cache`` (kernels ``vec`` and ``vec16``; bfloat16,
    float16, float32; blocks of 16 to 128; head sizes 64 and 128, and 80 and 112 where vLLM
    picks ``vec16``) writes keys and values into a block; the
    head-major kind's views at ``page_size = block_size`` read them back exactly, so a pool
    of that kind describes vLLM's CPU blocks truthfully."""
    result = subprocess.run([str(vllm_python()), str(HERE / "vllm_block_format.py")],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    checked = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(checked) == 3 * 3 * 2 + 3 * 4 * 3 and all(checked.values()), checked
