"""Peer-API calls made by hand, as a daemon (or an impostor) would make them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvxfer.pages import PageRuns
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc

ONE_PAGE = PageRuns.of([(0, 1)])


def beats(session_id: str, stop: threading.Event) -> Iterator[pb.WatchRequest]:
    """A sender's side of a Watch stream: the session, then a heartbeat every 0.5 s."""
    yield pb.WatchRequest(session_id=session_id)
    while not stop.wait(0.5):
        yield pb.WatchRequest(unix_time=time.time())


def channel_as(dec: Any, ca_dir: Path | None, name: str | None, trust: Path) -> grpc.Channel:
    """A channel to the decode daemon's peer port: plaintext (``trust`` None), TLS without a
    client certificate (``name`` None), or with ``name``'s certificate from ``ca_dir``."""
    if ca_dir is None:
        return grpc.insecure_channel(dec.peer_address)
    key = (ca_dir / f"{name}.key").read_bytes() if name else None
    cert = (ca_dir / f"{name}.pem").read_bytes() if name else None
    creds = grpc.ssl_channel_credentials((trust / "ca.pem").read_bytes(), key, cert)
    return grpc.secure_channel(dec.peer_address, creds)


class PeerAs:
    """A hand-driven peer with ``name``'s certificate: it opens sessions and makes peer
    calls like a daemon would, but never sends a byte."""

    def __init__(self, dec: Any, ca_dir: Path, name: str, pool: pb.PoolDescriptor) -> None:
        self.channel = channel_as(dec, ca_dir, name, ca_dir)
        self.stub = pb_grpc.KvxferPeerStub(self.channel)
        self._pool = pool
        self._watches: list[Any] = []
        self._closed = threading.Event()

    def open_session(self, session_id: str) -> str:
        self.stub.Handshake(pb.HandshakeRequest(protocol_version=1,
            session_id=session_id, ucx_host="127.0.0.1", ucx_ports=[1], ucx_error_handling=True,
            pools=[self._pool], peer_address="127.0.0.1:1"), timeout=5)
        self._watches.append(self.stub.Watch(beats(session_id, self._closed)))
        return session_id

    def claim_request(self, transfer_id: str, session_id: str, runs: PageRuns = ONE_PAGE,
                      capability: str = "") -> pb.ClaimRequest:
        return pb.ClaimRequest(
            transfer_id=transfer_id, session_id=session_id, src_pool=self._pool.name,
            src_runs=[pb.PageRun(start=s, count=c) for s, c in runs.pairs()],
            capability=capability)

    def claim(self, transfer_id: str, session_id: str, runs: PageRuns,
              capability: str = "") -> pb.ClaimResponse:
        return self.stub.Claim(self.claim_request(transfer_id, session_id, runs, capability),
                               timeout=10)

    def abort(self, transfer_id: str, session_id: str, capability: str = "") -> None:
        self.stub.AbortTransfer(pb.AbortTransferRequest(
            transfer_id=transfer_id, session_id=session_id, reason=f"by {session_id}",
            capability=capability), timeout=5)

    def request_push(self, transfer_id: str, capability: str = "") -> None:
        """Ask for an offer to be pushed to an address nobody listens at (nothing is sent
        unless the request is accepted)."""
        self.stub.RequestPush(pb.RequestPushRequest(
            transfer_id=transfer_id, reply_to="127.0.0.1:1", capability=capability), timeout=5)

    def close(self) -> None:
        self._closed.set()
        for watch in self._watches:
            watch.cancel()
        self.channel.close()


def refused(call: Callable[..., Any], *args: Any) -> tuple[grpc.StatusCode, str]:
    """The status code and message ``call(*args)`` failed with (it must fail)."""
    with pytest.raises(grpc.RpcError) as failed:
        call(*args)
    return failed.value.code(), failed.value.details()  # type: ignore[attr-defined]
