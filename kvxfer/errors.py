"""Typed errors of kvxfer.

Every failure kvxfer can explain is one of these. Each type names the gRPC
status code it crosses the wire as (``code``) and a stable ``reason``, the
``google.rpc.ErrorInfo`` reason that identifies the type on the wire, so an
error raised in a daemon comes back to a client (or another daemon) as the same
type with the same message (``kvxfer.wire.status``). This module imports no
gRPC: codes are named by their ``grpc.StatusCode`` names.
"""

from __future__ import annotations

from typing import Any, ClassVar


class KvxferError(Exception):
    """Base class of every error kvxfer raises on purpose."""

    code: ClassVar[str] = "UNKNOWN"
    reason: ClassVar[str] = "KVXFER_ERROR"

    def __init_subclass__(cls, *, code: str, reason: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.code, cls.reason = code, reason


class InternalError(KvxferError, code="INTERNAL", reason="INTERNAL"):
    """A bug or an unexpected failure inside kvxfer (never the caller's fault)."""


class InvalidSpecError(KvxferError, ValueError, code="INVALID_ARGUMENT", reason="INVALID_SPEC"):
    """A pool spec, layout, descriptor or setting is malformed (bad size, dtype, alignment)."""


class InvalidArgumentError(KvxferError, ValueError, code="INVALID_ARGUMENT", reason="INVALID_ARGUMENT"):
    """A request's argument is malformed: a page range (empty, negative, overlapping,
    unequal), an id, a deadline, a peer address or a capability left empty or too long."""


class PageOutOfRangeError(InvalidArgumentError, code="OUT_OF_RANGE", reason="PAGE_OUT_OF_RANGE"):
    """A page range reaches outside the pool it names."""


class IncompatibleLayoutError(KvxferError, code="FAILED_PRECONDITION", reason="INCOMPATIBLE_LAYOUT"):
    """Two pools (or a pool and an engine's KV cache) lay out their pages differently, so
    pages cannot move between them byte for byte (the message names the field)."""


class IncompatiblePeerError(KvxferError, code="FAILED_PRECONDITION", reason="INCOMPATIBLE_PEER"):
    """A peer daemon cannot carry this transfer in its session: it runs UCX with another
    error-handling mode, or names a pool its handshake did not describe."""


class AttachError(KvxferError, code="FAILED_PRECONDITION", reason="ATTACH_FAILED"):
    """A worker could not map the daemon's pool memory."""


class StaleArenaError(KvxferError, code="FAILED_PRECONDITION", reason="STALE_ARENA"):
    """The caller's mapping is of an earlier daemon's memory (the daemon restarted since it
    attached): re-attach, and redo what was written through the old mapping."""


class PromptMismatchError(KvxferError, code="FAILED_PRECONDITION", reason="PROMPT_MISMATCH"):
    """A pull presented a prompt digest other than the one its offer's KV was computed from."""


class ProtocolVersionError(KvxferError, code="FAILED_PRECONDITION", reason="PROTOCOL_VERSION"):
    """A peer speaks another version of the peer protocol (the message names both)."""


class PoolNotFoundError(KvxferError, LookupError, code="NOT_FOUND", reason="POOL_NOT_FOUND"):
    """No pool of that name is served here."""


class TransferNotFoundError(KvxferError, LookupError, code="NOT_FOUND", reason="TRANSFER_NOT_FOUND"):
    """No transfer of that id is known here."""


class TransferExistsError(KvxferError, code="ALREADY_EXISTS", reason="TRANSFER_EXISTS"):
    """A transfer of that id is already registered on this side."""


class PeerUnavailableError(KvxferError, code="UNAVAILABLE", reason="PEER_UNAVAILABLE"):
    """The peer daemon cannot be reached, or it disappeared mid-transfer."""


class TransferDeadlineError(KvxferError, TimeoutError, code="DEADLINE_EXCEEDED",
                            reason="TRANSFER_DEADLINE_EXCEEDED"):
    """The transfer did not complete before its deadline."""


class TransferAbortedError(KvxferError, code="ABORTED", reason="TRANSFER_ABORTED"):
    """The transfer was aborted by one of its sides."""


class IntegrityError(KvxferError, code="DATA_LOSS", reason="INTEGRITY_CHECK_FAILED"):
    """Bytes arrived but their checksum does not match what the sender computed."""


class PoolExhaustedError(KvxferError, code="RESOURCE_EXHAUSTED", reason="POOL_EXHAUSTED"):
    """A pool has fewer free pages than a lease asks for."""


class LeaseNotFoundError(KvxferError, LookupError, code="NOT_FOUND", reason="LEASE_NOT_FOUND"):
    """No lease of that id is held here (never granted, released, or expired)."""


class LeaseExpiredError(KvxferError, code="FAILED_PRECONDITION", reason="LEASE_EXPIRED"):
    """The lease whose pages a transfer uses ended before the transfer did."""


class PeerNotAllowedError(KvxferError, PermissionError, code="PERMISSION_DENIED",
                          reason="PEER_NOT_ALLOWED"):
    """The caller is authenticated, but may not do this: its certificate names no identity
    this daemon admits, or the transfer belongs to another session or peer."""


class DialNotAllowedError(PeerNotAllowedError, code="PERMISSION_DENIED", reason="DIAL_NOT_ALLOWED"):
    """This daemon may not dial that peer address: it is outside the operator's
    ``--dial-allow`` policy (nothing was sent to it)."""


class LimitExceededError(KvxferError, code="RESOURCE_EXHAUSTED", reason="LIMIT_EXCEEDED"):
    """A request would pass one of the daemon's bounds (sessions per peer,
    transfers in flight); the message names the limit."""


#: Every concrete error type, by its wire reason (the wire codec's lookup table).
ERROR_TYPES: dict[str, type[KvxferError]] = {
    cls.reason: cls
    for cls in (
        InternalError, InvalidSpecError, InvalidArgumentError, PageOutOfRangeError,
        IncompatibleLayoutError, IncompatiblePeerError, AttachError, StaleArenaError, PromptMismatchError,
        ProtocolVersionError, DialNotAllowedError, PoolNotFoundError, TransferNotFoundError,
        TransferExistsError, PeerUnavailableError, TransferDeadlineError, TransferAbortedError,
        IntegrityError, PoolExhaustedError, LeaseNotFoundError, LeaseExpiredError,
        PeerNotAllowedError, LimitExceededError,
    )
}
