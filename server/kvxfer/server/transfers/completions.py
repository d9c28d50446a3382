"""The transfers that ended, in order, for workers that poll once per engine step.

Every transfer that reaches a final state gets the next sequence number. A
worker asks for everything that ended after the cursor its last call returned
(waiting a bounded time if nothing has), so an engine pays one call per step
instead of one ``wait`` per request. The log keeps the last ``retain`` endings;
a cursor older than that is answered with what is left and ``missed``.
"""

from __future__ import annotations

import asyncio
from collections import deque

from kvxfer.server.transfers.record import Transfer


class CompletionLog:
    """The last ``retain`` transfers that ended, with their sequence numbers."""

    def __init__(self, retain: int) -> None:
        self._ended: deque[tuple[int, Transfer]] = deque(maxlen=retain)
        self._last = 0
        self._changed = asyncio.Event()

    def record(self, t: Transfer) -> None:
        """``t`` just ended."""
        self._last += 1
        self._ended.append((self._last, t))
        self._changed.set()
        self._changed = asyncio.Event()

    async def since(self, after: int, timeout_s: float) -> tuple[list[Transfer], int, bool]:
        """The transfers that ended after cursor ``after``, in order; the new cursor; and
        whether some that did are no longer kept. Waits up to ``timeout_s`` for one, unless
        ``after`` is from another lifetime of the daemon (ahead of its own cursor): that
        caller must hear at once that the daemon restarted."""
        if self._last == after and timeout_s > 0:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except TimeoutError:
                pass
        oldest = self._ended[0][0] if self._ended else self._last + 1
        missed = 0 < after < oldest - 1
        if after > self._last:  # a cursor from before this daemon (re)started
            after, missed = 0, True
        return [t for seq, t in self._ended if seq > after], self._last, missed
