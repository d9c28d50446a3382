"""Engines of other block sizes exchange KV through shared pages: the connector's halves (no
vLLM) on two real daemons whose pools keep head-major pages of 32 tokens, one engine with
blocks of 32 and one with blocks of 64, in both directions. Every token's K and V, read
through the head-major kind's own views of each engine's blocks (what vLLM's CPU attention
reads: ``test_block_tiling.py``), arrives equal; a transfer moves 32-token pages, and a
decode engine's prefix-cache hit (whole blocks of 64) is not pulled."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from test_vllm_connector import LAYOUT, MODEL, Request, save_prompt, settings, wait_finished

from kvxfer.client import KvxferClient
from kvxfer.client.integrations.vllm.layout import BlockLayout, pool_flag
from kvxfer.client.integrations.vllm.scheduler import SchedulerSide
from kvxfer.client.integrations.vllm.worker import WorkerSide
from kvxfer.errors import InvalidSpecError
from kvxfer.layout import MhaHeadMajorSpec

WIDE = dataclasses.replace(LAYOUT, block_size=64, page_size=32)
NUM_BLOCKS = 16


def kv_caches(layout: BlockLayout, seed: int) -> dict[str, torch.Tensor]:
    """Two layers of vLLM CPU KV cache of ``layout``'s block size, random."""
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, layout.num_kv_heads, layout.block_size, 2 * layout.head_size)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(*shape, generator=gen)
            .to(torch.bfloat16) for i in range(layout.num_layers)}


def tokens(layout: BlockLayout, kv: torch.Tensor, block_ids: list[int],
           count: int) -> list[torch.Tensor]:
    """K and V of a request's first ``count`` tokens in blocks ``block_ids``, each
    ``[count, heads, head_size]``, through the head-major views of one layer's blocks."""
    spec = MhaHeadMajorSpec(1, layout.num_kv_heads, layout.head_size, layout.dtype,
                            layout.block_size, NUM_BLOCKS)
    raw = kv.view(torch.uint8).reshape(-1)
    return [torch.cat([v.build(raw)[b] for b in block_ids])[:count] for v in spec.view_specs(0)]


def hand_off(pre: Any, dec: Any, layouts: tuple[BlockLayout, BlockLayout], src: list[int],
             dst: list[int], count: int, local: int = 0) -> dict[str, Any]:
    """A ``count``-token prompt prefilled in blocks ``src`` of an engine of ``layouts[0]``,
    loaded into blocks ``dst`` of one of ``layouts[1]`` with ``local`` tokens already in its
    prefix cache: which layers' tokens arrived equal, and the pages each side moved."""
    kv_p, kv_d = kv_caches(layouts[0], 1), kv_caches(layouts[1], 2)
    before = {k: v.clone() for k, v in kv_d.items()}
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d:
        sched_p = SchedulerSide(settings(pre.worker_address), layouts[0], MODEL, "P",
                                producer=True, consumer=False, client=p)
        sched_d = SchedulerSide(settings(dec.worker_address), layouts[1], MODEL, "D",
                                producer=False, consumer=True, client=None)
        work_p = WorkerSide(settings(pre.worker_address), layouts[0], "P")
        work_d = WorkerSide(settings(dec.worker_address), layouts[1], "D")
        try:
            work_p.register_kv_caches(kv_p)
            work_d.register_kv_caches(kv_d)
            params = save_prompt(sched_p, work_p, kv_p,
                                 Request("r", count, {"do_remote_decode": True}), (src,))
            dreq = Request("u", count, params)
            assert sched_d.get_num_new_matched_tokens(dreq, local) == (count - local, True)
            sched_d.update_state_after_alloc(dreq, (dst,), count - local)
            work_d.bind(sched_d.build_plan({}, lambda _: []))
            work_d.start_load_kv()
            wait_finished(work_d, "u")
            assert work_d.take_failed() == set()
            [sent] = [i for i in p.transfers()]
            [got] = [i for i in d.transfers()]
        finally:
            work_p.shutdown()
            work_d.shutdown()
    skipped = local // layouts[1].block_size
    equal = {}
    for name in kv_p:
        want = [t[local:] for t in tokens(layouts[0], kv_p[name], src, count)]
        have = [t[local:] for t in tokens(layouts[1], kv_d[name], dst, count)]
        untouched = torch.equal(kv_d[name][dst[:skipped]], before[name][dst[:skipped]])
        equal[name] = untouched and all(torch.equal(w, h) for w, h in zip(want, have, strict=True))
    return {"equal": equal, "sent_pages": sent.pages, "pulled_pages": got.pages}


