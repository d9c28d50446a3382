"""The fault matrix: a fault injected mid-transfer between real daemons, on either side.

For every fault: each transfer reaches a final state no later than its deadline (or,
where the fault is a dead or silent peer, the liveness limit) plus a stated margin; a
DONE transfer's pages are byte-exact and nothing outside them changed; no UCX request
stays posted; and the surviving daemons complete new transfers without a restart.
``kill -9`` of either side is in ``test_transfers.py``; the link cut and the lossy link
between network namespaces are in ``test_netns.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import torch
from pool_checks import assert_moved, fill_random
from test_benchmarks import run_benchmark
from test_transfers import posted_requests

from kvxfer.client import KvxferClient
from kvxfer.client.library import AttachedPool
from kvxfer.errors import PeerUnavailableError
from kvxfer.pages import PageRuns
from kvxfer.server.sessions import silence_limit_s
from kvxfer.server.transfers.registry import QUIESCE_S
from kvxfer.status import TransferInfo, TransferState
from kvxfer.ucx_settings import LOOPBACK_ENV

pytestmark = pytest.mark.slow  # about 3.5 min; see docs/development.md

POOL = "name=kv,preset=llama8b"  # 512 pages of 2 MiB: a whole-pool transfer takes ~0.3 s
HEARTBEAT_S = 1.0
LIVENESS_S = silence_limit_s(HEARTBEAT_S)  # 4 s
#: How late past its deadline or the liveness limit a transfer may end (a loaded machine).
MARGIN_S = 2.0
#: An engine that writes 7 into every byte of the pool, says so, and keeps it mapped.
ENGINE = """
import sys, time
from kvxfer.client import KvxferClient
with KvxferClient(sys.argv[1]) as kv, kv.attach("kv") as pool:
    pool.raw.fill_(7)
    print("WRITTEN", flush=True)
    time.sleep(600)
"""


def daemon(spawn, name: str, *extra: str):
    """A daemon with the standard pool and Prometheus metrics, heartbeating every second."""
    return spawn(name, [POOL], metrics=True,
                 extra_args=["--heartbeat-s", str(HEARTBEAT_S), *extra])


def until(condition, timeout_s: float, what: str) -> None:
    """Poll ``condition`` every 5 ms until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still not {what} after {timeout_s} s"
        time.sleep(0.005)


def state(client: KvxferClient, transfer_id: str) -> TransferState:
    return next(t.state for t in client.transfers() if t.transfer_id == transfer_id)


def no_request_posted(*daemons) -> None:
    """Every daemon's posted UCX requests drain to 0 within 5 s."""
    for d in daemons:
        until(lambda d=d: posted_requests(d.metrics_port) == 0, 5, f"drained on {d.name}")


