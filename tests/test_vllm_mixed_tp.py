"""Prefill and decode engines of different tensor-parallel sizes: the connector's halves on
real daemons (``engine_core.head_split``).

A decode rank pulls, from every prefill rank holding some of its KV heads, that rank's
transfer, and copies each page among its own heads: its blocks then hold exactly its heads
of what the prefill ranks computed, byte for byte. Real engines: ``tests/test_vllm.py``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from typing import Any

import pytest
import torch
from test_vllm_connector import LAYOUT, MODEL, Request, settings, wait_finished

from kvxfer.client.engine_core.head_split import Source
from kvxfer.client.engine_core.paged_blocks import PagedBlocks
from kvxfer.client.integrations.vllm import pull_plan
from kvxfer.client.integrations.vllm.layout import BlockLayout, pool_flag
from kvxfer.client.integrations.vllm.offer_keeper import OfferKeeper
from kvxfer.client.integrations.vllm.protocol import Refusal, StepPlan, parse_remote_prefill
from kvxfer.client.integrations.vllm.scheduler import SchedulerSide
from kvxfer.client.integrations.vllm.worker import WorkerSide
from kvxfer.client.library import KvxferClient
from kvxfer.errors import TransferNotFoundError
from kvxfer.layout import MhaHeadMajorSpec

NUM_BLOCKS = 16


def split(model_heads: int, tp: int, page_heads: int, block_size: int = 32,
          page_size: int = 32) -> BlockLayout:
    """``LAYOUT``'s model with ``model_heads`` KV heads over ``tp`` ranks."""
    return dataclasses.replace(LAYOUT, num_kv_heads=max(1, model_heads // tp), tp_size=tp,
                               model_kv_heads=model_heads, page_heads=page_heads,
                               block_size=block_size, page_size=page_size)


def kv_caches(layout: BlockLayout, seed: int) -> dict[str, torch.Tensor]:
    """vLLM's CPU KV caches of one rank: per layer ``[blocks, heads, slots, 2 * dim]``."""
    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(
        NUM_BLOCKS, layout.num_kv_heads, layout.block_size, 2 * layout.head_size,
        generator=gen).to(torch.bfloat16) for i in range(layout.num_layers)}


