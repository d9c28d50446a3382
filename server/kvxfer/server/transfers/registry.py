"""Every transfer this daemon knows: registration, lookup for peers, retention, endings.

``register`` validates a worker's request and records the transfer;
``receiving`` finds the registration a peer's Claim names (an Expect or a Pull,
both registered before their capability leaves this daemon): nothing waits for a
registration, an id not here is NOT_FOUND at once. ``finish`` is the one
place a transfer ends: it releases what the transfer holds (its deadline
timer, its task, its UCX requests, its lease if it was to end with it), counts
it and logs it for ``completions``. Finished transfers are kept for ``retain``
registrations more, so a late ``wait`` or ``transfers`` still sees how they
ended. At most ``limits.active_transfers`` transfers are unfinished.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvxfer.errors import (
    InternalError,
    InvalidArgumentError,
    KvxferError,
    PeerUnavailableError,
    TransferAbortedError,
    TransferExistsError,
    TransferNotFoundError,
)
from kvxfer.pages import PageRuns
from kvxfer.server.leases import PageLeases
from kvxfer.server.limits import Limits, check_below, check_id, check_seconds
from kvxfer.server.metrics import DaemonMetrics
from kvxfer.server.pools import PoolRegistry
from kvxfer.server.tracing import TransferTracing
from kvxfer.server.transfers.capability import not_open_to_caller
from kvxfer.server.transfers.completions import CompletionLog
from kvxfer.server.transfers.record import Transfer
from kvxfer.status import TransferRole
from kvxfer.transport import Transport

log = logging.getLogger("kvxfer.server.transfers")

#: The longest a failed transfer's end is held back for its in-flight UCX requests.
QUIESCE_S = 1.0


class TransferRegistry:
    """Registers, finds, pairs up and ends this daemon's transfers."""

    def __init__(self, pools: PoolRegistry, leases: PageLeases, transport: Transport,
                 metrics: DaemonMetrics, tracing: TransferTracing, *, default_timeout_s: float,
                 retain: int, limits: Limits) -> None:
        self._pools = pools
        self._leases = leases
        self.completions = CompletionLog(retain)
        self._transport = transport
        self._metrics = metrics
        self.tracing = tracing
        self.default_timeout_s = default_timeout_s
        self._retain = retain
        self._limits = limits
        self._unfinished: set[Transfer] = set()
        self._transfers: OrderedDict[str, Transfer] = OrderedDict()
        self.accepting = True
        #: Tells a transfer's peer that it ended here (why), where nothing else will: the
        #: parts of an offer that ended (``_ended_family``). Set by the coordinator.
        self.tell_peer: Callable[[Transfer, str], None] = lambda t, why: None

    def get(self, transfer_id: str) -> Transfer:
        """The transfer ``transfer_id``; raises TransferNotFoundError."""
        try:
            return self._transfers[transfer_id]
        except KeyError:
            raise TransferNotFoundError(f"no transfer {transfer_id!r} is known here") from None

    def find(self, transfer_id: str) -> Transfer | None:
        """The transfer ``transfer_id``, or None."""
        return self._transfers.get(transfer_id)

    def all(self) -> list[Transfer]:
        """Every transfer still remembered, oldest first."""
        return list(self._transfers.values())

    def unfinished(self) -> list[Transfer]:
        """Every transfer not final yet (at most ``max_active_transfers``)."""
        return list(self._unfinished)

    def register(self, transfer_id: str, role: TransferRole, pool_name: str, runs: PageRuns,
                 timeout_s: float, *, verify: bool = False, peer: str = "", disjoint: bool,
                 lease_id: str = "", release_lease: bool = False,
                 peer_identity: str = "", capability: str = "",
                 prompt_digest: bytes = b"") -> Transfer:
        """Record a new transfer (``timeout_s`` 0: the default). With ``lease_id`` its runs
        must lie in that lease of the same pool. Raises for a bad request, a busy id, past
        ``active_transfers``, or while shutting down."""
        if not self.accepting:
            raise PeerUnavailableError("this daemon is shutting down; no new transfers")
        check_id("transfer_id (the engine's request id)", transfer_id)
        check_seconds("timeout_s (0 means the default)", timeout_s)
        pool = self._pools.get(pool_name)
        runs.check_bounds(pool.descriptor.num_pages, what=f"pool {pool_name!r} pages")
        if runs.num_pages > pool.descriptor.num_pages:
            raise InvalidArgumentError(
                f"runs name {runs.num_pages} pages; a transfer moves at most the "
                f"{pool.descriptor.num_pages} pages of pool {pool_name!r}")
        if disjoint:
            runs.check_disjoint()
        if lease_id:
            lease = self._leases.get(lease_id)
            if lease.pool != pool_name or not lease.covers(runs):
                raise InvalidArgumentError(
                    f"runs {runs.pairs()} of pool {pool_name!r} are not all pages of lease "
                    f"{lease_id} (pool {lease.pool!r}, runs {lease.runs.pairs()})")
        elif release_lease:
            raise InvalidArgumentError("release_lease needs a lease_id")
        old = self._transfers.get(transfer_id)
        if old is not None and not old.state.final:
            raise TransferExistsError(
                f"transfer {transfer_id!r} is already {old.state.name} here as "
                f"{old.role.name}; wait for it or abort it first")
        check_below("max_active_transfers", len(self._unfinished), self._limits.active_transfers,
                    "transfers registered here and not ended")
        timeout = timeout_s or self.default_timeout_s
        t = Transfer(transfer_id, role, pool, runs, timeout, time.monotonic() + timeout,
                     verify=verify, peer=peer, lease_id=lease_id, release_lease=release_lease,
                     peer_identity=peer_identity, capability=capability,
                     prompt_digest=prompt_digest)
        self._transfers.pop(transfer_id, None)
        self._transfers[transfer_id] = t
        self._unfinished.add(t)
        self._metrics.registered(t)
        self.tracing.begin(t)
        self._prune()
        return t

    def _prune(self) -> None:
        """Forget the oldest final transfers beyond ``retain`` (unfinished ones stay). The
        table is in registration order, so this looks at a few of its oldest entries, not
        all of them (at 1024 remembered, scanning them all cost 0.26 ms per registration)."""
        excess = len(self._transfers) - self._retain
        if excess <= 0:
            return
        stale: list[str] = []
        for key, t in self._transfers.items():
            if len(stale) == excess:
                break
            if t.state.final:
                stale.append(key)
        for key in stale:
            del self._transfers[key]

    def receiving(self, transfer_id: str) -> Transfer:
        """The receiving side of ``transfer_id`` registered here, or the NOT_FOUND every
        caller gets for an id that is not open to it.

        A final transfer that already had its partner is history, not a match: its id
        is being reused and the new registration is still to come.
        """
        check_id("transfer_id", transfer_id)
        t = self._transfers.get(transfer_id)
        if t is None or t.role != TransferRole.RECEIVER or (t.state.final and t.session_id):
            raise not_open_to_caller(transfer_id)
        return t

    def finish(self, t: Transfer, error: KvxferError | None = None) -> None:
        """End ``t`` (once) and release what it holds; the final state follows ``error``.

        A receiving transfer that fails with UCX requests in flight (or its same-host copy
        running) is final at once, but told (``wait``, ``completions``, its lease released)
        only once none of them can still write its pages (at most ``QUIESCE_S`` later): a
        receive UCX matched before the failure keeps writing until it completes, and the
        engine may reuse the pages as soon as it is told.
        """
        if not t.end(error):
            return
        if t.timer is not None:
            t.timer.cancel()
        if t.task is not None and t.task is not asyncio.current_task():
            t.task.cancel()
        quiet: Future[Any] | None = None
        if t.batch is not None and error is not None:
            quiet = self._transport.abandon(t.batch, f"transfer {t.id!r} ended: {t.state.name}")
            if t.role != TransferRole.RECEIVER:
                quiet = None  # sends only read their pages; a frozen peer would hold them
        elif t.copying is not None and error is not None:
            quiet = t.copying  # a same-host copy writes until it sees the end (one chunk)
        if quiet is None or quiet.done():
            self._publish(t)
        else:
            loop = asyncio.get_running_loop()
            quiet.add_done_callback(lambda _: loop.call_soon_threadsafe(self._publish, t))
            loop.call_later(QUIESCE_S, self._publish, t, quiet)
        self._unfinished.discard(t)
        self._metrics.ended(t, error)
        self.tracing.end(t, error)
        self._ended_family(t)
        role = t.role.name.lower()
        if error is None:
            log.info("transfer %s %s done: %d bytes in %.3fs", t.id, role, t.bytes_total,
                     (t.finished or 0.0) - (t.started or t.finished or 0.0), extra=t.log_fields)
        else:
            log.warning("transfer %s %s %s: %s", t.id, role, t.state.name, error,
                        extra=t.log_fields)

    def _ended_family(self, t: Transfer) -> None:
        """An offer pulled in parts that ends ends its parts still running; a part that fails
        fails its offer (and so its other parts: the puller's request fails anyway), and the
        last of its parts to end, every part taken, ends it."""
        for child in t.children:
            if not child.state.final:
                why = f"its offer {t.id!r} ended: {t.state.name}"
                self.finish(child, TransferAbortedError(why))
                self.tell_peer(child, why)
        parent = t.parent
        if parent is None or parent.state.final:
            return
        if t.error is not None:
            self.finish(parent, t.failure(""))
        elif (len(parent.parts_taken) == parent.parts
              and all(child.state.final for child in parent.children)):
            self.finish(parent)

    def _publish(self, t: Transfer, quiet: Future[Any] | None = None) -> None:
        """Tell that ``t`` ended (once): its waiters, the completion log, its lease."""
        if t.done.is_set():
            return
        if quiet is not None and not quiet.done():
            log.warning("transfer %s: UCX requests still in flight %.0f s after it failed; its "
                        "pages may still change", t.id, QUIESCE_S, extra=t.log_fields)
        if t.release_lease and self._leases.held(t.lease_id):
            self._leases.release(t.lease_id, f"its transfer {t.id!r} ended")
        self.completions.record(t)
        t.done.set()
        t.arrived.set()

    def fail(self, t: Transfer, exc: BaseException) -> None:
        """End ``t`` with ``exc``; an exception that is no kvxfer error is a bug, logged as such."""
        if not isinstance(exc, KvxferError):
            log.error("transfer %s failed unexpectedly", t.id, exc_info=exc, extra=t.log_fields)
            exc = InternalError(f"internal error: {type(exc).__name__}: {exc}")
        self.finish(t, exc)
