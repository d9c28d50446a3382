"""Decode loads started and landed off the engine's step (#32 point 8), two real daemons.

The worker's ``start_load_kv`` only queues its pulls; a thread makes the ``LeasePull``
calls (``engine_core.pull_starts``), and another copies landed pages into the blocks
(``engine_core.landings``). These tests check that a step returns while its daemon cannot
answer and while a copy-in is under way, and what the threads must not change: an ending
that comes back before its start is collected still lands the load, a request that ends
while its start is in flight is reported once and its pull aborted and its pages
released, and a sibling rank's abort that reaches the daemon before the pull it aborts
still ends that pull at once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_vllm_connector import POOL, Engines, Request, split_load, wait_finished
from test_vllm_trust import engines_fixture  # noqa: F401 - the trust tests' ``engines``

from kvxfer.client import KvxferClient
from kvxfer.client.engine_core.paged_blocks import PagedBlocks
from kvxfer.client.engine_core.pull_starts import PullRequest
from kvxfer.client.integrations.vllm.worker import WorkerSide


@pytest.fixture
def held_copy(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Copies into blocks wait (up to 10 s each) for the second event, once they set the first."""
    entered, proceed = threading.Event(), threading.Event()
    copy_in = PagedBlocks.copy_in

    def held(self: PagedBlocks, *args: Any) -> None:
        entered.set()
        proceed.wait(10.0)
        copy_in(self, *args)

    monkeypatch.setattr(PagedBlocks, "copy_in", held)
    return entered, proceed


def until_copy_held(h: Engines, entered: threading.Event) -> None:
    """Step the decode worker until a copy-in is held, checking that no step reports a load."""
    deadline = time.monotonic() + 10.0
    while not entered.is_set():
        assert time.monotonic() < deadline, "the load never landed"
        assert h.work_d.get_finished() == set()
        time.sleep(0.01)


def gated(worker: WorkerSide, *, before: threading.Event | None = None,
          after: threading.Event | None = None) -> None:
    """Make ``worker``'s start thread wait (up to 10 s each) for ``before`` ahead of each
    ``LeasePull`` call and for ``after`` once it returned."""
    starts = worker._loads._starts
    call: Callable[[PullRequest[Any]], Any] = starts._start

    def start(request: PullRequest[Any]) -> Any:
        if before is not None:
            before.wait(10.0)
        try:
            return call(request)
        finally:
            if after is not None:
                after.wait(10.0)

    starts._start = start  # type: ignore[method-assign]


def load(h: Engines, name: str, src: list[int], dst: list[int]) -> Request:
    """Prefill ``src`` and plan its load into decode blocks ``dst``; start_load_kv is the
    caller's."""
    params = h.prefill(f"{name}-p", src)
    dreq = Request(f"{name}-d", 32 * len(src), params)
    h.sched_d.get_num_new_matched_tokens(dreq, 0)
    h.sched_d.update_state_after_alloc(dreq, (dst,), 32 * len(src))
    h.work_d.bind(h.sched_d.build_plan({}, lambda _: []))
    return dreq


def landed(h: Engines, src: list[int], dst: list[int]) -> bool:
    return all(torch.equal(h.kv_d[k][dst], h.kv_p[k][src]) for k in h.kv_p)


def test_a_step_that_starts_a_load_returns_while_the_daemon_cannot_answer(engines) -> None:
    """The decode daemon is frozen (SIGSTOP) while the step starts a load: the step returns
    and the load is not failed; once the daemon runs again, the load lands byte-exact."""
    dreq = load(engines, "frozen-daemon", [2, 3], [6, 7])
    os.kill(engines.dec.pid, signal.SIGSTOP)
    try:
        engines.work_d.start_load_kv()
        assert engines.work_d.get_finished() == set()
    finally:
        os.kill(engines.dec.pid, signal.SIGCONT)
    wait_finished(engines.work_d, dreq.request_id)
    assert engines.work_d.take_failed() == set()
    assert landed(engines, [2, 3], [6, 7])


def test_a_step_returns_while_a_landed_load_is_copied_into_its_blocks(engines, held_copy) -> None:
    """The copy-in of a landed load waits (up to 10 s) for this test's signal: steps go on
    returning meanwhile, without the load; once the copy is let through, the load is
    reported, byte-exact, and its pages released."""
    entered, proceed = held_copy
    dreq = load(engines, "held-copy", [1, 2], [11, 12])
    engines.work_d.start_load_kv()
    until_copy_held(engines, entered)
    assert engines.work_d.get_finished() == set()  # returned while the copy is held
    assert not proceed.is_set()
    proceed.set()
    wait_finished(engines.work_d, dreq.request_id)
    assert engines.work_d.take_failed() == set()
    assert landed(engines, [1, 2], [11, 12])
    with KvxferClient(engines.dec.worker_address) as d:
        deadline = time.monotonic() + 5.0  # releases run off the step
        while d.leased_pages() != {"kv": 0} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert d.leased_pages() == {"kv": 0}


