"""Transfers: the rendezvous and state machine behind expect/push/offer/pull.

Every transfer is keyed by its id (the engine's request id) and has a role on
this daemon, a deadline, and a final state (done, failed, aborted, deadline
exceeded) that both sides learn.

Push (``expect`` on the decode daemon D, ``push`` on the prefill daemon P, in
either order):

1. P opens a session with D (``peers.PeerLinks``): the handshake tells D every
   pool P serves, so a ``Claim`` names its source pool instead of describing it.
2. P calls ``Claim``. D waits for the matching ``expect``, checks the layouts,
   plans the chunks, posts one UCX receive per chunk straight into the
   destination pages and answers with the tag base.
3. P plans the same chunks and sends them from the source pages (a bounded
   window in flight). Without verify, each side is done when its UCX requests
   complete: D when the last byte arrived, P when its last send completed.
4. With verify, P then calls ``Commit`` with per-chunk checksums; D checks the
   bytes that arrived and answers with the final status, which P adopts.

Pull is the same with one step before: ``pull`` on D registers the
expectation and asks P (``RequestPush``) to push once its ``offer`` is there.

Both sides chunk identically (``plan_chunks``), so chunk ``i`` is the message
tagged ``tag_base + i``. Tag bases are unique for the receiver's lifetime.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client import Counter, Gauge

from kvxfer.descriptor import PoolDescriptor, check_compatible
from kvxfer.errors import (
    IncompatibleLayoutError,
    IntegrityError,
    InvalidRangeError,
    KvxferError,
    PeerUnavailableError,
    TransferAbortedError,
    TransferDeadlineError,
    TransferExistsError,
    TransferNotFoundError,
    error_for_status,
    status_name,
)
from kvxfer.integrity import checksum
from kvxfer.lanes import LaneBatch, LaneEndpoints, UcxLanes
from kvxfer.layout import PoolLayout
from kvxfer.pages import Extent, PageRuns, map_extents, split_extents
from kvxfer.server.peers import PeerLinks, silence_limit_s
from kvxfer.server.pools import Pool, PoolRegistry
from kvxfer.states import TransferRole, TransferState
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.wire import runs_from_proto, runs_to_proto

log = logging.getLogger("kvxfer.server.transfers")

TRANSFERS = Counter("kvxfer_transfers", "Finished transfers", ["role", "state"])
BYTES = Counter("kvxfer_bytes", "Bytes moved by finished transfers", ["role"])
ACTIVE = Gauge("kvxfer_active_transfers", "Transfers not yet final", ["role"])
POSTED = Gauge("kvxfer_ucx_posted_requests",
               "UCX sends and receives posted and not yet complete (0 when idle)")
INBOUND = Gauge("kvxfer_inbound_sessions", "Sessions peer daemons hold open to send to us")

CHUNK_BITS = 24
#: Set on a receiving daemon (tests only) to flip one byte of every transfer it receives.
FAULT_CORRUPT_ENV = "KVXFER_FAULT_CORRUPT_RECEIVED"


def plan_chunks(
    src_runs: PageRuns, src: PoolLayout, dst_runs: PageRuns, dst: PoolLayout, chunk_bytes: int
) -> tuple[Extent, ...]:
    """The messages of a transfer: minimal extents cut to ``chunk_bytes``. Both sides agree."""
    extents = map_extents(
        src_runs, dst_runs, page_bytes=src.page_bytes,
        src_anchor=src.anchor_bytes, dst_anchor=dst.anchor_bytes,
    )
    chunks = split_extents(extents, chunk_bytes)
    if len(chunks) >= 1 << CHUNK_BITS:
        raise InvalidRangeError(
            f"transfer needs {len(chunks)} messages; at most {(1 << CHUNK_BITS) - 1} fit a tag "
            "space; use a larger chunk_bytes"
        )
    return chunks


def _final_state(error: KvxferError) -> TransferState:
    if isinstance(error, TransferDeadlineError):
        return TransferState.DEADLINE_EXCEEDED
    if isinstance(error, TransferAbortedError):
        return TransferState.ABORTED
    return TransferState.FAILED


@dataclass(eq=False)
class InboundSession:
    """A peer that opened a session to send to us, as its handshake described it.

    ``watched`` turns true when the peer's Watch stream begins; a session still
    unwatched after the silence limit is dropped, so a handshake alone holds
    nothing for long.
    """

    peer_address: str
    pools: dict[str, PoolDescriptor]
    watched: bool = False


@dataclass(eq=False)
class Transfer:
    """One side of one transfer."""

    id: str
    role: TransferRole
    pool: Pool
    runs: PageRuns
    timeout_s: float
    deadline: float
    verify: bool = False
    peer: str = ""
    session_id: str = ""
    state: TransferState = TransferState.WAITING
    created_unix: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    data_finished: float | None = None
    chunks: tuple[Extent, ...] = ()
    lanes: int = 0
    error: KvxferError | None = None
    verified: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[Any] | None = None
    batch: LaneBatch | None = None
    timer: asyncio.TimerHandle | None = None

    @property
    def bytes_total(self) -> int:
        """Bytes the transfer moves."""
        return self.runs.num_pages * self.pool.descriptor.page_bytes

    @property
    def bytes_done(self) -> int:
        """Bytes of this transfer whose UCX messages completed."""
        if self.batch is not None:
            return self.batch.bytes_done
        return self.bytes_total if self.state == TransferState.DONE else 0

    def remaining(self) -> float:
        """Seconds to the deadline (0 when past it)."""
        return max(0.0, self.deadline - time.monotonic())

    def status(self) -> pb.TransferStatus:
        """The wire form of this side's status."""
        seconds = data_seconds = 0.0
        if self.started is not None:
            seconds = (self.finished or time.monotonic()) - self.started
            if self.data_finished is not None:
                data_seconds = self.data_finished - self.started
        return pb.TransferStatus(
            transfer_id=self.id,
            role=self.role.value,
            state=self.state.value,
            pool=self.pool.name,
            peer=self.peer,
            pages=self.runs.num_pages,
            bytes=self.bytes_total,
            bytes_done=self.bytes_done,
            extents=len(self.chunks),
            seconds=seconds,
            error_code=status_name(self.error) if self.error else "",
            error=str(self.error) if self.error else "",
            verified=self.verified,
            created_unix=self.created_unix,
            data_seconds=data_seconds,
            lanes=self.lanes,
        )


