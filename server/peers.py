"""Sessions with peer daemons: handshake, UCX endpoint, and liveness.

A ``PeerLink`` is this daemon's session with one peer it sends to: a gRPC
channel, the peer's pool descriptors, a UCX endpoint per data lane, and a
``Watch`` stream of heartbeats. The stream gives both sides liveness: when the
peer dies its TCP connection resets and the stream fails at once on our side;
when we die, the peer's stream handler is cancelled. Either way every transfer
of the session fails with UNAVAILABLE instead of waiting for its deadline. UCX
peer error handling (on by default) fails the data-plane requests too; with it
off, the stream is the only thing that notices a dead peer.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from kvxfer.descriptor import PoolDescriptor
from kvxfer.errors import IncompatibleLayoutError, PeerUnavailableError
from kvxfer.lanes import LaneEndpoints, UcxLanes
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc

log = logging.getLogger("kvxfer.server.peers")

CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 64 << 20),
]


def silence_limit_s(heartbeat_s: float) -> float:
    """How long either side of a session waits for the other's stream before giving up."""
    return 3 * heartbeat_s + 1


@dataclass
class PeerLink:
    """A live session with one peer daemon."""

    address: str
    session_id: str
    stub: pb_grpc.KvxferPeerStub
    pools: dict[str, PoolDescriptor]
    endpoints: LaneEndpoints
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    lost_reason: str = ""
    watch: asyncio.Task[None] | None = None


class PeerLinks:
    """Opens, caches and watches sessions with peer daemons."""

    def __init__(
        self,
        engine: UcxLanes,
        handshake: Callable[[str], pb.HandshakeRequest],
        on_lost: Callable[[str, str], None],
        heartbeat_s: float,
    ) -> None:
        self._engine = engine
        self._handshake = handshake
        self._on_lost = on_lost
        self._heartbeat_s = heartbeat_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._links: dict[str, PeerLink] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def stub(self, address: str) -> pb_grpc.KvxferPeerStub:
        """A stub for ``address``'s peer service over a cached channel (no session)."""
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = channel
        return pb_grpc.KvxferPeerStub(channel)

    async def get(self, address: str, timeout: float) -> PeerLink:
        """The live session with ``address``, opening one if needed."""
        link = self._links.get(address)
        if link is not None and not link.lost.is_set():
            return link
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            link = self._links.get(address)
            if link is not None and not link.lost.is_set():
                return link
            link = await self._open(address, timeout)
            self._links[address] = link
            return link

    async def _open(self, address: str, timeout: float) -> PeerLink:
        session_id = uuid.uuid4().hex
        stub = self.stub(address)
        request = self._handshake(session_id)
        try:
            reply = await stub.Handshake(request, timeout=max(timeout, 0.1))
        except grpc.aio.AioRpcError as exc:
            raise PeerUnavailableError(
                f"peer {address} did not answer the handshake: {exc.code().name} {exc.details()}"
            ) from None
        if reply.ucx_error_handling != request.ucx_error_handling:
            raise IncompatibleLayoutError(
                f"peer {address} runs UCX with error_handling={reply.ucx_error_handling}, we run "
                f"{request.ucx_error_handling}; both daemons must use the same setting"
            )
        pools = {d.name: PoolDescriptor.from_proto(d) for d in reply.pools}
        ports = list(reply.ucx_ports) or [reply.ucx_port]
        # Watch at once: the peer drops a session whose stream has not begun in time.
        call = stub.Watch(pb.WatchRequest(session_id=session_id))
        try:
            endpoints = await asyncio.to_thread(
                self._engine.connect, reply.ucx_host, ports, max(timeout, 1.0)
            )
        except Exception as exc:  # noqa: BLE001 - any UCX failure means unreachable
            call.cancel()
            raise PeerUnavailableError(
                f"cannot open UCX endpoints to {reply.ucx_host} ports {ports}: {exc}"
            ) from None
        except BaseException:  # cancelled: the stream must not keep the peer's session alive
            call.cancel()
            raise
        link = PeerLink(address, session_id, stub, pools, endpoints)
        link.watch = asyncio.create_task(self._watch(link, call), name=f"watch {address}")
        log.info("session %s with peer %s (UCX %s, %d lanes)", session_id[:8], address,
                 reply.ucx_host, len(endpoints))
        return link

    async def _watch(self, link: PeerLink, call: grpc.aio.UnaryStreamCall) -> None:
        reason = "heartbeat stream ended"
        limit_s = silence_limit_s(self._heartbeat_s)
        try:
            while True:
                beat = await asyncio.wait_for(call.read(), timeout=limit_s)
                if beat is grpc.aio.EOF:
                    break
        except TimeoutError:
            reason = f"no heartbeat for {limit_s:.0f}s"
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            call.cancel()
            reason = "session closed"
            self._lose(link, reason)
            raise
        call.cancel()
        self._lose(link, reason)

    def _lose(self, link: PeerLink, reason: str) -> None:
        if link.lost.is_set():
            return
        link.lost_reason = reason
        link.lost.set()
        self._engine.close_endpoints(link.endpoints)
        if self._links.get(link.address) is link:
            del self._links[link.address]
        log.warning("lost peer %s: %s", link.address, reason)
        self._on_lost(link.session_id, f"peer {link.address} lost: {reason}")

    async def close(self) -> None:
        """Close every session and channel."""
        for link in list(self._links.values()):
            if link.watch is not None:
                link.watch.cancel()
        for link in list(self._links.values()):
            if link.watch is not None:
                await asyncio.gather(link.watch, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close(grace=None)
        self._channels.clear()