@contextmanager
def frozen(d) -> Iterator[None]:
    """``d``'s process stopped (SIGSTOP) inside, continued (SIGCONT) after."""
    os.kill(d.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(d.pid, signal.SIGCONT)


def ended_within(info: TransferInfo, since: float, limit_s: float) -> float:
    """How long after ``since`` (a ``time.monotonic()`` of the fault) ``info``'s transfer was
    seen final (its wait just returned); fails past ``limit_s`` + margin."""
    took = time.monotonic() - since
    assert info.state.final
    assert took <= limit_s + MARGIN_S, f"{info.transfer_id} ended {took:.1f} s after the fault"
    return took


def new_transfer_works(p: KvxferClient, d: KvxferClient, dec, src: AttachedPool,
                       dst: AttachedPool, tid: str) -> None:
    """A fresh verified transfer between the same daemons, byte-exact."""
    before = dst.raw.clone()
    src_runs, dst_runs = PageRuns.of([(0, 32)]), PageRuns.of([(100, 32)])
    expected = d.expect(tid, "kv", dst_runs, timeout_s=30)
    p.push(tid, "kv", src_runs, peer=dec.peer_address, timeout_s=30, verify=True, capability=expected.capability)
    sent, got = p.wait(tid, timeout_s=35), d.wait(tid, timeout_s=35)
    assert sent.ok and got.ok and got.verified, (sent.error, got.error)
    assert_moved(src, dst, src_runs, dst_runs, before)


def start_whole_pool(p: KvxferClient, d: KvxferClient, dec, tid: str,
                     timeout_s: float = 30) -> None:
    """Push every page of the pool, and return once the receiver is TRANSFERRING."""
    expected = d.expect(tid, "kv", PageRuns.of([(0, 512)]), timeout_s=timeout_s)
    p.push(tid, "kv", PageRuns.of([(0, 512)]), peer=dec.peer_address, timeout_s=timeout_s,
           capability=expected.capability)
    until(lambda: state(d, tid) != TransferState.WAITING, 20, "claimed")


@pytest.mark.parametrize("side", ["receiver", "sender"])
def test_a_frozen_peer_fails_transfers_by_liveness_and_is_served_again_after(spawn, side) -> None:
    pre, dec = daemon(spawn, "prefill"), daemon(spawn, "decode")
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
            p.attach("kv") as src, d.attach("kv") as dst:
        fill_random(src, 3)
        start_whole_pool(p, d, dec, "frozen")
        survivor, victim = (p, dec) if side == "receiver" else (d, pre)
        with frozen(victim):
            frozen_at = time.monotonic()
            got = survivor.wait("frozen", timeout_s=30)
            if got.ok:
                pytest.skip("the transfer completed before the freeze landed")
            assert got.error_code == "UNAVAILABLE", got.error
            took = ended_within(got, frozen_at, LIVENESS_S)  # by liveness, not the 30 s deadline
            time.sleep(0.5)
        thawed_at = time.monotonic()
        other = d if survivor is p else p
        thawed = other.wait("frozen", timeout_s=30)  # the thawed side drops the stale session
        assert not thawed.ok
        ended_within(thawed, thawed_at, LIVENESS_S)
        no_request_posted(pre, dec)
        new_transfer_works(p, d, dec, src, dst, "after-thaw")
    print(f"frozen {side}: the other side failed the transfer {took:.1f} s after the freeze")


def test_a_daemon_slow_to_answer_a_new_connection_is_waited_for(spawn) -> None:
    """A daemon that takes a second to answer a new connection (a loaded machine: CI saw
    it under two vLLM engines of two ranks each) is waited for within the call's deadline,
    by a worker's first call and by a peer's first handshake, not refused with UNAVAILABLE
    once gRPC's 0.1 s reconnect backoff passed."""
    pre, dec = daemon(spawn, "prefill"), daemon(spawn, "decode")

    def first_call() -> dict[str, int]:
        with KvxferClient(pre.worker_address) as fresh:
            return fresh.leased_pages()

    with KvxferClient(dec.worker_address) as d, ThreadPoolExecutor(1) as caller:
        with frozen(pre):  # the kernel queues the connection; nobody answers it for 1 s
            answer = caller.submit(first_call)
            time.sleep(1.0)
        assert answer.result(timeout=15) == {"kv": 0}
        expected = d.expect("slow-peer", "kv", PageRuns.of([(0, 4)]), timeout_s=30)
        with KvxferClient(pre.worker_address) as p:
            with frozen(dec):  # the sender's first handshake to it waits
                p.push("slow-peer", "kv", PageRuns.of([(0, 4)]), peer=dec.peer_address,
                       timeout_s=30, capability=expected.capability)
                time.sleep(1.0)
            sent, got = p.wait("slow-peer", timeout_s=35), d.wait("slow-peer", timeout_s=35)
        assert sent.ok and got.ok, (sent.error, got.error)


def test_a_late_writer_cannot_land_in_reused_pages(spawn) -> None:
    """The receiver aborts a transfer mid-way and at once gives its pages to a transfer
    from another sender; the first sender's messages still in flight carry the aborted
    transfer's tags, which no receive matches any more, so the new bytes are exact."""
    late, fresh, dec = daemon(spawn, "late"), daemon(spawn, "fresh"), daemon(spawn, "decode")
    with KvxferClient(late.worker_address) as old, KvxferClient(fresh.worker_address) as new, \
            KvxferClient(dec.worker_address) as d, old.attach("kv") as old_src, \
            new.attach("kv") as new_src, d.attach("kv") as dst:
        fill_random(old_src, 4)
        fill_random(new_src, 5)
        pages = PageRuns.of([(0, 512)])
        start_whole_pool(old, d, dec, "aborted")
        d.abort("aborted", "reusing the pages")
        assert d.wait("aborted").state == TransferState.ABORTED
        told = dst.raw.clone()  # once the end is told, no write of the old transfer lands
        time.sleep(0.3)
        assert torch.equal(dst.raw, told), "the aborted transfer wrote after its end was told"
        expected = d.expect("reused", "kv", pages, timeout_s=30)
        new.push("reused", "kv", pages, peer=dec.peer_address, timeout_s=30, verify=True,
                 capability=expected.capability)
        sent, got = new.wait("reused", timeout_s=35), d.wait("reused", timeout_s=35)
        assert sent.ok and got.ok and got.verified, (sent.error, got.error)
        assert d.wait("aborted").state == TransferState.ABORTED
        assert not old.wait("aborted", timeout_s=10).ok
        time.sleep(0.5)  # anything the late sender still had in flight has landed by now
        assert torch.equal(dst.raw, new_src.raw), "a late message changed a reused page"
        no_request_posted(late, fresh, dec)


def test_a_peer_restarted_on_the_same_address_is_a_new_peer(spawn, dev_ca) -> None:
    """kill -9 of the receiver mid-transfer and a new process on the same ports: the old
    session fails (the new process knows no session of the old one), and the sender opens
    a new one with the new process's pools."""
    pre = daemon(spawn, "prefill")
    dec = daemon(spawn, "decode")
    ports = ["--peer-address", dec.peer_address, "--ucx-port", str(dec.ready_info["ucx_port"])]
    with KvxferClient(pre.worker_address) as p, p.attach("kv") as src:
        fill_random(src, 6)
        with KvxferClient(dec.worker_address) as d:
            start_whole_pool(p, d, dec, "orphaned")
            dec.kill()
            killed_at = time.monotonic()
        got = p.wait("orphaned", timeout_s=30)
        if got.ok:
            pytest.skip("the transfer completed before the kill landed")
        assert got.error_code == "UNAVAILABLE", got.error
        ended_within(got, killed_at, LIVENESS_S)
        again = daemon(spawn, "decode-again", *ports)
        assert again.peer_address == dec.peer_address
        with KvxferClient(again.worker_address) as d, d.attach("kv") as dst:
            new_transfer_works(p, d, again, src, dst, "after-restart")
        no_request_posted(pre, again)


def test_the_pools_outlive_the_engine_that_wrote_them(spawn) -> None:
    """An engine (here a worker process) writes pages and is killed; the daemon keeps the
    pools and the transfer in flight; a new worker reads exactly what its predecessor wrote."""
    pre, dec = daemon(spawn, "prefill"), daemon(spawn, "decode")
    writer = subprocess.Popen([sys.executable, "-c", ENGINE, pre.worker_address],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "WRITTEN"
        with KvxferClient(dec.worker_address) as d:
            expected = d.expect("survives", "kv", PageRuns.of([(0, 512)]), timeout_s=30)
            with KvxferClient(pre.worker_address) as p:
                p.push("survives", "kv", PageRuns.of([(0, 512)]), peer=dec.peer_address,
                       timeout_s=30, verify=True, capability=expected.capability)
            writer.kill()  # the engine dies with the transfer of its pages in flight
            writer.wait(10)
            assert d.wait("survives", timeout_s=35).ok
            with KvxferClient(pre.worker_address) as p, p.attach("kv") as src, \
                    d.attach("kv") as dst:
                expected = torch.full_like(src.raw, 7)
                assert torch.equal(src.raw, expected), "the pool lost what the dead engine wrote"
                assert torch.equal(dst.raw, expected)
    finally:
        writer.kill()
        writer.wait(10)


def test_deadlines_are_kept_on_both_sides(spawn) -> None:
    """Transfers nobody completes (expects no sender fills, offers no receiver pulls) end
    DEADLINE_EXCEEDED when their deadline passes, not later."""
    pre, dec = daemon(spawn, "prefill"), daemon(spawn, "decode")
    deadlines = [0.5 + 0.25 * i for i in range(8)]
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d:
        for i, timeout_s in enumerate(deadlines):
            d.expect(f"unfilled-{i}", "kv", PageRuns.of([(i, 1)]), timeout_s=timeout_s)
            p.offer(f"unpulled-{i}", "kv", PageRuns.of([(i, 1)]), timeout_s=timeout_s)
        overshoot: dict[str, float] = {}
        end = time.monotonic() + max(deadlines) + 5
        while len(overshoot) < 2 * len(deadlines) and time.monotonic() < end:
            now = time.time()
            for t in [*d.transfers(), *p.transfers()]:
                if t.state.final and t.transfer_id not in overshoot:
                    assert t.state == TransferState.DEADLINE_EXCEEDED, t.error
                    overshoot[t.transfer_id] = now - (t.created_unix + t.timeout_s)
            time.sleep(0.01)
    assert len(overshoot) == 2 * len(deadlines), f"not ended: {len(overshoot)}"
    worst = max(overshoot.values())
    assert worst < 0.5, f"a transfer ended {worst:.3f} s after its deadline"
    assert min(overshoot.values()) > -0.05, "a transfer ended before its deadline"
    print(f"deadlines: worst overshoot {worst * 1e3:.0f} ms over {len(overshoot)} transfers")


@pytest.mark.parametrize("local_copy", [False, True], ids=["ucx", "local-copy"])
def test_a_one_minute_soak_with_kills_and_freezes_keeps_every_invariant(local_copy: bool) -> None:
    """60 s of ``benchmarks/soak.py`` (the note reports 10 minutes), over UCX and with
    same-host copy: three daemons, transfers both ways with aborts, a daemon killed and
    restarted or frozen every 15 s; every failure inside a fault, deadlines kept, DONE
    bytes exact, nothing left posted."""
    got = run_benchmark("soak.py", "--seconds", "60", "--fault-every", "15", "--seed", "3",
                        *(["--local-copy"] if local_copy else []), "--json", timeout=300)
    assert got["violations"] == [], got["violations"]
    assert len(got["faults"]) >= 2 and got["transfers"] > 100
    cases = {outcome.split(":")[0] for outcome in got["outcomes"]}
    assert cases == {"push", "pull", "receiver-aborts", "sender-aborts", "unfilled"}
    assert all(g["posted_requests"] == 0 and g["active_transfers"] == 0
               for g in got["idle_gauges"].values()), got["idle_gauges"]
    assert got["worst_overshoot_s"] < 2.0 + QUIESCE_S  # a receiver's end waits for its writes
    # A transfer that met a freeze (6 s here) is told once its daemon thaws.
    assert got["worst_overshoot_in_fault_s"] < LIVENESS_S + 2 + 2.0 + QUIESCE_S
    assert got["ok"], got


def test_sigterm_drains_health_first_then_refuses_then_fails_what_cannot_finish(spawn) -> None:
    """A receiving daemon gets SIGTERM while a transfer runs (its sender frozen, so it cannot
    finish) and another waits: health turns NOT_SERVING, new requests get UNAVAILABLE, and
    after the grace period both transfers fail saying the daemon is draining; it exits 0."""
    grace_s = 3.0
    pre, dec = daemon(spawn, "prefill"), daemon(spawn, "decode", "--grace-s", str(grace_s))
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d:
        d.expect("waiting", "kv", PageRuns.of([(0, 1)]), timeout_s=60)
        expected = d.expect("running", "kv", PageRuns.of([(1, 511)]), timeout_s=60)
        p.push("running", "kv", PageRuns.of([(1, 511)]), peer=dec.peer_address, timeout_s=60,
               capability=expected.capability)
        until(lambda: state(d, "running") != TransferState.WAITING, 20, "claimed")
        with frozen(pre):
            if state(d, "running").final:
                pytest.skip("the transfer completed before the freeze landed")
            dec.process.send_signal(signal.SIGTERM)
            sigterm = time.monotonic()
            until(lambda: d.health() == "NOT_SERVING", 2, "NOT_SERVING")
            with pytest.raises(PeerUnavailableError, match="shutting down"):
                d.expect("new", "kv", PageRuns.of([(0, 1)]), timeout_s=10)
            ended = [d.wait("waiting", timeout_s=10), d.wait("running", timeout_s=10)]
            took = time.monotonic() - sigterm
        for info in ended:
            assert info.state == TransferState.FAILED and "is draining" in info.error, info.error
        assert grace_s - 0.5 <= took <= grace_s + MARGIN_S, f"ended {took:.1f} s after SIGTERM"
        assert dec.process.wait(20) == 0
        sent = p.wait("running", timeout_s=LIVENESS_S + MARGIN_S)
        # Told by the draining daemon (if the tell reached it after the thaw), or lost it.
        assert not sent.ok and ("is draining" in sent.error or sent.error_code == "UNAVAILABLE"), \
            sent.error
        no_request_posted(pre)


def test_a_shm_dir_too_small_is_refused_at_start_naming_sizes(tmp_path) -> None:
    """Pools that do not fit the shared-memory file system: one line naming both sizes,
    a non-zero exit, and nothing left in the directory."""
    small = tmp_path / "small-shm"
    small.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)],
                             capture_output=True, text=True, timeout=10)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "kvxfer.client.cli", "serve", "--pool", POOL,
             "--worker-address", f"unix://{tmp_path}/s.sock", "--shm-dir", str(small)],
            capture_output=True, text=True, timeout=60, env={**os.environ, **LOOPBACK_ENV})
        assert out.returncode == 2, out.stdout + out.stderr
        assert "cannot allocate 1073741824 bytes of shared memory" in out.stdout
        assert "(4194304 bytes free there)" in out.stdout
        assert "Traceback" not in out.stdout + out.stderr
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], capture_output=True, timeout=10)