class TransferManager:
    """Owns every transfer of this daemon and drives them to a final state."""

    def __init__(
        self,
        pools: PoolRegistry,
        engine: UcxLanes,
        *,
        peer_address: str,
        chunk_bytes: int,
        window_bytes: int,
        heartbeat_s: float,
        default_timeout_s: float,
        retain: int,
        error_handling: bool,
    ) -> None:
        self._pools = pools
        self._engine = engine
        POSTED.set_function(engine.posted_requests)
        self.peer_address = peer_address
        self._chunk_bytes = chunk_bytes
        self._window_bytes = window_bytes
        self._default_timeout = default_timeout_s
        self._retain = retain
        self._error_handling = error_handling
        self._transfers: OrderedDict[str, Transfer] = OrderedDict()
        self._registered = asyncio.Condition()
        self._next_tag = random.getrandbits(32)
        self._inbound: dict[str, InboundSession] = {}  # by session id
        INBOUND.set_function(lambda: len(self._inbound))
        self._session_grace_s = silence_limit_s(heartbeat_s)
        # Ids a peer aborted before this side registered them: registering one ends it at once.
        self._aborted_early: OrderedDict[str, str] = OrderedDict()
        self._accepting = True
        self._corrupt = os.environ.get(FAULT_CORRUPT_ENV) == "1"
        self.links = PeerLinks(engine, self.handshake_request, self.session_lost, heartbeat_s)

    # -- bookkeeping -----------------------------------------------------------

    def get(self, transfer_id: str) -> Transfer:
        """The transfer ``transfer_id``; raises TransferNotFoundError."""
        try:
            return self._transfers[transfer_id]
        except KeyError:
            raise TransferNotFoundError(f"no transfer {transfer_id!r} is known here") from None

    def all(self) -> list[Transfer]:
        """Every transfer still remembered, oldest first."""
        return list(self._transfers.values())

    def _timeout(self, timeout_s: float) -> float:
        if timeout_s < 0:
            raise InvalidRangeError(f"timeout_s={timeout_s} must be >= 0 (0 means the default)")
        return timeout_s or self._default_timeout

    async def _register(
        self, transfer_id: str, role: TransferRole, pool_name: str, runs: PageRuns,
        timeout_s: float, *, verify: bool = False, peer: str = "", disjoint: bool,
    ) -> Transfer:
        if not self._accepting:
            raise PeerUnavailableError("this daemon is shutting down; no new transfers")
        if not transfer_id:
            raise InvalidRangeError("transfer_id is empty; expected the engine's request id")
        pool = self._pools.get(pool_name)
        runs.check_bounds(pool.descriptor.num_pages, what=f"pool {pool_name!r} pages")
        if disjoint:
            runs.check_disjoint()
        old = self._transfers.get(transfer_id)
        if old is not None and not old.state.final:
            raise TransferExistsError(
                f"transfer {transfer_id!r} is already {old.state.name} here as "
                f"{old.role.name}; wait for it or abort it first"
            )
        timeout = self._timeout(timeout_s)
        t = Transfer(
            transfer_id, role, pool, runs, timeout, time.monotonic() + timeout,
            verify=verify, peer=peer,
        )
        self._transfers.pop(transfer_id, None)
        self._transfers[transfer_id] = t
        t.timer = asyncio.get_running_loop().call_later(timeout, self._expire, t)
        ACTIVE.labels(role.name.lower()).inc()
        self._prune()
        if transfer_id in self._aborted_early:
            self._finish(t, TransferAbortedError(
                f"aborted by the peer before it was registered here: "
                f"{self._aborted_early.pop(transfer_id)}"))
        async with self._registered:
            self._registered.notify_all()
        return t

    def _prune(self) -> None:
        final = [k for k, t in self._transfers.items() if t.state.final]
        for key in final[: max(0, len(self._transfers) - self._retain)]:
            del self._transfers[key]

    def _expire(self, t: Transfer) -> None:
        if not t.state.final:
            self._finish(t, TransferDeadlineError(
                f"transfer {t.id!r} did not complete within its {t.timeout_s:g}s deadline "
                f"(it was {t.state.name})"
            ))
            self._tell_peer_abort(t, "deadline exceeded")

    def _finish(self, t: Transfer, error: KvxferError | None = None) -> None:
        """Move ``t`` to its final state (once); release what it holds."""
        if t.state.final:
            return
        t.state = TransferState.DONE if error is None else _final_state(error)
        t.error = error
        t.finished = time.monotonic()
        if t.timer is not None:
            t.timer.cancel()
        if t.task is not None and t.task is not asyncio.current_task():
            t.task.cancel()
        if t.batch is not None and error is not None:
            self._engine.abandon(t.batch, f"transfer {t.id!r} ended: {t.state.name}")
        t.done.set()
        t.arrived.set()
        role = t.role.name.lower()
        ACTIVE.labels(role).dec()
        TRANSFERS.labels(role, t.state.name.lower()).inc()
        if error is None:
            BYTES.labels(role).inc(t.bytes_total)
            log.info("transfer %s %s done: %d bytes in %.3fs", t.id, role, t.bytes_total,
                     (t.finished - (t.started or t.finished)))
        else:
            log.warning("transfer %s %s %s: %s", t.id, role, t.state.name, error)

    def _fail(self, t: Transfer, exc: BaseException) -> None:
        if isinstance(exc, grpc.aio.AioRpcError):
            exc = error_for_status(exc.code().name, f"peer {t.peer}: {exc.details()}")
        if not isinstance(exc, KvxferError):
            log.exception("transfer %s failed unexpectedly", t.id, exc_info=exc)
            exc = KvxferError(f"internal error: {type(exc).__name__}: {exc}")
        self._finish(t, exc)

    def _tell_peer_abort(self, t: Transfer, reason: str) -> None:
        if not t.peer:
            return
        request = pb.AbortTransferRequest(transfer_id=t.id, session_id=t.session_id, reason=reason)

        async def tell() -> None:
            try:
                await self.links.stub(t.peer).AbortTransfer(request, timeout=2.0)
            except grpc.aio.AioRpcError as exc:
                log.info("could not tell %s that %s ended: %s", t.peer, t.id, exc.code().name)

        asyncio.get_running_loop().create_task(tell())

    async def _wait_registered(self, transfer_id: str, role: TransferRole, timeout: float,
                               verb: str) -> Transfer:
        def found() -> bool:
            # A final transfer that already had its partner is history, not a match: the
            # id is being reused and the new registration is still to come.
            t = self._transfers.get(transfer_id)
            partnered = t is not None and bool(t.session_id if role == TransferRole.RECEIVER
                                               else t.peer)
            return t is not None and t.role == role and not (t.state.final and partnered)

        try:
            async with self._registered:
                await asyncio.wait_for(self._registered.wait_for(found), timeout)
        except TimeoutError:
            raise TransferDeadlineError(
                f"no {verb} for transfer {transfer_id!r} arrived at {self.peer_address} within "
                f"{timeout:g}s"
            ) from None
        return self._transfers[transfer_id]

    @staticmethod
    def _check_claimable(t: Transfer) -> None:
        if t.state.final:
            raise t.error or TransferAbortedError(f"transfer {t.id!r} already ended")
        if t.state != TransferState.WAITING or t.session_id:
            raise TransferExistsError(f"transfer {t.id!r} was already claimed by another sender")

    # -- worker verbs ------------------------------------------------------------

    async def expect(self, transfer_id: str, pool: str, dst_runs: PageRuns,
                     timeout_s: float) -> Transfer:
        """Register destination pages for ``transfer_id`` (decode side)."""
        return await self._register(transfer_id, TransferRole.RECEIVER, pool, dst_runs,
                                    timeout_s, disjoint=True)

    async def push(self, transfer_id: str, pool: str, src_runs: PageRuns, peer: str,
                   timeout_s: float, verify: bool) -> Transfer:
        """Send source pages of ``transfer_id`` to the daemon at ``peer`` (prefill side)."""
        if not peer:
            raise InvalidRangeError("peer is empty; expected the decode daemon's host:port")
        t = await self._register(transfer_id, TransferRole.SENDER, pool, src_runs, timeout_s,
                                 verify=verify, peer=peer, disjoint=False)
        t.task = asyncio.create_task(self._run_push(t), name=f"push {transfer_id}")
        return t

    async def offer(self, transfer_id: str, pool: str, src_runs: PageRuns, timeout_s: float,
                    verify: bool) -> Transfer:
        """Make source pages available for a peer's ``pull`` (prefill side)."""
        return await self._register(transfer_id, TransferRole.SENDER, pool, src_runs,
                                    timeout_s, verify=verify, disjoint=False)

    async def pull(self, transfer_id: str, peer: str, pool: str, dst_runs: PageRuns,
                   timeout_s: float) -> Transfer:
        """Fetch ``transfer_id`` from the daemon at ``peer`` into ``dst_runs`` (decode side)."""
        if not peer:
            raise InvalidRangeError("peer is empty; expected the prefill daemon's host:port")
        t = await self.expect(transfer_id, pool, dst_runs, timeout_s)
        t.peer = peer
        t.task = asyncio.create_task(self._request_push(t), name=f"pull {transfer_id}")
        return t

    async def wait(self, transfer_id: str, timeout_s: float) -> Transfer:
        """Wait until ``transfer_id`` is final (or ``timeout_s`` passes: TransferDeadlineError)."""
        t = self.get(transfer_id)
        try:
            await asyncio.wait_for(t.done.wait(), timeout_s or t.remaining() + 1)
        except TimeoutError:
            raise TransferDeadlineError(
                f"transfer {transfer_id!r} is still {t.state.name} after waiting {timeout_s:g}s"
            ) from None
        return t

    async def abort(self, transfer_id: str, reason: str) -> Transfer:
        """End ``transfer_id`` on both sides (no-op if already final)."""
        t = self.get(transfer_id)
        if not t.state.final:
            self._finish(t, TransferAbortedError(f"aborted here: {reason or 'no reason given'}"))
            self._tell_peer_abort(t, reason)
        return t

    # -- peer verbs ----------------------------------------------------------------

    def handshake_request(self, session_id: str) -> pb.HandshakeRequest:
        """What we tell a peer about ourselves when opening a session."""
        return pb.HandshakeRequest(
            session_id=session_id,
            ucx_host=self._engine.host,
            ucx_port=self._engine.ports[0],
            ucx_ports=self._engine.ports,
            ucx_error_handling=self._error_handling,
            pools=[d.to_proto() for d in self._pools.descriptors()],
            peer_address=self.peer_address,
        )

    def handshake(self, request: pb.HandshakeRequest) -> pb.HandshakeResponse:
        """Accept a session from a peer that will send to us."""
        pools = {d.name: PoolDescriptor.from_proto(d) for d in request.pools}
        session = InboundSession(request.peer_address, pools)
        self._inbound[request.session_id] = session
        asyncio.get_running_loop().call_later(
            self._session_grace_s, self._drop_unwatched, request.session_id, session)
        return pb.HandshakeResponse(
            session_id=request.session_id,
            ucx_host=self._engine.host,
            ucx_port=self._engine.ports[0],
            ucx_ports=self._engine.ports,
            ucx_error_handling=self._error_handling,
            pools=[d.to_proto() for d in self._pools.descriptors()],
        )

    async def claim(self, request: pb.ClaimRequest) -> pb.ClaimResponse:
        """A sender asks where ``transfer_id`` goes; post the receives and answer (step 2)."""
        session = self._inbound.get(request.session_id)
        if session is None:
            raise PeerUnavailableError(f"session {request.session_id[:8]} is unknown; handshake first")
        t = await self._wait_registered(request.transfer_id, TransferRole.RECEIVER,
                                        request.timeout_s or self._default_timeout, "expect")
        self._check_claimable(t)
        t.session_id = request.session_id
        t.peer = t.peer or session.peer_address
        try:
            src = session.pools.get(request.src_pool)
            if src is None:
                raise IncompatibleLayoutError(
                    f"sender {session.peer_address} claims from pool {request.src_pool!r}, which "
                    f"its handshake did not describe (it described {sorted(session.pools)})")
            check_compatible(src, t.pool.descriptor)
            t.chunks = plan_chunks(runs_from_proto(request.src_runs), src.layout, t.runs,
                                   t.pool.descriptor.layout, request.chunk_bytes or self._chunk_bytes)
            tag_base = self._next_tag << CHUNK_BITS
            self._next_tag = (self._next_tag + 1) % (1 << (64 - CHUNK_BITS))
            t.verify = request.verify
            if request.lanes > self._engine.lanes:
                raise InvalidRangeError(
                    f"the sender offers {request.lanes} UCX lanes; this daemon has "
                    f"{self._engine.lanes} (its handshake said so)")
            # A lane with no chunk would only cost a wake-up on both sides.
            t.lanes = min(request.lanes or 1, max(1, len(t.chunks)))
            t.state = TransferState.TRANSFERRING
            t.started = time.monotonic()
            arena = t.pool.arena
            t.batch = self._engine.receive(
                [(arena.buffer(c.dst_offset, c.nbytes), tag_base + i)
                 for i, c in enumerate(t.chunks)],
                t.lanes,
            )
        except KvxferError as exc:
            self._finish(t, exc)
            raise
        t.task = asyncio.create_task(self._receive(t, t.batch), name=f"recv {t.id}")
        return pb.ClaimResponse(tag_base=tag_base, dst_pool=t.pool.name,
                                dst_runs=runs_to_proto(t.runs), lanes=t.lanes)

    async def _receive(self, t: Transfer, batch: LaneBatch) -> None:
        try:
            await asyncio.wrap_future(batch.future)
            t.data_finished = time.monotonic()
            if self._corrupt:
                view = t.pool.arena.raw[t.chunks[0].dst_offset]
                view.bitwise_not_()
            if not t.verify:
                self._finish(t)  # every byte is in place; no Commit will come
            t.arrived.set()
        except Exception as exc:  # noqa: BLE001 - the transfer fails, the daemon does not
            self._fail(t, exc)

    async def commit(self, request: pb.CommitRequest) -> pb.TransferStatus:
        """The sender sent everything; wait for the bytes, verify, and answer (step 4).

        Only verifying senders call this, but answering any sender works: an
        unverified transfer is already final here once its bytes arrived.
        """
        t = self.get(request.transfer_id)
        if t.role != TransferRole.RECEIVER or t.session_id != request.session_id:
            raise TransferNotFoundError(f"transfer {t.id!r} is not being received from this session")
        try:
            await asyncio.wait_for(t.arrived.wait(), t.remaining() + 0.1)
        except TimeoutError:
            self._expire(t)
        if t.state.final:
            return t.status()
        if request.checksums:
            await self._verify(t, list(request.checksums))
        if not t.state.final:
            t.verified = bool(request.checksums)
            self._finish(t)
        return t.status()

    async def _verify(self, t: Transfer, expected: list[int]) -> None:
        if len(expected) != len(t.chunks):
            self._finish(t, IntegrityError(
                f"sender sent {len(expected)} checksums for {len(t.chunks)} chunks"))
            return
        arena = t.pool.arena
        actual = await asyncio.to_thread(
            lambda: [checksum(arena.buffer(c.dst_offset, c.nbytes)) for c in t.chunks]
        )
        for i, (want, got) in enumerate(zip(expected, actual)):
            if want != got:
                c = t.chunks[i]
                self._finish(t, IntegrityError(
                    f"chunk {i} of transfer {t.id!r} (destination bytes "
                    f"[{c.dst_offset}, {c.dst_offset + c.nbytes})) has checksum {got:#x}, the "
                    f"sender computed {want:#x}"))
                return

    async def request_push(self, request: pb.RequestPushRequest) -> None:
        """A puller asks us to push ``transfer_id`` to it once it is offered."""
        t = await self._wait_registered(request.transfer_id, TransferRole.SENDER,
                                        request.timeout_s or self._default_timeout, "offer")
        if t.state.final:
            raise t.error or TransferAbortedError(f"transfer {t.id!r} already ended")
        if t.peer or t.task is not None:
            raise TransferExistsError(f"transfer {t.id!r} is already being sent to {t.peer}")
        t.peer = request.reply_to
        t.task = asyncio.create_task(self._run_push(t), name=f"push {t.id}")

    def abort_from_peer(self, request: pb.AbortTransferRequest) -> None:
        """The peer ended the transfer; end our side too."""
        t = self._transfers.get(request.transfer_id)
        if t is None:
            self._aborted_early[request.transfer_id] = request.reason or "no reason given"
            while len(self._aborted_early) > self._retain:
                self._aborted_early.popitem(last=False)
            return
        if not t.state.final:
            if t.session_id and request.session_id and t.session_id != request.session_id:
                return
            self._finish(t, TransferAbortedError(
                f"aborted by peer {t.peer or '?'}: {request.reason or 'no reason given'}"))

    def session_lost(self, session_id: str, reason: str) -> None:
        """A peer went away: fail every transfer of that session now."""
        self._inbound.pop(session_id, None)
        for t in list(self._transfers.values()):
            if t.session_id == session_id and not t.state.final:
                self._finish(t, PeerUnavailableError(f"transfer {t.id!r} failed: {reason}"))

    def _drop_unwatched(self, session_id: str, session: InboundSession) -> None:
        if not session.watched and self._inbound.get(session_id) is session:
            log.warning("dropping session %s from %s: no Watch stream %.0f s after its handshake",
                        session_id[:8], session.peer_address, self._session_grace_s)
            self.session_lost(session_id, f"sender {session.peer_address} never watched its session")

    def inbound_session_watched(self, session_id: str) -> None:
        """The sender's heartbeat stream began; raises PeerUnavailableError for an unknown session."""
        session = self._inbound.get(session_id)
        if session is None:
            raise PeerUnavailableError(
                f"session {session_id[:8]} is unknown here (never handshaken, or dropped "
                f"{self._session_grace_s:.0f} s after a handshake without a Watch stream)")
        session.watched = True

    def inbound_session_ended(self, session_id: str) -> None:
        """The sender's heartbeat stream to us ended (it died or closed the session)."""
        session = self._inbound.get(session_id)
        peer = session.peer_address if session is not None else "?"
        self.session_lost(session_id, f"sender {peer} went away")

    # -- the sending side ------------------------------------------------------------

    async def _request_push(self, t: Transfer) -> None:
        request = pb.RequestPushRequest(transfer_id=t.id, reply_to=self.peer_address,
                                        dst_pool=t.pool.name, timeout_s=t.remaining())
        try:
            await self.links.stub(t.peer).RequestPush(request, timeout=t.remaining() + 0.5)
        except Exception as exc:  # noqa: BLE001 - the transfer fails, the daemon does not
            self._fail(t, exc)

    async def _run_push(self, t: Transfer) -> None:
        try:
            link = await self.links.get(t.peer, timeout=t.remaining())
            t.session_id = link.session_id
            claim = await link.stub.Claim(
                pb.ClaimRequest(
                    transfer_id=t.id, session_id=link.session_id,
                    src_pool=t.pool.name, src_runs=runs_to_proto(t.runs),
                    timeout_s=t.remaining(), verify=t.verify, chunk_bytes=self._chunk_bytes,
                    lanes=len(link.endpoints),
                ),
                timeout=t.remaining() + 0.5,
            )
            dst = link.pools.get(claim.dst_pool)
            if dst is None:
                raise IncompatibleLayoutError(f"peer {t.peer} names unknown pool {claim.dst_pool!r}")
            check_compatible(t.pool.descriptor, dst)
            t.chunks = plan_chunks(t.runs, t.pool.descriptor.layout, runs_from_proto(claim.dst_runs),
                                   dst.layout, self._chunk_bytes)
            t.lanes = claim.lanes or 1
            if t.lanes > len(link.endpoints):
                raise InvalidRangeError(f"peer {t.peer} posted on {t.lanes} lanes; we offered "
                                        f"{len(link.endpoints)}")
            t.state = TransferState.TRANSFERRING
            t.started = time.monotonic()
            checksums = await self._send_chunks(t, link.endpoints[: t.lanes], claim.tag_base)
            if not t.verify:
                self._finish(t)
                return
            status = await link.stub.Commit(
                pb.CommitRequest(transfer_id=t.id, session_id=link.session_id, checksums=checksums),
                timeout=t.remaining() + 0.5,
            )
            if status.state == TransferState.DONE.value:
                t.verified = status.verified
                self._finish(t)
            else:
                self._finish(t, error_for_status(status.error_code, f"receiver: {status.error}"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the transfer fails, the daemon does not
            self._fail(t, exc)

    async def _send_chunks(self, t: Transfer, endpoints: LaneEndpoints,
                           tag_base: int) -> list[int]:
        """Send every chunk (at most ``window_bytes`` in flight); the per-chunk checksums.

        Checksums are computed in a worker thread while UCX sends: both only read
        the source pages.
        """
        arena = t.pool.arena
        buffers = [arena.buffer(c.src_offset, c.nbytes) for c in t.chunks]
        t.batch = self._engine.send(
            endpoints, [(b, tag_base + i) for i, b in enumerate(buffers)], self._window_bytes
        )
        checksums: list[int] = []
        if t.verify:
            checksums = await asyncio.to_thread(lambda: [checksum(b) for b in buffers])
        await asyncio.wrap_future(t.batch.future)
        t.data_finished = time.monotonic()
        return checksums

    # -- shutdown ------------------------------------------------------------------------

    async def shutdown(self, grace_s: float) -> None:
        """Refuse new transfers, let running ones finish for ``grace_s``, fail the rest."""
        self._accepting = False
        running = [t for t in self._transfers.values()
                   if t.state == TransferState.TRANSFERRING]
        if running:
            log.info("waiting up to %.1fs for %d running transfers", grace_s, len(running))
            await asyncio.wait([asyncio.create_task(t.done.wait()) for t in running],
                               timeout=grace_s)
        for t in list(self._transfers.values()):
            if not t.state.final:
                self._finish(t, PeerUnavailableError(f"daemon {self.peer_address} shut down"))
                self._tell_peer_abort(t, "peer daemon shut down")
        await asyncio.sleep(0.1)
        await self.links.close()
