"""The vLLM connector's halves without vLLM: real daemons, KV blocks in plain tensors.

The scheduler and worker halves take vLLM's objects by the few attributes they
read, so these tests hand them stand-ins (a request id, its kv_transfer_params,
its prompt length and status) and KV caches shaped as vLLM's CPU backend keeps
them, and move the blocks through two real daemons. ``test_vllm.py`` runs the
same code inside real vLLM engines.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvxfer.client import KvxferClient
from kvxfer.client.integrations.vllm.layout import BlockLayout, PageLayout, check_pool, pool_flag
from kvxfer.client.integrations.vllm.model_identity import ModelIdentity
from kvxfer.client.integrations.vllm.protocol import RemotePrefill, parse_remote_prefill
from kvxfer.client.integrations.vllm.scheduler import SchedulerSide
from kvxfer.client.integrations.vllm.settings import load_settings
from kvxfer.client.integrations.vllm.worker import WorkerSide
from kvxfer.errors import IncompatibleLayoutError, InvalidSpecError, TransferNotFoundError

LAYOUT = BlockLayout(dtype="bfloat16", block_size=32, num_layers=2, num_kv_heads=2,
                     head_size=64, tp_size=1, block_format="mha_head_major")
MODEL = ModelIdentity(fingerprint="0123456789abcdef" * 2, name="tiny", vllm_version="0.32.0")
POOL = pool_flag(LAYOUT, "kv", 64)
NUM_BLOCKS = 16


@dataclass
class Request:
    """The attributes of vLLM's Request the connector reads (the prompt's token ids are
    ``0..num_prompt_tokens-1`` shifted by ``seed``)."""

    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    status: Any = field(default_factory=lambda: SimpleNamespace(name="FINISHED_LENGTH_CAPPED"))
    seed: int = 0
    cache_salt: str | None = None
    prompt_embeds: Any = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return [self.seed + i for i in range(self.num_prompt_tokens)]


def kv_caches(seed: int) -> dict[str, torch.Tensor]:
    """Two layers of KV cache as vLLM's CPU backend shapes them: [blocks, heads, slots, 2*dim]."""
    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(NUM_BLOCKS, 2, 32, 128, generator=gen)
            .to(torch.bfloat16) for i in range(2)}


def save_prompt(sched: SchedulerSide, worker: WorkerSide, kv: dict[str, torch.Tensor],
                req: Request, tables: tuple[list[int], ...]) -> dict[str, Any]:
    """A prefill engine's halves finish ``req`` (``do_remote_decode``) in blocks ``tables``
    (one per KV cache group) in one step and save it: the params its response carries."""
    tokens = req.num_prompt_tokens
    sched.update_state_after_alloc(req, tables, 0)
    worker.bind(sched.build_plan({req.request_id: (0, tokens)}, lambda _: tables))
    for layer, blocks in kv.items():
        worker.save_kv_layer(layer, blocks)
    worker.wait_for_save()
    params = sched.request_finished(req)
    assert params is not None, "the prefill side offered nothing"
    return params


def settings(daemon: str, **extra: Any):
    return load_settings({"daemon": daemon, "pool": "kv", "timeout_s": 20, **extra})


