"""The verbs workers and peers call, routed to the registry, the sender and the receiver.

The coordinator owns what is common to both roles: a transfer's deadline (a
timer that ends it with DEADLINE_EXCEEDED), a transfer's lease (when the lease
ends first, the transfer fails), ending a transfer on the other side too (an
abort, a deadline, a shutdown tell the peer), who may end it from there (the
session that claimed it; before a claim, the peer it names, or any admitted
peer if it names none), and the shutdown itself. Offers kept alive or dropped by their
puller are ``offers`` (``offer_keeping``).
Background work it starts is tracked and awaited or cancelled at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Coroutine
from typing import Any

from kvxfer.errors import (
    InvalidArgumentError,
    KvxferError,
    LeaseExpiredError,
    PeerUnavailableError,
    StaleArenaError,
    TransferAbortedError,
    TransferDeadlineError,
    TransferNotFoundError,
)
from kvxfer.offer_parts import WHOLE_OFFER, OfferPart, check_not_a_part, part_id
from kvxfer.pages import PageRuns
from kvxfer.server.leases import CAPABILITY_BYTES, Lease, PageLeases
from kvxfer.server.limits import check_digest, check_seconds, check_text
from kvxfer.server.peer_client import PeerClients
from kvxfer.server.peer_protocol import Claim, ClaimGrant, Commit, PeerAbort, PullAsk, PushStarted
from kvxfer.server.sessions import Sessions
from kvxfer.server.tls import Caller
from kvxfer.server.transfers.capability import not_open_to_caller, presents
from kvxfer.server.transfers.early_aborts import KEEP_S, EarlyAborts
from kvxfer.server.transfers.offer_keeping import OfferKeeping
from kvxfer.server.transfers.receiver import Receiver
from kvxfer.server.transfers.record import Transfer
from kvxfer.server.transfers.registry import TransferRegistry
from kvxfer.server.transfers.sender import Sender
from kvxfer.status import LeaseUse, TransferInfo, TransferRole, TransferState

log = logging.getLogger("kvxfer.server.transfers")

#: How long telling a peer that a transfer ended may take.
TELL_PEER_S = 2.0
#: The longest a completions call may wait.
MAX_POLL_S = 60.0


NO_LEASE = LeaseUse()


def _check_counterpart(peer: str, side: str, capability: str, where_from: str) -> None:
    """A push or pull names the other ``side``'s daemon and presents a capability."""
    if not peer:
        raise InvalidArgumentError(f"peer is empty; expected the {side} daemon's host:port")
    if not capability:
        raise InvalidArgumentError(f"capability is empty; {where_from}")
    check_text("capability", capability)


