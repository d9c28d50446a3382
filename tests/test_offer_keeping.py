"""Offers kept waiting while their puller still wants them, and dropped when it never will:
a keep moves an offer's deadline (and the lease that ends with it) past where it was, up
to the prefill daemon's --max-offer-s, for a caller holding its capability only; a drop ends
it and frees its pages at once. Real daemons, gRPC and UCX."""

from __future__ import annotations

import time

import pytest
from pool_checks import assert_moved, fill_random
from test_transfers import SMALL

from kvxfer.client import KvxferClient, OfferHold
from kvxfer.errors import DialNotAllowedError, InvalidArgumentError
from kvxfer.pages import PageRuns
from kvxfer.status import TransferState

#: The offers' own deadline in these tests.
OFFER_S = 1.5


def _states(client: KvxferClient) -> dict[str, tuple[TransferState, str, float]]:
    return {i.transfer_id: (i.state, i.error, i.timeout_s) for i in client.transfers()}


def test_a_kept_offer_outlives_its_deadline_and_its_lease_then_moves_intact(spawn) -> None:
    pre = spawn("prefill-keep", [SMALL])
    dec = spawn("decode-keep", [SMALL])
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
            p.attach("kv") as src, d.attach("kv") as dst:
        fill_random(src, 11)
        lease = p.allocate("kv", 3, lease_s=OFFER_S + 1, holder="test prefill")
        kept = p.offer("kept", "kv", lease.runs, timeout_s=OFFER_S, lease_id=lease.lease_id,
                       release_lease=True)
        p.offer("not-kept", "kv", PageRuns.of([(20, 2)]), timeout_s=OFFER_S)
        holds = [OfferHold("kept", kept.capability)]
        kept_until = time.monotonic() + 2 * OFFER_S + 1  # past both deadlines and the lease
        while time.monotonic() < kept_until:
            [remaining] = d.keep_offers(pre.peer_address, holds, keep_s=OFFER_S)
            assert OFFER_S - 0.5 < remaining <= OFFER_S, remaining
            time.sleep(0.3)
        states = _states(p)
        assert states["not-kept"][0] == TransferState.DEADLINE_EXCEEDED, states
        assert states["kept"][0] == TransferState.WAITING, states
        assert lease.lease_id in {x.lease_id for x in p.leases()}  # renewed with the offer

        before, dst_runs = dst.raw.clone(), PageRuns.of([(40, 3)])
        d.pull("kept", pre.peer_address, "kv", dst_runs, timeout_s=30,
               capability=kept.capability)
        assert d.wait("kept").ok and p.wait("kept").ok
        assert_moved(src, dst, lease.runs, dst_runs, before)
        assert d.keep_offers(pre.peer_address, holds) == [0.0]  # pulled: nothing left to keep
        assert lease.lease_id not in {x.lease_id for x in p.leases()}


def test_a_keep_needs_the_capability_and_stops_at_max_offer_s(spawn) -> None:
    pre = spawn("prefill-cap", [SMALL], extra_args=["--max-offer-s", "3"])
    dec = spawn("decode-cap", [SMALL])
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d:
        a = p.offer("a", "kv", PageRuns.of([(0, 2)]), timeout_s=OFFER_S)
        b = p.offer("b", "kv", PageRuns.of([(4, 2)]), timeout_s=OFFER_S)
        wrong, unknown = OfferHold("a", "0" * len(a.capability)), OfferHold("nope", a.capability)
        answers = d.keep_offers(pre.peer_address, [wrong, unknown, OfferHold("b", b.capability)],
                                keep_s=60)
        assert answers[:2] == [0.0, 0.0], answers  # the same answer: nothing learnt
        assert 0 < answers[2] <= 3.0, answers  # capped at 3 s after the offer, not 60 from now
        deadline = time.monotonic() + 10  # the cap is 3 s; a regression must not hang here
        while not _states(p)["b"][0].final:
            assert time.monotonic() < deadline, _states(p)
            d.keep_offers(pre.peer_address, [OfferHold("b", b.capability)], keep_s=60)
            time.sleep(0.2)
        states = _states(p)
        assert states["a"][0] == TransferState.DEADLINE_EXCEEDED, states
        assert states["a"][2] == pytest.approx(OFFER_S), states  # the wrong capability kept nothing
        assert states["b"][0] == TransferState.DEADLINE_EXCEEDED, states
        assert states["b"][2] == pytest.approx(3.0, abs=0.05), states  # kept to the cap, no more
        assert "within its 3s deadline" in states["b"][1]


