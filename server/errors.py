"""The one boundary where kvxfer errors become gRPC status codes."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from prometheus_client import Counter

from kvxfer.errors import KvxferError, status_name

log = logging.getLogger("kvxfer.server")

RPCS = Counter("kvxfer_rpcs", "gRPC calls handled, by method and status code", ["method", "code"])

Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


def grpc_code(exc: BaseException) -> grpc.StatusCode:
    """The status code ``exc`` crosses the wire as."""
    return grpc.StatusCode[status_name(exc)]


def rpc(handler: Handler) -> Handler:
    """Wrap a servicer method: typed errors abort with their code; the daemon keeps serving."""

    method = handler.__name__

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            reply = await handler(self, request, context)
        except KvxferError as exc:
            RPCS.labels(method, status_name(exc)).inc()
            await context.abort(grpc_code(exc), str(exc))
        except (ValueError, TypeError, OverflowError) as exc:
            RPCS.labels(method, "INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {exc}")
        RPCS.labels(method, "OK").inc()
        return reply

    return wrapper  # type: ignore[return-value]
