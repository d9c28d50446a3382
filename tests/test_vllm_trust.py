"""The connector's failure contract without vLLM: real daemons killed and restarted, bad saves.

Each guard has a negative control: the same scenario with the guard switched off
(a test-only seam: ``monkeypatch`` of the one method that implements it) shows the
bad outcome the guard prevents, so the guard's test can fail.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import settings as examples
from hypothesis import strategies as st
from test_vllm_connector import (
    LAYOUT,
    MODEL,
    POOL,
    Engines,
    Request,
    engines_on,
    wait_finished,
)

from kvxfer.client import KvxferClient
from kvxfer.client.completion_feed import CompletionFeed
from kvxfer.client.engine_core.loads import PageLoads
from kvxfer.client.engine_core.pull_starts import PullStarts
from kvxfer.client.integrations.vllm.protocol import RemotePrefill
from kvxfer.client.integrations.vllm.worker import WorkerSide
from kvxfer.status import LeaseUse
from kvxfer.wire.codec import lease_use_to_proto


@pytest.fixture(name="engines")
def engines_fixture(spawn):
    pre, dec = spawn("prefill", [POOL]), spawn("decode", [POOL])
    client = KvxferClient(pre.worker_address)
    parts = engines_on(pre, dec, client)
    yield parts
    parts.work_p.shutdown()
    parts.work_d.shutdown()
    client.close()
    assert workers_threads_end(), "a worker's completions or release thread outlived it"


def workers_threads_end(within_s: float = 3.0) -> bool:
    """Whether every thread a worker half starts (its completions feed, its releases) ends
    within ``within_s`` (a feed dropped at a re-attach ends with its call in flight)."""
    def left() -> list[str]:
        return [t.name for t in threading.enumerate()
                if t.name.startswith(("kvxfer-completions", "kvxfer-release",
                                          "kvxfer-pull-starts", "kvxfer-landings"))]
    deadline = time.monotonic() + within_s
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not left()


def mapped(path: str) -> bool:
    """Whether this process maps the file at ``path`` (Linux marks it "(deleted)" once the
    file is unlinked, as a killed daemon's arena is)."""
    return any(line.endswith((path, f"{path} (deleted)"))
               for line in Path("/proc/self/maps").read_text().splitlines())


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_after_a_daemon_restart_the_engines_reattach_and_the_kv_is_right(engines, side) -> None:
    assert engines.hand_off("before", [3, 7], [1, 2]) == (True, set())
    daemon = engines.dec if side == "decode" else engines.pre
    worker = engines.work_d if side == "decode" else engines.work_p
    old = worker._blocks.memory.shm.path
    assert mapped(old)
    daemon.restart()
    engines.fresh_kv(5)
    assert engines.hand_off("after", [4, 9], [5, 6]) == (True, set())
    assert worker._blocks.memory.shm.path != old and not mapped(old)  # the old arena is let go
    engines.fresh_kv(6)
    assert engines.hand_off("again", [0, 1], [7, 8]) == (True, set())


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_negative_control_without_reattaching_a_restart_changes_the_kv(engines, side,
                                                                        monkeypatch) -> None:
    """The guard switched off (``_current`` keeps the old mapping, no epoch on the verbs,
    not even the library's default):
    the restarted daemon moves memory the engine never wrote, or fills memory it never reads."""
    completions = KvxferClient.completions
    monkeypatch.setattr(WorkerSide, "_current", lambda self, epoch: None)
    monkeypatch.setattr(KvxferClient, "completions", lambda self, *args, **kwargs: dataclasses.replace(
        completions(self, *args, **kwargs), epoch=""))
    for worker in (engines.work_p, engines.work_d):
        monkeypatch.setattr(worker._blocks, "epoch", "")
        monkeypatch.setattr(worker._loads, "_epoch", "")
    monkeypatch.setattr(KvxferClient, "_lease", lambda self, pool, lease_id, release, epoch:
                        lease_use_to_proto(LeaseUse(lease_id, release, "")))
    (engines.dec if side == "decode" else engines.pre).restart()
    engines.fresh_kv(5)
    equal, errors = engines.hand_off("after", [4, 9], [5, 6])
    assert not equal and errors == set()  # wrong KV, and nothing says so


@pytest.mark.parametrize("lost", [True, False], ids=["guarded", "negative-control"])
def test_a_load_in_flight_when_its_daemon_restarts_fails_at_once(engines, monkeypatch,
                                                                  lost: bool) -> None:
    """Its transfer died with the daemon: the load fails as soon as the worker hears of the
    new daemon (within about two seconds), not at its deadline (30 s). The prefill daemon is stopped
    (SIGSTOP) so that the pull stays in flight. Negative control: without ``_lost`` the
    load would wait for its deadline."""
    if not lost:
        monkeypatch.setattr(PageLoads, "_lost", lambda self, epoch: [])
    params = {"do_remote_prefill": True, "do_remote_decode": False,
              "kvxfer": {"version": 4, "transfer_id": "P/frozen", "peer": engines.pre.peer_address,
                         "capabilities": ["0" * 32], "layout": LAYOUT.as_dict(),
                         "model": dataclasses.asdict(MODEL)}}
    dreq = Request("orphan", 64, params)
    assert engines.sched_d.get_num_new_matched_tokens(dreq, 0) == (64, True)
    engines.sched_d.update_state_after_alloc(dreq, ([8, 9],), 64)
    os.kill(engines.pre.pid, signal.SIGSTOP)
    try:
        engines.work_d.bind(engines.sched_d.build_plan({}, lambda _: []))
        engines.work_d.start_load_kv()
        time.sleep(0.5)
        assert engines.work_d.get_finished() == set()  # the pull waits on the frozen daemon
        engines.dec.restart()
        finished = set()
        until = time.monotonic() + 3.0
        while not finished and time.monotonic() < until:
            finished = engines.work_d.get_finished()
    finally:
        os.kill(engines.pre.pid, signal.SIGCONT)
    assert (finished, engines.work_d.take_failed()) == (({"orphan"}, {"orphan"}) if lost
                                                        else (set(), set()))


@pytest.mark.parametrize("idle", [True, False], ids=["idle-step", "busy-step"])
def test_only_a_step_that_computes_nothing_waits_for_endings(engines, monkeypatch,
                                                             idle: bool) -> None:
    """A step that computes no token, with a load in flight, waits up to ``idle_wait_s`` for
    endings (instead of spinning a core the daemons need); a step that computes tokens
    never waits. The prefill daemon is stopped (SIGSTOP) so that the pull stays in flight."""
    waits: list[float] = []
    wait = CompletionFeed.wait
    monkeypatch.setattr(CompletionFeed, "wait",
                        lambda self, timeout_s: waits.append(timeout_s) or wait(self, timeout_s))
    wait_start = PullStarts.wait  # a step with only a start in flight waits for it instead
    monkeypatch.setattr(PullStarts, "wait", lambda self, timeout_s: waits.append(timeout_s)
                        or wait_start(self, timeout_s))
    params = {"do_remote_prefill": True, "do_remote_decode": False,
              "kvxfer": {"version": 4, "transfer_id": "P/frozen", "peer": engines.pre.peer_address,
                         "capabilities": ["0" * 32], "layout": LAYOUT.as_dict(),
                         "model": dataclasses.asdict(MODEL)}}
    dreq = Request("waiting", 64, params)
    engines.sched_d.get_num_new_matched_tokens(dreq, 0)
    engines.sched_d.update_state_after_alloc(dreq, ([8, 9],), 64)
    os.kill(engines.pre.pid, signal.SIGSTOP)
    try:
        engines.work_d.bind(engines.sched_d.build_plan({}, lambda _: []))
        engines.work_d.start_load_kv()
        busy = {"running": (64, 1)}
        for _ in range(3):
            engines.work_d.bind(engines.sched_d.build_plan({} if idle else busy, lambda _: []))
            assert engines.work_d.get_finished() == set()
    finally:
        os.kill(engines.pre.pid, signal.SIGCONT)
    assert waits == ([engines.work_d._settings.idle_wait_s] * 3 if idle else [])


def test_a_save_that_fails_part_way_is_never_offered(engines, caplog) -> None:
    """One layer's copy fails: the pages are not offered (the decode side computes the prompt)
    and go back to the pool; the engine's loop sees no exception."""
    req = Request("half", 64, {"do_remote_decode": True})
    engines.sched_p.update_state_after_alloc(req, ([2, 3],), 0)
    plan = engines.sched_p.build_plan({"half": (0, 64)}, lambda _: ([2, 3],))
    engines.work_p.bind(plan)
    first, second = list(engines.kv_p)
    engines.work_p.save_kv_layer(first, engines.kv_p[first])
    engines.work_p.save_kv_layer(second, torch.zeros(1, dtype=torch.bfloat16))  # not blocks
    engines.work_p.wait_for_save()
    assert "its KV was not saved" in caplog.text
    with KvxferClient(engines.pre.worker_address) as p:
        assert p.transfers() == [] and p.leased_pages() == {"kv": 0}


def forged_hand_off(engines: Engines, decode_seed: int) -> tuple[str, set[str], bool]:
    """Prefill a 2-block prompt (seed 0), then send its params with a decode request whose
    prompt has the same length but ``decode_seed``'s tokens: that request's id, the loads
    reported failed, and whether the decode blocks got the prefill KV."""
    params = engines.prefill("a-p", [3, 7])
    forged = Request("b-d", 64, params, seed=decode_seed)
    assert engines.sched_d.get_num_new_matched_tokens(forged, 0) == (64, True)
    engines.sched_d.update_state_after_alloc(forged, ([5, 6],), 64)
    engines.work_d.bind(engines.sched_d.build_plan({}, lambda _: []))
    engines.work_d.start_load_kv()
    wait_finished(engines.work_d, "b-d", timeout_s=30)
    got = all(torch.equal(engines.kv_d[k][[5, 6]], engines.kv_p[k][[3, 7]]) for k in engines.kv_p)
    return "b-d", engines.work_d.take_failed(), got


def test_params_replayed_for_another_prompt_do_not_load_its_kv(engines) -> None:
    """The decode connector's digest of its own prompt differs from the one the prefill
    connector offered with: the prefill daemon refuses, the load fails (vLLM recomputes)."""
    before = {k: v.clone() for k, v in engines.kv_d.items()}
    rid, failed, got = forged_hand_off(engines, decode_seed=1)
    assert failed == {rid} and not got
    assert all(torch.equal(engines.kv_d[k], before[k]) for k in before)


def test_negative_control_without_the_prompt_digest_another_prompts_kv_loads(
        engines, monkeypatch) -> None:
    monkeypatch.setattr("kvxfer.client.integrations.vllm.scheduler.prompt_digest",
                        lambda request, engine=b"": b"")
    rid, failed, got = forged_hand_off(engines, decode_seed=1)
    assert failed == set() and got  # KV of prompt A served as prompt B's, and nothing says so


def test_a_failed_entry_point_fails_only_its_own_requests(engines) -> None:
    """What the connector answers when one of its entry points raised (its ``_guarded``
    fallbacks): a request whose blocks were allocated gets a load that fails at once
    (``fail_load``), a plan that could not be built fails its loads (``failed_plan``), and
    the worker reports both failed, so vLLM recomputes them instead of waiting forever."""
    sched, worker = engines.sched_d, engines.work_d
    params = RemotePrefill("P/x", engines.pre.peer_address, ("0" * 32,), LAYOUT.page, MODEL).to_params()
    first, second = Request("first", 64, dict(params)), Request("second", 64, dict(params))
    for request in (first, second):
        assert sched.get_num_new_matched_tokens(request, 0) == (64, True)
    sched.fail_load(first, ([1, 2],), 64, "update_state_after_alloc failed")
    sched.update_state_after_alloc(second, ([3, 4],), 64)
    plan = sched.failed_plan("build_connector_meta failed")
    assert [(load.req_id, load.refused) for load in plan.loads] == [
        ("first", "update_state_after_alloc failed"), ("second", "build_connector_meta failed")]
    worker.bind(plan)
    worker.start_load_kv()
    assert worker.get_finished() == worker.take_failed() == {"first", "second"}
    with KvxferClient(engines.dec.worker_address) as d:
        assert d.transfers() == [] and d.leased_pages() == {"kv": 0}  # nothing was asked


#: What the decode connector reports, by the oracle, for params a client forged from a real
#: prefill answer: the failed load's reason (None: the load is the real one and succeeds).
FORGERIES: dict[str, str | None] = {
    "none": None,
    "wrong_capability": "TRANSFER_NOT_FOUND",
    "altered_id": "TRANSFER_NOT_FOUND",
    "replayed": "TRANSFER_NOT_FOUND",
    "other_prompt": "PROMPT_MISMATCH",
    "outside_dial_policy": "DIAL_NOT_ALLOWED",
    "closed_port": "PEER_UNAVAILABLE",
}


def forge(params: dict[str, Any], forgery: str) -> dict[str, Any]:
    """``params`` as a client that edits them would send them."""
    forged = copy.deepcopy(params)
    kvxfer = forged["kvxfer"]
    if forgery == "wrong_capability":
        kvxfer["capabilities"] = ["0" * 32]
    elif forgery == "altered_id":
        kvxfer["transfer_id"] += "x"
    elif forgery == "outside_dial_policy":
        kvxfer["peer"] = "10.9.8.7:7500"  # the daemons dial loopback only (the default)
    elif forgery == "closed_port":
        kvxfer["peer"] = "127.0.0.1:1"
    return forged


def test_forged_loads_fail_for_the_reason_the_oracle_predicts(engines) -> None:
    """Generated forgeries of real params (hypothesis), each through both connector halves of
    a decode engine against real daemons: a real load succeeds byte-exact, every forged one
    is reported failed (vLLM then recomputes it) and leaves its blocks untouched, and the
    worker's failures by reason equal the oracle's counts."""
    predicted: Counter[str] = Counter()
    before = Counter(engines.work_d.load_failures)
    count = 0

    @examples(max_examples=100, database=None, deadline=None)
    @given(forgery=st.sampled_from(sorted(FORGERIES)), blocks=st.integers(1, 3))
    def one(forgery: str, blocks: int) -> None:
        nonlocal count
        count += 1
        engines.fresh_kv(count)
        src, dst = list(range(blocks)), list(range(8, 8 + blocks))
        tokens = 32 * blocks
        params = engines.prefill(f"p{count}", src, seed=count)
        asks = ([copy.deepcopy(params), copy.deepcopy(params)] if forgery == "replayed"
                else [forge(params, forgery)])
        for attempt, sent in enumerate(asks):
            seed = count + 1_000_000 if forgery == "other_prompt" else count
            decode = Request(f"d{count}.{attempt}", tokens, sent, seed=seed)
            untouched = {k: v[dst].clone() for k, v in engines.kv_d.items()}
            assert engines.sched_d.get_num_new_matched_tokens(decode, 0) == (tokens, True)
            engines.sched_d.update_state_after_alloc(decode, (dst,), tokens)
            engines.work_d.bind(engines.sched_d.build_plan({}, lambda _: []))
            engines.work_d.start_load_kv()
            wait_finished(engines.work_d, decode.request_id, timeout_s=30)
            failed = engines.work_d.take_failed()
            reason = FORGERIES[forgery] if attempt == len(asks) - 1 else None
            if reason is None:
                assert failed == set(), forgery
                assert all(torch.equal(engines.kv_d[k][dst], engines.kv_p[k][src]) for k in engines.kv_p)
            else:
                predicted[reason] += 1
                assert failed == {decode.request_id}, forgery
                assert all(torch.equal(engines.kv_d[k][dst], untouched[k]) for k in untouched)
        with KvxferClient(engines.pre.worker_address) as p:  # an offer nobody pulled ends now
            for info in p.transfers():
                if not info.state.final:
                    p.abort(info.transfer_id, "the test's case is over")

    one()
    assert engines.work_d.load_failures - before == predicted, (engines.work_d.load_failures, predicted)
    assert set(predicted) == {r for r in FORGERIES.values() if r}, predicted
