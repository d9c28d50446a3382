"""KV heads across engines of different tensor-parallel sizes (``engine_core.head_split``).

The property test holds the model's KV (every head) in one engine's blocks, splits it over
the prefill ranks as vLLM does, copies each rank's blocks out into pages of ``page_heads``
heads in the order a rank's transfer keeps, moves to each decode rank the offer pages its
``sources`` name (as a pull would), copies them in where they say, and checks that every
decode rank's blocks hold exactly its own heads of the model's KV, byte for byte.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvxfer.client.engine_core.block_tiling import BlockTiling, Places
from kvxfer.client.engine_core.head_split import (
    HeadSplit,
    Source,
    pulled_ranks,
    pullers,
    sources,
)
from kvxfer.errors import IncompatibleLayoutError, InvalidSpecError
from kvxfer.layout import MhaHeadMajorSpec, PoolLayout


def test_ranks_hold_heads_in_order_or_replicated() -> None:
    four_over_two = HeadSplit(4, 2, 1)
    assert (four_over_two.rank_heads, four_over_two.groups) == (2, 2)
    assert [four_over_two.first_group(r) for r in range(2)] == [0, 2]
    two_over_four = HeadSplit(2, 4, 1)  # each head on two ranks
    assert [two_over_four.first_group(r) for r in range(4)] == [0, 0, 1, 1]
    assert two_over_four.holders(1) == [2, 3]
    assert HeadSplit(8, 2, 2).first_group(1) == 2
    with pytest.raises(InvalidSpecError, match="3 KV heads do not split evenly over 2"):
        HeadSplit(3, 2, 1)
    with pytest.raises(InvalidSpecError, match="page_heads=2 does not divide a rank's 1"):
        HeadSplit(2, 2, 2)


def test_each_decode_rank_pulls_the_groups_it_owns_from_the_ranks_that_hold_them() -> None:
    tp1, tp2 = HeadSplit(4, 1, 1), HeadSplit(4, 2, 1)
    assert sources(tp2, tp1, 0) == [Source(0, (0, 1), (0, 1)), Source(1, (0, 1), (2, 3))]
    assert sources(tp1, tp2, 1) == [Source(0, (2, 3), (0, 1))]
    assert Source(0, (2, 3), (0, 1)).offer_pages(4, 1, 3) == [6, 7, 10, 11]
    replicated = HeadSplit(2, 4, 1)
    assert [sources(replicated, HeadSplit(2, 1, 1), 0)] == [[Source(0, (0,), (0,)),
                                                              Source(2, (0,), (1,))]]
    assert pulled_ranks(replicated, HeadSplit(2, 1, 1)) == {0, 2}
    with pytest.raises(IncompatibleLayoutError, match="pages of 2, the decode engine 4 "
                                                      "into pages of 1"):
        sources(HeadSplit(4, 1, 2), tp1, 0)


def test_decode_ranks_that_pull_from_one_prefill_rank_share_its_transfer() -> None:
    tp1, tp2 = HeadSplit(4, 1, 1), HeadSplit(4, 2, 1)
    assert pullers(tp1, tp2, 0) == [0, 1]  # each its own part
    assert pullers(tp2, tp1, 1) == [0]
    assert pullers(HeadSplit(1, 1, 1), HeadSplit(1, 4, 1), 0) == [0, 1, 2, 3]  # replicated


def rank_blocks(model: torch.Tensor, split: HeadSplit, rank: int, head_bytes: int) -> torch.Tensor:
    """A rank's blocks of the model's (head-major: each head's bytes together) blocks."""
    first = rank * split.num_kv_heads // split.tp_size
    return model[:, first * head_bytes:(first + split.rank_heads) * head_bytes].contiguous()


@settings(max_examples=80, deadline=None)
@given(heads=st.sampled_from([1, 2, 4, 8]), tps=st.tuples(st.sampled_from([1, 2, 4]),
                                                          st.sampled_from([1, 2, 4])),
       page_heads=st.sampled_from([1, 2, 4]), sizes=st.tuples(st.sampled_from([2, 4]),
                                                             st.sampled_from([1, 2])),
       blocks=st.integers(1, 5), first_block=st.integers(0, 2), seed=st.integers(0, 1 << 16))
def test_every_decode_rank_gets_exactly_its_heads_of_the_model(
        heads: int, tps: tuple[int, int], page_heads: int, sizes: tuple[int, int], blocks: int,
        first_block: int, seed: int) -> None:
    try:
        prefill, decode = (HeadSplit(heads, tp, page_heads) for tp in tps)
    except InvalidSpecError:
        assume(False)
        return
    block_size, per_block = sizes[0], sizes[1]
    page_size = block_size // per_block
    head_dim, num_blocks = 4, 8
    token_pages = blocks * per_block
    first = min(first_block, blocks - 1) * per_block  # earlier blocks: a local cache hit
    model_spec = MhaHeadMajorSpec(1, heads, head_dim, "bfloat16", block_size, num_blocks)
    head_bytes = model_spec.page_bytes // heads
    model = torch.randint(0, 256, (num_blocks, model_spec.page_bytes), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(seed))
    pool = PoolLayout(MhaHeadMajorSpec(1, page_heads, head_dim, "bfloat16", page_size, 512), 0)
    block_ids = list(range(num_blocks))[::-1][:blocks]  # any order
    offers: list[list[int]] = []  # per prefill rank, its offer's pool pages
    raw = torch.zeros(pool.spec.total_bytes, dtype=torch.uint8)
    for rank in range(prefill.tp_size):
        pages = [rank * 100 + k for k in range(token_pages * prefill.groups)]
        tiling = BlockTiling(pool, block_size, prefill.rank_heads)
        tiling.copy_out(raw, 0, rank_blocks(model, prefill, rank, head_bytes),
                        Places.of(block_ids, per_block, 0, token_pages,
                                  range(prefill.groups)), pages)
        offers.append(pages)
    for rank in range(decode.tp_size):
        got = torch.zeros(num_blocks, head_bytes * decode.rank_heads, dtype=torch.uint8)
        tiling = BlockTiling(pool, block_size, decode.rank_heads)
        landed = 400
        for source in sources(prefill, decode, rank):
            wanted = source.offer_pages(prefill.groups, first, token_pages)
            lease = list(range(landed, landed + len(wanted)))
            landed += len(wanted)
            rows = raw.view(pool.num_pages, pool.page_bytes)
            rows[lease] = rows[[offers[source.rank][k] for k in wanted]]  # the pull
            tiling.copy_in(raw, 0, got, lease, Places.of(
                block_ids[first // per_block:], per_block, first, token_pages, source.places))
        want = rank_blocks(model, decode, rank, head_bytes)
        used = block_ids[first // per_block:]
        assert torch.equal(got[used], want[used]), (rank, sources(prefill, decode, rank))
        others = sorted(set(range(num_blocks)) - set(used))
        assert not got[others].any()  # nothing outside the load's blocks
