"""Pulls being started off the engine's step: their ``LeasePull`` calls made in a thread.

A step that starts loads must not wait on its daemon: each start is a local round trip
under the engine process's GIL, and a step that starts 8 loads would make 8. So
``PullStarts.submit`` only queues a start; one thread of its own makes the calls, in
order, and ``collect`` hands back what came of each, on the caller's thread. The thread
only makes the call: every other decision (a start whose request ended meanwhile, a
retry after a daemon restart, an ending that arrived before its start was collected) is
the caller's, on its own thread (``engine_core.loads``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvxfer.client.engine_core.reconnecting import Reconnecting
from kvxfer.client.library import KvxferClient
from kvxfer.offer_parts import OfferPart, part_id
from kvxfer.status import LeaseInfo, TransferInfo

P = TypeVar("P")


@dataclass
class PullRequest(Generic[P]):
    """A pull to start: what it serves (``payload``), what to pull and into which lease, the
    memory epoch of the caller's mapping, whether it is a retry, and, once its request ended
    before the start was collected, why (``cancelled``)."""

    payload: P
    transfer_id: str
    peer: str
    pool: str
    pages: int
    skip_pages: int
    part: OfferPart
    capability: str
    prompt_digest: bytes
    epoch: str
    lease_s: float
    holder: str
    retried: bool = False
    cancelled: str = ""

    @property
    def local_id(self) -> str:
        """The pull's transfer id on the caller's daemon (a shared part's is its own)."""
        return part_id(self.transfer_id, self.part.index) if self.part.shared else self.transfer_id


@dataclass(frozen=True)
class Started(Generic[P]):
    """What came of one start: the new lease and the pull's status, or the call's error;
    when it was submitted (``perf_counter``) and when the call returned (``time.time``; for
    a failed call, when its failure was collected)."""

    request: PullRequest[P]
    lease: LeaseInfo | None
    info: TransferInfo | None
    error: Exception | None
    submitted: float
    returned_unix: float


_Call = tuple[LeaseInfo, TransferInfo, float]  # the lease, the pull, when the call returned


class PullStarts(Generic[P]):
    """Starts ``client``'s pulls from one thread; every method but the thread's is the caller's."""

    def __init__(self, client: KvxferClient, reach: Reconnecting, *, timeout_s: float) -> None:
        self._client = client
        self._reach = reach
        self._timeout_s = timeout_s
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvxfer-pull-starts")
        self._starting: dict[str, tuple[PullRequest[P], float, Future[_Call]]] = {}
        self._done = threading.Event()

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._starting

    def __len__(self) -> int:
        return len(self._starting)

    def submit(self, request: PullRequest[P]) -> None:
        """Queue ``request``'s start (the caller checked that its id is free here)."""
        future = self._thread.submit(self._start, request)
        future.add_done_callback(lambda _: self._done.set())
        self._starting[request.local_id] = (request, time.perf_counter(), future)

    def _start(self, request: PullRequest[P]) -> _Call:
        """The thread's only work: lease and pull in one call (waiting once, bounded, for a
        daemon that restarts)."""
        lease, info = self._reach.call(lambda: self._client.lease_and_pull(
            request.transfer_id, request.peer, request.pool, request.pages,
            timeout_s=self._timeout_s, lease_s=request.lease_s, holder=request.holder,
            arena_epoch=request.epoch, capability=request.capability,
            prompt_digest=request.prompt_digest, skip_pages=request.skip_pages,
            part=request.part))
        return lease, info, time.time()

    def cancel(self, which: Callable[[P], bool], why: str) -> list[P]:
        """Mark the starts whose payload ``which`` selects as cancelled (their request ended):
        ``collect`` still returns them, for the caller to abort what was started."""
        dropped = []
        for request, _, _ in self._starting.values():
            if not request.cancelled and which(request.payload):
                request.cancelled = why
                dropped.append(request.payload)
        return dropped

    def collect(self) -> list[Started[P]]:
        """The starts whose call returned since the last call, in the order submitted."""
        self._done.clear()
        started = []
        for transfer_id, (request, submitted, future) in list(self._starting.items()):
            if not future.done():
                continue
            del self._starting[transfer_id]
            if future.cancelled():
                continue  # never begun (``close``)
            error = future.exception()
            if error is not None:
                started.append(Started(request, None, None, _as_exception(error), submitted,
                                       time.time()))
            else:
                lease, info, returned = future.result()
                started.append(Started(request, lease, info, None, submitted, returned))
        return started

    def wait(self, timeout_s: float) -> None:
        """Wait until a start not collected yet returned, at most ``timeout_s``."""
        if any(future.done() for _, _, future in self._starting.values()):
            return
        self._done.wait(timeout_s)

    def close(self, wait_s: float) -> list[Started[P]]:
        """Drop the starts not begun; wait up to ``wait_s`` for the one in its call; return
        what came of those that returned (their pulls are the caller's to abort). A start
        that returns later is not seen: its pull runs to its deadline and its lease lasts
        until its ``lease_s``."""
        self._thread.shutdown(wait=False, cancel_futures=True)
        running = [future for _, _, future in self._starting.values() if not future.cancelled()]
        wait_futures(running, timeout=wait_s)
        return [start for start in self.collect() if start.error is None]


def _as_exception(error: BaseException) -> Exception:
    if isinstance(error, Exception):
        return error
    return RuntimeError(f"{type(error).__name__}: {error}")
