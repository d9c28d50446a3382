"""Aborts of transfers not registered yet, remembered for a while.

An engine may abort a transfer before its own call that registers it reached the daemon:
a decode worker starts its pulls from a thread, off the engine's step, and a sibling
rank whose load failed aborts the others' transfers of the same request at once. Such an
abort finds nothing to end. ``EarlyAborts`` remembers it (for ``KEEP_S``, at most
``CAPACITY`` ids, the oldest forgotten first), so that the transfer, if it is registered
in time, ends ABORTED at once instead of running to its deadline.
"""

from __future__ import annotations

import time
from collections import OrderedDict

#: How long an abort of an unknown transfer id is remembered.
KEEP_S = 60.0
#: The most such aborts remembered.
CAPACITY = 1024


class EarlyAborts:
    """Transfer ids aborted before they were registered, and why."""

    def __init__(self, keep_s: float = KEEP_S, capacity: int = CAPACITY) -> None:
        self._keep_s = keep_s
        self._capacity = capacity
        self._aborted: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def remember(self, transfer_id: str, reason: str) -> None:
        """``transfer_id`` was aborted for ``reason`` while not registered."""
        self._aborted.pop(transfer_id, None)
        self._aborted[transfer_id] = (reason, time.monotonic() + self._keep_s)
        while len(self._aborted) > self._capacity:
            self._aborted.popitem(last=False)

    def take(self, transfer_id: str) -> str | None:
        """Why ``transfer_id`` was aborted before it was registered (forgetting it), or None
        if it was not, or too long ago."""
        now = time.monotonic()
        while self._aborted:
            oldest, (_, until) = next(iter(self._aborted.items()))
            if until > now:
                break
            del self._aborted[oldest]
        remembered = self._aborted.pop(transfer_id, None)
        return None if remembered is None else remembered[0]
