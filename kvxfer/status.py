"""What a daemon reports: a transfer's role, state and status; a page lease; the
completions; its sessions with peers and their data plane.

The numbers of ``TransferRole``, ``TransferState`` and ``DataPlane`` are the proto enums'
(``kvxfer.v1.TransferRole`` / ``TransferState`` / ``DataPlane``): each member is defined as its
proto value, and a test checks that the two enums have the same members, so
nothing is copied by hand and a value read off the wire is a member here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvxfer.errors import KvxferError
from kvxfer.pages import PageRuns
from kvxfer.v1 import kvxfer_pb2 as pb


class TransferRole(enum.IntEnum):
    """Which side of a transfer a daemon is."""

    SENDER = pb.TRANSFER_ROLE_SENDER
    RECEIVER = pb.TRANSFER_ROLE_RECEIVER


class TransferState(enum.IntEnum):
    """Where a transfer is; the last four are final."""

    WAITING = pb.TRANSFER_STATE_WAITING
    TRANSFERRING = pb.TRANSFER_STATE_TRANSFERRING
    DONE = pb.TRANSFER_STATE_DONE
    FAILED = pb.TRANSFER_STATE_FAILED
    ABORTED = pb.TRANSFER_STATE_ABORTED
    DEADLINE_EXCEEDED = pb.TRANSFER_STATE_DEADLINE_EXCEEDED

    @property
    def final(self) -> bool:
        """True once the transfer can no longer change."""
        return self not in (TransferState.WAITING, TransferState.TRANSFERRING)


class DataPlane(enum.IntEnum):
    """How a session's transfers move their bytes, chosen when the session opens."""

    LOCAL_COPY = pb.DATA_PLANE_LOCAL_COPY
    UCX_TAGGED = pb.DATA_PLANE_UCX_TAGGED

    @property
    def label(self) -> str:
        """Its name as the CLI and the metrics write it (``local-copy``, ``ucx-tagged``)."""
        return self.name.lower().replace("_", "-")


@dataclass(frozen=True)
class PeerSessionInfo:
    """A session with a peer daemon: ``outbound`` when this daemon sends to it."""

    peer_address: str
    outbound: bool
    session_id: str
    data_plane: DataPlane
    lanes: int
    identity: str = ""


@dataclass(frozen=True)
class TransferInfo:
    """One side's view of a transfer, as its daemon reports it.

    ``failure`` is the error that ended it (the same ``kvxfer.errors`` type on
    every side of the wire), None while it runs and when it succeeded. ``capability``
    is set only in the answer to the offer that registered it: the secret its pull
    must present (it is left out of ``as_dict``).
    """

    transfer_id: str
    role: TransferRole
    state: TransferState
    pool: str
    peer: str
    pages: int
    bytes: int
    bytes_done: int
    extents: int
    seconds: float
    failure: KvxferError | None
    verified: bool
    created_unix: float
    data_seconds: float
    lanes: int
    timeout_s: float = 0.0
    capability: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        """True when the transfer finished and every byte arrived."""
        return self.state == TransferState.DONE

    @property
    def error_code(self) -> str:
        """The gRPC status code name of the failure ("" if none)."""
        return self.failure.code if self.failure is not None else ""

    @property
    def error(self) -> str:
        """The failure's message ("" if none)."""
        return str(self.failure) if self.failure is not None else ""

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (enums by name, the failure as code, type and message)."""
        out: dict[str, Any] = {k: v for k, v in self.__dict__.items()
                               if k not in ("failure", "capability")}
        out["role"], out["state"] = self.role.name, self.state.name
        out["error_code"], out["error"] = self.error_code, self.error
        out["error_type"] = type(self.failure).__name__ if self.failure is not None else ""
        return out


@dataclass(frozen=True)
class LeaseUse:
    """What a transfer verb says about its pages: the lease they belong to, if any (with
    ``release_lease``, it ends with the transfer), and the memory epoch of the mapping the
    caller used them through ("": not checked)."""

    lease_id: str = ""
    release_lease: bool = False
    arena_epoch: str = ""


#: The most offers one KeepOffers or DropOffers call may name.
MAX_OFFER_HOLDS = 1024


@dataclass(frozen=True)
class OfferHold:
    """An offer a decode engine still wants (to keep) or never will (to drop), named with the
    capability its params carried."""

    transfer_id: str
    capability: str = field(repr=False)


@dataclass(frozen=True)
class LeaseInfo:
    """Pages a daemon leased to a holder: which, and for how much longer."""

    lease_id: str
    pool: str
    runs: PageRuns
    expires_in_s: float
    holder: str
    arena_epoch: str = ""
    capability: str = field(default="", repr=False)


@dataclass(frozen=True)
class Completions:
    """The transfers that ended since a cursor, in order, and the cursor to ask from next.

    ``missed`` says some ended after the old cursor but the daemon no longer keeps them
    (or it restarted): the caller should ``wait`` for the transfers it still tracks.
    ``epoch`` is the daemon's memory epoch: when it changes, the daemon restarted and every
    transfer the caller tracks there is gone.
    """

    transfers: list[TransferInfo]
    cursor: int
    missed: bool
    epoch: str = ""