def wait_finished(worker: WorkerSide, req_id: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while req_id not in worker.get_finished():
        assert time.monotonic() < deadline, f"{req_id} never finished loading"
        time.sleep(0.02)


@pytest.fixture
def pair(spawn):
    """A prefill and a decode daemon whose pools hold this layout's blocks."""
    return spawn("prefill", [POOL]), spawn("decode", [POOL])


@dataclass
class Engines:
    """A prefill and a decode engine's connector halves, each on its own daemon."""

    pre: Any
    dec: Any
    sched_p: SchedulerSide
    sched_d: SchedulerSide
    work_p: WorkerSide
    work_d: WorkerSide
    kv_p: dict[str, torch.Tensor]
    kv_d: dict[str, torch.Tensor]

    def prefill(self, req_id: str, src: list[int], seed: int = 0) -> dict[str, Any]:
        """Prefill a prompt of ``len(src)`` blocks (token ids shifted by ``seed``) in blocks
        ``src`` and save it: the params its response carries."""
        req = Request(req_id, 32 * len(src), {"do_remote_decode": True}, seed=seed)
        return save_prompt(self.sched_p, self.work_p, self.kv_p, req, (src,))

    def hand_off(self, name: str, src: list[int], dst: list[int]) -> tuple[bool, set[str]]:
        """One prompt of ``len(src)`` blocks from prefill blocks ``src`` to decode blocks
        ``dst``: whether every layer's blocks arrived equal, and the loads reported failed."""
        tokens = 32 * len(src)
        params = self.prefill(f"{name}-p", src)
        dreq = Request(f"{name}-d", tokens, params)
        assert self.sched_d.get_num_new_matched_tokens(dreq, 0) == (tokens, True)
        self.sched_d.update_state_after_alloc(dreq, (dst,), tokens)
        self.work_d.bind(self.sched_d.build_plan({}, lambda _: []))
        self.work_d.start_load_kv()
        wait_finished(self.work_d, dreq.request_id, timeout_s=30)
        errors = self.work_d.take_failed()
        equal = all(torch.equal(self.kv_d[k][dst], self.kv_p[k][src]) for k in self.kv_p)
        return equal, errors

    def fresh_kv(self, seed: int) -> None:
        """New prefill KV (so that what arrived cannot be left over from earlier)."""
        for layer, kv in kv_caches(seed).items():
            self.kv_p[layer].copy_(kv)


def engines_on(pre: Any, dec: Any, client: KvxferClient, seed: int = 1) -> Engines:
    """Both engines' halves (TP 1) on daemons ``pre`` and ``dec`` (``client``: the prefill
    scheduler's), with KV caches seeded ``seed`` and ``seed + 1``, registered."""
    parts = Engines(
        pre, dec,
        SchedulerSide(settings(pre.worker_address), LAYOUT, MODEL, "P", producer=True, consumer=False,
                      client=client),
        SchedulerSide(settings(dec.worker_address), LAYOUT, MODEL, "D", producer=False, consumer=True,
                      client=None),
        WorkerSide(settings(pre.worker_address), LAYOUT, "P"),
        WorkerSide(settings(dec.worker_address), LAYOUT, "D"),
        kv_caches(seed), kv_caches(seed + 1))
    parts.work_p.register_kv_caches(parts.kv_p)
    parts.work_d.register_kv_caches(parts.kv_d)
    return parts


def test_blocks_cross_two_daemons_byte_exact_and_leave_no_page_leased(pair) -> None:
    pre, dec = pair
    with KvxferClient(pre.worker_address) as p:
        h = engines_on(pre, dec, p, seed=1)
        sched_p, sched_d, work_p, work_d, kv_p, kv_d = (h.sched_p, h.sched_d, h.work_p, h.work_d,
                                                        h.kv_p, h.kv_d)
        decode_before = {k: v.clone() for k, v in kv_d.items()}

        # Prefill: a 70-token prompt in blocks 3, 7, 9 is finished this step.
        req = Request("r1", 70, {"do_remote_decode": True})
        sched_p.update_state_after_alloc(req, ([3, 7, 9],), 0)
        plan = sched_p.build_plan({"r1": (0, 70)}, lambda _: ([3, 7, 9],))
        assert [s.block_tables for s in plan.saves] == [((3, 7, 9),)]
        assert plan.saves[0].capabilities == ()  # the workers' plan carries no secret
        work_p.bind(plan)
        for name, kv in kv_p.items():
            work_p.save_kv_layer(name, kv)
        work_p.wait_for_save()
        assert work_p.get_finished() == set()  # the step ends (vLLM asks every worker)
        params = sched_p.request_finished(req)
        assert params is not None and params["do_remote_prefill"] is True
        remote = parse_remote_prefill(params, LAYOUT, MODEL)
        assert isinstance(remote, RemotePrefill) and remote.peer == pre.peer_address
        assert "num_tokens" not in params["kvxfer"] and params["kvxfer"]["version"] == 4

        # Decode: the 70 tokens are an async external hit, loaded into blocks 1, 2, 5.
        dreq = Request("d1", 70, params)
        assert sched_d.get_num_new_matched_tokens(dreq, 0) == (70, True)
        sched_d.update_state_after_alloc(dreq, ([1, 2, 5],), 70)
        work_d.bind(sched_d.build_plan({}, lambda _: []))
        work_d.start_load_kv()
        wait_finished(work_d, "d1")
        assert work_d.take_failed() == set()
        for work in (work_p, work_d):  # each step that saved or loaded counted its time
            steps = (work.interval.take() or {}).get("step_seconds", [])
            assert steps and all(0 < s < 5 for s in steps), steps
        for name in kv_d:
            expected = decode_before[name].clone()
            expected[[1, 2, 5]] = kv_p[name][[3, 7, 9]]
            assert torch.equal(kv_d[name], expected), name
        with KvxferClient(dec.worker_address) as d:
            assert p.leased_pages() == {"kv": 0} and d.leased_pages() == {"kv": 0}
        work_p.shutdown()
        work_d.shutdown()


@pytest.mark.parametrize("lie", [True, False], ids=["lying-params", "negative-control"])
def test_params_that_lie_about_the_prefill_engines_model_fail_at_the_prefill_daemon(
        pair, monkeypatch, lie: bool) -> None:
    """The prefill engine runs another model (another fingerprint); its params are edited to
    claim the decode engine's, so the decode engine accepts them. The prefill daemon still
    refuses the pull (PROMPT_MISMATCH): each side binds its prompt digest to its own model.
    Negative control: digests bound to no engine (the old encoding) let the other model's
    KV load."""
    from kvxfer.client.integrations.vllm import scheduler

    if not lie:
        monkeypatch.setattr(scheduler, "engine_binding", lambda layout, fingerprint: b"")
    pre, dec = pair
    with KvxferClient(pre.worker_address) as p:
        h = engines_on(pre, dec, p, seed=9)
        other = ModelIdentity("f" * 32, "another-model", MODEL.vllm_version)
        h.sched_p = SchedulerSide(settings(pre.worker_address), LAYOUT, other, "P", producer=True,
                                  consumer=False, client=p)
        params = h.prefill("liar-p", [3, 7])
        assert params["kvxfer"]["model"]["fingerprint"] == other.fingerprint
        params["kvxfer"]["model"]["fingerprint"] = MODEL.fingerprint
        dreq = Request("liar-d", 64, params)
        assert h.sched_d.get_num_new_matched_tokens(dreq, 0) == (64, True)
        h.sched_d.update_state_after_alloc(dreq, ([1, 2],), 64)
        h.work_d.bind(h.sched_d.build_plan({}, lambda _: []))
        h.work_d.start_load_kv()
        wait_finished(h.work_d, "liar-d", timeout_s=30)
        assert h.work_d.take_failed() == ({"liar-d"} if lie else set())
        h.work_p.shutdown()
        h.work_d.shutdown()


def test_with_a_local_prefix_hit_only_the_blocks_past_it_cross_the_wire(pair) -> None:
    """The decode engine's prefix cache holds the first block: its page is not pulled (the
    daemons move 2 of the 3 pages), the block keeps its bytes, the others get the prefill's;
    the interval's figures count the 2 pages."""
    pre, dec = pair
    with KvxferClient(pre.worker_address) as p:
        h = engines_on(pre, dec, p, seed=3)
        decode_before = {k: v.clone() for k, v in h.kv_d.items()}
        dreq = Request("d2", 96, h.prefill("r2", [3, 7, 9]))
        assert h.sched_d.get_num_new_matched_tokens(dreq, 32) == (64, True)
        h.sched_d.update_state_after_alloc(dreq, ([1, 2, 5],), 64)
        h.work_d.bind(h.sched_d.build_plan({}, lambda _: []))
        h.work_d.start_load_kv()
        wait_finished(h.work_d, "d2")
        assert h.work_d.take_failed() == set()
        for name in h.kv_d:
            expected = decode_before[name].clone()
            expected[[2, 5]] = h.kv_p[name][[7, 9]]
            assert torch.equal(h.kv_d[name], expected), name
        moved = [i for i in p.transfers() if i.transfer_id.endswith("/r2")]
        assert [i.pages for i in moved] == [2] and moved[0].ok
        figures = h.work_d.interval.take()
        assert figures is not None and figures["load_pages"] == [2]
        assert figures["load_bytes"] == [2 * LAYOUT.num_layers * LAYOUT.block_bytes]
        h.work_p.shutdown()
        h.work_d.shutdown()


def test_a_layout_that_differs_is_refused_naming_every_difference(caplog) -> None:
    theirs = PageLayout(**{**LAYOUT.as_dict(), "page_size": 16, "block_format": "LBHNC/cpu-amx"})
    params = RemotePrefill("P/x", "127.0.0.1:1", ("0" * 32,), theirs, MODEL).to_params()
    sched = SchedulerSide(settings("unix:///nowhere"), LAYOUT, MODEL, "D", producer=False, consumer=True,
                          client=None)
    req = Request("x", 40, params)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # computed here, nothing loaded
    assert sched.refusals == {"layout": 1}
    assert "page_size: ours 32, theirs 16" in caplog.text
    assert "block_format: ours 'mha_head_major', theirs 'LBHNC/cpu-amx'" in caplog.text
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False) and sched.refusals == {"layout": 1}


