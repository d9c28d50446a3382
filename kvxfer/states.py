"""Transfer roles and states, shared by the daemon, the client and the wire."""

from __future__ import annotations

import enum


class TransferRole(enum.Enum):
    """Which side of a transfer this daemon is."""

    SENDER = 1
    RECEIVER = 2


class TransferState(enum.Enum):
    """Where a transfer is; the last four are final."""

    WAITING = 1
    TRANSFERRING = 2
    DONE = 3
    FAILED = 4
    ABORTED = 5
    DEADLINE_EXCEEDED = 6

    @property
    def final(self) -> bool:
        """True once the transfer can no longer change."""
        return self not in (TransferState.WAITING, TransferState.TRANSFERRING)
