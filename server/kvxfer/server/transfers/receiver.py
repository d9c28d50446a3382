"""The receiving side of a transfer: claim, post receives, wait for the bytes, verify.

Push, on the decode daemon D (see ``kvxfer.server.transfers``):

2. A sender's ``Claim`` waits for the matching ``expect``, checks that the
   layouts are compatible (before any byte moves), plans the chunks, posts one
   receive per chunk straight into the destination pages, and answers with the
   tag base.
3. Without verify, D is DONE when the last message lands.
4. With verify, the sender's ``Commit`` brings per-chunk checksums; D checks
   the bytes that arrived and answers with the final status.

A pull starts here: ``pull`` registers the expectation and asks the prefill
daemon (``RequestPush``) to push it. When that daemon holds a session with us
already, the ask carries a placement (our pages, a tag base, the lanes): it
plans, starts sending and answers with its runs, and we plan the same chunks
and post the receives then (UCX keeps what came first), so the pull costs one
round trip; otherwise it claims, as for a push. A pull that ends before its
receives are posted has what its sender sends taken into scratch
(``Transport.discard``), never into its pages. The receive runs under the
sender's session: when the session is lost, the transfer fails at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

from kvxfer.descriptor import check_compatible
from kvxfer.errors import (
    IncompatiblePeerError,
    IntegrityError,
    InvalidArgumentError,
    KvxferError,
    PeerNotAllowedError,
    PeerUnavailableError,
    TransferExistsError,
)
from kvxfer.integrity import checksum
from kvxfer.local_copy import PeerArena, copy_in_threads
from kvxfer.pages import Extent
from kvxfer.server.peer_client import PeerClients
from kvxfer.server.peer_protocol import Claim, ClaimGrant, Commit, Placement, PullAsk, PushStarted
from kvxfer.server.sessions import InboundSession, Sessions
from kvxfer.server.tls import Caller
from kvxfer.server.transfers.capability import not_open_to_caller, presents
from kvxfer.server.transfers.planning import TagAllocator, max_chunks, plan_chunks
from kvxfer.server.transfers.record import Transfer
from kvxfer.server.transfers.registry import TransferRegistry
from kvxfer.status import TransferInfo, TransferRole, TransferState
from kvxfer.transport import Batch, Transport

log = logging.getLogger("kvxfer.server.transfers")

#: How an ask with a placement may fail after its sender started sending (a sender refuses
#: anything else before it sends, or stops its sends before it answers).
MAYBE_SENT = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL", "UNKNOWN", "ABORTED",
                        "CANCELLED"})


class Receiver:
    """Claims, receives and verifies the transfers this daemon receives."""

    def __init__(self, registry: TransferRegistry, sessions: Sessions, clients: PeerClients,
                 transport: Transport, *, peer_address: str, chunk_bytes: int) -> None:
        self._registry = registry
        self._sessions = sessions
        self._clients = clients
        self._transport = transport
        self._peer_address = peer_address
        self._chunk_bytes = chunk_bytes
        self._tags = TagAllocator()
        self._copy_threads = os.cpu_count() or 1
        self._copier = ThreadPoolExecutor(max_workers=self._copy_threads,
                                          thread_name_prefix="kvxfer-copy")

    async def claim(self, claim: Claim, caller: Caller) -> ClaimGrant:
        """``caller`` asks where ``claim.transfer_id`` goes, in one of its sessions; post the
        receives and answer. A claim without the transfer's capability is NOT_FOUND, like an
        unknown id; a transfer that names another peer identity is refused."""
        session = self._sessions.inbound(claim.session_id, caller)
        t = self._registry.receiving(claim.transfer_id)
        if not presents(claim.capability, t.capability):
            raise not_open_to_caller(claim.transfer_id)
        if t.peer_identity and not caller.is_named(t.peer_identity):
            raise PeerNotAllowedError(f"transfer {t.id!r} is reserved for another peer; "
                                      f"{caller.name} may not claim it")
        if t.state.final:
            raise t.failure(f"transfer {t.id!r} already ended")
        if t.state != TransferState.WAITING or t.session_id:
            raise TransferExistsError(f"transfer {t.id!r} was already claimed by another sender")
        t.session_id, t.placed_session = claim.session_id, ""  # the placement was not taken
        t.peer = t.peer or session.peer_address
        self._registry.tracing.join(t)
        source = session.sources.get(claim.src_pool)
        try:
            if source is not None:
                return await self._copy(t, claim, session, source)
            grant = self._post(t, claim, session)
        except KvxferError as exc:
            self._registry.finish(t, exc)
            raise
        assert t.batch is not None
        t.task = asyncio.create_task(self._receive(t, t.batch, session), name=f"recv {t.id}")
        return grant

    def _plan(self, t: Transfer, claim: Claim, session: InboundSession) -> tuple[Extent, ...]:
        src = session.pools.get(claim.src_pool)
        if src is None:
            raise IncompatiblePeerError(
                f"sender {session.peer_address} claims from pool {claim.src_pool!r}, which "
                f"its handshake did not describe (it described {sorted(session.pools)})")
        check_compatible(src, t.pool.descriptor)
        return plan_chunks(claim.src_runs, src.layout, t.runs, t.pool.descriptor.layout,
                           claim.chunk_bytes or self._chunk_bytes)

    def _post(self, t: Transfer, claim: Claim, session: InboundSession,
              tag_base: int | None = None) -> ClaimGrant:
        chunks = self._plan(t, claim, session)
        if claim.lanes > self._transport.lanes:
            raise InvalidArgumentError(
                f"the sender offers {claim.lanes} UCX lanes; this daemon has "
                f"{self._transport.lanes} (its handshake said so)")
        # A lane with no chunk would only cost a wake-up on both sides.
        lanes = min(claim.lanes or 1, max(1, len(chunks)))
        tag_base = self._tags.next_base() if tag_base is None else tag_base
        t.verify = claim.verify
        t.begin(chunks, lanes)
        arena = t.pool.arena
        t.batch = self._transport.receive(
            [(arena.buffer(c.dst_offset, c.nbytes), tag_base + i) for i, c in enumerate(chunks)],
            lanes)
        return ClaimGrant(tag_base, t.pool.name, t.runs, lanes)

    async def _copy(self, t: Transfer, claim: Claim, session: InboundSession,
                    source: PeerArena) -> ClaimGrant:
        """Same host: copy every chunk from the sender's mapped arena, then answer ``copied``.
        The transfer ends only with the sender's Commit, which a sender sends only if its
        transfer was still running when this answer came, so the source pages cannot have
        been handed back to its engine while they were read. The copy runs in the
        transfer's own task: a Claim call cancelled midway (its sender died) leaves it to
        the session to fail the transfer."""
        chunks = self._plan(t, claim, session)
        t.verify = claim.verify
        t.begin(chunks, 0)
        t.copying = copy_in_threads(self._copier, self._copy_threads, source, t.pool.arena,
                                    chunks, lambda: t.state.final)
        t.task = asyncio.create_task(self._copied(t, session), name=f"copy {t.id}")
        await t.arrived.wait()  # set once copied, or once the transfer's end is told
        if t.state.final:
            raise t.failure(f"transfer {t.id!r} ended during its copy")
        return ClaimGrant(0, t.pool.name, t.runs, 0, copied=True)

    async def _copied(self, t: Transfer, session: InboundSession) -> None:
        """Wait for ``t``'s copy under the session, then for its sender's Commit."""
        assert t.copying is not None
        try:
            with self._registry.tracing.phase(t, "data"):
                # shield: giving up on the copy (session lost) must not cancel the future
                # that tells when the copier threads stopped writing.
                await session.guard(asyncio.shield(asyncio.wrap_future(t.copying)))
            if t.state.final:
                return
            self._landed(t)
            t.arrived.set()
        except Exception as exc:  # noqa: BLE001 - the transfer fails, the daemon does not
            self._registry.fail(t, exc)
            return
        await self._until_end(t, session)

    def _landed(self, t: Transfer) -> None:
        """Every byte of ``t`` is in its pages (unverified yet)."""
        t.data_finished = time.monotonic()

    async def _receive(self, t: Transfer, batch: Batch, session: InboundSession) -> None:
        try:
            with self._registry.tracing.phase(t, "data"):
                await session.guard(asyncio.wrap_future(batch.future))
            self._landed(t)
            if not t.verify:
                self._registry.finish(t)  # every byte is in place; no Commit will come
            t.arrived.set()
        except Exception as exc:  # noqa: BLE001 - the transfer fails, the daemon does not
            self._registry.fail(t, exc)
            return
        await self._until_end(t, session)

    async def _until_end(self, t: Transfer, session: InboundSession) -> None:
        """Keep a transfer whose bytes are in place but which waits for its sender's Commit
        under the session: a sender lost before it commits fails it now, not at its deadline."""
        if t.state.final:
            return
        try:
            await session.guard(t.done.wait())
        except Exception as exc:  # noqa: BLE001 - the transfer fails, the daemon does not
            self._registry.fail(t, exc)

    async def commit(self, commit: Commit, caller: Caller) -> TransferInfo:
        """The sender sent everything; wait for the bytes, verify, and answer with the end.
        A transfer this session did not claim (or no such transfer) is the same NOT_FOUND as
        any id not open to the caller.

        Only verifying senders call this, but answering any sender works: an
        unverified transfer is already final here once its bytes arrived.
        """
        self._sessions.inbound(commit.session_id, caller)
        t = self._registry.find(commit.transfer_id)
        if t is None or t.role != TransferRole.RECEIVER or t.session_id != commit.session_id:
            raise not_open_to_caller(commit.transfer_id)  # no hint of which ids exist
        with self._registry.tracing.phase(t, "commit", in_call=True):
            try:
                await asyncio.wait_for(t.arrived.wait(), t.remaining() + 0.1)
            except TimeoutError:
                pass  # the deadline timer ends it; report what it ended as
            if not t.state.final and commit.checksums:
                failure = await self._verify(t, commit.checksums)
                t.verified = failure is None
                self._registry.finish(t, failure)
            elif not t.state.final:
                self._registry.finish(t)
        return t.info()

    async def _verify(self, t: Transfer, expected: tuple[int, ...]) -> IntegrityError | None:
        if len(expected) != len(t.chunks):
            return IntegrityError(f"sender sent {len(expected)} checksums for {len(t.chunks)} chunks")
        arena = t.pool.arena
        actual = await asyncio.to_thread(
            lambda: [checksum(arena.buffer(c.dst_offset, c.nbytes)) for c in t.chunks])
        for i, (want, got) in enumerate(zip(expected, actual)):
            if want != got:
                c = t.chunks[i]
                return IntegrityError(
                    f"chunk {i} of transfer {t.id!r} (destination bytes "
                    f"[{c.dst_offset}, {c.dst_offset + c.nbytes})) has checksum {got:#x}, the "
                    f"sender computed {want:#x}")
        return None

    def start_pull(self, t: Transfer) -> None:
        """Ask the daemon at ``t.peer`` to push ``t`` here (its offer must be there already)."""
        t.task = asyncio.create_task(self._request_push(t), name=f"pull {t.id}")

    async def _request_push(self, t: Transfer) -> None:
        """Ask for the push, with a placement when the sender holds a session with us (then
        post the receives as its answer says it sends); without one, its Claim follows."""
        session = self._sessions.inbound_from(t.peer, t.peer_identity)
        placement = None
        if session is not None:
            lanes = min(len(session.peer.ucx_ports), self._transport.lanes)
            placement = Placement(session.session_id, t.pool.name, t.runs,
                                  self._tags.next_base(), lanes, self._chunk_bytes)
            t.placed_session = session.session_id  # an abort from here names it
        request = PullAsk(t.offer_id or t.id, self._peer_address, t.capability,
                          t.prompt_digest, placement, t.skip_pages, t.part)
        try:
            with self._registry.tracing.phase(t, "request_push"):
                started = await (await self._clients.get(t.peer)).request_push(request, t.deadline)
        except asyncio.CancelledError:  # the transfer ended here meanwhile
            if placement is not None:
                self._discard_unknown(t, placement)
            raise
        except Exception as exc:  # noqa: BLE001 - the transfer fails, the daemon does not
            code = exc.code if isinstance(exc, KvxferError) else "UNKNOWN"
            if placement is not None and code in MAYBE_SENT:
                self._discard_unknown(t, placement)
            self._registry.fail(t, exc)
            return
        if started is None:
            t.placed_session = ""  # the sender claims
            return
        assert session is not None and placement is not None
        await self._receive_placed(t, session, placement, started)

    async def _receive_placed(self, t: Transfer, session: InboundSession, placement: Placement,
                              started: PushStarted) -> None:
        """The sender sends to ``placement`` already: post the receives its answer implies
        and receive under the session. If ``t`` ended or its session was lost meanwhile, or
        the answer does not fit our plan, what it sends (the chunks and lanes it said) is
        taken and thrown away, never into ``t``'s pages."""
        claim = Claim(t.id, session.session_id, started.src_pool, started.src_runs,
                      started.verify, placement.chunk_bytes, placement.lanes)
        if t.state.final or t.session_id or t.placed_session != session.session_id:
            self._transport.discard(placement.tag_base, started.chunks, started.lanes)
            return  # it ended meanwhile (or, never by this sender, was claimed)
        try:
            if session.lost.done():
                raise PeerUnavailableError(session.lost.result())
            chunks = self._plan(t, claim, session)
            lanes = min(placement.lanes, max(1, len(chunks)))
            if (len(chunks), lanes) != (started.chunks, started.lanes):
                raise IncompatiblePeerError(
                    f"sender {t.peer} sends {t.id!r} as {started.chunks} chunks over "
                    f"{started.lanes} lanes; our plan has {len(chunks)} over {lanes}")
            t.session_id, t.placed_session = session.session_id, ""
            self._registry.tracing.join(t)
            self._post(t, claim, session, placement.tag_base)
        except Exception as exc:  # noqa: BLE001 - the transfer fails, the daemon does not
            if t.batch is None:
                self._transport.discard(placement.tag_base, started.chunks, started.lanes)
            self._registry.fail(t, exc)  # which abandons a posted batch, draining the rest
            return
        assert t.batch is not None
        await self._receive(t, t.batch, session)

    def _discard_unknown(self, t: Transfer, placement: Placement) -> None:
        """The sender's answer never came, so it may be sending: take and throw away as many
        messages as any plan into ``t``'s pages could have."""
        self._transport.discard(placement.tag_base,
                                max_chunks(t.runs, t.pool.descriptor.layout, placement.chunk_bytes),
                                placement.lanes)
