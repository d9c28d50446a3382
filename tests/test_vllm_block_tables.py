"""vLLM's hybrid KV cache manager, without vLLM: a block table per KV cache group.

A hybrid model's full-attention and sliding-window layers are two KV cache groups, each with
its own block table, their layers' tensors sharing memory (as vLLM allocates them), and the
sliding-window table names vLLM's null block (0) before its window. The connector halves
move such a request between two real daemons; each layer's blocks must land in its own
table's blocks, and nothing in the null block or any other block. ``test_vllm.py`` runs the
same with real engines (``vllm_hybrid.py``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_vllm_connector import (
    LAYOUT,
    MODEL,
    NUM_BLOCKS,
    Request,
    save_prompt,
    settings,
    wait_finished,
)

from kvxfer.client import KvxferClient
from kvxfer.client.integrations.vllm import worker as worker_module
from kvxfer.client.integrations.vllm.block_tables import layer_tables
from kvxfer.client.integrations.vllm.layout import pool_flag
from kvxfer.client.integrations.vllm.scheduler import SchedulerSide
from kvxfer.client.integrations.vllm.worker import WorkerSide
from kvxfer.errors import InvalidSpecError

FULL, SLIDING = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"


class FullAttentionSpec(SimpleNamespace):
    """Stands for vLLM's spec of that name (``layer_tables`` reads its name and block size)."""


class SlidingWindowSpec(SimpleNamespace):
    """Stands for vLLM's spec of that name."""


class MambaSpec(SimpleNamespace):
    """Stands for vLLM's spec of that name."""


def hybrid_config(sliding_spec: Any = None) -> SimpleNamespace:
    """Two KV cache groups: layer 0 full attention, layer 1 a sliding window."""
    return SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(layer_names=[FULL], kv_cache_spec=FullAttentionSpec(block_size=32)),
        SimpleNamespace(layer_names=[SLIDING],
                        kv_cache_spec=sliding_spec or SlidingWindowSpec(block_size=32))])


