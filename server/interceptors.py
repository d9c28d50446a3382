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
    """An interceptor that runs ``around`` every unary and server-streaming call."""

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> Handler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        # The stubs type the behaviours as synchronous; on an aio server they are coroutines.
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, cast(Unary, handler.unary_unary)),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._streaming(method, cast(Streaming, handler.unary_stream)),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler

    def _unary(self, method: str, behaviour: Unary) -> Unary:
        raise NotImplementedError

    def _streaming(self, method: str, behaviour: Streaming) -> Streaming:
        raise NotImplementedError


class ErrorMapping(_Wrapping):
    """Typed errors abort with their rich status; anything else is INTERNAL and logged."""

    def _unary(self, method: str, behaviour: Unary) -> Unary:
        async def call(request: Any, context: Context) -> Any:
            try:
                return await behaviour(request, context)
            except KvxferError as exc:
                await _abort(context, exc)
            except Exception as exc:  # noqa: BLE001 - a bug; the daemon keeps serving
                await _abort(context, _internal(method, exc))
        return call

    def _streaming(self, method: str, behaviour: Streaming) -> Streaming:
        async def call(request: Any, context: Context) -> AsyncIterator[Any]:
            try:
                async for item in behaviour(request, context):
                    yield item
            except KvxferError as exc:
                await _abort(context, exc)
            except Exception as exc:  # noqa: BLE001 - a bug; the daemon keeps serving
                await _abort(context, _internal(method, exc))
        return call


class RpcMetrics(_Wrapping):
    """Counts every call in ``kvxfer_rpcs`` by method and final status code."""

    def __init__(self, metrics: DaemonMetrics) -> None:
        self._rpcs = metrics.rpcs

    def _unary(self, method: str, behaviour: Unary) -> Unary:
        async def call(request: Any, context: Context) -> Any:
            try:
                reply = await behaviour(request, context)
            except BaseException:
                self._count(method, context, failed=True)
                raise
            self._count(method, context, failed=False)
            return reply
        return call

    def _streaming(self, method: str, behaviour: Streaming) -> Streaming:
        async def call(request: Any, context: Context) -> AsyncIterator[Any]:
            try:
                async for item in behaviour(request, context):
                    yield item
            except BaseException:
                self._count(method, context, failed=True)
                raise
            self._count(method, context, failed=False)
        return call

    def _count(self, method: str, context: Context, *, failed: bool) -> None:
        code = context.code()
        if code is None or (failed and code == grpc.StatusCode.OK):
            # Cancelled by the client (or the server stopping) rather than aborted.
            code = grpc.StatusCode.CANCELLED if failed else grpc.StatusCode.OK
        name = code.name if isinstance(code, grpc.StatusCode) else str(code)
        self._rpcs.labels(method, name).inc()


def _internal(method: str, exc: Exception) -> InternalError:
    log.error("%s failed unexpectedly", method, exc_info=exc)
    return InternalError(f"internal error in {method}: {type(exc).__name__}: {exc}")


async def _abort(context: Context, error: KvxferError) -> None:
    status = to_rpc_status(error)
    await context.abort(status.code, status.details, trailing_metadata=status.trailing_metadata)

