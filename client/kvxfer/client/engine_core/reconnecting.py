"""Calls from an engine's worker to a daemon that may be restarting.

A sidecar daemon that crashed comes back in about a second, but the worker's gRPC
channel learnt meanwhile that nothing listens there and backs off (up to a second,
``kvxfer.client.library.CHANNEL_OPTIONS``): a call in that window fails at once with
UNAVAILABLE, and the load it was for with it. ``Reconnecting`` gives such a call one
bounded wait for the daemon to be reachable, then one more try. A daemon that stays
down costs one wait per ``DOWN_S``, not one per call: the step that makes the calls
must not stall on every load.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from kvxfer.client.library import KvxferClient
from kvxfer.errors import PeerUnavailableError

log = logging.getLogger("kvxfer.engine_core")

T = TypeVar("T")

#: How long a call that could not reach the daemon waits for it (its channel's backoff is
#: at most 1 s, with 20 % jitter).
RECONNECT_WAIT_S = 2.0
#: After a wait in vain, how long calls that cannot reach the daemon fail at once.
DOWN_S = 10.0


class Reconnecting:
    """Runs calls to ``client``'s daemon, waiting once (bounded) for it when unreachable."""

    def __init__(self, client: KvxferClient) -> None:
        self._client = client
        self._down_until = 0.0

    def call(self, attempt: Callable[[], T]) -> T:
        """``attempt()``; if the daemon was unreachable, once more after it is reachable
        again (within ``RECONNECT_WAIT_S``); PeerUnavailableError if it is not."""
        try:
            return attempt()
        except PeerUnavailableError:
            if time.monotonic() < self._down_until:
                raise
            if not self._client.reachable(RECONNECT_WAIT_S):
                self._down_until = time.monotonic() + DOWN_S
                log.warning("kvxfer: daemon %s unreachable for %.0f s; calls fail at once for "
                            "%.0f s", self._client.address, RECONNECT_WAIT_S, DOWN_S)
                raise
        return attempt()
