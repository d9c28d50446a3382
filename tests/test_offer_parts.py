"""An offer pulled in parts (``kvxfer.offer_parts``): several pullers share one offer, each
taking its own pages once; the offer ends, its lease with it, when every part has ended, and
a failed part ends the offer and its other parts. Real daemons, gRPC and UCX."""

from __future__ import annotations

import time

import pytest
from pool_checks import assert_moved, fill_random
from test_transfers import SMALL

from kvxfer.client import KvxferClient
from kvxfer.errors import InvalidArgumentError, TransferNotFoundError
from kvxfer.offer_parts import OfferPart
from kvxfer.pages import PageRuns


def test_each_part_moves_its_own_pages_and_the_offer_ends_with_the_last(spawn) -> None:
    pre, dec = spawn("prefill-parts", [SMALL]), spawn("decode-parts", [SMALL])
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
            p.attach("kv") as src, d.attach("kv") as dst:
        fill_random(src, 11)
        lease = p.allocate("kv", 6, 30)
        offered_runs = lease.runs
        offered = p.offer("shared", "kv", offered_runs, timeout_s=30, lease_id=lease.lease_id,
                          release_lease=True)
        before = dst.raw.clone()
        # Two pullers, overlapping (a replicated head): part 0 takes pages 0, 2, 4, part 1
        # pages 2 to 5; the second asks with verify's checksums off, as the first.
        parts = {0: PageRuns.of([(0, 1), (2, 1), (4, 1)]), 1: PageRuns.of([(2, 4)])}
        dst_runs = {0: PageRuns.of([(40, 3)]), 1: PageRuns.of([(50, 2), (60, 2)])}
        for index in (1, 0):
            d.pull("shared", pre.peer_address, "kv", dst_runs[index], timeout_s=30,
                   capability=offered.capability, part=OfferPart(index, 2, parts[index]))
        offered_pages = list(offered_runs.pages())
        for index in (0, 1):
            got = d.wait(f"shared#{index}")
            assert got.ok, got.error
        taken = [offered_pages[k] for index in (0, 1) for k in parts[index].pages()]
        landed = [page for index in (0, 1) for page in dst_runs[index].pages()]
        assert_moved(src, dst, PageRuns.from_pages(taken), PageRuns.from_pages(landed), before)
        ended = p.wait("shared")
        assert ended.ok and ended.bytes == 0  # its parts moved the bytes
        assert {i.transfer_id for i in p.transfers()} == {"shared", "shared#0", "shared#1"}
        assert p.leased_pages() == {"kv": 0}  # the offer's lease ended with it


def test_a_part_is_pulled_once_and_every_puller_names_the_same_count(spawn) -> None:
    pre, dec = spawn("prefill-once", [SMALL]), spawn("decode-once", [SMALL])
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d:
        offered = p.offer("once", "kv", PageRuns.of([(3, 4)]), timeout_s=30)
        d.pull("once", pre.peer_address, "kv", PageRuns.of([(8, 2)]), timeout_s=30,
               capability=offered.capability, part=OfferPart(0, 2, PageRuns.of([(0, 2)])))
        assert d.wait("once#0").ok
        again = d.pull("once", pre.peer_address, "kv", PageRuns.of([(20, 2)]), timeout_s=30,
                       capability=offered.capability,
                       part=OfferPart(0, 2, PageRuns.of([(2, 2)])), wait=True)
        assert isinstance(again.failure, TransferNotFoundError), again.error  # taken already
        other_count = d.pull("once", pre.peer_address, "kv", PageRuns.of([(30, 2)]),
                             timeout_s=30, capability=offered.capability,
                             part=OfferPart(1, 3, PageRuns.of([(2, 2)])), wait=True)
        assert isinstance(other_count.failure, InvalidArgumentError)
        assert "pulled in 2 parts; this pull asks for part 1 of 3" in other_count.error
        whole = d.pull("once", pre.peer_address, "kv", PageRuns.of([(40, 4)]), timeout_s=30,
                       capability=offered.capability, wait=True)
        assert not whole.ok and "once" not in {i.transfer_id for i in d.transfers()
                                               if i.state.name == "DONE"}
        beyond = d.pull("once", pre.peer_address, "kv", PageRuns.of([(50, 1)]), timeout_s=30,
                        capability=offered.capability,
                        part=OfferPart(1, 2, PageRuns.of([(4, 1)])), wait=True)
        assert "part.pages reach page 4 of the offer, which has 4 pages" in beyond.error
        d.pull("once", pre.peer_address, "kv", PageRuns.of([(60, 2)]), timeout_s=30,
               capability=offered.capability, part=OfferPart(1, 2, PageRuns.of([(2, 2)])))
        assert d.wait("once#1").ok and p.wait("once").ok


def test_a_part_asked_with_another_prompts_digest_ends_the_offer_and_its_lease(spawn) -> None:
    """(A part that fails once sent ends the offer and its other parts: the state-machine
    scenario ``a_part_aborted_mid_transfer_ends_its_offer_and_the_other_part``.)"""
    pre, dec = spawn("prefill-failpart", [SMALL]), spawn("decode-failpart", [SMALL])
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d:
        lease = p.allocate("kv", 4, 30)
        offered = p.offer("fails", "kv", lease.runs, timeout_s=30, lease_id=lease.lease_id,
                          release_lease=True)
        d.pull("fails", pre.peer_address, "kv", PageRuns.of([(8, 2)]), timeout_s=30,
               capability=offered.capability, part=OfferPart(0, 2, PageRuns.of([(0, 2)])))
        assert d.wait("fails#0").ok
        wrong = d.pull("fails", pre.peer_address, "kv", PageRuns.of([(20, 2)]), timeout_s=30,
                       capability=offered.capability, prompt_digest=b"x" * 32,
                       part=OfferPart(1, 2, PageRuns.of([(2, 2)])), wait=True)
        assert not wrong.ok and wrong.failure is not None
        assert wrong.failure.reason == "PROMPT_MISMATCH"
        start = time.monotonic()
        ended = p.wait("fails", timeout_s=5)
        assert ended.state.name == "FAILED" and time.monotonic() - start < 5
        assert p.leased_pages() == {"kv": 0}


def test_ids_with_the_part_mark_are_the_daemons_own(spawn) -> None:
    pre = spawn("prefill-mark", [SMALL])
    with KvxferClient(pre.worker_address) as p:
        reserved = "holds '#', which is reserved"
        with pytest.raises(InvalidArgumentError, match=reserved):
            p.offer("a#0", "kv", PageRuns.of([(0, 1)]), timeout_s=30)
        with pytest.raises(InvalidArgumentError, match=reserved):
            p.expect("a#1", "kv", PageRuns.of([(1, 1)]), timeout_s=30)
        with pytest.raises(InvalidArgumentError, match=reserved):
            p.pull("a#2", pre.peer_address, "kv", PageRuns.of([(2, 1)]), timeout_s=30,
                   capability="0" * 32)
        with pytest.raises(InvalidArgumentError, match=reserved):
            p.push("a#3", "kv", PageRuns.of([(3, 1)]), pre.peer_address, timeout_s=30,
                   capability="0" * 32)
        assert p.transfers() == []
        offered = p.offer("a", "kv", PageRuns.of([(0, 2)]), timeout_s=30)
        with KvxferClient(pre.worker_address) as again:
            refused = again.pull("a", pre.peer_address, "kv", PageRuns.of([(9, 1)]),
                                 timeout_s=30, capability=offered.capability, wait=True,
                                 part=OfferPart(0, 2, PageRuns.of([(0, 1)] * 3)))
        assert "part.pages name 3 pages; the offer has 2" in refused.error
