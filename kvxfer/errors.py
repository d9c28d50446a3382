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
