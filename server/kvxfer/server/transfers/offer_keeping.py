"""Offers kept waiting for their puller while it still wants them, or dropped by it.

An offer waits for its pull until its deadline. A decode engine's request can wait
longer than that in the engine's queue; while it waits, the decode daemon keeps the
offer alive for it (``KeepOffers``: one call per prefill daemon for all the offers the
engine wants from it). A keep presents the offer's capability, as a pull does, without
spending it; it moves the offer's deadline to ``keep_s`` from now, never past
``max_offer_s`` after the offer was made, so a puller that never pulls cannot hold
pages for ever. A lease that ends with the offer is renewed to outlive the new
deadline; a lease the prefill worker still holds bounds it. Anything not kept (never
offered, already pulled or ended, a wrong capability, a caller other than the peer the
offer names) gets the same answer, 0 seconds, so a keep tells nothing about other
transfers. An engine that will never pull an offer drops it: its daemon aborts it at
the prefill daemon with the capability (``AbortTransfer``), which frees its pages now
instead of at its deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from kvxfer.errors import InvalidArgumentError, TransferNotFoundError
from kvxfer.server.leases import PageLeases
from kvxfer.server.limits import check_id, check_seconds, check_text
from kvxfer.server.peer_client import PeerClients
from kvxfer.server.peer_protocol import PeerAbort
from kvxfer.server.tls import Caller
from kvxfer.server.transfers.capability import presents
from kvxfer.server.transfers.record import Transfer
from kvxfer.server.transfers.registry import TransferRegistry
from kvxfer.status import MAX_OFFER_HOLDS, OfferHold, TransferRole, TransferState

log = logging.getLogger("kvxfer.server.transfers")

#: How much longer than the offer a lease that ends with it is renewed for.
LEASE_MARGIN_S = 1.0
#: How long a keep or a drop call to the prefill daemon may take.
PEER_CALL_S = 5.0


def _check_call(peer: str, holds: Sequence[OfferHold]) -> None:
    """A worker's keep or drop names the prefill daemon and at most ``MAX_OFFER_HOLDS``."""
    _check_holds(holds)
    if not peer:
        raise InvalidArgumentError("peer is empty; expected the prefill daemon's host:port")


def _check_holds(holds: Sequence[OfferHold]) -> None:
    if len(holds) > MAX_OFFER_HOLDS:
        raise InvalidArgumentError(f"{len(holds)} offers named; a call may name at most "
                                   f"{MAX_OFFER_HOLDS} (split them)")
    for hold in holds:
        check_id("offers[].transfer_id", hold.transfer_id)
        check_text("offers[].capability", hold.capability)


class OfferKeeping:
    """Keeps and drops offers: here for a puller's daemon (``keep``), and at a prefill
    daemon for this node's engine (``keep_at``, ``drop_at``)."""

    def __init__(self, registry: TransferRegistry, leases: PageLeases, clients: PeerClients,
                 *, max_offer_s: float, expire: Callable[[Transfer], None]) -> None:
        self._registry = registry
        self._leases = leases
        self._clients = clients
        self._max_offer_s = max_offer_s
        self._expire = expire

    # -- the prefill side ------------------------------------------------------------------

    def keep(self, holds: Sequence[OfferHold], keep_s: float, caller: Caller) -> list[float]:
        """Move each offer's deadline to ``keep_s`` (0: the default deadline) from now, at
        most ``max_offer_s`` after it was offered; the seconds each now waits (0: not kept)."""
        _check_holds(holds)
        check_seconds("keep_s (0 means the default transfer deadline)", keep_s)
        want = keep_s or self._registry.default_timeout_s
        return [self._keep_one(hold, want, caller) for hold in holds]

    def _keep_one(self, hold: OfferHold, keep_s: float, caller: Caller) -> float:
        t = self._registry.find(hold.transfer_id)
        if (t is None or t.role != TransferRole.SENDER or t.state != TransferState.WAITING
                or t.capability_spent or not presents(hold.capability, t.capability)
                or (t.peer_identity and not caller.is_named(t.peer_identity))):
            return 0.0
        now = time.monotonic()
        until = min(now + keep_s, t.registered + self._max_offer_s)
        if t.lease_id:
            if not self._leases.held(t.lease_id):
                return 0.0  # its lease ended: the transfer is failing with it
            lease = self._leases.get(t.lease_id)
            if not t.release_lease:
                until = min(until, lease.expires)  # the prefill worker's lease bounds it
            elif lease.expires < until + LEASE_MARGIN_S:
                self._leases.renew(lease.id, until + LEASE_MARGIN_S - now)
        if until > t.deadline:
            t.deadline, t.timeout_s = until, until - t.registered
            if t.timer is not None:
                t.timer.cancel()
            t.timer = asyncio.get_running_loop().call_later(until - now, self._expire, t)
        return t.remaining()

    # -- the decode side -------------------------------------------------------------------

    async def keep_at(self, peer: str, holds: Sequence[OfferHold], keep_s: float) -> list[float]:
        """Keep ``holds`` waiting at the prefill daemon ``peer``; the seconds each now waits
        there (0: not kept)."""
        _check_call(peer, holds)
        check_seconds("keep_s (0 means the default transfer deadline)", keep_s)
        if not holds:
            return []
        client = await self._clients.get(peer)
        return await client.keep_offers(list(holds), keep_s, PEER_CALL_S)

    async def drop_at(self, peer: str, holds: Sequence[OfferHold], reason: str) -> int:
        """End ``holds`` at the prefill daemon ``peer`` (ABORTED, ``reason``); how many ended
        there (the rest had ended, or were not open to us). Raises when the peer cannot be
        reached."""
        _check_call(peer, holds)
        check_text("reason", reason)
        client = await self._clients.get(peer)
        why = reason or "its puller will not pull it"
        ended = await asyncio.gather(
            *(client.abort_transfer(PeerAbort(h.transfer_id, "", why, h.capability), PEER_CALL_S)
              for h in holds), return_exceptions=True)
        dropped = 0
        for hold, outcome in zip(holds, ended, strict=True):
            if outcome is None:
                dropped += 1
            elif isinstance(outcome, TransferNotFoundError):
                log.debug("offer %s at %s was not dropped: it had ended or is not ours",
                          hold.transfer_id, peer)
            elif isinstance(outcome, BaseException):
                raise outcome
        return dropped
