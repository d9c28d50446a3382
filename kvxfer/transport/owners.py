"""Receive owners: how a transfer's receives are cancelled with ucxx's own API.

UCX tag receives are posted on the worker, and ucxx's Python API cannot cancel
one. But ucxx tracks the requests posted through an endpoint and cancels the
unfinished ones when that endpoint closes. So each receive batch is posted
through an *owner*: an endpoint to this worker's own address, lent to that one
batch. Closing the owner cancels exactly the batch's unmatched receives (a
message UCX already matched still completes). Owners of batches that completed
hold no requests and are lent again: creating one took 0.07-0.3 ms here.
Called from the engine's progress thread only.
"""

from __future__ import annotations

from typing import Any

#: Idle owners kept for reuse.
POOL_SIZE = 64


class ReceiveOwners:
    """Lends owner endpoints to receive batches, and cancels through them."""

    def __init__(self, api: Any, worker: Any, error_handling: bool) -> None:
        self._api = api
        self._worker = worker
        self._address = worker.address
        self._error_handling = error_handling
        self._idle: list[Any] = []

    def lend(self) -> Any:
        """An owner with no request of its own (raises if UCX cannot make one)."""
        if self._idle:
            return self._idle.pop()
        return self._api.UCXEndpoint.create_from_worker_address(
            self._worker, self._address, self._error_handling)

    def give_back(self, owner: Any) -> None:
        """The batch completed: every request of ``owner`` is done; lend it again."""
        if len(self._idle) < POOL_SIZE:
            self._idle.append(owner)
        else:
            owner.close_blocking(0, 10)

    @staticmethod
    def cancel(owner: Any) -> None:
        """The batch failed: cancel ``owner``'s unfinished receives and close it."""
        owner.close_blocking(0, 10)

    def close(self) -> None:
        """Close every idle owner."""
        for owner in self._idle:
            owner.close_blocking(0, 10)
        self._idle.clear()
