"""Pulls in flight into pages leased for them, and how each ended: an engine's decode half.

``start`` queues a pull: a thread of its own (``engine_core.pull_starts``) leases pages and
pulls the transfer into them in one call (``LeasePull``), through the memory epoch of the
caller's mapping, so the caller's step makes no call. A ``CompletionFeed`` (another thread)
long-polls the daemon for endings. ``poll`` takes both, on the caller's thread, which alone
decides what they mean:

- a start that failed ends its pull at once; one the daemon refused because it restarted
  since the mapping was made (StaleArenaError) re-maps the pool (``remap``) and is tried
  once more;
- an ending that arrives before its start was collected is held until it is;
- a pull dropped (``cancel``: its request ended), started or still starting, is aborted
  and its lease released only once its end is told, since bytes already on their way may
  land until then.

``poll`` hands back each pull that ended, once: a failed one with its lease already
released, a successful one for the caller to read and then ``release``. ``expire`` fails
pulls the daemon has not ended well past their deadline. ``follow`` after (re)mapping the
pool: endings from now on, and every pull of another memory epoch failed at once (the
daemon that held it restarted, its pages with it). Each pull carries the engine's own
``payload`` (vLLM's ``Load``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvxfer.client.completion_feed import CompletionFeed
from kvxfer.client.engine_core.endings import Endings
from kvxfer.client.engine_core.pull_starts import PullRequest, PullStarts, Started
from kvxfer.client.engine_core.reconnecting import Reconnecting
from kvxfer.client.library import KvxferClient
from kvxfer.errors import KvxferError, StaleArenaError, TransferExistsError
from kvxfer.offer_parts import WHOLE_OFFER, OfferPart, part_id
from kvxfer.status import LeaseInfo, TransferInfo

log = logging.getLogger("kvxfer.engine_core")

P = TypeVar("P")

#: How long past its deadline a pull may stay unreported before it is failed here.
EXPIRY_GRACE_S = 10.0
#: How long ``close`` waits for a start in its call, to abort what it started.
CLOSE_WAIT_S = 5.0


@dataclass
class Pull(Generic[P]):
    """A pull: where its pages land (None: its start failed, nothing was leased), when it
    was queued (``perf_counter``), the memory epoch of the mapping it lands in, when the
    daemon registered it (a completion of an earlier registration of the same id is not its
    own) and when its start call returned (``time.time``)."""

    payload: P
    transfer_id: str
    lease: LeaseInfo | None
    started: float
    epoch: str
    registered_unix: float
    returned_unix: float


@dataclass(frozen=True)
class PullEnd(Generic[P]):
    """How a pull ended: the daemon's status (None when it never told: expired, or its daemon
    restarted), and for a failure why and its reason (a kvxfer error's, or NO_ENDING,
    DAEMON_RESTARTED)."""

    pull: Pull[P]
    info: TransferInfo | None
    why: str = ""
    reason: str = ""

    @property
    def ok(self) -> bool:
        """Whether its pages hold the transfer's bytes."""
        return self.info is not None and self.info.ok


def failure_reason(exc: BaseException) -> str:
    """A failure's reason: a kvxfer error's own, else the exception's type."""
    return exc.reason if isinstance(exc, KvxferError) else type(exc).__name__