class Pair:
    """A prefill engine of ``pre`` ranks and a decode engine of ``dec`` ranks' halves."""

    def __init__(self, daemons: tuple[Any, Any], pre: BlockLayout, dec: BlockLayout,
                 client: KvxferClient, keeper: OfferKeeper | None = None) -> None:
        self.daemons, self.pre, self.dec = daemons, pre, dec
        p, d = (daemon.worker_address for daemon in daemons)
        self.sched_p = SchedulerSide(settings(p), pre, MODEL, "P", producer=True,
                                     consumer=False, client=client)
        self.sched_d = SchedulerSide(settings(d), dec, MODEL, "D", producer=False,
                                     consumer=True, client=None, keeper=keeper)
        self.work_p = [WorkerSide(settings(p), pre, "P", r) for r in range(pre.tp_size)]
        self.work_d = [WorkerSide(settings(d), dec, "D", r) for r in range(dec.tp_size)]
        self.kv_p = [kv_caches(pre, 10 + r) for r in range(pre.tp_size)]
        self.kv_d = [kv_caches(dec, 20 + r) for r in range(dec.tp_size)]
        for worker, kv in [*zip(self.work_p, self.kv_p), *zip(self.work_d, self.kv_d)]:
            worker.register_kv_caches(kv)

    def prefill(self, req_id: str, tokens: int, blocks: list[int]) -> dict[str, Any]:
        req = Request(req_id, tokens, {"do_remote_decode": True})
        self.sched_p.update_state_after_alloc(req, (blocks,), 0)
        plan = self.sched_p.build_plan({req_id: (0, tokens)}, lambda _: (blocks,))
        for worker, kv in zip(self.work_p, self.kv_p, strict=True):
            worker.bind(plan)
            for name, layer in kv.items():
                worker.save_kv_layer(name, layer)
            worker.wait_for_save()
        params = self.sched_p.request_finished(req)
        assert params is not None
        return params

    def plan_load(self, req_id: str, tokens: int, blocks: list[int],
                  params: dict[str, Any]) -> StepPlan:
        """The decode scheduler's plan of a load of ``params`` into ``blocks``."""
        request = Request(req_id, tokens, params)
        self.sched_d.on_new_request(request)
        assert self.sched_d.get_num_new_matched_tokens(request, 0) == (tokens, True)
        self.sched_d.update_state_after_alloc(request, (blocks,), tokens)
        return self.sched_d.build_plan({}, lambda _: [])

    def load(self, req_id: str, tokens: int, blocks: list[int], params: dict[str, Any]) -> None:
        plan = self.plan_load(req_id, tokens, blocks, params)
        for worker in self.work_d:
            worker.bind(plan)
            worker.start_load_kv()
        for worker in self.work_d:
            wait_finished(worker, req_id)

    def model_heads(self, ranks: list[dict[str, torch.Tensor]], layout: BlockLayout,
                    blocks: list[int], name: str) -> torch.Tensor:
        """The model's KV of layer ``name`` in ``blocks``, every head in order (a head that
        ranks replicate, once)."""
        step = max(1, layout.tp_size // layout.model_kv_heads)
        return torch.cat([ranks[r][name][blocks] for r in range(0, layout.tp_size, step)], 1)

    def holds_model_heads(self, src: list[int], dst: list[int]) -> bool:
        """Whether every decode rank's blocks ``dst`` hold exactly its heads (replicas too)
        of what the prefill ranks computed in blocks ``src``."""
        dec = self.dec
        return all(
            torch.equal(as_tokens(kv[name][dst], dec), as_tokens(
                self.model_heads(self.kv_p, self.pre, src, name)[
                    :, rank * dec.model_kv_heads // dec.tp_size:][:, :dec.num_kv_heads],
                self.pre))
            for name in self.kv_p[0] for rank, kv in enumerate(self.kv_d))

    def close(self) -> None:
        for worker in [*self.work_p, *self.work_d]:
            worker.shutdown()


def hand_off_lands_heads(spawn: Any, pre: BlockLayout, dec: BlockLayout) -> bool:
    """Prefill a prompt on ``pre``'s ranks, load it on ``dec``'s: whether every decode rank's
    blocks hold exactly its heads of what the prefill ranks computed."""
    pool = pool_flag(pre, "kv", 128)
    daemons = spawn("prefill", [pool]), spawn("decode", [pool])
    with KvxferClient(daemons[0].worker_address) as p:
        pair = Pair(daemons, pre, dec, p)
        src, dst = [2, 3, 5, 6], [7, 11, 1, 4]
        pair.load("u", 120, dst, pair.prefill("t", 120, src))
        landed = pair.holds_model_heads(src, dst)
        pair.close()
        return landed


def test_negative_control_pages_copied_among_the_wrong_heads_are_caught(spawn,
                                                                        monkeypatch) -> None:
    """``sources`` switched to place each prefill rank's pages at the decode rank's first
    heads: the decode blocks then do not hold the model's heads (the check above fails)."""
    real = pull_plan.sources

    def first_heads(prefill: Any, decode: Any, rank: int) -> list[Source]:
        return [dataclasses.replace(s, places=tuple(range(len(s.places))))
                for s in real(prefill, decode, rank)]

    monkeypatch.setattr(pull_plan, "sources", first_heads)
    assert not hand_off_lands_heads(spawn, split(4, 2, 1), split(4, 1, 1))


@pytest.mark.parametrize(("pre", "dec"), [
    (split(4, 2, 2), split(4, 1, 2)),                        # pages of a prefill rank's heads
    (split(4, 2, 1), split(4, 1, 1, 64)),                    # pages of one head; blocks 32 -> 64
    (split(4, 2, 1), split(4, 2, 1)),                        # the same TP, pages of one head
    (split(4, 1, 1), split(4, 2, 1)),                        # one transfer, a part per rank
    (split(4, 1, 2), split(4, 2, 2, 64)),                    # parts of two-head pages, 32 -> 64
    (split(1, 1, 1), split(1, 2, 1)),                        # one head, replicated on decode
], ids=["tp2-to-tp1", "tp2-to-tp1-one-head-pages-block64", "tp2-to-tp2-one-head-pages",
        "tp1-to-tp2", "tp1-to-tp2-block64", "tp1-to-tp2-replicated"])
def test_each_decode_rank_gets_its_heads_from_the_prefill_ranks_that_hold_them(
        spawn, pre: BlockLayout, dec: BlockLayout) -> None:
    pool = pool_flag(pre, "kv", 128)
    assert pool == pool_flag(dec, "kv", 128)  # the same pages on both sides
    daemons = spawn("prefill", [pool]), spawn("decode", [pool])
    with KvxferClient(daemons[0].worker_address) as p, \
            KvxferClient(daemons[1].worker_address) as d:
        pair = Pair(daemons, pre, dec, p)
        src, dst = [2, 3, 5, 6], [7, 11] if dec.block_size == 64 else [7, 11, 1, 4]
        pair.load("u", 120, dst, pair.prefill("t", 120, src))
        assert pair.holds_model_heads(src, dst)
        pulls = max(pre.tp_size, dec.tp_size)  # one per prefill rank, or one per part of it
        assert len(d.transfers()) == pulls, [i.transfer_id for i in d.transfers()]
        deadline = time.monotonic() + 5.0  # releases run off the step
        while {"kv": 0} != d.leased_pages() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.leased_pages() == {"kv": 0} and d.leased_pages() == {"kv": 0}
        pair.close()


def as_tokens(kv: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Blocks ``[blocks, heads, ...]`` read through the head-major kind's views (vLLM's CPU
    blocks keep K transposed) as ``[K or V, tokens, heads, dim]``: comparable across block
    sizes."""
    spec = MhaHeadMajorSpec(1, kv.shape[1], layout.head_size, layout.dtype, layout.block_size,
                            kv.shape[0])
    k, v = (view.build(kv.contiguous().view(torch.uint8).flatten()) for view in spec.view_specs(0))
    return torch.stack([k.flatten(0, 1), v.flatten(0, 1)])


def test_pages_of_another_number_of_heads_are_refused_by_name() -> None:
    other_pages = parse_remote_prefill(
        {"do_remote_prefill": True, "kvxfer": {
            "version": 4, "transfer_id": "P/x", "peer": "127.0.0.1:1",
            "capabilities": ["0" * 32, "1" * 32], "layout": split(4, 2, 2).page.as_dict(),
            "model": dataclasses.asdict(MODEL)}}, split(4, 1, 1), MODEL)
    assert isinstance(other_pages, Refusal) and other_pages.reason == "layout"
    assert "page_heads: ours 1, theirs 2" in other_pages.detail


def test_replicated_heads_are_pulled_once_and_the_other_offers_dropped(spawn) -> None:
    """One KV head over two prefill ranks (each holds it): the decode engine (TP 1) pulls it
    from rank 0, and rank 1's offer, which nobody pulls, is dropped at once (not left to its
    deadline)."""
    pre, dec = split(1, 2, 1), split(1, 1, 1)
    pool = pool_flag(pre, "kv", 64)
    daemons = spawn("prefill", [pool]), spawn("decode", [pool])
    with KvxferClient(daemons[0].worker_address) as p, \
            KvxferClient(daemons[1].worker_address) as d:
        keeper = OfferKeeper(KvxferClient(daemons[1].worker_address), every_s=5, keep_s=20)
        pair = Pair(daemons, pre, dec, p, keeper)
        params = pair.prefill("t", 64, [2, 3])
        pair.load("u", 64, [4, 9], params)
        for name in pair.kv_p[0]:
            assert torch.equal(pair.kv_d[0][name][[4, 9]], pair.kv_p[0][name][[2, 3]])
        [pulled] = d.transfers()
        assert pulled.transfer_id == "P/t/tp0"
        deadline = time.monotonic() + 5.0
        while p.leased_pages() != {"kv": 0} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.leased_pages() == {"kv": 0}, "rank 1's offer was left to its deadline"
        assert keeper.dropped_offers == 1
        keeper.close()
        pair.close()


def test_one_failed_pull_fails_the_load_once_and_ends_its_other_pull(spawn) -> None:
    """TP 2 -> TP 1: the start of the pull of prefill rank 1's transfer is refused while the
    pull of rank 0's waits on a frozen prefill daemon (for its 20 s deadline): the decode
    rank reports the request failed once, within seconds, ends the other pull at once, and
    no page stays leased."""
    pre, dec = split(4, 2, 2), split(4, 1, 2)
    pool = pool_flag(pre, "kv", 64)
    daemons = spawn("prefill", [pool]), spawn("decode", [pool])
    with KvxferClient(daemons[0].worker_address) as p, \
            KvxferClient(daemons[1].worker_address) as d:
        pair = Pair(daemons, pre, dec, p)
        params = pair.prefill("t", 64, [2, 3])
        starts = pair.work_d[0]._loads._starts
        start = starts._start

        def refused(request: Any) -> Any:
            if request.transfer_id.endswith("/tp1"):
                raise TransferNotFoundError(f"{request.transfer_id} (this test)")
            return start(request)

        starts._start = refused  # type: ignore[method-assign]
        plan = pair.plan_load("u", 64, [4, 9], params)
        worker = pair.work_d[0]
        os.kill(daemons[0].pid, signal.SIGSTOP)
        try:
            worker.bind(plan)
            worker.start_load_kv()
            wait_finished(worker, "u", timeout_s=5.0)
            assert worker.take_failed() == {"u"}
            deadline = time.monotonic() + 5.0  # the other pull ends, its lease released
            while d.leased_pages() != {"kv": 0} and time.monotonic() < deadline:
                assert "u" not in worker.get_finished()  # reported once
                time.sleep(0.05)
            assert d.leased_pages() == {"kv": 0}
            [other] = d.transfers()
            assert other.transfer_id == "P/t/tp0" and other.state.name == "ABORTED"
            assert worker.get_finished() == set()  # reported once
        finally:
            os.kill(daemons[0].pid, signal.SIGCONT)
        pair.close()


def test_when_one_decode_rank_fails_its_part_the_other_ranks_part_is_aborted_at_once(
        spawn) -> None:
    """TP 1 -> 2: the ranks pull parts of one transfer. Rank 1's start is refused; rank 0's
    pull, from a frozen prefill daemon, would wait for its 20 s deadline, but rank 1 aborts
    it by its part's id: both ranks report the request failed within seconds."""
    pre, dec = split(4, 1, 1), split(4, 2, 1)
    pool = pool_flag(pre, "kv", 64)
    daemons = spawn("prefill", [pool]), spawn("decode", [pool])
    with KvxferClient(daemons[0].worker_address) as p, \
            KvxferClient(daemons[1].worker_address) as d:
        pair = Pair(daemons, pre, dec, p)
        params = pair.prefill("t", 64, [2, 3])

        def refused(request: Any) -> None:
            raise TransferNotFoundError(f"{request.transfer_id} (this test's rank 1)")

        pair.work_d[1]._loads._starts._start = refused  # type: ignore[method-assign]
        plan = pair.plan_load("u", 64, [4, 9], params)
        os.kill(daemons[0].pid, signal.SIGSTOP)
        try:
            for worker in pair.work_d:
                worker.bind(plan)
                worker.start_load_kv()
            for worker in pair.work_d[::-1]:  # rank 1 steps first: its failure aborts rank 0's
                wait_finished(worker, "u", timeout_s=5.0)
                assert worker.take_failed() == {"u"}
            [aborted] = d.transfers()
            assert aborted.transfer_id == "P/t#0" and aborted.state.name == "ABORTED"
            assert "rank 1's load of it failed (TRANSFER_NOT_FOUND)" in aborted.error
        finally:
            os.kill(daemons[0].pid, signal.SIGCONT)
        pair.close()


def test_a_load_whose_copy_fails_after_its_other_pull_failed_is_still_reported(
        spawn, monkeypatch) -> None:
    """TP 2 -> TP 1: rank 0's transfer lands and its copy-in starts (held); then the start of
    the pull of rank 1's is refused (the load fails, but a copy still runs, so it is not
    reported yet); then the copy fails. The load is reported failed, once."""
    pre, dec = split(4, 2, 2), split(4, 1, 2)
    pool = pool_flag(pre, "kv", 64)
    daemons = spawn("prefill", [pool]), spawn("decode", [pool])
    entered, proceed = threading.Event(), threading.Event()

    def failing_copy(self: Any, *args: Any) -> None:
        entered.set()
        proceed.wait(10.0)
        raise RuntimeError("this test's copy-in fails")

    monkeypatch.setattr(PagedBlocks, "copy_in", failing_copy)
    with KvxferClient(daemons[0].worker_address) as p:
        pair = Pair(daemons, pre, dec, p)
        params = pair.prefill("t", 64, [2, 3])
        worker = pair.work_d[0]
        start = worker._loads._starts._start

        def late_refusal(request: Any) -> Any:
            if request.transfer_id.endswith("/tp1"):
                entered.wait(10.0)
                raise TransferNotFoundError(f"{request.transfer_id} (this test)")
            return start(request)

        worker._loads._starts._start = late_refusal  # type: ignore[method-assign]
        worker.bind(pair.plan_load("u", 64, [4, 9], params))
        worker.start_load_kv()
        deadline = time.monotonic() + 10.0
        while not worker.load_failures["TRANSFER_NOT_FOUND"]:  # the other pull fails
            assert "u" not in worker.get_finished()
            assert time.monotonic() < deadline, "the refused start never ended"
            time.sleep(0.02)
        for _ in range(10):  # its copy still runs: not reported
            assert "u" not in worker.get_finished(), "reported while its copy still ran"
            time.sleep(0.02)
        proceed.set()
        while "u" not in worker.get_finished():
            assert time.monotonic() < deadline, "the load was never reported"
            time.sleep(0.02)
        assert worker.take_failed() == {"u"}
        time.sleep(0.2)
        assert worker.get_finished() == set()  # once
        pair.close()
