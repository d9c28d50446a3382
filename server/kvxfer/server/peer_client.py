"""Typed calls to peer daemons: each KvxferPeer method with a deadline and typed errors.

``PeerClient`` speaks to one peer over a cached channel. Every call takes the
absolute deadline (``time.monotonic()``) of the work it serves and gives the
RPC the time left, so the peer's handler sees the same deadline in its context.
A failed call raises the ``kvxfer.errors`` type the peer raised (or the nearest
one for gRPC's own failures), its message prefixed with the peer's address.

Retries are gRPC's own (a service config on the channel), for the calls that
are safe to repeat: a handshake (a session whose reply was lost is dropped by
the peer when no Watch stream follows), an abort and a keep (idempotent), on
UNAVAILABLE only. A claim, a commit or a push request is never repeated.
Each call carries the caller's trace context and its round trip is measured
(``kvxfer_peer_call_seconds``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from kvxfer.errors import DialNotAllowedError, InternalError
from kvxfer.propagation import outgoing_metadata
from kvxfer.server.dial_policy import LOOPBACK, DialPolicy
from kvxfer.server.metrics import DaemonMetrics
from kvxfer.server.peer_protocol import (
    Claim,
    ClaimGrant,
    Commit,
    DaemonHello,
    PeerAbort,
    PullAsk,
    PushStarted,
    abort_to_proto,
    claim_to_proto,
    commit_to_proto,
    grant_from_proto,
    hello_from_response,
    hello_to_request,
    pull_ask_to_proto,
    started_from_proto,
)
from kvxfer.server.tls import PeerTls
from kvxfer.status import OfferHold, TransferInfo
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from kvxfer.wire.codec import holds_to_proto, info_from_proto
from kvxfer.wire.status import from_rpc_error

PEER_SERVICE = pb.DESCRIPTOR.services_by_name["KvxferPeer"].full_name
#: Safe-to-repeat calls are retried on UNAVAILABLE by gRPC itself.
SERVICE_CONFIG = json.dumps({"methodConfig": [{
    "name": [{"service": PEER_SERVICE, "method": "Handshake"},
             {"service": PEER_SERVICE, "method": "AbortTransfer"},
             {"service": PEER_SERVICE, "method": "KeepOffers"}],
    "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.05s", "maxBackoff": "0.5s",
                    "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
}]})
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.enable_retries", 1),
    ("grpc.service_config", SERVICE_CONFIG),
    # A restarted peer is dialled again within a second (gRPC's default backoff grows to 2 min);
    # not min_reconnect_backoff_ms, which also cuts each connection attempt to that long.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
#: The least time a call is given, so that a call made at its deadline still says why it failed.
MIN_CALL_S = 0.1
#: How long the TLS handshake that reads a dialled peer's certificate names may take.
IDENTITY_CHECK_S = 5.0


def time_left(deadline: float, slack_s: float = 0.0) -> float:
    """Seconds from now to ``deadline`` (plus ``slack_s``), at least ``MIN_CALL_S``."""
    return max(MIN_CALL_S, deadline - time.monotonic() + slack_s)


class WatchStream:
    """A session's heartbeat stream as its sender holds it: our beats out, the peer's in."""

    def __init__(self, call: grpc.aio.StreamStreamCall[pb.WatchRequest, pb.Heartbeat]) -> None:
        self._call = call

    async def beat(self) -> None:
        """Send one heartbeat (raises grpc.aio.AioRpcError once the stream failed)."""
        await self._call.write(pb.WatchRequest(unix_time=time.time()))

    async def peer_beat(self) -> bool:
        """Wait for the peer's next heartbeat; False when the peer ended the stream."""
        return await self._call.read() is not grpc.aio.EOF

    def cancel(self) -> None:
        """End the stream (and with it the session, on both sides)."""
        self._call.cancel()