class TransferCoordinator:
    """Every transfer verb of this daemon, for its workers and its peers."""

    def __init__(self, registry: TransferRegistry, leases: PageLeases, sender: Sender,
                 receiver: Receiver, clients: PeerClients, sessions: Sessions, *,
                 peer_address: str, authenticated_peers: bool, epoch: str,
                 max_offer_s: float) -> None:
        self.registry = registry
        registry.tell_peer = self._tell_peer
        self.leases = leases
        self._sender = sender
        self._receiver = receiver
        self._clients = clients
        self._sessions = sessions
        self.peer_address = peer_address
        self._authenticated_peers = authenticated_peers
        self._epoch = epoch
        self._background: set[asyncio.Task[None]] = set()
        self._early_aborts = EarlyAborts()
        self._lease_watch: asyncio.Task[None] | None = None
        #: Offers kept waiting for their puller, or dropped by it.
        self.offers = OfferKeeping(registry, leases, clients, max_offer_s=max_offer_s,
                                   expire=self._expire)

    def start(self) -> None:
        """Start failing the transfers whose lease ends before they do."""
        self._lease_watch = asyncio.create_task(self._watch_leases(), name="lease endings")

    async def _watch_leases(self) -> None:
        async for lease, why in self.leases.ended():
            for t in self.registry.unfinished():
                if t.lease_id != lease.id:
                    continue
                try:
                    self.registry.finish(t, LeaseExpiredError(
                        f"transfer {t.id!r} lost its pages: lease {lease.id} of pool "
                        f"{lease.pool!r} {why} before it ended"))
                    self._tell_peer(t, f"its lease {why}")
                except Exception:  # noqa: BLE001 - a bug here must not stop the watch
                    log.exception("could not end transfer %s after its lease ended", t.id)

    # -- worker verbs ----------------------------------------------------------------------

    def expect(self, transfer_id: str, pool: str, dst_runs: PageRuns, timeout_s: float,
               lease: LeaseUse = NO_LEASE, peer_identity: str = "") -> Transfer:
        """Register destination pages for ``transfer_id`` (decode side), to be filled by
        the push that presents the capability minted now (``Transfer.capability``) and,
        with ``peer_identity``, comes from that peer."""
        check_not_a_part(transfer_id)
        return self._register(transfer_id, TransferRole.RECEIVER, pool, dst_runs, timeout_s,
                              disjoint=True, lease=lease, peer_identity=peer_identity,
                              capability=secrets.token_hex(CAPABILITY_BYTES))

    def push(self, transfer_id: str, pool: str, src_runs: PageRuns, peer: str,
             timeout_s: float, verify: bool, lease: LeaseUse = NO_LEASE,
             capability: str = "") -> Transfer:
        """Send source pages of ``transfer_id`` to the daemon at ``peer`` (prefill side),
        presenting the ``capability`` its expect's answer told."""
        check_not_a_part(transfer_id)
        _check_counterpart(peer, "decode", capability, "a push presents its expect's capability "
                           "(the decode daemon's answer to the Expect holds it)")
        t = self._register(transfer_id, TransferRole.SENDER, pool, src_runs, timeout_s,
                           verify=verify, peer=peer, disjoint=False, lease=lease,
                           capability=capability)
        if not t.state.final:
            self._sender.start(t)
        return t

    def offer(self, transfer_id: str, pool: str, src_runs: PageRuns, timeout_s: float,
              verify: bool, lease: LeaseUse = NO_LEASE, peer_identity: str = "",
              prompt_digest: bytes = b"") -> Transfer:
        """Make source pages available for the ``pull`` of the peer named ``peer_identity``
        (empty: of any admitted peer) that presents the offer's capability (the lease's, or
        one minted now) and ``prompt_digest`` (prefill side)."""
        check_not_a_part(transfer_id)
        check_digest(prompt_digest)
        held = self.leases.get(lease.lease_id) if lease.lease_id else None
        capability = secrets.token_hex(CAPABILITY_BYTES)
        if held is not None and not held.capability_offered:
            capability = held.capability  # the one Allocate told, for the lease's first offer
        t = self._register(transfer_id, TransferRole.SENDER, pool, src_runs, timeout_s,
                           verify=verify, disjoint=False, lease=lease,
                           peer_identity=peer_identity, capability=capability,
                           prompt_digest=prompt_digest)
        if held is not None:
            held.capability_offered = True
        return t

    def pull(self, transfer_id: str, peer: str, pool: str, dst_runs: PageRuns,
             timeout_s: float, lease: LeaseUse = NO_LEASE, peer_identity: str = "",
             capability: str = "", prompt_digest: bytes = b"", skip_pages: int = 0,
             part: OfferPart = WHOLE_OFFER) -> Transfer:
        """Fetch ``transfer_id`` from the daemon at ``peer`` into ``dst_runs`` (decode side),
        presenting the offer's ``capability`` and the ``prompt_digest`` its KV must have been
        computed from; with ``peer_identity``, only that peer's session may fill it. The
        offer's first ``skip_pages`` pages are not moved: ``dst_runs`` get the rest; with a
        ``part``, its pages (shared by several pullers: registered as ``part_id``)."""
        check_not_a_part(transfer_id)
        _check_counterpart(peer, "prefill", capability, "a pull presents its offer's capability "
                           "(the offer's or its lease's answer holds it)")
        check_digest(prompt_digest)
        local_id = part_id(transfer_id, part.index) if part.shared else transfer_id
        t = self._register(local_id, TransferRole.RECEIVER, pool, dst_runs, timeout_s,
                           peer=peer, disjoint=True, lease=lease, peer_identity=peer_identity,
                           capability=capability, prompt_digest=prompt_digest)
        t.skip_pages, t.offer_id, t.part = skip_pages, transfer_id, part
        if not t.state.final:
            self._receiver.start_pull(t)
        return t

    def lease_and_pull(self, pool: str, pages: int, lease_s: float, holder: str,
                       transfer_id: str, peer: str, timeout_s: float, arena_epoch: str = "",
                       peer_identity: str = "", capability: str = "",
                       prompt_digest: bytes = b"", skip_pages: int = 0,
                       part: OfferPart = WHOLE_OFFER) -> tuple[Lease, Transfer]:
        """Lease ``pages`` pages of ``pool`` (as ``allocate``) and ``pull`` into them; the
        lease outlives the transfer. A refused pull releases the lease and raises."""
        lease = self.leases.allocate(pool, pages, lease_s, holder)
        try:
            t = self.pull(transfer_id, peer, pool, lease.runs, timeout_s,
                          LeaseUse(lease.id, False, arena_epoch), peer_identity, capability,
                          prompt_digest, skip_pages, part)
        except BaseException:
            self.leases.release(lease.id)
            raise
        return lease, t

    async def wait(self, transfer_id: str, timeout_s: float) -> Transfer:
        """``transfer_id`` once final; TransferDeadlineError if ``timeout_s`` passes first
        (0: until its own deadline)."""
        check_seconds("timeout_s", timeout_s)
        return await self.until_final(self.registry.get(transfer_id), timeout_s)

    async def until_final(self, t: Transfer, timeout_s: float = 0.0) -> Transfer:
        """``t`` once final; TransferDeadlineError if ``timeout_s`` passes first (0: until its
        own deadline, which its timer enforces)."""
        try:
            await asyncio.wait_for(t.done.wait(), timeout_s or t.remaining() + 1)
        except TimeoutError:
            raise TransferDeadlineError(
                f"transfer {t.id!r} is still {t.state.name} after waiting {timeout_s:g}s"
            ) from None
        return t

    def abort(self, transfer_id: str, reason: str) -> Transfer:
        """End ``transfer_id`` on both sides (nothing happens if it already ended). An id not
        registered here is NOT_FOUND, and remembered (``early_aborts``): an expect or pull
        registered under it within ``KEEP_S`` ends ABORTED at once."""
        check_text("reason", reason)
        t = self.registry.find(transfer_id)
        if t is None:
            self._early_aborts.remember(transfer_id, reason)
            raise TransferNotFoundError(
                f"no transfer {transfer_id!r} is known here; the abort is remembered for "
                f"{KEEP_S:g}s, and ends it at once if it is registered meanwhile")
        if not t.state.final:
            self.registry.finish(t, TransferAbortedError(
                f"aborted here: {reason or 'no reason given'}"))
            self._tell_peer(t, reason)
        return t

    def all(self) -> list[TransferInfo]:
        """Every transfer still remembered, oldest first."""
        return [t.info() for t in self.registry.all()]

    async def completions(self, after: int, timeout_s: float) -> tuple[list[TransferInfo], int, bool]:
        """The transfers that ended after cursor ``after`` (waiting up to ``timeout_s`` for
        one), the next cursor, and whether some were no longer retained."""
        check_seconds("timeout_s", timeout_s, most=MAX_POLL_S)
        ended, cursor, missed = await self.registry.completions.since(after, timeout_s)
        return [t.info() for t in ended], cursor, missed

    def _register(self, transfer_id: str, role: TransferRole, pool: str, runs: PageRuns,
                  timeout_s: float, *, verify: bool = False, peer: str = "",
                  disjoint: bool, lease: LeaseUse, peer_identity: str = "", capability: str = "",
                  prompt_digest: bytes = b"") -> Transfer:
        if peer_identity and not self._authenticated_peers:
            raise InvalidArgumentError(
                f"peer_identity={peer_identity!r} names a certificate, but this daemon's peer "
                "API has no mutual TLS (--peer-tls-cert/--peer-tls-key/--peer-tls-ca)")
        check_text("peer_identity", peer_identity)
        if lease.arena_epoch and lease.arena_epoch != self._epoch:
            raise StaleArenaError(
                f"transfer {transfer_id!r} names pages through a mapping of memory epoch "
                f"{lease.arena_epoch[:12]}, but this daemon restarted since: its epoch is "
                f"{self._epoch[:12]}; re-attach to pool {pool!r} and write or read them again")
        t = self.registry.register(transfer_id, role, pool, runs, timeout_s, verify=verify,
                                   peer=peer, disjoint=disjoint, lease_id=lease.lease_id,
                                   release_lease=lease.release_lease,
                                   peer_identity=peer_identity, capability=capability,
                                   prompt_digest=prompt_digest)
        aborted = self._early_aborts.take(transfer_id) if role == TransferRole.RECEIVER else None
        if aborted is not None:
            self.registry.finish(t, TransferAbortedError(
                f"aborted here before it was registered: {aborted or 'no reason given'}"))
        if not t.state.final:
            t.timer = asyncio.get_running_loop().call_later(t.timeout_s, self._expire, t)
        return t

    def _expire(self, t: Transfer) -> None:
        if t.state.final:
            return
        self.registry.finish(t, TransferDeadlineError(
            f"transfer {t.id!r} did not complete within its {t.timeout_s:g}s deadline "
            f"(it was {t.state.name})"))
        self._tell_peer(t, "deadline exceeded")

    # -- peer verbs --------------------------------------------------------------------------

    async def claim(self, claim: Claim, caller: Caller) -> ClaimGrant:
        """``caller`` asks where a registered transfer goes, presenting its capability."""
        return await self._receiver.claim(claim, caller)

    async def commit(self, commit: Commit, caller: Caller) -> TransferInfo:
        """A verifying sender hands over its checksums; the final status."""
        return await self._receiver.commit(commit, caller)

    def request_push(self, request: PullAsk, caller: Caller) -> PushStarted | None:
        """A puller asks us to push an offered transfer (see ``Sender.accept_push_request``)."""
        return self._sender.accept_push_request(request, caller)

    def abort_from_peer(self, abort: PeerAbort, caller: Caller) -> None:
        """``caller`` ended a transfer; end our side too.

        A claimed transfer may be aborted only through the session that claimed it; an
        unclaimed one only by a caller presenting its capability (and, if it names a peer,
        that peer). Anything else, and an id not registered here, is NOT_FOUND with the
        same message, changes nothing, and is not remembered.
        """
        t = self.registry.find(abort.transfer_id)
        if t is None:
            raise not_open_to_caller(abort.transfer_id)
        if t.session_id:
            allowed = abort.session_id == t.session_id and self._sessions.owns(t.session_id, caller)
        else:
            allowed = presents(abort.capability, t.capability) and (
                not t.peer_identity or caller.is_named(t.peer_identity))
        if not allowed:
            raise not_open_to_caller(abort.transfer_id)
        if not t.state.final:
            reason = abort.reason or "no reason given"
            self.registry.finish(t, TransferAbortedError(
                f"aborted by peer {t.peer or caller.name}: {reason}"))

    # -- both sides ------------------------------------------------------------------------------

    def _tell_peer(self, t: Transfer, reason: str) -> None:
        if not t.peer:
            return
        abort = PeerAbort(t.id, t.session_id or t.placed_session, reason, t.capability)
        self._spawn(self._tell(t.peer, abort), name=f"tell {t.peer} {t.id} ended")

    async def _tell(self, peer: str, abort: PeerAbort) -> None:
        try:
            await (await self._clients.get(peer)).abort_transfer(abort, TELL_PEER_S)
        except KvxferError as exc:
            log.info("could not tell %s that %s ended: %s", peer, abort.transfer_id, exc)

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def shutdown(self, grace_s: float) -> None:
        """Refuse new transfers, let running ones finish for ``grace_s``, fail the rest (telling
        their peers), and wait for those messages to go out."""
        self.registry.accepting = False
        running = [t for t in self.registry.unfinished() if t.state == TransferState.TRANSFERRING]
        if running:
            log.info("waiting up to %.1fs for %d running transfers", grace_s, len(running))
            await asyncio.wait([asyncio.create_task(t.done.wait()) for t in running],
                               timeout=grace_s)
        for t in self.registry.unfinished():
            if not t.state.final:
                self.registry.finish(t, PeerUnavailableError(
                    f"daemon {self.peer_address} is draining: it shut down before this transfer "
                    f"finished (grace {grace_s:g} s)"))
                self._tell_peer(t, "the peer daemon is draining (shutting down)")
        if self._lease_watch is not None:
            self._lease_watch.cancel()
        if self._background:
            await asyncio.wait(self._background, timeout=TELL_PEER_S + 0.5)