def test_compatibility_is_by_bytes_and_model_not_by_names_or_versions(caplog) -> None:
    """The same bytes and model under another path and vLLM release load; the same bytes of
    another model (another fingerprint) are refused, naming both."""
    sched = SchedulerSide(settings("unix:///nowhere"), LAYOUT, MODEL, "D", producer=False, consumer=True,
                          client=None)
    renamed = ModelIdentity(MODEL.fingerprint, "/elsewhere/tiny", "0.31.0")
    params = RemotePrefill("P/a", "127.0.0.1:1", ("0" * 32,), LAYOUT.page, renamed).to_params()
    assert sched.get_num_new_matched_tokens(Request("a", 40, params), 0) == (40, True)
    other = ModelIdentity("f" * 32, "tiny", "0.32.0")
    params = RemotePrefill("P/b", "127.0.0.1:1", ("0" * 32,), LAYOUT.page, other).to_params()
    assert sched.get_num_new_matched_tokens(Request("b", 40, params), 0) == (0, False)
    assert sched.refusals == {"model": 1}
    assert f"fingerprint {'f' * 32} ('tiny'), ours {MODEL.fingerprint} ('tiny')" in caplog.text


@dataclass
class PendingLoad:
    """A decode engine's halves with one load in flight: a pull of a transfer never offered."""

    sched: SchedulerSide
    worker: WorkerSide
    request: Request
    kv: dict[str, torch.Tensor]
    before: dict[str, torch.Tensor]

    def untouched(self) -> bool:
        return all(torch.equal(self.kv[k], self.before[k]) for k in self.kv)


