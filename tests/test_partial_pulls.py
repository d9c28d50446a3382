"""A pull that skips the offer's first pages (the puller's prefix cache holds their KV):
only the rest cross the wire, into the puller's pages, byte for byte; a skip the offer
cannot honour is refused, naming it, and spends nothing. Real daemons, gRPC and UCX."""

from __future__ import annotations

from pool_checks import assert_moved, fill_random
from test_transfers import SMALL, metric, spawn_with_metrics

from kvxfer.client import KvxferClient
from kvxfer.errors import InvalidArgumentError
from kvxfer.pages import PageRuns

SENT_BYTES = 'kvxfer_bytes_total{role="sender"}'


def test_a_pull_moves_only_the_pages_past_its_skip(spawn) -> None:
    pre, port = spawn_with_metrics(spawn, "prefill-skip", SMALL)
    dec = spawn("decode-skip", [SMALL])
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
            p.attach("kv") as src, d.attach("kv") as dst:
        fill_random(src, 7)
        page_bytes = src.descriptor.page_bytes
        # The first pull opens the session (the sender claims); the later ones are placed.
        cases = [("claimed", False, [(1, 3), (10, 4)], 2, [(58, 5)]),
                 ("placed", False, [(20, 6)], 5, [(30, 1)]),
                 ("placed-verified", True, [(40, 2), (44, 3)], 3, [(50, 1), (55, 1)])]
        for tid, verify, offered_pages, skip, dst_pages in cases:
            src_runs, dst_runs = PageRuns.of(offered_pages), PageRuns.of(dst_pages)
            before, sent_before = dst.raw.clone(), metric(port, SENT_BYTES)
            offered = p.offer(tid, "kv", src_runs, timeout_s=30, verify=verify)
            d.pull(tid, pre.peer_address, "kv", dst_runs, timeout_s=30,
                   capability=offered.capability, skip_pages=skip)
            sent, got = p.wait(tid), d.wait(tid)
            assert sent.ok and got.ok, (tid, sent.error, got.error)
            assert got.verified is verify
            assert_moved(src, dst, src_runs.after(skip), dst_runs, before)
            moved = metric(port, SENT_BYTES) - sent_before
            assert moved == dst_runs.num_pages * page_bytes, (tid, moved)


def test_a_skip_the_offer_cannot_honour_fails_the_pull_and_spends_nothing(spawn) -> None:
    pre = spawn("prefill-badskip", [SMALL])
    dec = spawn("decode-badskip", [SMALL])
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
            p.attach("kv") as src, d.attach("kv") as dst:
        fill_random(src, 9)
        src_runs = PageRuns.of([(3, 4)])
        offered = p.offer("skip-all", "kv", src_runs, timeout_s=30)
        before = dst.raw.clone()
        refused = d.pull("skip-all", pre.peer_address, "kv", PageRuns.of([(8, 1)]), timeout_s=30,
                         capability=offered.capability, skip_pages=4, wait=True)
        assert not refused.ok and isinstance(refused.failure, InvalidArgumentError)
        assert "skip_pages=4, but there are 4 pages" in refused.error
        assert bool((dst.raw == before).all())
        assert not p.transfers()[0].state.final  # the offer still waits, its capability unspent
        dst_runs = PageRuns.of([(8, 1)])
        d.pull("skip-all", pre.peer_address, "kv", dst_runs, timeout_s=30,
               capability=offered.capability, skip_pages=3)
        assert d.wait("skip-all").ok and p.wait("skip-all").ok
        assert_moved(src, dst, src_runs.after(3), dst_runs, before)