class PeerClient:
    """The KvxferPeer service of one peer daemon, with typed arguments, results and errors."""

    def __init__(self, address: str, channel: grpc.aio.Channel, metrics: DaemonMetrics) -> None:
        self.address = address
        self._stub = pb_grpc.KvxferPeerStub(channel)
        self._prefix = f"peer {address}: "
        self._seconds = metrics.peer_call_seconds

    async def _call(self, method: str, request: Any, timeout: float, what: str = "") -> Any:
        rpc: Callable[..., Awaitable[Any]] = getattr(self._stub, method)
        start = time.monotonic()
        try:
            return await rpc(request, timeout=timeout, metadata=outgoing_metadata())
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, f"{self._prefix}{what}") from None
        finally:
            self._seconds.labels(method).observe(time.monotonic() - start)

    async def handshake(self, hello: DaemonHello, deadline: float) -> DaemonHello:
        """Open a session: tell the peer who we are; its answer says who it is."""
        reply = await self._call("Handshake", hello_to_request(hello), time_left(deadline),
                                 "handshake failed: ")
        return hello_from_response(reply)

    async def watch(self, session_id: str) -> WatchStream:
        """Open the session's two-way heartbeat stream (cancel it to close the session)."""
        call = self._stub.Watch()
        try:
            await call.write(pb.WatchRequest(session_id=session_id))
        except grpc.aio.AioRpcError as exc:
            call.cancel()
            raise from_rpc_error(exc, f"{self._prefix}watch failed: ") from None
        return WatchStream(call)

    async def claim(self, claim: Claim, deadline: float) -> ClaimGrant:
        """Ask where a transfer's pages go; the peer answers once it posted its receives.

        The call may take until the transfer's deadline (a peer on the same host copies
        the pages before it answers), plus a moment so that the peer's own deadline error
        arrives.
        """
        reply = await self._call("Claim", claim_to_proto(claim), time_left(deadline, 0.5))
        return grant_from_proto(reply)

    async def commit(self, commit: Commit, deadline: float) -> TransferInfo:
        """Hand over the checksums; the peer's final status of the transfer."""
        reply = await self._call("Commit", commit_to_proto(commit), time_left(deadline, 0.5))
        return info_from_proto(reply)

    async def request_push(self, request: PullAsk, deadline: float) -> PushStarted | None:
        """Ask the peer to push an offered transfer to us: how it started sending to the
        request's placement, or None when it claims instead."""
        reply = await self._call("RequestPush", pull_ask_to_proto(request),
                                 time_left(deadline, 0.5))
        return started_from_proto(reply)

    async def abort_transfer(self, abort: PeerAbort, timeout_s: float) -> None:
        """Tell the peer a transfer ended here."""
        await self._call("AbortTransfer", abort_to_proto(abort), timeout_s)

    async def keep_offers(self, holds: list[OfferHold], keep_s: float,
                          timeout_s: float) -> list[float]:
        """Keep the peer's offers ``holds`` waiting ``keep_s`` more; the seconds each now waits
        (0: not kept)."""
        reply = await self._call("KeepOffers", pb.PeerKeepOffersRequest(
            offers=holds_to_proto(holds), keep_s=keep_s), timeout_s)
        if len(reply.remaining_s) != len(holds):
            raise InternalError(f"{self._prefix}answered {len(reply.remaining_s)} figures for "
                                f"{len(holds)} offers kept")
        return list(reply.remaining_s)


class PeerClients:
    """One cached channel (and client) per peer address."""

    def __init__(self, metrics: DaemonMetrics, tls: PeerTls | None = None,
                 policy: DialPolicy | None = None, peer_allow: frozenset[str] = frozenset()) -> None:
        self._metrics = metrics
        self._tls = tls
        self._policy = policy or DialPolicy(LOOPBACK)
        self._peer_allow = peer_allow
        self._clients: dict[str, PeerClient] = {}
        self._channels: list[grpc.aio.Channel] = []

    async def get(self, address: str) -> PeerClient:
        """The client of the peer at ``address`` (host:port), over mutual TLS if configured;
        DialNotAllowedError (counted) if the dial policy refuses the address (checked at
        every call: a name may resolve elsewhere by now) or, with ``peer_allow``, if the
        certificate the peer presents names no allowed identity (checked before the first
        call to it)."""
        await self.check(address)
        client = self._clients.get(address)
        if client is None:
            await self._check_identity(address)
            target = f"dns:///{address}"  # never another scheme (unix:, ...) from a peer address
            if self._tls is None:
                channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
            else:
                channel = grpc.aio.secure_channel(target, self._tls.channel_credentials(),
                                                  options=CHANNEL_OPTIONS)
            self._channels.append(channel)
            client = self._clients[address] = PeerClient(address, channel, self._metrics)
        return client

    async def check(self, address: str) -> None:
        """Raise DialNotAllowedError (counted) unless the dial policy allows ``address``."""
        try:
            await self._policy.check(address)
        except DialNotAllowedError:
            self._metrics.dials_refused.inc()
            raise

    async def _check_identity(self, address: str) -> None:
        """With mutual TLS and ``peer_allow``: DialNotAllowedError (counted) unless the peer's
        certificate names an allowed identity."""
        if self._tls is None or not self._peer_allow:
            return
        names = await self._tls.names_presented(address, IDENTITY_CHECK_S)
        if not names & self._peer_allow:
            self._metrics.dials_refused.inc()
            raise DialNotAllowedError(
                f"peer {address!r} presents a certificate for {sorted(names)}, none of them in "
                f"this daemon's peer_allow ({', '.join(sorted(self._peer_allow))}); nothing "
                f"was sent to it")

    async def close(self) -> None:
        """Close every channel."""
        for channel in self._channels:
            await channel.close(grace=None)
        self._channels.clear()
        self._clients.clear()