@contextmanager
def pending_load(pre, dec, req_id: str, **extra: Any) -> Iterator[PendingLoad]:
    """Start loading a 64-token prompt into blocks 8 and 9 from a prefill daemon frozen
    (SIGSTOP) for the duration, so that the load stays in flight."""
    params = RemotePrefill("P/frozen", pre.peer_address, ("0" * 32,), LAYOUT.page, MODEL).to_params()
    sched = SchedulerSide(settings(dec.worker_address), LAYOUT, MODEL, "D", producer=False, consumer=True,
                          client=None)
    worker = WorkerSide(settings(dec.worker_address, **extra), LAYOUT, "D")
    kv = kv_caches(4)
    worker.register_kv_caches(kv)
    request = Request(req_id, 64, params)
    sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, ([8, 9],), 64)
    os.kill(pre.pid, signal.SIGSTOP)
    try:
        worker.bind(sched.build_plan({}, lambda _: []))
        worker.start_load_kv()
        with KvxferClient(dec.worker_address) as d:  # the start is made off the step
            deadline = time.monotonic() + 10.0
            while not d.transfers():
                assert time.monotonic() < deadline, "the pull was never registered"
                time.sleep(0.01)
        yield PendingLoad(sched, worker, request, kv, {k: v.clone() for k, v in kv.items()})
    finally:
        os.kill(pre.pid, signal.SIGCONT)
        worker.shutdown()


