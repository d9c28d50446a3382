"""Typed errors of the kvxfer library.

Every failure the library can explain is one of these. The daemon maps them to
gRPC status codes at exactly one boundary (``kvxfer.server.errors``); the
library itself never imports gRPC.
"""

from __future__ import annotations


class KvxferError(Exception):
    """Base class of every error kvxfer raises on purpose."""


class InvalidSpecError(KvxferError, ValueError):
    """A pool spec, layout or descriptor is malformed (bad size, dtype, alignment)."""


class InvalidRangeError(KvxferError, ValueError):
    """Page ranges are malformed: empty, negative, overlapping or of unequal length."""


class PageOutOfRangeError(InvalidRangeError):
    """A page range reaches outside the pool it names."""


class IncompatibleLayoutError(KvxferError):
    """Two pools cannot exchange pages: their layouts differ (the message names how)."""


class PoolNotFoundError(KvxferError, LookupError):
    """No pool of that name is served here."""


class TransferNotFoundError(KvxferError, LookupError):
    """No transfer of that id is known here."""


class TransferExistsError(KvxferError):
    """A transfer of that id is already registered on this side."""


class PeerUnavailableError(KvxferError):
    """The peer daemon cannot be reached, or it disappeared mid-transfer."""


class TransferDeadlineError(KvxferError, TimeoutError):
    """The transfer did not complete before its deadline."""


class TransferAbortedError(KvxferError):
    """The transfer was aborted by one of its sides."""


class IntegrityError(KvxferError):
    """Bytes arrived but their checksum does not match what the sender computed."""


class AttachError(KvxferError):
    """A worker could not map the daemon's pool memory."""


#: The gRPC status code (by name) each error crosses the wire as. The daemon's
#: boundary turns the name into ``grpc.StatusCode``; clients turn it back.
STATUS_NAMES: dict[type[KvxferError], str] = {
    InvalidSpecError: "INVALID_ARGUMENT",
    PageOutOfRangeError: "OUT_OF_RANGE",
    InvalidRangeError: "INVALID_ARGUMENT",
    IncompatibleLayoutError: "FAILED_PRECONDITION",
    PoolNotFoundError: "NOT_FOUND",
    TransferNotFoundError: "NOT_FOUND",
    TransferExistsError: "ALREADY_EXISTS",
    PeerUnavailableError: "UNAVAILABLE",
    TransferDeadlineError: "DEADLINE_EXCEEDED",
    TransferAbortedError: "ABORTED",
    IntegrityError: "DATA_LOSS",
    AttachError: "FAILED_PRECONDITION",
}

_BY_NAME: dict[str, type[KvxferError]] = {
    "INVALID_ARGUMENT": InvalidRangeError,
    "OUT_OF_RANGE": PageOutOfRangeError,
    "FAILED_PRECONDITION": IncompatibleLayoutError,
    "NOT_FOUND": PoolNotFoundError,
    "ALREADY_EXISTS": TransferExistsError,
    "UNAVAILABLE": PeerUnavailableError,
    "DEADLINE_EXCEEDED": TransferDeadlineError,
    "ABORTED": TransferAbortedError,
    "CANCELLED": TransferAbortedError,
    "DATA_LOSS": IntegrityError,
}


def status_name(exc: BaseException) -> str:
    """The gRPC status code name for ``exc`` (INTERNAL for anything unexpected)."""
    for cls in type(exc).__mro__:
        if cls in STATUS_NAMES:
            return STATUS_NAMES[cls]
    return "INTERNAL"


def error_for_status(name: str, message: str) -> KvxferError:
    """The kvxfer error a gRPC status code name stands for (for errors that crossed the wire)."""
    return _BY_NAME.get(name, KvxferError)(message)