def test_a_request_that_ends_while_its_load_is_copied_in_is_reported_once(engines, held_copy) -> None:
    """The request ends while its landed load's copy-in is held: the copy finishes (vLLM
    keeps the blocks until the load is reported), the load is reported finished once, not
    failed, and its pages are released."""
    entered, proceed = held_copy
    dreq = load(engines, "gone-copying", [3, 4], [13, 14])
    engines.work_d.start_load_kv()
    until_copy_held(engines, entered)
    assert engines.sched_d.request_finished(dreq) is None  # the client went away
    engines.work_d.bind(engines.sched_d.build_plan({}, lambda _: []))
    engines.work_d.start_load_kv()
    assert engines.work_d.get_finished() == set()  # not before its copy finished
    proceed.set()
    wait_finished(engines.work_d, dreq.request_id)
    assert engines.work_d.take_failed() == set()
    with KvxferClient(engines.dec.worker_address) as d:
        deadline = time.monotonic() + 5.0
        while d.leased_pages() != {"kv": 0} and time.monotonic() < deadline:
            assert engines.work_d.get_finished() == set()  # reported once
            time.sleep(0.02)
        assert d.leased_pages() == {"kv": 0}


def test_an_ending_that_comes_before_its_start_is_collected_still_lands_the_load(engines) -> None:
    """The start thread returns only once the test lets it: the transfer's ending reaches
    the worker first (on its completion feed). The worker holds it until the start is
    collected, and the load lands byte-exact (dropped, the load would wait for its deadline)."""
    returned = threading.Event()
    gated(engines.work_d, after=returned)
    dreq = load(engines, "early-ending", [4, 5, 6], [1, 2, 3])
    engines.work_d.start_load_kv()
    deadline = time.monotonic() + 10.0
    while not engines.work_d._loads._early:  # the ending, held until its start is collected
        assert time.monotonic() < deadline, "the ending never reached the worker"
        assert engines.work_d.get_finished() == set()
        time.sleep(0.01)
    returned.set()
    wait_finished(engines.work_d, dreq.request_id, timeout_s=10)
    assert engines.work_d.take_failed() == set()
    assert landed(engines, [4, 5, 6], [1, 2, 3])


def test_a_request_that_ends_while_its_load_is_starting_is_reported_once_and_aborted(
        engines) -> None:
    """The request ends while its pull's start is in flight: it is reported finished (not
    failed) at once, exactly once; the pull, once registered, is aborted; its pages are
    released; the decode engine's blocks are untouched."""
    let_start = threading.Event()
    gated(engines.work_d, before=let_start)
    before = {k: v.clone() for k, v in engines.kv_d.items()}
    dreq = load(engines, "gone-starting", [2, 3], [9, 10])
    engines.work_d.start_load_kv()
    assert engines.sched_d.request_finished(dreq) is None  # the client went away
    engines.work_d.bind(engines.sched_d.build_plan({}, lambda _: []))
    engines.work_d.start_load_kv()
    assert engines.work_d.get_finished() == {dreq.request_id}
    assert engines.work_d.take_failed() == set()
    let_start.set()
    with KvxferClient(engines.dec.worker_address) as d:
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            assert engines.work_d.get_finished() == set()  # reported once
            states = [i.state.name for i in d.transfers()]
            if states and all(s == "ABORTED" for s in states) and d.leased_pages() == {"kv": 0}:
                break
            time.sleep(0.02)
        [info] = d.transfers()
        assert info.state.name == "ABORTED" and "its request ended" in info.error
        assert d.leased_pages() == {"kv": 0}
    assert all(torch.equal(engines.kv_d[k], before[k]) for k in before)


def test_an_abort_that_reaches_the_daemon_before_its_pull_ends_the_pull_at_once(spawn) -> None:
    """TP 2: rank 1's load fails at its start while rank 0's start waits (its thread is held
    until rank 1's abort of rank 0's transfer was made), so that abort reaches the decode
    daemon first. The daemon remembers it: rank 0's pull ends ABORTED when it is
    registered, and both ranks report the request failed within seconds, not at the pull's
    20 s deadline (the prefill daemon is frozen, so nothing else would end it)."""
    pre, dec = spawn("prefill", [POOL]), spawn("decode", [POOL])
    workers, plan = split_load(pre, dec, "split-early", seed=40)
    aborted = threading.Event()
    gated(workers[0], before=aborted)
    os.kill(pre.pid, signal.SIGSTOP)
    try:
        for worker in workers:
            worker.bind(plan)
            worker.start_load_kv()
        wait_finished(workers[1], "split-early", timeout_s=5.0)
        assert workers[1].take_failed() == {"split-early"}
        # Rank 1's aborts run in order in one thread: once this no-op ran, rank 0's was made.
        workers[1]._endings._releaser.submit(lambda: None).result(10.0)
        with KvxferClient(dec.worker_address) as d:
            assert d.transfers() == []  # the abort came first
            aborted.set()
            wait_finished(workers[0], "split-early", timeout_s=8.0)
            assert workers[0].take_failed() == {"split-early"}
            [info] = d.transfers()
            assert info.transfer_id == "P/split-early/tp0" and info.state.name == "ABORTED"
            assert "before it was registered" in info.error
            deadline = time.monotonic() + 5.0  # releases run off the step
            while d.leased_pages() != {"kv": 0} and time.monotonic() < deadline:
                time.sleep(0.05)
            assert d.leased_pages() == {"kv": 0}
    finally:
        os.kill(pre.pid, signal.SIGCONT)
        for worker in workers:
            worker.shutdown()