def test_a_dropped_offer_ends_at_once_and_frees_its_pages(spawn) -> None:
    pre = spawn("prefill-drop", [SMALL])
    dec = spawn("decode-drop", [SMALL])
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d:
        lease = p.allocate("kv", 2, lease_s=60, holder="test prefill")
        dropped = p.offer("dropped", "kv", lease.runs, timeout_s=30, lease_id=lease.lease_id,
                          release_lease=True)
        p.offer("other", "kv", PageRuns.of([(30, 1)]), timeout_s=30)
        count = d.drop_offers(pre.peer_address, [OfferHold("dropped", dropped.capability),
                                                 OfferHold("other", "f" * 32)],
                              reason="the decode request ended")
        assert count == 1
        states = _states(p)
        assert states["dropped"][0] == TransferState.ABORTED, states
        assert "the decode request ended" in states["dropped"][1], states
        assert states["other"][0] == TransferState.WAITING, states  # no capability, no drop
        assert lease.lease_id not in {x.lease_id for x in p.leases()}
        assert p.leased_pages()["kv"] == 0
        refused = d.pull("dropped", pre.peer_address, "kv", PageRuns.of([(0, 2)]), timeout_s=10,
                         capability=dropped.capability, wait=True)
        assert not refused.ok and "the decode request ended" in refused.error, refused


def test_keeps_and_drops_refuse_bad_requests_naming_what_was_wrong(spawn) -> None:
    pre = spawn("prefill-bad", [SMALL])
    dec = spawn("decode-bad", [SMALL])
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d:
        offer = p.offer("bad", "kv", PageRuns.of([(0, 1)]), timeout_s=30)
        hold = OfferHold("bad", offer.capability)
        cases = [
            (lambda: d.keep_offers(pre.peer_address, [hold], keep_s=-1), "keep_s"),
            (lambda: d.keep_offers(pre.peer_address, [hold] * 1025), "at most 1024"),
            (lambda: d.keep_offers("", [hold]), "peer is empty"),
            (lambda: d.keep_offers(pre.peer_address, [OfferHold("", "x")]),
             "offers[].transfer_id is empty"),
            (lambda: d.drop_offers(pre.peer_address, [hold], reason="x" * 2000), "reason"),
        ]
        for call, words in cases:
            with pytest.raises(InvalidArgumentError, match=words.replace("[", r"\[")):
                call()
        with pytest.raises(DialNotAllowedError):
            d.keep_offers("192.0.2.1:7500", [hold])  # outside the dial policy: never dialled
        assert _states(p)["bad"][0] == TransferState.WAITING  # nothing above touched it
        assert d.keep_offers(pre.peer_address, [hold])[0] > 0


def test_a_keep_from_another_peer_than_the_offer_names_or_past_the_workers_lease_is_bounded(
        spawn) -> None:
    """An offer for another peer (by certificate name) is not kept for this one; an offer
    whose lease the prefill worker still holds (not ending with it) is kept no longer than
    that lease."""
    pre = spawn("prefill-who", [SMALL])
    dec = spawn("decode-who", [SMALL])
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d:
        theirs = p.offer("theirs", "kv", PageRuns.of([(0, 1)]), timeout_s=30,
                         peer_identity="another-decode")
        lease = p.allocate("kv", 2, lease_s=4, holder="test prefill")
        leased = p.offer("leased", "kv", lease.runs, timeout_s=1, lease_id=lease.lease_id)
        answers = d.keep_offers(pre.peer_address, [OfferHold("theirs", theirs.capability),
                                                   OfferHold("leased", leased.capability)],
                                keep_s=60)
        assert answers[0] == 0.0, answers
        assert 2.5 < answers[1] <= 4.0, answers  # the worker's lease, not 60 s
        assert _states(p)["theirs"][2] == 30  # untouched