def test_a_request_that_ends_while_loading_is_cancelled_reported_finished_and_untouched(pair) -> None:
    """vLLM frees the blocks of a request that ended while waiting for its KV only once the
    connector reports its load finished: the cancelled load is reported, exactly once."""
    pre, dec = pair
    with pending_load(pre, dec, "gone") as load, KvxferClient(dec.worker_address) as d:
        assert load.worker.get_finished() == set()
        assert d.leased_pages() == {"kv": 2}
        assert load.sched.request_finished(load.request) is None  # the client went away
        load.worker.bind(load.sched.build_plan({}, lambda _: []))
        load.worker.start_load_kv()
        deadline = time.monotonic() + 5.0  # the abort and the end are off the step
        while (info := d.transfers()[0]).state.name != "ABORTED" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert info.state.name == "ABORTED" and "its request ended" in info.error
        finished = set()
        while not finished and time.monotonic() < deadline:
            finished = load.worker.get_finished()
        assert finished == {"gone"} and load.worker.take_failed() == set()
        while d.leased_pages() != {"kv": 0} and time.monotonic() < deadline:
            assert load.worker.get_finished() == set()  # reported once
            time.sleep(0.02)  # released, off the step, once the daemon told the end
        assert d.leased_pages() == {"kv": 0}
        assert load.worker.get_finished() == set()
        assert load.untouched()


def test_a_daemon_that_dies_mid_load_fails_the_load_and_not_the_engine(pair, monkeypatch) -> None:
    monkeypatch.setattr("kvxfer.client.engine_core.loads.EXPIRY_GRACE_S", 0.0)
    pre, dec = pair
    with pending_load(pre, dec, "orphan", timeout_s=1) as load:
        dec.kill()
        assert load.worker.get_finished() == set()  # the daemon does not answer: the load waits
        time.sleep(1.1)
        assert load.worker.get_finished() == {"orphan"} and load.worker.take_failed() == {"orphan"}
        assert load.untouched()


def test_without_daemon_pages_the_decode_engine_computes_the_prompt(spawn) -> None:
    pre = spawn("small", [pool_flag(LAYOUT, "kv", 2)])  # room for 2 blocks, the prompt needs 3
    with KvxferClient(pre.worker_address) as p:
        sched = SchedulerSide(settings(pre.worker_address), LAYOUT, MODEL, "P", producer=True,
                              consumer=False, client=p)
        req = Request("big", 70, {"do_remote_decode": True})
        sched.update_state_after_alloc(req, ([0, 1, 2],), 0)
        assert sched.build_plan({"big": (0, 70)}, lambda _: ([0, 1, 2],)).saves == []
        assert sched.request_finished(req) is None  # no remote prefill: decode computes it


def test_a_pool_that_does_not_hold_the_blocks_is_refused_with_the_flag_that_would(spawn) -> None:
    d = spawn("wrong", ["name=kv,preset=tiny-head-major,page_size=16",
                        "name=slots,preset=tiny,page_size=32"])
    with KvxferClient(d.worker_address) as kv:
        descriptor, _ = kv.describe("kv")
        slot_major, _ = kv.describe("slots")
    with pytest.raises(IncompatibleLayoutError, match=r"page_size is 16, the engine needs 32") as err:
        check_pool(LAYOUT, descriptor)
    assert pool_flag(LAYOUT, "kv", 64) in str(err.value)
    with pytest.raises(IncompatibleLayoutError, match=r"kind is mha, the engine needs mha_head_major"):
        check_pool(LAYOUT, slot_major)


def test_an_unknown_connector_setting_is_refused() -> None:
    with pytest.raises(InvalidSpecError, match="timeout=5.*keys:"):
        load_settings({"daemon": "unix:///x", "timeout": 5})


