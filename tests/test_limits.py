"""Bounds against exhaustion: a request past a limit is refused with a status that names
the limit, and changes nothing; the daemon keeps serving everyone else."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from peer_calls import PeerAs, refused

from kvxfer.certs import issue_certs
from kvxfer.client import KvxferClient
from kvxfer.errors import InvalidArgumentError, LimitExceededError
from kvxfer.pages import PageRuns
from kvxfer.server.limits import MAX_ID_CHARS
from kvxfer.wire.codec import descriptor_to_proto

POOL = "name=kv,preset=tiny,num_pages=64"
LIMITS = ["--max-sessions-per-peer", "2", "--max-active-transfers", "3", "--max-message-bytes", "65536"]


def test_every_limit_is_refused_by_name_and_changes_nothing(spawn, tmp_path: Path) -> None:
    ca = tmp_path / "ca"
    issue_certs(ca, ["decode", "tester", "eve"])
    dec = spawn("decode", [POOL], tls=ca, extra_args=LIMITS)
    with KvxferClient(dec.worker_address) as d, d.attach("kv") as pool:
        before = pool.raw.clone()
        proto = descriptor_to_proto(d.describe("kv")[0])
        tester, eve = PeerAs(dec, ca, "tester", proto), PeerAs(dec, ca, "eve", proto)
        try:
            # Sessions per peer identity: a third is refused; another peer still gets one.
            tester.open_session("s1"), tester.open_session("s2")
            code, message = refused(tester.open_session, "s3")
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions_per_peer" in message
            eve.open_session("e1")

            # Transfers not yet ended.
            for i in range(3):
                d.expect(f"t{i}", "kv", PageRuns.of([(i, 1)]), timeout_s=60)
            with pytest.raises(LimitExceededError, match="max_active_transfers"):
                d.expect("t3", "kv", PageRuns.of([(3, 1)]), timeout_s=60)
            d.abort("t2")
            d.expect("t3", "kv", PageRuns.of([(3, 1)]), timeout_s=60)  # room again

            # Per request: id length, deadline, pages per transfer, message size.
            with pytest.raises(InvalidArgumentError, match=f"the limit is {MAX_ID_CHARS}"):
                d.expect("x" * (MAX_ID_CHARS + 1), "kv", PageRuns.of([(9, 1)]))
            with pytest.raises(InvalidArgumentError, match="expected 0 to 3600 seconds"):
                d.expect("nan", "kv", PageRuns.of([(9, 1)]), timeout_s=float("nan"))
            with pytest.raises(InvalidArgumentError, match="at most the 64 pages"):
                d.offer("twice", "kv", PageRuns.of([(0, 64), (0, 64)]))
            with pytest.raises(LimitExceededError, match=r"larger than max \(\d+ vs. 65536\)"):
                d.expect("y" * 70_000, "kv", PageRuns.of([(9, 1)]))

            states = {t.transfer_id: t.state.name for t in d.transfers()}
            assert states == {"t0": "WAITING", "t1": "WAITING", "t2": "ABORTED", "t3": "WAITING"}
            assert d.health() == "SERVING"
        finally:
            tester.close()
            eve.close()
        assert pool.raw.equal(before)
