"""Errors on the wire: ``kvxfer.errors`` types as ``google.rpc.Status`` and back, losslessly.

A status carries the error type's gRPC code, its message, and one
``google.rpc.ErrorInfo`` (domain ``kvxfer``) whose reason names the type
(``KvxferError.reason``). Failed RPCs carry it in their trailing metadata
(grpcio-status' rich status); a ``TransferStatus`` carries it as its ``error``
field. Decoding looks the reason up, so every type comes back as itself. A
status without kvxfer's ErrorInfo (gRPC's own failures: an unreachable address,
a client-side deadline) maps by code to the nearest kvxfer type.
"""

from __future__ import annotations

from typing import Protocol

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvxfer.errors import (
    ERROR_TYPES,
    InternalError,
    KvxferError,
    LimitExceededError,
    PeerUnavailableError,
    TransferAbortedError,
    TransferDeadlineError,
)

DOMAIN = "kvxfer"

#: What a status without kvxfer's ErrorInfo means, by code; any other code is InternalError.
_BY_CODE: dict[grpc.StatusCode, type[KvxferError]] = {
    grpc.StatusCode.UNAVAILABLE: PeerUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: TransferDeadlineError,
    grpc.StatusCode.CANCELLED: TransferAbortedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LimitExceededError,  # gRPC's own message-size limit
}
_CODES_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


class RpcFailure(Protocol):
    """What a failed call gives: ``grpc.RpcError`` (sync) and ``grpc.aio.AioRpcError`` both do."""

    def code(self) -> grpc.StatusCode: ...

    def details(self) -> str | None: ...

    def trailing_metadata(self) -> object: ...


def grpc_code(error: KvxferError) -> grpc.StatusCode:
    """The status code ``error`` crosses the wire as."""
    return grpc.StatusCode[error.code]


def to_status(error: KvxferError) -> status_pb2.Status:
    """``error`` as a rich status: code, message, and an ErrorInfo naming its type."""
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN))
    return status_pb2.Status(code=grpc_code(error).value[0], message=str(error), details=[info])


def from_status(status: status_pb2.Status) -> KvxferError:
    """The kvxfer error a rich status stands for (the same type that was encoded)."""
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info) and info.domain == DOMAIN and info.reason in ERROR_TYPES:
            return ERROR_TYPES[info.reason](status.message)
    code = _CODES_BY_NUMBER.get(status.code, grpc.StatusCode.UNKNOWN)
    return _by_code(code, status.message)


def to_rpc_status(error: KvxferError) -> grpc.Status:
    """``error`` as what a servicer aborts with (code, details and trailing metadata)."""
    return rpc_status.to_status(to_status(error))


def from_rpc_error(failure: RpcFailure, prefix: str = "") -> KvxferError:
    """The kvxfer error a failed call carried; ``prefix`` (e.g. "peer X: ") starts its message."""
    try:
        status = rpc_status.from_call(failure)  # type: ignore[arg-type]
    except ValueError:  # code or message disagree with the rich status: trust neither
        status = None
    if status is not None:
        error = from_status(status)
    else:
        error = _by_code(failure.code(), failure.details() or failure.code().name)
    return type(error)(f"{prefix}{error}") if prefix else error


def _by_code(code: grpc.StatusCode, message: str) -> KvxferError:
    error_type = _BY_CODE.get(code, InternalError)
    if error_type is InternalError:
        message = f"{code.name}: {message}"
    return error_type(message)