def test_with_tensor_parallelism_each_rank_moves_its_own_shard(pair) -> None:
    """TP 2: one lease and one transfer per rank; each rank's blocks land in the same rank."""
    pre, dec = pair
    tp2 = dataclasses.replace(LAYOUT, tp_size=2, model_kv_heads=4)
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d:
        sched_p = SchedulerSide(settings(pre.worker_address), tp2, MODEL, "P", producer=True,
                                consumer=False, client=p)
        sched_d = SchedulerSide(settings(dec.worker_address), tp2, MODEL, "D", producer=False,
                                consumer=True, client=None)
        ranks = range(2)
        work_p = [WorkerSide(settings(pre.worker_address), tp2, "P", rank) for rank in ranks]
        work_d = [WorkerSide(settings(dec.worker_address), tp2, "D", rank) for rank in ranks]
        kv_p = [kv_caches(10 + rank) for rank in ranks]
        kv_d = [kv_caches(20 + rank) for rank in ranks]
        for worker, kv in [*zip(work_p, kv_p), *zip(work_d, kv_d)]:
            worker.register_kv_caches(kv)
        req = Request("t", 40, {"do_remote_decode": True})
        sched_p.update_state_after_alloc(req, ([2, 3],), 0)
        plan = sched_p.build_plan({"t": (0, 40)}, lambda _: ([2, 3],))
        [save] = plan.saves
        assert len(save.lease_ids) == 2 and not set(save.pages[0]) & set(save.pages[1])
        for worker, kv in zip(work_p, kv_p):
            worker.bind(plan)
            for name, layer in kv.items():
                worker.save_kv_layer(name, layer)
            worker.wait_for_save()
        params = sched_p.request_finished(req)
        dreq = Request("u", 40, params)
        sched_d.get_num_new_matched_tokens(dreq, 0)
        sched_d.update_state_after_alloc(dreq, ([7, 11],), 40)
        dplan = sched_d.build_plan({}, lambda _: [])
        for worker in work_d:
            worker.bind(dplan)
            worker.start_load_kv()
        for worker in work_d:
            wait_finished(worker, "u")
        for rank in ranks:
            for name in kv_d[rank]:
                assert torch.equal(kv_d[rank][name][[7, 11]], kv_p[rank][name][[2, 3]]), (rank, name)
        assert {i.transfer_id.rsplit("/", 1)[-1] for i in d.transfers()} == {"tp0", "tp1"}
        assert p.leased_pages() == {"kv": 0} and d.leased_pages() == {"kv": 0}
        for worker in [*work_p, *work_d]:
            worker.shutdown()


def split_load(pre: Any, dec: Any, req_id: str, seed: int) -> tuple[list[WorkerSide], Any]:
    """The two decode workers (TP 2) of a 64-token load of ``req_id`` from the offer
    ``P/<req_id>`` of daemon ``pre``, and the step plan that starts it; rank 1's start is
    refused (TRANSFER_NOT_FOUND) without a call."""
    tp2 = dataclasses.replace(LAYOUT, tp_size=2, model_kv_heads=4)
    params = RemotePrefill(f"P/{req_id}", pre.peer_address, ("0" * 32, "1" * 32), tp2.page,
                           MODEL).to_params()
    sched = SchedulerSide(settings(dec.worker_address), tp2, MODEL, "D", producer=False,
                          consumer=True, client=None)
    workers = [WorkerSide(settings(dec.worker_address), tp2, "D", rank) for rank in range(2)]
    for rank, worker in enumerate(workers):
        worker.register_kv_caches(kv_caches(seed + rank))

    def refused(request: Any) -> None:
        raise TransferNotFoundError(f"{request.transfer_id} is not offered (this test's rank 1)")

    workers[1]._loads._starts._start = refused  # type: ignore[method-assign]
    request = Request(req_id, 64, params)
    sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, ([8, 9],), 64)
    return workers, sched.build_plan({}, lambda _: [])


def test_when_one_rank_fails_its_load_the_sibling_ranks_transfers_are_aborted_at_once(pair) -> None:
    """TP 2: rank 1's load fails at its start; rank 0's pull from a frozen prefill daemon
    would wait for its 20 s deadline, but rank 1 aborts it: both ranks report the request
    failed within seconds, and no page stays leased."""
    pre, dec = pair
    workers, plan = split_load(pre, dec, "split", seed=30)
    os.kill(pre.pid, signal.SIGSTOP)
    try:
        for worker in workers:
            worker.bind(plan)
            worker.start_load_kv()
        wait_finished(workers[1], "split", timeout_s=5.0)
        assert workers[1].take_failed() == {"split"}
        wait_finished(workers[0], "split", timeout_s=5.0)
        assert workers[0].take_failed() == {"split"}
        with KvxferClient(dec.worker_address) as d:
            [info] = d.transfers()
            assert info.transfer_id == "P/split/tp0" and info.state.name == "ABORTED"
            assert "rank 1's load of it failed (TRANSFER_NOT_FOUND)" in info.error
            deadline = time.monotonic() + 5.0  # releases run off the step
            while d.leased_pages() != {"kv": 0} and time.monotonic() < deadline:
                time.sleep(0.05)
            assert d.leased_pages() == {"kv": 0}
    finally:
        os.kill(pre.pid, signal.SIGCONT)
        for worker in workers:
            worker.shutdown()
