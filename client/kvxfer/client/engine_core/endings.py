"""Ending leases and transfers from an engine's worker: calls that never raise into the engine.

A release or an abort that fails is not the engine's problem: the daemon frees a lease
when it expires and ends a transfer at its deadline. Releases run in a thread of their
own: a release's round trip would hold up the step that lands a load.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from kvxfer.client.library import KvxferClient
from kvxfer.errors import LeaseNotFoundError

log = logging.getLogger("kvxfer.engine_core")

#: How long ``close`` waits for the releases asked for (the rest expire with their leases).
CLOSE_WAIT_S = 5.0


class Endings:
    """Releases leases (off the caller's thread) and aborts transfers of ``client``'s daemon."""

    def __init__(self, client: KvxferClient) -> None:
        self._client = client
        self._releaser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvxfer-release")

    def release(self, lease_id: str) -> None:
        """Release a lease soon, in the releasing thread (here once ``close`` was called)."""
        try:
            self._releaser.submit(self._release_now, lease_id)
        except RuntimeError:  # closed already
            self._release_now(lease_id)

    def abort_soon(self, transfer_id: str, why: str) -> None:
        """Abort a transfer soon, in the releasing thread (here once ``close`` was called)."""
        try:
            self._releaser.submit(self.abort, transfer_id, why)
        except RuntimeError:  # closed already
            self.abort(transfer_id, why)

    def abort(self, transfer_id: str, why: str) -> None:
        """Abort a transfer now."""
        try:
            self._client.abort(transfer_id, why)
        except Exception as exc:  # noqa: BLE001 - never into the engine's worker loop
            log.info("could not abort %s: %s", transfer_id, exc)

    def close(self) -> None:
        """Wait up to ``CLOSE_WAIT_S`` for the releases asked for so far; drop the rest."""
        try:
            self._releaser.submit(lambda: None).result(CLOSE_WAIT_S)
        except FutureTimeout:
            log.warning("kvxfer: leases not released within %.0f s of shutdown expire instead",
                        CLOSE_WAIT_S)
        except RuntimeError:
            pass  # closed already
        self._releaser.shutdown(wait=False, cancel_futures=True)

    def _release_now(self, lease_id: str) -> None:
        try:
            self._client.release(lease_id)
        except LeaseNotFoundError:
            pass  # it ended with its transfer, or expired
        except Exception as exc:  # noqa: BLE001 - never into the engine's worker loop
            log.warning("could not release lease %s: %s", lease_id, exc)
