"""OpenTelemetry spans of a transfer, on both daemons, in the trace of the call that started it.

Off by default: without ``otlp_endpoint`` the API's no-op tracer records nothing
(a process that installs its own tracer provider, as the tests do with the SDK's
in-memory exporter, gets real spans). Trace ids still flow: a worker's call that
carries ``traceparent`` gives its transfer that trace id, which the JSON logs show.

One push, traced (``kvxfer.daemon`` says where each span ran)::

    worker span (the engine's, if any)
      kvxfer.transfer   prefill: registration to end     (role sender)
        kvxfer.session    opening the session (when none is open)
        kvxfer.claim      the Claim call ->
          kvxfer.transfer   decode: claim to end          (role receiver, linked to
            kvxfer.data       decode: receives posted to   the decode worker's expect)
                              last byte
        kvxfer.data       prefill: first send to last send complete
        kvxfer.commit     the Commit call (verify) ->
          kvxfer.commit     decode: wait for the bytes, check them

A pull is the mirror image: the decode daemon's ``kvxfer.request_push`` call
carries the trace to the prefill daemon, whose sending transfer joins it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Link, Span, Status, StatusCode

from kvxfer.errors import KvxferError
from kvxfer.server.transfers.record import Transfer

TRACER = trace.get_tracer("kvxfer")


def export_to(endpoint: str, service_name: str) -> None:
    """Export this process's spans by OTLP/gRPC to ``endpoint`` (``http://HOST:PORT``, or
    ``https://`` for TLS)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)


class TransferTracing:
    """Starts and ends the spans of this daemon's transfers (``daemon`` names it in each)."""

    def __init__(self, daemon: str) -> None:
        self.daemon = daemon

    def _attributes(self, t: Transfer) -> dict[str, str | int]:
        return {"kvxfer.daemon": self.daemon, "kvxfer.transfer_id": t.id,
                "kvxfer.role": t.role.name.lower()}

    def begin(self, t: Transfer) -> None:
        """Open ``t``'s span in the current context (the registering call's trace)."""
        span = TRACER.start_span("kvxfer.transfer", attributes={
            **self._attributes(t), "kvxfer.pool": t.pool.name, "kvxfer.pages": t.runs.num_pages,
            "kvxfer.bytes": t.bytes_total})
        t.spans.append(span)
        t.trace = trace.set_span_in_context(span)

    def join(self, t: Transfer) -> None:
        """The peer's call (the current context) drives ``t`` from now: continue in its
        trace with a span of its own, linked to the one ``t`` was registered in (unless that
        is the same trace: a pull's claim comes back in the trace the pull began)."""
        caller = trace.get_current_span().get_span_context()
        if t.spans and caller.is_valid and caller.trace_id == t.spans[0].get_span_context().trace_id:
            return
        links = [Link(s.get_span_context()) for s in t.spans[:1] if s.get_span_context().is_valid]
        span = TRACER.start_span("kvxfer.transfer", links=links, attributes=self._attributes(t))
        t.spans.append(span)
        t.trace = trace.set_span_in_context(span)

    @contextmanager
    def phase(self, t: Transfer, name: str, *, in_call: bool = False) -> Iterator[Span]:
        """A span for one phase of ``t``, current while the block runs (so calls made in it
        carry it): a child of ``t``'s trace, or with ``in_call`` of the call being served."""
        parent = otel_context.get_current() if in_call else t.trace
        with TRACER.start_as_current_span(f"kvxfer.{name}", context=parent,
                                          attributes=self._attributes(t)) as span:
            yield span

    @staticmethod
    def end(t: Transfer, error: KvxferError | None) -> None:
        """End ``t``'s spans with its final state (and its error)."""
        for span in t.spans:
            span.set_attribute("kvxfer.state", t.state.name)
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            span.end()
