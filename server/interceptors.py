"""What every RPC of both services goes through: error mapping and per-RPC metrics.

``ErrorMapping`` is the one boundary where errors become gRPC status: a
``kvxfer.errors`` type aborts the call with its rich status (code, message and
an ErrorInfo naming the type, so the caller gets the same type back); anything
else is a bug and aborts with INTERNAL, logged with its traceback. The daemon
keeps serving either way. ``RpcMetrics`` counts every call by method and the
status code it ended with. Both wrap unary and server-streaming handlers (the
Watch stream too); the standard services' bidirectional streams pass through.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeAlias, cast

import grpc

from kvxfer.errors import InternalError, KvxferError
from kvxfer.server.metrics import DaemonMetrics
from kvxfer.wire.status import to_rpc_status

log = logging.getLogger("kvxfer.server")

Context = grpc.aio.ServicerContext[Any, Any]
Unary = Callable[[Any, Context], Awaitable[Any]]
Streaming = Callable[[Any, Context], AsyncIterator[Any]]
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # generic in the stubs only
Continuation: TypeAlias = "Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]]"


class _Wrapping(grpc.aio.ServerInterceptor):
    """An interceptor that runs every unary and server-streaming call inside ``_around``."""

    def _around(self, method: str, context: Context) -> AbstractAsyncContextManager[None]:
        raise NotImplementedError

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> Handler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        # The stubs type the behaviours as synchronous; on an aio server they are coroutines.
        if handler.unary_unary is not None:
            unary = cast(Unary, handler.unary_unary)

            async def call(request: Any, context: Context) -> Any:
                reply = None
                async with self._around(method, context):
                    reply = await unary(request, context)
                return reply

            return grpc.unary_unary_rpc_method_handler(
                call, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            streaming = cast(Streaming, handler.unary_stream)

            async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
                async with self._around(method, context):
                    async for item in streaming(request, context):
                        yield item

            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler


class ErrorMapping(_Wrapping):
    """Typed errors abort with their rich status; anything else is INTERNAL and logged."""

    @asynccontextmanager
    async def _around(self, method: str, context: Context) -> AsyncIterator[None]:
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - mapped; the daemon keeps serving
            await _abort(context, method, exc)


class RpcMetrics(_Wrapping):
    """Counts every call in ``kvxfer_rpcs`` by method and final status code."""

    def __init__(self, metrics: DaemonMetrics) -> None:
        self._rpcs = metrics.rpcs

    @asynccontextmanager
    async def _around(self, method: str, context: Context) -> AsyncIterator[None]:
        try:
            yield
        except BaseException:
            self._count(method, context, failed=True)
            raise
        self._count(method, context, failed=False)

    def _count(self, method: str, context: Context, *, failed: bool) -> None:
        code = context.code()
        if code is None or (failed and code == grpc.StatusCode.OK):
            # Cancelled by the client (or the server stopping) rather than aborted.
            code = grpc.StatusCode.CANCELLED if failed else grpc.StatusCode.OK
        name = code.name if isinstance(code, grpc.StatusCode) else str(code)
        self._rpcs.labels(method, name).inc()


async def _abort(context: Context, method: str, exc: Exception) -> None:
    """End the call with ``exc``'s rich status; an exception that is no kvxfer error is a
    bug: INTERNAL, logged with its traceback."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc  # the handler aborted the call itself: its status stands
    if isinstance(exc, KvxferError):
        error = exc
    else:
        log.error("%s failed unexpectedly", method, exc_info=exc)
        error = InternalError(f"internal error in {method}: {type(exc).__name__}: {exc}")
    status = to_rpc_status(error)
    await context.abort(status.code, status.details, trailing_metadata=status.trailing_metadata)