def shared_kv(seed: int) -> dict[str, torch.Tensor]:
    """Both layers' KV in one tensor, as vLLM's hybrid manager allocates them: a block id is
    one group's at a time."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(NUM_BLOCKS, 2, 32, 128, generator=gen).to(torch.bfloat16)
    return {FULL: kv, SLIDING: kv}


def test_one_group_is_one_table_and_groups_kvxfer_cannot_page_are_refused_by_name() -> None:
    assert layer_tables(None, [FULL, SLIDING], 32) == (0, 0)
    assert layer_tables(hybrid_config(), [FULL, SLIDING], 32) == (0, 1)
    with pytest.raises(InvalidSpecError, match="group 1 .*MambaSpec"):
        layer_tables(hybrid_config(MambaSpec(block_size=32)), [FULL, SLIDING], 32)
    with pytest.raises(InvalidSpecError, match="SlidingWindowSpec in blocks of 64"):
        layer_tables(hybrid_config(SlidingWindowSpec(block_size=64)), [FULL, SLIDING], 32)
    with pytest.raises(InvalidSpecError, match="in no KV cache group"):
        layer_tables(hybrid_config(), [FULL, SLIDING, "model.layers.2.self_attn.attn"], 32)


#: A 4-block prompt: full-attention tables (prefill, decode), then sliding-window tables
#: with null blocks before the window.
FOUR_BLOCKS = (([3, 7, 9, 11], [0, 0, 5, 12]), ([1, 2, 4, 6], [0, 0, 10, 13]))


def hand_off_hybrid(spawn: Any, tokens: int = 128, tables: Any = FOUR_BLOCKS,
                    computes_last_token: bool = False
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor,
                               set[str]]:
    """A prompt of ``tokens`` of a hybrid engine to another, in the prefill's and the
    decode's ``tables``: the prefill KV, the decode KV, the decode KV before, and the loads
    reported failed."""
    pool = pool_flag(LAYOUT, "kv", 64)
    pre, dec = spawn("prefill", [pool]), spawn("decode", [pool])
    (full_p, sliding_p), (full_d, sliding_d) = tables
    with KvxferClient(pre.worker_address) as client:
        sched_p = SchedulerSide(settings(pre.worker_address), LAYOUT, MODEL, "P", producer=True,
                                consumer=False, client=client)
        sched_d = SchedulerSide(settings(dec.worker_address), LAYOUT, MODEL, "D", producer=False,
                                consumer=True, client=None,
                                computes_last_token=computes_last_token)
        work_p = WorkerSide(settings(pre.worker_address), LAYOUT, "P", kv_cache_config=hybrid_config())
        work_d = WorkerSide(settings(dec.worker_address), LAYOUT, "D", kv_cache_config=hybrid_config())
        kv_p, kv_d = shared_kv(1), shared_kv(2)
        before = kv_d[FULL].clone()
        work_p.register_kv_caches(kv_p)
        work_d.register_kv_caches(kv_d)
        try:
            params = save_prompt(sched_p, work_p, kv_p,
                                 Request("h-p", tokens, {"do_remote_decode": True}),
                                 (full_p, sliding_p))
            dreq = Request("h-d", tokens, params)
            loaded = tokens - 1 if computes_last_token else tokens
            assert sched_d.get_num_new_matched_tokens(dreq, 0) == (loaded, True)
            sched_d.update_state_after_alloc(dreq, (full_d, sliding_d), loaded)
            work_d.bind(sched_d.build_plan({}, lambda _: []))
            work_d.start_load_kv()
            wait_finished(work_d, "h-d", timeout_s=30)
            return kv_p, kv_d, before, work_d.take_failed()
        finally:
            work_p.shutdown()
            work_d.shutdown()


def test_each_layer_lands_in_its_own_groups_blocks_and_the_null_block_is_never_written(
        spawn) -> None:
    kv_p, kv_d, before, failed = hand_off_hybrid(spawn)
    assert failed == set()
    full, sliding = kv_d[FULL], kv_d[SLIDING]
    assert torch.equal(full[[1, 2, 4, 6]], kv_p[FULL][[3, 7, 9, 11]])
    assert torch.equal(sliding[[10, 13]], kv_p[SLIDING][[5, 12]])
    untouched = [b for b in range(NUM_BLOCKS) if b not in (1, 2, 4, 6, 10, 13)]
    assert 0 in untouched and torch.equal(full[untouched], before[untouched])


def test_negative_control_one_table_for_every_layer_puts_the_sliding_layers_kv_elsewhere(
        spawn, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blind to the groups (every layer through the first table, the tests' seam), the
    sliding-window layer's KV is cut from, and lands in, the full-attention blocks."""
    monkeypatch.setattr(worker_module, "layer_tables", lambda config, names, size: (0,) * len(names))
    kv_p, kv_d, _, failed = hand_off_hybrid(spawn)
    assert failed == set()
    assert not torch.equal(kv_d[SLIDING][[10, 13]], kv_p[SLIDING][[5, 12]])


def test_with_a_sliding_window_the_last_token_is_left_to_the_engine_even_past_a_block(
        spawn) -> None:
    """A 129-token prompt on an engine that computes a prompt's last token: 128 are loaded,
    into the 4 blocks vLLM allocated for them (the 5th, the last token's, comes when vLLM
    computes it): the 5th page goes nowhere, and nothing else changes."""
    tables = (([3, 7, 9, 11, 14], [0, 0, 5, 12, 15]), ([1, 2, 4, 6], [0, 0, 10, 13]))
    kv_p, kv_d, before, failed = hand_off_hybrid(spawn, 129, tables, computes_last_token=True)
    assert failed == set()
    assert torch.equal(kv_d[FULL][[1, 2, 4, 6]], kv_p[FULL][[3, 7, 9, 11]])
    assert torch.equal(kv_d[SLIDING][[10, 13]], kv_p[SLIDING][[5, 12]])
    untouched = [b for b in range(NUM_BLOCKS) if b not in (1, 2, 4, 6, 10, 13)]
    assert torch.equal(kv_d[FULL][untouched], before[untouched])