class PageLoads(Generic[P]):
    """The pulls one engine worker has in flight through ``client``'s daemon."""

    def __init__(self, client: KvxferClient, endings: Endings, reach: Reconnecting, *,
                 timeout_s: float, remap: Callable[[], None]) -> None:
        """``remap`` maps the pool again (its daemon restarted) and calls ``follow``."""
        self._client = client
        self._endings = endings
        self._remap = remap
        self._timeout_s = timeout_s
        self._starts: PullStarts[P] = PullStarts(client, reach, timeout_s=timeout_s)
        self._early: dict[str, TransferInfo] = {}  # endings of pulls still starting
        self._pending: dict[str, Pull[P]] = {}
        self._releasing: dict[str, Pull[P]] = {}  # dropped pulls whose end is not told yet
        self._cursor = 0
        self._feed: CompletionFeed | None = None  # from the first pull on
        self._resync = False  # some endings were missed: ask for every ended transfer
        self._epoch = ""  # of the mapping the pulls land in (``follow``)

    def follow(self, epoch: str) -> list[PullEnd[P]]:
        """The pool was mapped at memory ``epoch``: follow endings from now on; the pulls of
        another epoch end DAEMON_RESTARTED (returned)."""
        self.stop_following()
        self._epoch = epoch
        self._cursor = self._client.completions().cursor
        return self._lost(epoch)

    def stop_following(self) -> None:
        """Stop the feed (not on the caller's step: its call in flight ends it)."""
        if self._feed is not None:
            self._feed.close(wait=False)
            self._feed = None

    def check_free(self, transfer_id: str) -> None:
        """TransferExistsError if ``transfer_id`` is still being pulled (or dropped) here."""
        if (transfer_id in self._pending or transfer_id in self._releasing
                or transfer_id in self._starts):
            raise TransferExistsError(f"transfer {transfer_id!r} is already being loaded here")

    def start(self, payload: P, transfer_id: str, *, peer: str, pool: str, pages: int,
              skip_pages: int, capability: str, prompt_digest: bytes, epoch: str,
              lease_s: float, holder: str, part: OfferPart = WHOLE_OFFER) -> None:
        """Queue a pull: lease ``pages`` and pull ``transfer_id`` from ``peer`` into them, past
        the offer's first ``skip_pages`` or its ``part`` (``poll`` tells how it went; a part
        shared by several pullers is the transfer ``part_id``); TransferExistsError if it is
        still being pulled here."""
        self.check_free(part_id(transfer_id, part.index) if part.shared else transfer_id)
        self._submit(PullRequest(payload, transfer_id, peer, pool, pages, skip_pages, part,
                                 capability, prompt_digest, epoch, lease_s, holder))

    def _submit(self, request: PullRequest[P]) -> None:
        """Queue ``request``'s start, following endings from then on."""
        self._starts.submit(request)
        if self._feed is None:
            self._feed = CompletionFeed(self._client, self._cursor)

    def cancel(self, which: Callable[[P], bool], why: str) -> list[P]:
        """Abort the pulls whose payload ``which`` selects; their leases are released once
        their ends are told."""
        dropped = self._starts.cancel(which, why)
        for tid, pull in list(self._pending.items()):
            if which(pull.payload):
                del self._pending[tid]
                self._endings.abort_soon(tid, why)
                self._releasing[tid] = pull
                dropped.append(pull.payload)
        return dropped

    def wait(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for an ending while pulls are in flight, or for a start while
        only starts are (returns at once when one arrives, or nothing is in flight)."""
        if not wait_s:
            return
        if self._feed is not None and self._pending:
            self._feed.wait(wait_s)
        elif self._starts:
            self._starts.wait(wait_s)

    def poll(self) -> list[PullEnd[P]]:
        """The pulls that ended since the last call. When the daemon no longer kept some
        endings, asks it for every ended transfer, each call until one succeeds. A failed
        call is logged, never raised."""
        ends = self._collect_starts()
        if self._feed is None:
            return ends
        batches, error = self._feed.take()
        if error is not None:
            log.warning("kvxfer: could not ask the daemon which transfers ended: %s: %s",
                        type(error).__name__, error)
        for ended in batches:
            if ended.epoch != self._epoch:
                ends += self._lost(ended.epoch)
                continue
            self._resync = self._resync or ended.missed
            ends += self._settle(ended.transfers)
        if self._resync and (self._pending or self._releasing or self._starts):
            try:
                ends += self._settle([i for i in self._client.transfers() if i.state.final])
            except Exception as exc:  # noqa: BLE001 - the ends settled above must not be lost
                log.warning("kvxfer: could not ask the daemon for every ended transfer (some "
                            "endings were missed); asking again next step: %s", exc)
                return ends
        self._resync = False
        return ends

    def _collect_starts(self) -> list[PullEnd[P]]:
        """Register the pulls whose start returned; end those that failed, retry those a
        restarted daemon refused (once, after re-mapping), abort those dropped meanwhile."""
        ends: list[PullEnd[P]] = []
        for start in self._starts.collect():
            request = start.request
            early = self._early.pop(request.local_id, None)
            if start.error is not None:
                if request.cancelled:
                    continue  # nothing was leased or started
                if isinstance(start.error, StaleArenaError) and not request.retried:
                    ends += self._retry(start)
                    continue
                ends.append(self._start_failed(start, f"{type(start.error).__name__}: "
                                               f"{start.error}", failure_reason(start.error)))
                continue
            assert start.lease is not None and start.info is not None
            pull = Pull(request.payload, request.local_id, start.lease, start.submitted,
                        request.epoch, start.info.created_unix, start.returned_unix)
            if request.cancelled:
                self._endings.abort_soon(request.local_id, request.cancelled)
                self._releasing[request.local_id] = pull
            elif request.epoch != self._epoch:  # registered before its daemon restarted
                self._pending[request.local_id] = pull
                ends += self._lost(self._epoch)
                continue
            else:
                self._pending[request.local_id] = pull
            if early is not None:
                ends += self._settle([early])
        return ends

    def _retry(self, start: Started[P]) -> list[PullEnd[P]]:
        """Start again a pull the daemon refused for its memory epoch, after re-mapping the
        pool if no one did since the start was queued."""
        request = start.request
        if request.epoch == self._epoch:
            try:
                self._remap()
            except Exception as exc:  # noqa: BLE001 - the load fails, not the engine
                return [self._start_failed(start, f"re-mapping the pool failed: "
                                           f"{type(exc).__name__}: {exc}", failure_reason(exc))]
        request.epoch, request.retried = self._epoch, True
        self._submit(request)
        return []

    @staticmethod
    def _start_failed(start: Started[P], why: str, reason: str) -> PullEnd[P]:
        request = start.request
        pull = Pull(request.payload, request.local_id, None, start.submitted, request.epoch,
                    0.0, start.returned_unix)
        return PullEnd(pull, None, why, reason)

    def _settle(self, infos: list[TransferInfo]) -> list[PullEnd[P]]:
        ends: list[PullEnd[P]] = []
        for info in infos:
            if info.transfer_id in self._starts:
                self._early[info.transfer_id] = info  # its start is not collected yet
                continue
            dropped = self._releasing.get(info.transfer_id)
            if dropped is not None and info.created_unix == dropped.registered_unix:
                del self._releasing[info.transfer_id]
                self._release(dropped)
            pull = self._pending.get(info.transfer_id)
            if pull is None or info.created_unix != pull.registered_unix:
                continue  # not ours, or an earlier registration of the same id
            del self._pending[info.transfer_id]
            if info.ok:
                ends.append(PullEnd(pull, info))
                continue
            self._release(pull)
            ends.append(PullEnd(pull, info, f"transfer {info.state.name}: {info.error}",
                                failure_reason(info.failure) if info.failure is not None
                                else info.state.name))
        return ends

    def release(self, end: PullEnd[P]) -> None:
        """The caller has read ``end``'s pages: release them."""
        self._release(end.pull)

    def _release(self, pull: Pull[P]) -> None:
        if pull.lease is not None:
            self._endings.release(pull.lease.lease_id)

    def _lost(self, epoch: str) -> list[PullEnd[P]]:
        ends: list[PullEnd[P]] = []
        for tid, pull in list(self._pending.items()):
            if pull.epoch != epoch:
                del self._pending[tid]
                ends.append(PullEnd(pull, None, f"the daemon restarted (memory epoch "
                                                 f"{epoch[:12]}, the load's {pull.epoch[:12]}): "
                                                 "its transfer is gone", "DAEMON_RESTARTED"))
        for tid, dropped in list(self._releasing.items()):
            if dropped.epoch != epoch:
                del self._releasing[tid]  # its lease went with the daemon
        return ends

    def expire(self) -> list[PullEnd[P]]:
        """Fail the pulls the daemon has not ended well past their deadline (it did not
        answer, or lost them): their blocks must not wait forever."""
        limit = self._timeout_s + EXPIRY_GRACE_S
        now = time.perf_counter()
        ends: list[PullEnd[P]] = []
        for tid, pull in list(self._pending.items()):
            if now - pull.started > limit:
                del self._pending[tid]
                self._endings.abort_soon(tid, "no ending reported by its deadline")
                self._releasing[tid] = pull
                ends.append(PullEnd(pull, None, f"the daemon reported no ending within "
                                                f"{limit:.0f}s", "NO_ENDING"))
        for tid, dropped in list(self._releasing.items()):
            if now - dropped.started > 2 * limit:  # its end never came: the lease expires anyway
                del self._releasing[tid]
                self._release(dropped)
        return ends

    def close(self, why: str) -> None:
        """Abort every pull in flight (waiting up to ``CLOSE_WAIT_S`` for one being started)
        and release its pages; stop following endings."""
        for start in self._starts.close(CLOSE_WAIT_S):
            assert start.lease is not None
            self._endings.abort(start.request.local_id, why)
            self._endings.release(start.lease.lease_id)
        for tid, pull in list(self._pending.items()):
            self._endings.abort(tid, why)
            self._release(pull)
        self._pending.clear()
        if self._feed is not None:
            self._feed.close()
            self._feed = None
