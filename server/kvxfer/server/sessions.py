"""Sessions with peer daemons, in both directions, and the heartbeats that keep them alive.

A daemon that sends to a peer opens an *outbound* session: a handshake (each
side describes its data plane and every pool it serves), a UCX connection, and
a ``Watch`` stream on which both sides beat every ``heartbeat_s``. The peer
holds the matching *inbound* session. The stream is the liveness signal for
both: when either side dies its connection resets and the stream fails at once
on the other; a frozen side (SIGSTOP, a hung host, a cut link) stops beating
and the other gives it up after ``silence_limit_s``. An inbound session whose
stream has not begun within that limit after its handshake is dropped, so a
handshake alone holds nothing for long.

A session's end is its ``lost`` future (resolved with the reason). Transfers
run their work through ``session.guard(...)``, which fails with
PeerUnavailableError the moment the session is lost; nothing calls back into
the transfers.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import grpc

from kvxfer.descriptor import PoolDescriptor
from kvxfer.errors import IncompatiblePeerError, InvalidArgumentError, PeerUnavailableError
from kvxfer.local_copy import ArenaFile, PeerArena, map_peer_arena
from kvxfer.server.limits import Limits, check_below, check_id
from kvxfer.server.peer_client import PeerClient, PeerClients, WatchStream, time_left
from kvxfer.server.peer_protocol import DaemonHello
from kvxfer.server.tls import Caller
from kvxfer.status import DataPlane, PeerSessionInfo
from kvxfer.transport import Connection, Transport

log = logging.getLogger("kvxfer.server.sessions")

T = TypeVar("T")


def silence_limit_s(heartbeat_s: float) -> float:
    """How long either side of a session waits for the other's stream before giving up."""
    return 3 * heartbeat_s + 1


@dataclass(frozen=True)
class DaemonIdentity:
    """What this daemon tells peers about itself in every handshake."""

    peer_address: str
    pools: dict[str, PoolDescriptor]
    error_handling: bool
    local_copy: bool = False
    arena_files: dict[str, ArenaFile] = field(default_factory=dict)


@dataclass(eq=False)
class Session:
    """A session with one peer; ``lost`` resolves (with the reason) when it ends."""

    session_id: str
    peer: DaemonHello
    lost: asyncio.Future[str] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def pools(self) -> dict[str, PoolDescriptor]:
        """The pools the peer serves, by name, as its handshake described them."""
        return self.peer.pools

    def end(self, reason: str) -> bool:
        """Mark the session lost (once); True if this call ended it."""
        if self.lost.done():
            return False
        self.lost.set_result(reason)
        return True

    async def guard(self, work: Awaitable[T]) -> T:
        """``work``'s result, unless the session is lost first: then ``work`` is cancelled
        and PeerUnavailableError says why."""
        task = asyncio.ensure_future(work)
        racing: set[asyncio.Future[Any]] = {task, self.lost}
        try:
            await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task.done():
            return task.result()
        task.cancel()
        raise PeerUnavailableError(self.lost.result())


@dataclass(eq=False)
class OutboundSession(Session):
    """A session we opened to send to ``address``."""

    address: str = ""
    client: PeerClient | None = None
    connection: Connection | None = None
    watch: asyncio.Task[None] | None = None

    def info(self) -> PeerSessionInfo:
        """The session as ``ListPeers`` reports it: a local copy when the peer said it maps
        our pools (it then copies every transfer itself), else UCX tagged messages."""
        plane = DataPlane.LOCAL_COPY if self.peer.reads_locally else DataPlane.UCX_TAGGED
        lanes = 0 if self.peer.reads_locally or self.connection is None else self.connection.lanes
        return PeerSessionInfo(self.address, True, self.session_id, plane, lanes)


