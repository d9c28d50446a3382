"""Keeps the offers of a decode engine's queued requests alive at their prefill daemons, and
drops those a request will never pull, off vLLM's scheduler loop.

A prefill engine's offer waits for its pull until its deadline (``timeout_s``); a decode
request can wait in its engine's queue for longer. From the moment the decode engine sees
the request (``want``) until its load is planned (``stop``), a thread of ours keeps its
offers alive: every ``every_s`` (the first keep of a request comes within ``every_s`` of
its arrival), one ``KeepOffers`` call to the local daemon per prefill daemon and
``MAX_OFFER_HOLDS`` offers, for all the offers wanted from it, each moving the deadline to
``keep_s`` from then (the prefill daemon caps it at its ``--max-offer-s``). A request that
ends before its load, or loads nothing, has its offers dropped (``drop``), which frees their
pages at the prefill daemon at once instead of at their deadline. The scheduler only
records and signals: none of these calls waits on a daemon. A failed keep or drop is
logged and never reaches vLLM: an offer not kept ends at its deadline, and its load then
fails as it would without us.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Sequence

from kvxfer.client.library import KvxferClient
from kvxfer.errors import KvxferError
from kvxfer.status import MAX_OFFER_HOLDS, OfferHold

log = logging.getLogger("kvxfer.integrations.vllm")

#: How long ``close`` waits for the thread's call in flight.
CLOSE_S = 15.0


class OfferKeeper:
    """The offers each waiting decode request still wants, kept alive by one thread."""

    def __init__(self, client: KvxferClient, *, every_s: float, keep_s: float) -> None:
        self._client = client
        self._every_s = every_s
        self._keep_s = keep_s
        self._wanted: dict[str, tuple[str, tuple[OfferHold, ...]]] = {}  # req id -> peer, offers
        self._to_drop: list[tuple[str, tuple[OfferHold, ...], str]] = []
        self._changed = threading.Condition()
        self._closed = False
        #: Offers kept (counted per keep) and offers dropped, for tests and logs.
        self.kept_offers = self.dropped_offers = 0
        self._thread = threading.Thread(target=self._run, name="kvxfer offer keeper", daemon=True)
        self._thread.start()

    def want(self, req_id: str, peer: str, holds: Sequence[OfferHold]) -> None:
        """``req_id`` waits for ``holds`` at the prefill daemon ``peer``: keep them alive."""
        with self._changed:
            self._wanted[req_id] = (peer, tuple(holds))

    def stop(self, req_id: str) -> None:
        """``req_id``'s load is planned: its pull takes the offers; stop keeping them."""
        with self._changed:
            self._wanted.pop(req_id, None)

    def drop(self, req_id: str, reason: str) -> None:
        """``req_id`` will never pull its offers (it ended, or loads nothing): drop them now.
        Nothing happens for a request not wanted (never, or its load was planned)."""
        with self._changed:
            wanted = self._wanted.pop(req_id, None)
            if wanted is not None:
                self._to_drop.append((wanted[0], wanted[1], f"decode request {req_id}: {reason}"))
                self._changed.notify()

    def drop_now(self, peer: str, holds: Sequence[OfferHold], reason: str) -> None:
        """Drop ``holds`` at ``peer`` now (offers nobody here will pull)."""
        with self._changed:
            self._to_drop.append((peer, tuple(holds), reason))
            self._changed.notify()

    def wanted(self) -> int:
        """How many requests' offers are being kept."""
        with self._changed:
            return len(self._wanted)

    def close(self) -> None:
        """Stop the thread (after its call in flight, at most ``CLOSE_S``)."""
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join(CLOSE_S)

    def _run(self) -> None:
        next_keep = time.monotonic() + self._every_s
        while True:
            with self._changed:
                while not self._closed and not self._to_drop and time.monotonic() < next_keep:
                    self._changed.wait(max(0.0, next_keep - time.monotonic()))
                if self._closed:
                    return
                drops, self._to_drop = self._to_drop, []
                keep_now = time.monotonic() >= next_keep
                by_peer: dict[str, list[OfferHold]] = defaultdict(list)
                if keep_now:
                    for peer, holds in self._wanted.values():
                        by_peer[peer].extend(holds)
            for peer, holds, reason in drops:
                self._drop(peer, holds, reason)
            if keep_now:
                next_keep = time.monotonic() + self._every_s
                for peer, holds_of_peer in by_peer.items():
                    for first in range(0, len(holds_of_peer), MAX_OFFER_HOLDS):
                        self._keep(peer, holds_of_peer[first:first + MAX_OFFER_HOLDS])

    def _keep(self, peer: str, holds: list[OfferHold]) -> None:
        try:
            remaining = self._client.keep_offers(peer, holds, self._keep_s)
        except KvxferError as exc:
            log.warning("could not keep %d offers of %s alive (%s: %s); they end at their "
                        "deadline unless pulled by then", len(holds), peer, type(exc).__name__, exc)
            return
        self.kept_offers += sum(1 for seconds in remaining if seconds > 0)
        for hold, seconds in zip(holds, remaining, strict=False):
            if seconds <= 0:
                log.info("offer %s of %s was not kept: it was pulled or has ended",
                         hold.transfer_id, peer)

    def _drop(self, peer: str, holds: tuple[OfferHold, ...], reason: str) -> None:
        try:
            for first in range(0, len(holds), MAX_OFFER_HOLDS):
                self.dropped_offers += self._client.drop_offers(
                    peer, holds[first:first + MAX_OFFER_HOLDS], reason)
        except KvxferError as exc:
            log.warning("could not drop %d offers of %s (%s: %s); they end at their deadline",
                        len(holds), peer, type(exc).__name__, exc)
