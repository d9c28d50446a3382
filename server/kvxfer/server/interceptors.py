"""What every RPC of both services goes through: the caller's trace context, error
mapping, per-RPC metrics, and on the peer port, authorization.

``ErrorMapping`` is the one boundary where errors become gRPC status: a
``kvxfer.errors`` type aborts the call with its rich status (code, message and
an ErrorInfo naming the type, so the caller gets the same type back); anything
else is a bug and aborts with INTERNAL, logged with its traceback. The daemon
keeps serving either way. ``RpcMetrics`` counts every call by method and the
status code it ended with, and times it. These wrap every kind of method (streams
too, the standard health and reflection services' included). ``TraceContext``
makes the trace context a unary call carries current while its handler runs.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeAlias

import grpc
from opentelemetry import context as otel_context

from kvxfer.errors import InternalError, KvxferError, PeerNotAllowedError
from kvxfer.propagation import incoming_context
from kvxfer.server.metrics import DaemonMetrics
from kvxfer.server.tls import identities
from kvxfer.wire.status import to_rpc_status

log = logging.getLogger("kvxfer.server")

Context = grpc.aio.ServicerContext[Any, Any]
Unary = Callable[[Any, Context], Awaitable[Any]]
Streaming = Callable[[Any, Context], AsyncIterator[Any]]
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # generic in the stubs only
Continuation: TypeAlias = "Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]]"


#: gRPC's four kinds of method, and whether each answers with a stream.
_KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler, False),
    ("unary_stream", grpc.unary_stream_rpc_method_handler, True),
    ("stream_unary", grpc.stream_unary_rpc_method_handler, False),
    ("stream_stream", grpc.stream_stream_rpc_method_handler, True),
)


class _Wrapping(grpc.aio.ServerInterceptor):
    """An interceptor that runs every call, of every kind, inside ``_around``."""

    def _around(self, method: str, context: Context) -> AbstractAsyncContextManager[None]:
        raise NotImplementedError

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> Handler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        for kind, make, streams in _KINDS:
            behaviour = getattr(handler, kind)
            if behaviour is not None:
                wrapped = self._stream(method, behaviour) if streams else self._call(method, behaviour)
                return make(wrapped, request_deserializer=handler.request_deserializer,
                            response_serializer=handler.response_serializer)
        return handler

    def _call(self, method: str, behaviour: Unary) -> Unary:
        async def call(request: Any, context: Context) -> Any:
            reply = None
            async with self._around(method, context):
                reply = await behaviour(request, context)
            return reply
        return call

    def _stream(self, method: str, behaviour: Callable[[Any, Context], Any]) -> Streaming:
        async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
            async with self._around(method, context):
                answer = behaviour(request, context)
                if inspect.isasyncgen(answer):
                    async for item in answer:
                        yield item
                else:  # a coroutine that writes its answers through the context (health Watch)
                    await answer
        return stream


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
        self._seconds = metrics.rpc_seconds

    @asynccontextmanager
    async def _around(self, method: str, context: Context) -> AsyncIterator[None]:
        start = time.monotonic()
        try:
            yield
        except BaseException:
            self._count(method, context, failed=True)
            raise
        finally:
            self._seconds.labels(method).observe(time.monotonic() - start)
        self._count(method, context, failed=False)

    def _count(self, method: str, context: Context, *, failed: bool) -> None:
        code = context.code()
        if code is None or (failed and code == grpc.StatusCode.OK):
            # Cancelled by the client (or the server stopping) rather than aborted.
            code = grpc.StatusCode.CANCELLED if failed else grpc.StatusCode.OK
        name = code.name if isinstance(code, grpc.StatusCode) else str(code)
        self._rpcs.labels(method, name).inc()


class TraceContext(_Wrapping):
    """A unary call runs in the trace context its metadata carries (W3C ``traceparent``), so
    the spans it starts continue the caller's trace. Streams (heartbeats, health watches)
    are left as they are."""

    @asynccontextmanager
    async def _around(self, method: str, context: Context) -> AsyncIterator[None]:
        token = otel_context.attach(incoming_context(context.invocation_metadata()))
        try:
            yield
        finally:
            otel_context.detach(token)

    def _stream(self, method: str, behaviour: Callable[[Any, Context], Any]) -> Streaming:
        return behaviour


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



class PeerAuthorization(_Wrapping):
    """Every call, of every service on the peer port, from a peer whose certificate names
    no identity in ``allow`` ends with PERMISSION_DENIED before its handler runs."""

    def __init__(self, allow: frozenset[str]) -> None:
        self._allow = allow

    @asynccontextmanager
    async def _around(self, method: str, context: Context) -> AsyncIterator[None]:
        names = identities(context)
        if self._allow.isdisjoint(names):
            who = names[0] if names else "a peer without a certificate"
            log.warning("denied %s to %r: not in peer_allow", method, who)
            await _abort(context, method, PeerNotAllowedError(
                f"peer {who!r} may not call {method}: this daemon admits only the "
                "identities in its peer_allow"))
        yield