@dataclass(eq=False)
class InboundSession(Session):
    """A session ``caller`` opened to send to us; ``watched`` once its Watch stream began.
    Only the same caller may use it. ``sources``: the caller's arenas, by pool, mapped
    read-only when it is on this host and both sides allow local copy."""

    caller: Caller = Caller((), "")
    watched: bool = False
    sources: dict[str, PeerArena] = field(default_factory=dict)

    @property
    def peer_address(self) -> str:
        """Where the peer serves its peer API."""
        return self.peer.peer_address

    def info(self) -> PeerSessionInfo:
        """The session as ``ListPeers`` reports it: a local copy when we mapped the peer's
        pools, else UCX tagged messages on as many lanes as the peer's handshake offered."""
        plane = DataPlane.LOCAL_COPY if self.sources else DataPlane.UCX_TAGGED
        lanes = 0 if self.sources else len(self.peer.ucx_ports)
        return PeerSessionInfo(self.peer_address, False, self.session_id, plane, lanes,
                               self.caller.name)


def _map_all(files: dict[str, ArenaFile]) -> dict[str, PeerArena]:
    """Every peer arena mapped read-only, by pool; empty unless all of them could be."""
    mapped = {pool: map_peer_arena(f) for pool, f in files.items()}
    if any(m is None for m in mapped.values()):
        return {}
    return {pool: m for pool, m in mapped.items() if m is not None}


