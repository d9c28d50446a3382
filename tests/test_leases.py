"""Page leases: the daemon hands out pages so that workers sharing it never pick the same ones."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fake_transport import FakeNetwork
from hypothesis import given
from hypothesis import strategies as st
from inprocess import run, side
from pool_checks import assert_moved, fill_random

from kvxfer.client import KvxferClient
from kvxfer.errors import (
    InvalidArgumentError,
    LeaseExpiredError,
    LeaseNotFoundError,
    PoolExhaustedError,
    StaleArenaError,
)
from kvxfer.pages import PageRuns
from kvxfer.server.leases import FreePages
from kvxfer.status import LeaseUse
from kvxfer.v1 import kvxfer_pb2 as pb

TINY = "name=kv,preset=tiny"  # 64 pages

# An operation: take N pages, or give back the i-th live lease.
operations = st.lists(st.one_of(st.tuples(st.just("take"), st.integers(1, 24)),
                                st.tuples(st.just("give"), st.integers(0, 9))), max_size=60)


@given(ops=operations)
def test_free_pages_never_hand_out_a_page_twice(ops: list[tuple[str, int]]) -> None:
    free = FreePages(64)
    live: list[PageRuns] = []
    for op, n in ops:
        if op == "take":
            runs = free.take(n)
            in_use = sum(r.num_pages for r in live)
            if runs is None:
                assert n > 64 - in_use
                continue
            assert runs.num_pages == n
            taken = set(runs.pages())
            assert not taken & {p for r in live for p in r.pages()}
            live.append(runs)
        elif live:
            free.give_back(live.pop(n % len(live)))
        assert free.count == 64 - sum(r.num_pages for r in live)


def test_a_lease_is_one_run_when_one_free_run_holds_it() -> None:
    free = FreePages(16)
    first, second, third = free.take(4), free.take(4), free.take(4)
    assert first is not None and second is not None and third is not None
    free.give_back(first)  # free now: 0-3 and 12-15; the smallest that fits is chosen
    assert free.take(3) == PageRuns.of([(0, 3)])
    free.give_back(third)  # free: 3, 8-15 -> 10 pages need both runs, largest first
    assert free.take(9) == PageRuns.of([(3, 1), (8, 8)])


def test_leases_are_disjoint_and_refused_clearly_when_the_pool_is_full(spawn) -> None:
    d = spawn("leases", [TINY])
    with KvxferClient(d.worker_address) as kv:
        leases = [kv.allocate("kv", 20, holder=f"engine-{i}") for i in range(3)]
        pages = [set(x.runs.pages()) for x in leases]
        assert all(len(p) == 20 for p in pages)
        assert not (pages[0] & pages[1] or pages[0] & pages[2] or pages[1] & pages[2])
        assert kv.leased_pages() == {"kv": 60}
        with pytest.raises(PoolExhaustedError, match="pool 'kv' has 4 free pages, 5 were asked for"):
            kv.allocate("kv", 5)
        with pytest.raises(InvalidArgumentError, match="pages=0; pool 'kv' has 64"):
            kv.allocate("kv", 0)
        kv.release(leases[1].lease_id)
        with pytest.raises(LeaseNotFoundError, match="no lease"):
            kv.release(leases[1].lease_id)
        assert kv.leased_pages() == {"kv": 40}
        assert {x.holder for x in kv.leases()} == {"engine-0", "engine-2"}
        with pytest.raises(InvalidArgumentError, match="are not all pages of lease"):
            kv.expect("outside", "kv", PageRuns.of([(0, 64)]), lease_id=leases[0].lease_id)
        with pytest.raises(InvalidArgumentError, match="holder has 1025 characters; the limit is 1024"):
            kv.allocate("kv", 1, holder="h" * 1025)
        with pytest.raises(InvalidArgumentError, match="lease_id has 257 characters; the limit is 256"):
            kv.renew("l" * 257)
        with pytest.raises(InvalidArgumentError, match="lease_id is empty"):
            kv.release("")
        assert kv.leased_pages() == {"kv": 40}


def test_an_expired_lease_frees_its_pages_and_fails_its_transfer(tmp_path: Path) -> None:
    async def body() -> None:
        async with side(tmp_path, "decode", FakeNetwork(), lease_s=60) as decode:
            leases = decode.transfers.leases
            lease = leases.allocate("kv", 8, 0.3, "a slow engine")
            assert leases.leased_pages("kv") == 8
            decode.transfers.expect("held", "kv", lease.runs, 10, LeaseUse(lease.id))
            got = await decode.final("held", timeout_s=5)
            assert isinstance(got.failure, LeaseExpiredError), got.error
            assert "expired before it ended" in got.error
            assert leases.leased_pages("kv") == 0 and not leases.held(lease.id)
    run(body)


def test_renewing_keeps_a_lease_alive(tmp_path: Path) -> None:
    async def body() -> None:
        import asyncio

        async with side(tmp_path, "decode", FakeNetwork()) as decode:
            leases = decode.transfers.leases
            lease = leases.allocate("kv", 2, 0.3, "")
            for _ in range(4):
                await asyncio.sleep(0.15)
                leases.renew(lease.id, 0.3)
            assert leases.held(lease.id)
            await asyncio.sleep(0.5)
            assert not leases.held(lease.id)
    run(body)


def test_a_hundred_leased_transfers_leak_no_page(spawn) -> None:
    """What an engine pair does per request: the prefill side leases pages, writes them and
    offers them with release_lease; the decode side leases pages, pulls, reads, releases."""
    pre, dec = spawn("prefill", [TINY]), spawn("decode", [TINY])
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
            p.attach("kv") as src, d.attach("kv") as dst:
        peer = p.peer_address()
        assert peer == pre.peer_address
        start = time.monotonic()
        for i in range(100):
            fill_random(src, i)
            out = p.allocate("kv", 1 + i % 7, lease_s=30, holder="prefill")
            inn = d.allocate("kv", out.runs.num_pages, lease_s=30, holder="decode")
            before = dst.raw.clone()
            p.offer(f"req-{i}", "kv", out.runs, timeout_s=30, lease_id=out.lease_id,
                    release_lease=True)
            d.pull(f"req-{i}", peer, "kv", inn.runs, timeout_s=30, lease_id=inn.lease_id,
                   capability=out.capability)
            assert d.wait(f"req-{i}").ok and p.wait(f"req-{i}").ok
            assert_moved(src, dst, out.runs, inn.runs, before)
            d.release(inn.lease_id)
        elapsed = time.monotonic() - start
        assert p.leased_pages() == {"kv": 0} and d.leased_pages() == {"kv": 0}
        assert p.leases() == [] and d.leases() == []
    assert elapsed < 60


def test_lease_and_pull_fills_a_new_lease_in_one_call_and_a_refused_one_leaves_none(
        spawn) -> None:
    """The decode worker's Allocate and Pull in one round trip: the bytes land in the new
    lease's pages, which stay leased after the transfer until released. A pull refused at
    once (a stale memory epoch, no capability, a destination named twice, a wait that
    would hold a lease nobody learns of if the call ended first) leaves no lease."""
    pre, dec = spawn("prefill", [TINY]), spawn("decode", [TINY])
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
            p.attach("kv") as src, d.attach("kv") as dst:
        fill_random(src, 7)
        out = p.allocate("kv", 3, lease_s=30)
        p.offer("one-call", "kv", out.runs, timeout_s=30, lease_id=out.lease_id,
                release_lease=True)
        before = dst.raw.clone()
        lease, pulled = d.lease_and_pull("one-call", pre.peer_address, "kv", 3, timeout_s=30,
                                         holder="decode", capability=out.capability)
        assert lease.runs.num_pages == 3 and pulled.transfer_id == "one-call"
        assert d.wait("one-call").ok
        assert_moved(src, dst, out.runs, lease.runs, before)
        assert [held.lease_id for held in d.leases()] == [lease.lease_id]  # outlives it
        d.release(lease.lease_id)
        with pytest.raises(StaleArenaError, match="re-attach"):
            d.lease_and_pull("stale", pre.peer_address, "kv", 2, timeout_s=30,
                             arena_epoch="f" * 32, capability=out.capability)
        with pytest.raises(InvalidArgumentError, match="capability"):
            d.lease_and_pull("no-capability", pre.peer_address, "kv", 2, timeout_s=30)
        twice = pb.LeasePullRequest(lease=pb.AllocateRequest(pool="kv", pages=2),
                                    pull=pb.PullRequest(transfer_id="twice", peer=pre.peer_address,
                                                        capability=out.capability,
                                                        dst_runs=[pb.PageRun(start=0, count=2)]))
        with pytest.raises(InvalidArgumentError, match="pull.dst_runs"):
            d._call(d._stub.LeasePull, twice)
        waiting = pb.LeasePullRequest(lease=pb.AllocateRequest(pool="kv", pages=2),
                                      pull=pb.PullRequest(transfer_id="waits", wait=True,
                                                          peer=pre.peer_address,
                                                          capability=out.capability))
        with pytest.raises(InvalidArgumentError, match="call Wait for the end"):
            d._call(d._stub.LeasePull, waiting)
        assert d.leases() == [] and d.leased_pages() == {"kv": 0}


def test_an_offer_nobody_pulls_gives_its_pages_back_at_its_deadline(tmp_path: Path) -> None:
    async def body() -> None:
        async with side(tmp_path, "prefill", FakeNetwork()) as prefill:
            leases = prefill.transfers.leases
            lease = leases.allocate("kv", 4, 60, "prefill engine")
            prefill.transfers.offer("orphan", "kv", lease.runs, 0.3, False,
                                    LeaseUse(lease.id, release_lease=True))
            sent = await prefill.final("orphan", timeout_s=5)
            assert sent.state.name == "DEADLINE_EXCEEDED"
            assert leases.leased_pages("kv") == 0 and not leases.held(lease.id)
    run(body)
