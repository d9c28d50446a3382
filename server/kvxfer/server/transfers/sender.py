"""The sending side of a transfer: open a session, claim, send the chunks, commit.

Push, on the prefill daemon P (see ``kvxfer.server.transfers``):

1. P opens (or reuses) a session with the decode daemon D.
2. P claims the transfer; D answers once its receives are posted.
3. P plans the same chunks and sends them from the source pages, a bounded
   window in flight. Without verify, P is DONE when its last send completed.
4. With verify, P hands D the per-chunk checksums (``Commit``) and adopts
   D's final status.

A pull whose ask brings a placement, in the session P holds with D already,
skips steps 1 and 2: the placement says where the chunks go, and P sends at once.

Everything after the session opens runs under it (``session.guard``): a lost
peer fails the transfer at once, wherever it is.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvxfer.descriptor import PoolDescriptor, check_compatible
from kvxfer.errors import (
    IncompatiblePeerError,
    InternalError,
    InvalidArgumentError,
    PromptMismatchError,
    TransferExistsError,
)
from kvxfer.integrity import checksum
from kvxfer.offer_parts import OfferPart, part_id
from kvxfer.pages import PageRuns
from kvxfer.server.peer_protocol import Claim, ClaimGrant, Commit, PullAsk, PushStarted
from kvxfer.server.sessions import OutboundSession, Sessions
from kvxfer.server.tls import Caller
from kvxfer.server.transfers.capability import not_open_to_caller, presents, same_prompt
from kvxfer.server.transfers.planning import plan_chunks
from kvxfer.server.transfers.record import Transfer
from kvxfer.server.transfers.registry import TransferRegistry
from kvxfer.status import TransferRole, TransferState
from kvxfer.transport import Transport


class Sender:
    """Drives the transfers this daemon sends."""

    def __init__(self, registry: TransferRegistry, sessions: Sessions, transport: Transport, *,
                 chunk_bytes: int, window_bytes: int) -> None:
        self._registry = registry
        self._sessions = sessions
        self._transport = transport
        self._chunk_bytes = chunk_bytes
        self._window_bytes = window_bytes

    def start(self, t: Transfer) -> None:
        """Push ``t`` to ``t.peer`` in the background."""
        t.task = asyncio.create_task(self._push(t), name=f"push {t.id}")

    def accept_push_request(self, request: PullAsk, caller: Caller) -> PushStarted | None:
        """``caller`` asks us to push ``request.transfer_id`` to it. It must be offered here
        already, and the request must present the offer's capability (once) and, if the
        offer names a peer, come from it: anything else is the same NOT_FOUND, at once. A
        prompt digest other than the offer's fails the transfer (PromptMismatchError). The
        offer's first ``request.skip_pages`` pages are not sent (fewer than it has, or
        InvalidArgumentError and the capability stays unspent). A pull of a part of the offer
        (``kvxfer.offer_parts``) takes that part once, as a transfer of its own; the
        capability then stays good for the other parts.

        With a placement in the session we opened to ``reply_to`` (and a peer that does not
        read our memory), the chunks are planned and sent now, without a Claim, and the
        answer says how; otherwise (None) the push claims as any push does."""
        offer = self._registry.find(request.transfer_id)
        if (offer is None or offer.role != TransferRole.SENDER or offer.capability_spent
                or offer.parent is not None or request.part.index in offer.parts_taken
                or not presents(request.capability, offer.capability)
                or (offer.peer_identity and not caller.is_named(offer.peer_identity))):
            raise not_open_to_caller(request.transfer_id)
        if offer.state.final:
            raise offer.failure(f"transfer {offer.id!r} already ended")
        if offer.peer or offer.task is not None:
            raise TransferExistsError(f"transfer {offer.id!r} is already being sent to {offer.peer}")
        if offer.parts != (request.part.count if request.part.shared else 0) and offer.parts:
            raise InvalidArgumentError(
                f"offer {offer.id!r} is being pulled in {offer.parts} parts; this pull asks for "
                f"part {request.part.index} of {request.part.count or 1}")
        runs = request.part.of(offer.runs, request.skip_pages)
        if not same_prompt(request.prompt_digest, offer.prompt_digest):
            mismatch = PromptMismatchError(
                f"transfer {offer.id!r} holds KV computed from another prompt than the puller's "
                f"(prompt digests {offer.prompt_digest.hex()[:12] or 'none'} here, "
                f"{request.prompt_digest.hex()[:12] or 'none'} asked)")
            offer.capability_spent = True
            self._registry.finish(offer, mismatch)  # it keeps a copy without the traceback
            raise mismatch
        t = offer
        if request.part.shared:
            t = self._take_part(offer, request.part, runs)
        else:
            offer.capability_spent = True
        t.peer, t.runs = request.reply_to, runs
        self._registry.tracing.join(t)
        session = self._sessions.open_outbound(t.peer)
        where = request.placement
        if (where is None or session is None or session.session_id != where.session_id
                or session.peer.reads_locally):
            self.start(t)
            return None
        t.session_id = session.session_id
        try:
            buffers = self._send(t, session, where.grant(), where.chunk_bytes)
        except Exception as exc:
            self._registry.fail(t, exc)
            raise
        t.task = asyncio.create_task(self._placed(t, session, buffers), name=f"push {t.id}")
        return PushStarted(t.pool.name, t.runs, len(t.chunks), t.lanes, t.verify)

    def _take_part(self, offer: Transfer, part: OfferPart, runs: PageRuns) -> Transfer:
        """Register part ``part`` of ``offer`` (its pages ``runs``) as a transfer of its own
        to send; the offer ends once every part has (``TransferRegistry.finish``)."""
        child = self._registry.register(
            part_id(offer.id, part.index), TransferRole.SENDER, offer.pool.name, runs,
            max(offer.remaining(), 0.001), verify=offer.verify, disjoint=False,
            capability=offer.capability)  # its claim presents it, as the offer's would
        child.capability_spent = True
        child.deadline = offer.deadline
        child.parent = offer
        offer.children.append(child)
        offer.parts = part.count
        offer.parts_taken.add(part.index)
        if offer.state == TransferState.WAITING:
            offer.begin((), 0)
        return child

    async def _placed(self, t: Transfer, session: OutboundSession, buffers: list[Any]) -> None:
        """Finish a push that started from a pull's placement, under its session."""
        try:
            await session.guard(self._complete(t, session, buffers))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the transfer fails, the daemon does not
            self._registry.fail(t, exc)

    async def _push(self, t: Transfer) -> None:
        try:
            with self._registry.tracing.phase(t, "session"):
                session = await self._sessions.outbound(t.peer, t.deadline)
            t.session_id = session.session_id
            await session.guard(self._run(t, session))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the transfer fails, the daemon does not
            self._registry.fail(t, exc)

    async def _run(self, t: Transfer, session: OutboundSession) -> None:
        assert session.client is not None and session.connection is not None
        claim = Claim(t.id, session.session_id, t.pool.name, t.runs, t.verify,
                      self._chunk_bytes, session.connection.lanes, t.capability)
        with self._registry.tracing.phase(t, "claim"):
            grant = await session.client.claim(claim, t.deadline)
        if grant.copied:
            await self._after_copy(t, session, grant, self._destination(t, session, grant))
            return
        await self._complete(t, session, self._send(t, session, grant, self._chunk_bytes))

    def _destination(self, t: Transfer, session: OutboundSession,
                     grant: ClaimGrant) -> PoolDescriptor:
        dst = session.pools.get(grant.dst_pool)
        if dst is None:
            raise IncompatiblePeerError(f"peer {t.peer} names unknown pool {grant.dst_pool!r}")
        check_compatible(t.pool.descriptor, dst)
        return dst

    def _send(self, t: Transfer, session: OutboundSession, grant: ClaimGrant,
              chunk_bytes: int) -> list[Any]:
        """Plan ``t``'s chunks into the granted pages and start sending them (chunk ``k`` to
        tag ``tag_base + k``, on lane ``k % lanes`` of as many as have a chunk); the chunks'
        buffers."""
        assert session.connection is not None
        dst = self._destination(t, session, grant)
        chunks = plan_chunks(t.runs, t.pool.descriptor.layout, grant.dst_runs, dst.layout,
                             chunk_bytes)
        if grant.lanes > session.connection.lanes:
            raise InvalidArgumentError(f"peer {t.peer} posted on {grant.lanes} lanes; we offered "
                                    f"{session.connection.lanes}")
        lanes = min(grant.lanes, max(1, len(chunks)))
        arena = t.pool.arena
        buffers = [arena.buffer(c.src_offset, c.nbytes) for c in chunks]
        t.begin(chunks, lanes)
        t.batch = self._transport.send(
            session.connection, [(b, grant.tag_base + i) for i, b in enumerate(buffers)],
            self._window_bytes, lanes)
        return buffers

    async def _complete(self, t: Transfer, session: OutboundSession, buffers: list[Any]) -> None:
        """Wait for ``t``'s sends (checksumming them meanwhile, with verify), then end it."""
        assert t.batch is not None
        with self._registry.tracing.phase(t, "data"):
            # Checksums are computed in a worker thread while UCX sends: both only read the pages.
            checksums = (await asyncio.to_thread(lambda: [checksum(b) for b in buffers])
                         if t.verify else [])
            await asyncio.wrap_future(t.batch.future)
        t.data_finished = time.monotonic()
        if not t.verify:
            self._registry.finish(t)
            return
        await self._commit(t, session, checksums)

    async def _after_copy(self, t: Transfer, session: OutboundSession, grant: ClaimGrant,
                          dst: PoolDescriptor) -> None:
        """The receiver copied from our pool (same host): commit, for the receiver ends only
        with it, with each chunk's checksum when verifying (only then is there a plan to make)."""
        if not session.peer.reads_locally:
            raise InvalidArgumentError(f"peer {t.peer} says it copied {t.id!r} from our memory, "
                                    "but it did not map our arenas")
        chunks = (plan_chunks(t.runs, t.pool.descriptor.layout, grant.dst_runs, dst.layout,
                              self._chunk_bytes) if t.verify else ())
        t.begin(chunks, 0)
        t.data_finished = time.monotonic()
        arena = t.pool.arena
        checksums = (await asyncio.to_thread(
            lambda: [checksum(arena.buffer(c.src_offset, c.nbytes)) for c in chunks])
            if t.verify else [])
        await self._commit(t, session, checksums)

    async def _commit(self, t: Transfer, session: OutboundSession, checksums: list[int]) -> None:
        """Hand the receiver the checksums (none: just the end) and adopt its final status."""
        assert session.client is not None
        with self._registry.tracing.phase(t, "commit"):
            outcome = await session.client.commit(
                Commit(t.id, session.session_id, tuple(checksums)), t.deadline)
        t.verified = outcome.verified
        failure = outcome.failure
        if failure is not None:
            failure = type(failure)(f"receiver {t.peer}: {failure}")
        elif not outcome.ok:
            failure = InternalError(f"receiver {t.peer} answered {outcome.state.name} with no reason")
        self._registry.finish(t, failure)