class Sessions:
    """Opens, accepts, watches and ends every session of this daemon."""

    def __init__(self, transport: Transport, clients: PeerClients, identity: DaemonIdentity,
                 heartbeat_s: float, limits: Limits) -> None:
        self._transport = transport
        self._clients = clients
        self._identity = identity
        self._heartbeat_s = heartbeat_s
        self._limits = limits
        self.silence_limit_s = silence_limit_s(heartbeat_s)
        self._outbound: dict[str, OutboundSession] = {}  # by peer address
        self._opening: dict[str, asyncio.Lock] = {}
        self._inbound: dict[str, InboundSession] = {}  # by session id
        self._closing = asyncio.Event()

    def hello(self, session_id: str) -> DaemonHello:
        """What we tell a peer about ourselves."""
        return DaemonHello(session_id, self._transport.host, tuple(self._transport.ports),
                           self._identity.error_handling, self._identity.pools,
                           self._identity.peer_address, self._identity.arena_files)

    @property
    def inbound_count(self) -> int:
        """Peers holding a session open to send to us."""
        return len(self._inbound)

    def describe(self) -> list[PeerSessionInfo]:
        """Every open session, outbound first (safe from another thread: the metrics')."""
        sessions: list[OutboundSession | InboundSession] = [*list(self._outbound.values()),
                                                            *list(self._inbound.values())]
        return [s.info() for s in sessions if not s.lost.done()]

    # -- outbound --------------------------------------------------------------------------

    async def outbound(self, address: str, deadline: float) -> OutboundSession:
        """The live session with the peer at ``address``, opened now if there is none."""
        session = self._outbound.get(address)
        if session is not None and not session.lost.done():
            return session
        async with self._opening.setdefault(address, asyncio.Lock()):
            session = self._outbound.get(address)
            if session is None or session.lost.done():
                session = self._outbound[address] = await self._open(address, deadline)
            return session

    def open_outbound(self, address: str) -> OutboundSession | None:
        """The live session with the peer at ``address``, if one is open (never opens one)."""
        session = self._outbound.get(address)
        return session if session is not None and not session.lost.done() else None

    async def _open(self, address: str, deadline: float) -> OutboundSession:
        if self._closing.is_set():
            raise PeerUnavailableError("this daemon is shutting down; no new sessions")
        session_id = uuid.uuid4().hex
        client = await self._clients.get(address)
        mine = self.hello(session_id)
        peer = await client.handshake(mine, deadline)
        await self._clients.check(peer.ucx_host)  # where it says its UCX listens: dialled too
        if peer.ucx_error_handling != mine.ucx_error_handling:
            raise IncompatiblePeerError(
                f"peer {address} runs UCX with error_handling={peer.ucx_error_handling}, we run "
                f"{mine.ucx_error_handling}; both daemons must use the same setting")
        # Watch at once: the peer drops a session whose stream has not begun in time.
        stream = await client.watch(session_id)
        try:
            connection = await asyncio.to_thread(
                self._transport.connect, peer.ucx_host, peer.ucx_ports,
                max(time_left(deadline), 1.0))
        except Exception as exc:  # noqa: BLE001 - any UCX failure means unreachable
            stream.cancel()
            raise PeerUnavailableError(
                f"cannot open UCX endpoints to {peer.ucx_host} ports {list(peer.ucx_ports)}: {exc}"
            ) from None
        except BaseException:  # cancelled: the stream must not keep the peer's session alive
            stream.cancel()
            raise
        session = OutboundSession(session_id, peer, address=address, client=client,
                                  connection=connection)
        session.watch = asyncio.create_task(self._watch(session, stream), name=f"watch {address}")
        log.info("session %s with peer %s (UCX %s, %d lanes)", session_id[:8], address,
                 peer.ucx_host, connection.lanes)
        return session

    async def _watch(self, session: OutboundSession, stream: WatchStream) -> None:
        reason = "heartbeat stream ended"
        beating = asyncio.create_task(self._beat(stream), name=f"beat {session.address}")
        try:
            while await asyncio.wait_for(stream.peer_beat(), timeout=self.silence_limit_s):
                pass
        except TimeoutError:
            reason = f"no heartbeat for {self.silence_limit_s:.0f}s"
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            reason = "session closed"
            raise
        finally:
            beating.cancel()
            stream.cancel()
            self._lose_outbound(session, reason)

    async def _beat(self, stream: WatchStream) -> None:
        """Our heartbeats to the peer, until the stream fails (``_watch`` says why)."""
        try:
            while True:
                await asyncio.sleep(self._heartbeat_s)
                await stream.beat()
        except grpc.aio.AioRpcError:
            return

    def _lose_outbound(self, session: OutboundSession, reason: str) -> None:
        if not session.end(f"peer {session.address} lost: {reason}"):
            return
        if session.connection is not None:
            self._transport.close_connection(session.connection)
        if self._outbound.get(session.address) is session:
            del self._outbound[session.address]
        log.warning("lost peer %s: %s", session.address, reason)

    # -- inbound ---------------------------------------------------------------------------

    async def accept(self, peer: DaemonHello, caller: Caller) -> DaemonHello:
        """``caller`` opens a session to send to us; our hello in reply. A session id must
        be new, and a caller holds at most ``limits.sessions_per_peer`` sessions. With local
        copy on here, the caller's arena files are mapped if they are on this host."""
        if self._closing.is_set():
            raise PeerUnavailableError("this daemon is shutting down; no new sessions")
        check_id("session_id", peer.session_id)
        if peer.session_id in self._inbound:
            raise InvalidArgumentError(f"session id {peer.session_id[:8]}... is in use; every "
                                    "handshake needs a new one")
        held = sum(1 for s in self._inbound.values() if s.caller.name == caller.name)
        check_below("max_sessions_per_peer", held, self._limits.sessions_per_peer,
                    f"peer {caller.name} holds sessions open here")
        session = InboundSession(peer.session_id, peer, caller=caller)
        self._inbound[peer.session_id] = session
        asyncio.get_running_loop().call_later(self.silence_limit_s, self._drop_unwatched, session)
        if self._identity.local_copy and peer.arena_files:
            session.sources = await asyncio.to_thread(_map_all, peer.arena_files)
        return replace(self.hello(peer.session_id), reads_locally=bool(session.sources))

    def inbound(self, session_id: str, caller: Caller) -> InboundSession:
        """The live inbound session ``session_id`` of ``caller``; PeerUnavailableError if
        there is none (another caller's session is as unknown as a missing one)."""
        session = self._inbound.get(session_id)
        if session is None or session.caller.name != caller.name:
            raise PeerUnavailableError(
                f"session {session_id[:8]} is unknown; handshake first (a session is dropped "
                f"{self.silence_limit_s:.0f} s after its handshake without a Watch stream)")
        return session

    def inbound_from(self, address: str, identity: str = "") -> InboundSession | None:
        """The newest live, watched session the peer serving at ``address`` opened to us
        over UCX (not by local copy), whose certificate names ``identity`` if one is given."""
        for session in reversed(list(self._inbound.values())):
            if (session.peer_address == address and session.watched and not session.sources
                    and not session.lost.done()
                    and (not identity or session.caller.is_named(identity))):
                return session
        return None

    def owns(self, session_id: str, caller: Caller) -> bool:
        """Whether ``session_id`` is a live session of ours with ``caller``: one it opened
        to us, or one we opened to it (whose id only that peer was told)."""
        inbound = self._inbound.get(session_id)
        if inbound is not None:
            return inbound.caller.name == caller.name
        return any(s.session_id == session_id and not s.lost.done()
                   for s in self._outbound.values())

    async def heartbeats(self, session_id: str, caller: Caller,
                         sender_beats: AsyncIterator[object]) -> AsyncIterator[float]:
        """The Watch stream of ``caller``'s inbound session: a heartbeat (unix time) every
        ``heartbeat_s`` until this daemon closes, or the sender's beats (``sender_beats``)
        stop or fall silent for ``silence_limit_s``; the session ends with the stream."""
        session = self.inbound(session_id, caller)
        if session.watched:
            raise InvalidArgumentError(f"session {session_id[:8]} is already watched; a session "
                                    "has one Watch stream, opened right after its handshake")
        session.watched = True
        listening = asyncio.create_task(self._listen(sender_beats), name=f"listen {session_id[:8]}")
        closing = asyncio.create_task(self._closing.wait(), name=f"closing {session_id[:8]}")
        try:
            while not (closing.done() or listening.done()):
                yield time.time()
                await asyncio.wait({listening, closing}, timeout=self._heartbeat_s,
                                   return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._lose_inbound(session, _why_watch_ended(session, listening, closing))
            listening.cancel()
            closing.cancel()

    def watch_ended(self, session_id: str, reason: str) -> None:
        """The Watch stream of inbound session ``session_id`` ended, however it ended."""
        session = self._inbound.get(session_id)
        if session is not None and session.watched:
            self._lose_inbound(session, f"sender {session.peer_address}: {reason}")

    async def _listen(self, sender_beats: AsyncIterator[object]) -> str:
        """How the sender's beats ended: it closed the stream, or it fell silent."""
        beats = aiter(sender_beats)
        while True:
            try:
                await asyncio.wait_for(anext(beats), self.silence_limit_s)
            except StopAsyncIteration:
                return "closed its session"
            except TimeoutError:
                return f"fell silent (no heartbeat for {self.silence_limit_s:.0f}s)"
            except Exception as exc:  # noqa: BLE001 - any failure of the stream ends the session
                return f"broke its stream: {exc}"

    def _drop_unwatched(self, session: InboundSession) -> None:
        if not session.watched and self._inbound.get(session.session_id) is session:
            log.warning("dropping session %s from %s: no Watch stream %.0f s after its handshake",
                        session.session_id[:8], session.peer_address, self.silence_limit_s)
            self._lose_inbound(session, f"sender {session.peer_address} never watched its session")

    def _lose_inbound(self, session: InboundSession, reason: str) -> None:
        if self._inbound.get(session.session_id) is session:
            del self._inbound[session.session_id]
        # Unmapped as soon as no running copy holds them: a mapping would keep a dead
        # sender's unlinked pool in memory (ended transfers may still refer to the session).
        session.sources = {}
        session.end(reason)

    # -- shutdown ---------------------------------------------------------------------------

    async def close(self) -> None:
        """End every session: inbound streams finish, outbound ones are closed."""
        self._closing.set()
        watches = [s.watch for s in self._outbound.values() if s.watch is not None]
        for watch in watches:
            watch.cancel()
        await asyncio.gather(*watches, return_exceptions=True)
        for session in list(self._inbound.values()):
            self._lose_inbound(session, "this daemon shut down")


def _why_watch_ended(session: InboundSession, listening: asyncio.Task[str],
                     closing: asyncio.Task[bool]) -> str:
    """Why a Watch stream ended: this daemon closed, the sender's beats ended (and how), or
    the stream broke under us, as it does when the sender dies. The sender's beats and our
    stream often end at the same moment; whichever did, the reason names the sender."""
    if closing.done() and not closing.cancelled():
        return "this daemon shut down"
    if listening.done() and not listening.cancelled():
        return f"sender {session.peer_address} {listening.result()}"
    return f"sender {session.peer_address} went away"
