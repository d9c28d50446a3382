"""Typed errors of kvxfer.

Every failure kvxfer can explain is one of these. Each type names the gRPC
status code it crosses the wire as (``code``) and a stable ``reason``, the
``google.rpc.ErrorInfo`` reason that identifies the type on the wire, so an
error raised in a daemon comes back to a client (or another daemon) as the same
type with the same message (``kvxfer.wire.status``). This module imports no
gRPC: codes are named by their ``grpc.StatusCode`` names.
"""

from __future__ import annotations

from typing import ClassVar


class KvxferError(Exception):
    """Base class of every error kvxfer raises on purpose."""

    code: ClassVar[str] = "UNKNOWN"
    reason: ClassVar[str] = "KVXFER_ERROR"


class InternalError(KvxferError):
    """A bug or an unexpected failure inside kvxfer (never the caller's fault)."""

    code = "INTERNAL"
    reason = "INTERNAL"


class InvalidSpecError(KvxferError, ValueError):
    """A pool spec, layout, descriptor or setting is malformed (bad size, dtype, alignment)."""

    code = "INVALID_ARGUMENT"
    reason = "INVALID_SPEC"


class InvalidRangeError(KvxferError, ValueError):
    """Page ranges or transfer arguments are malformed: empty, negative, overlapping, unequal."""

    code = "INVALID_ARGUMENT"
    reason = "INVALID_RANGE"


class PageOutOfRangeError(InvalidRangeError):
    """A page range reaches outside the pool it names."""

    code = "OUT_OF_RANGE"
    reason = "PAGE_OUT_OF_RANGE"


class IncompatibleLayoutError(KvxferError):
    """Two pools or daemons cannot exchange pages: their layouts differ (the message names how)."""

    code = "FAILED_PRECONDITION"
    reason = "INCOMPATIBLE_LAYOUT"


class AttachError(KvxferError):
    """A worker could not map the daemon's pool memory."""

    code = "FAILED_PRECONDITION"
    reason = "ATTACH_FAILED"


class PoolNotFoundError(KvxferError, LookupError):
    """No pool of that name is served here."""

    code = "NOT_FOUND"
    reason = "POOL_NOT_FOUND"


class TransferNotFoundError(KvxferError, LookupError):
    """No transfer of that id is known here."""

    code = "NOT_FOUND"
    reason = "TRANSFER_NOT_FOUND"


class TransferExistsError(KvxferError):
    """A transfer of that id is already registered on this side."""

    code = "ALREADY_EXISTS"
    reason = "TRANSFER_EXISTS"


class PeerUnavailableError(KvxferError):
    """The peer daemon cannot be reached, or it disappeared mid-transfer."""

    code = "UNAVAILABLE"
    reason = "PEER_UNAVAILABLE"


class TransferDeadlineError(KvxferError, TimeoutError):
    """The transfer did not complete before its deadline."""

    code = "DEADLINE_EXCEEDED"
    reason = "TRANSFER_DEADLINE_EXCEEDED"


class TransferAbortedError(KvxferError):
    """The transfer was aborted by one of its sides."""

    code = "ABORTED"
    reason = "TRANSFER_ABORTED"


class IntegrityError(KvxferError):
    """Bytes arrived but their checksum does not match what the sender computed."""

    code = "DATA_LOSS"
    reason = "INTEGRITY_CHECK_FAILED"


#: Every concrete error type, by its wire reason (the wire codec's lookup table).
ERROR_TYPES: dict[str, type[KvxferError]] = {
    cls.reason: cls
    for cls in (
        InternalError, InvalidSpecError, InvalidRangeError, PageOutOfRangeError,
        IncompatibleLayoutError, AttachError, PoolNotFoundError, TransferNotFoundError,
        TransferExistsError, PeerUnavailableError, TransferDeadlineError, TransferAbortedError,
        IntegrityError,
    )
}
