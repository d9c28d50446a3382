"""Transfers' endings gathered in the background, for callers that must not wait.

An engine's step loop asks which transfers ended many times per transfer. Asked
with a ``Completions`` call each time, every step pays a round trip to the daemon,
and the daemon answers a stream of polls while it moves the bytes (on a machine
with few cores, the same cores). ``CompletionFeed`` instead keeps one long-polling
``Completions`` call open in a thread of its own: the daemon answers it the moment
a transfer ends, and ``take`` hands the caller what arrived, without a call.
"""

from __future__ import annotations

import logging
import threading

from kvxfer.client.library import KvxferClient
from kvxfer.status import Completions

log = logging.getLogger("kvxfer.client")

#: How long one long-polling call waits for an ending (also how soon ``close`` returns).
POLL_S = 0.5
#: How long the thread waits before asking again after a failed call.
RETRY_S = 0.05


class CompletionFeed:
    """Follows the endings of the transfers of ``client``'s daemon from cursor ``after``.

    ``take`` returns the batches gathered since the last call, in order, each as the
    daemon answered it (its epoch and ``missed`` included), and the error of the latest
    failed call since then, if the thread could not ask the daemon (it keeps asking).
    """

    def __init__(self, client: KvxferClient, after: int) -> None:
        self._client = client
        self._cursor = after
        self._lock = threading.Lock()
        self._batches: list[Completions] = []
        self._error: Exception | None = None
        self._epoch_told = ""
        self._arrived = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="kvxfer-completions",
                                        daemon=True)
        self._thread.start()

    def take(self) -> tuple[list[Completions], Exception | None]:
        """The batches gathered since the last call, and the latest call's error since then."""
        with self._lock:
            batches, self._batches = self._batches, []
            error, self._error = self._error, None
            self._arrived.clear()
        return batches, error

    def wait(self, timeout_s: float) -> None:
        """Wait until a batch not taken yet is here, at most ``timeout_s``."""
        self._arrived.wait(timeout_s)

    def close(self, wait: bool = True) -> None:
        """Stop following. With ``wait``, return once the thread stopped (within ``POLL_S``
        and a call's timeout); without, at once (the thread ends with its call in flight)."""
        self._stop.set()
        if wait:
            self._thread.join(POLL_S + self._client.timeout_s)

    @property
    def running(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                ended = self._client.completions(self._cursor, timeout_s=POLL_S)
            except Exception as exc:  # noqa: BLE001 - told to the caller; the thread goes on
                with self._lock:
                    self._error = exc
                self._stop.wait(RETRY_S)
                continue
            self._cursor = ended.cursor
            # An answer without endings still tells a new epoch (the daemon restarted).
            if ended.transfers or ended.missed or ended.epoch != self._epoch_told:
                self._epoch_told = ended.epoch
                with self._lock:
                    self._batches.append(ended)
                    self._arrived.set()