def test_blocks_of_32_load_into_blocks_of_64(spawn) -> None:
    pre = spawn("prefill", [pool_flag(LAYOUT, "kv", 64)])
    dec = spawn("decode", [pool_flag(WIDE, "kv", 64)])
    moved = hand_off(pre, dec, (LAYOUT, WIDE), src=[3, 7, 9], dst=[4, 1], count=70)
    assert moved == {"equal": dict.fromkeys(kv_caches(LAYOUT, 0), True),
                     "sent_pages": 3, "pulled_pages": 3}


def test_blocks_of_32_load_into_blocks_of_64_past_a_prefix_cache_hit(spawn) -> None:
    """The decode engine (blocks of 64) holds the first block: pages 2-4 cross, into the
    second block's two parts and the third's first."""
    pre = spawn("prefill", [pool_flag(LAYOUT, "kv", 64)])
    dec = spawn("decode", [pool_flag(WIDE, "kv", 64)])
    moved = hand_off(pre, dec, (LAYOUT, WIDE), src=[3, 7, 9, 1, 12], dst=[6, 4, 1], count=130,
                     local=64)
    assert moved == {"equal": dict.fromkeys(kv_caches(LAYOUT, 0), True),
                     "sent_pages": 3, "pulled_pages": 3}


def test_blocks_of_64_load_into_blocks_of_32_past_a_prefix_cache_hit(spawn) -> None:
    """The decode engine (blocks of 32) holds the first 64 tokens: of the 5 pages offered,
    only pages 2-4 cross, and its first two blocks are left as they were."""
    pre = spawn("prefill", [pool_flag(WIDE, "kv", 64)])
    dec = spawn("decode", [pool_flag(LAYOUT, "kv", 64)])
    moved = hand_off(pre, dec, (WIDE, LAYOUT), src=[5, 2, 9], dst=[8, 0, 11, 6, 2], count=130,
                     local=64)
    assert moved == {"equal": dict.fromkeys(kv_caches(LAYOUT, 0), True),
                     "sent_pages": 3, "pulled_pages": 3}


def test_pools_are_described_as_vllms_blocks_are() -> None:
    """The flag of an engine of blocks of 64 in pages of 32: head-major pages of 32 tokens."""
    assert pool_flag(WIDE, "kv", 8) == ("name=kv,kind=mha_head_major,layer_num=2,head_num=2,"
                                        "head_dim=64,dtype=bfloat16,page_size=32,num_pages=8")


def test_blocks_kvxfer_cannot_describe_move_whole_through_opaque_pages(spawn) -> None:
    """An in-block format kvxfer has no kind for (an AMX CPU's) goes through pools of kind
    ``opaque``, a page per block, byte for byte; pages shorter than its blocks are refused at
    start, naming the format."""
    amx = dataclasses.replace(LAYOUT, block_format="LBHNC/cpu-amx")
    assert pool_flag(amx, "kv", 8) == ("name=kv,kind=opaque,layer_num=2,layer_bytes=16384,"
                                       "page_size=32,num_pages=8")
    pre = spawn("prefill", [pool_flag(amx, "kv", 64)])
    dec = spawn("decode", [pool_flag(amx, "kv", 64)])
    moved = hand_off(pre, dec, (amx, amx), src=[3, 7], dst=[4, 1], count=64)
    assert moved == {"equal": dict.fromkeys(kv_caches(LAYOUT, 0), True),
                     "sent_pages": 2, "pulled_pages": 2}
    with pytest.raises(InvalidSpecError, match="in-block format 'LBHNC/cpu-amx' does not say "
                                               "where each slot and head sits"):
        dataclasses.replace(amx, block_size=64, page_size=32)
