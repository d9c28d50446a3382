"""The one boundary where kvxfer errors become gRPC status codes."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvxfer.errors import KvxferError, status_name

log = logging.getLogger("kvxfer.server")

Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


def grpc_code(exc: BaseException) -> grpc.StatusCode:
    """The status code ``exc`` crosses the wire as."""
    return grpc.StatusCode[status_name(exc)]


def rpc(handler: Handler) -> Handler:
    """Wrap a servicer method: typed errors abort with their code; the daemon keeps serving."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except KvxferError as exc:
            await context.abort(grpc_code(exc), str(exc))
        except (ValueError, TypeError, OverflowError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {exc}")

    return wrapper  # type: ignore[return-value]
