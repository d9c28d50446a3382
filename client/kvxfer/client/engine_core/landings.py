"""Copies of landed pulls into an engine's blocks, made from a thread, off the engine's step.

When a burst of loads lands together, copying each into its request's blocks on the step
(about 0.5 ms each here) holds up every running request's next token. ``Landings`` makes
the copies in one thread of its own (torch releases the GIL while it copies) and hands
back, on the caller's thread, the ones that finished (``collect``). A copy only writes the
blocks of a request the engine does not compute yet (it waits for its KV), so it may run
beside a model step. Whoever drops the mapping the copies read from must ``drain`` first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Generic, TypeVar

P = TypeVar("P")

#: How long ``drain`` and ``close`` wait for the copies in flight.
DRAIN_S = 10.0


@dataclass(frozen=True)
class Landed(Generic[P]):
    """A finished copy: what it served, how long it took, and its error (None: copied)."""

    payload: P
    seconds: float
    error: Exception | None


class Landings(Generic[P]):
    """Copies made in one thread; every method but the thread's is the caller's."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvxfer-landings")
        self._copying: list[tuple[P, Future[float]]] = []
        self._done = threading.Event()

    def __len__(self) -> int:
        return len(self._copying)

    def submit(self, payload: P, copy: Callable[[], None]) -> None:
        """Make ``copy`` in the thread, for ``payload``."""
        future = self._thread.submit(_timed, copy)
        future.add_done_callback(lambda _: self._done.set())
        self._copying.append((payload, future))

    def collect(self) -> list[Landed[P]]:
        """The copies that finished since the last call, in the order submitted."""
        self._done.clear()
        landed, copying = [], []
        for payload, future in self._copying:
            if not future.done():
                copying.append((payload, future))
                continue
            error = future.exception()
            if error is None:
                landed.append(Landed(payload, future.result(), None))
            else:
                landed.append(Landed(payload, 0.0, error if isinstance(error, Exception)
                                     else RuntimeError(repr(error))))
        self._copying = copying
        return landed

    def wait(self, timeout_s: float) -> None:
        """Wait until a copy not collected yet finished, at most ``timeout_s``."""
        if any(future.done() for _, future in self._copying):
            return
        self._done.wait(timeout_s)

    def drain(self) -> None:
        """Wait for every copy in flight (TimeoutError after ``DRAIN_S``: the mapping they
        read from must then not be dropped)."""
        running = [future for _, future in self._copying]
        _, pending = wait_futures(running, timeout=DRAIN_S)
        if pending:
            raise TimeoutError(f"{len(pending)} copies into the engine's blocks did not "
                                   f"finish within {DRAIN_S:g}s")

    def close(self) -> None:
        """Finish the copies in flight (at most ``DRAIN_S``) and stop the thread."""
        try:
            self.drain()
        finally:
            self._thread.shutdown(wait=False, cancel_futures=True)


def _timed(copy: Callable[[], None]) -> float:
    start = time.perf_counter()
    copy()
    return time.perf_counter() - start
