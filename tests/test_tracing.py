"""One transfer, one trace across both daemons: W3C trace context from the worker's call to
the peer daemon, spans exported with the SDK's in-memory exporter.

The daemons run in this process (real gRPC servers and sessions, the in-memory data
plane), so that one exporter sees the spans of both; ``kvxfer.daemon`` tells them apart.
The last test runs real daemons that export by OTLP to a collector the test serves (the
same trace id also shows in both daemons' JSON logs: ``test_observability.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from fake_transport import FakeNetwork
from inprocess import DaemonThread
from opentelemetry import context, trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from kvxfer.client import KvxferClient
from kvxfer.client.spawn import LocalDaemon
from kvxfer.pages import PageRuns
from kvxfer.status import TransferState

POOL = "name=kv,preset=tiny"
RUNS = PageRuns.of([(0, 3), (10, 2)])
DST = PageRuns.of([(20, 5)])


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """This process's tracer provider, recording into memory (a provider is set once per
    process: the daemons' tracer follows it)."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    trace.set_tracer_provider(provider)
    yield memory
    memory.clear()


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory, exporter: InMemorySpanExporter):
    network = FakeNetwork()
    root = tmp_path_factory.mktemp("tracing")
    with DaemonThread(root, "prefill", network) as pre, DaemonThread(root, "decode", network) as dec, \
            KvxferClient(pre.bound.worker_address) as p, KvxferClient(dec.bound.worker_address) as d:
        yield pre, dec, p, d


def _trace(exporter: InMemorySpanExporter, trace_id: int) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]


def _one(spans: list[ReadableSpan], name: str, daemon: str) -> ReadableSpan:
    found = [s for s in spans if s.name == name and s.attributes.get("kvxfer.daemon") == daemon]
    assert len(found) == 1, f"{name} on {daemon}: {[(s.name, s.attributes) for s in spans]}"
    return found[0]


def _parent(span: ReadableSpan) -> int:
    assert span.parent is not None, f"{span.name} has no parent"
    return span.parent.span_id


def test_one_push_is_one_trace_across_both_daemons(daemons, exporter) -> None:
    pre, dec, p, d = daemons
    engine = trace.get_tracer("an engine")
    expected = d.expect("traced-push", "kv", DST, timeout_s=10)  # the decode engine's call, untraced
    with engine.start_as_current_span("prefill request") as request:
        p.push("traced-push", "kv", RUNS, peer=dec.peer_address, timeout_s=10, verify=True,
               capability=expected.capability)
    assert p.wait("traced-push").state == TransferState.DONE
    assert d.wait("traced-push").state == TransferState.DONE

    spans = _trace(exporter, request.get_span_context().trace_id)
    prefill, decode = pre.peer_address, dec.peer_address
    sender = _one(spans, "kvxfer.transfer", prefill)
    assert _parent(sender) == request.get_span_context().span_id
    assert sender.attributes["kvxfer.role"] == "sender"
    assert sender.attributes["kvxfer.state"] == "DONE"
    assert sender.attributes["kvxfer.bytes"] == 5 * pre.page_bytes
    for phase in ("kvxfer.session", "kvxfer.claim", "kvxfer.data", "kvxfer.commit"):
        span = _one(spans, phase, prefill)
        assert _parent(span) == sender.context.span_id, phase
        assert sender.start_time <= span.start_time <= span.end_time <= sender.end_time, phase

    # The decode daemon continues the trace from the Claim call, and its data phase is its own.
    receiver = _one(spans, "kvxfer.transfer", decode)
    assert _parent(receiver) == _one(spans, "kvxfer.claim", prefill).context.span_id
    assert receiver.attributes["kvxfer.role"] == "receiver"
    data = _one(spans, "kvxfer.data", decode)
    assert _parent(data) == receiver.context.span_id
    assert _parent(_one(spans, "kvxfer.commit", decode)) == (
        _one(spans, "kvxfer.commit", prefill).context.span_id)
    # ... linked to the span of the decode engine's expect, which began its own trace.
    expect = [s for s in exporter.get_finished_spans() if s.name == "kvxfer.transfer"
              and s.attributes.get("kvxfer.transfer_id") == "traced-push" and s.parent is None]
    assert len(expect) == 1 and expect[0].attributes["kvxfer.daemon"] == decode
    assert [link.context.span_id for link in receiver.links] == [expect[0].context.span_id]


def test_a_pull_joins_the_decode_engines_trace_on_the_prefill_daemon(daemons, exporter) -> None:
    pre, dec, p, d = daemons
    engine = trace.get_tracer("an engine")
    offered = p.offer("traced-pull", "kv", RUNS, timeout_s=10, verify=False)
    with engine.start_as_current_span("decode request") as request:
        d.pull("traced-pull", pre.peer_address, "kv", DST, timeout_s=10,
               capability=offered.capability)
    assert d.wait("traced-pull").state == TransferState.DONE
    assert p.wait("traced-pull").state == TransferState.DONE

    spans = _trace(exporter, request.get_span_context().trace_id)
    receiver = _one(spans, "kvxfer.transfer", dec.peer_address)
    asked = _one(spans, "kvxfer.request_push", dec.peer_address)
    sender = _one(spans, "kvxfer.transfer", pre.peer_address)
    assert _parent(asked) == receiver.context.span_id
    assert _parent(sender) == asked.context.span_id
    assert _parent(_one(spans, "kvxfer.data", pre.peer_address)) == sender.context.span_id
    assert _parent(_one(spans, "kvxfer.data", dec.peer_address)) == receiver.context.span_id


def test_a_failed_transfer_ends_its_spans_with_the_error(daemons, exporter) -> None:
    pre, dec, p, d = daemons
    engine = trace.get_tracer("an engine")
    with engine.start_as_current_span("doomed request") as request:
        d.expect("traced-abort", "kv", DST, timeout_s=10)
        d.abort("traced-abort", "the engine dropped the request")
    assert d.wait("traced-abort").state == TransferState.ABORTED
    span = _one(_trace(exporter, request.get_span_context().trace_id), "kvxfer.transfer",
                dec.peer_address)
    assert span.attributes["kvxfer.state"] == "ABORTED"
    assert span.status.status_code == trace.StatusCode.ERROR
    assert "the engine dropped the request" in (span.status.description or "")


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps what it is sent."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []  # (the exporting service's name, span)
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the gRPC method
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next((a.value.string_value for a in resource_spans.resource.attributes
                                if a.key == "service.name"), "")
                for scope in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def _attributes(span: Any) -> dict[str, Any]:
    return {a.key: a.value.string_value or a.value.int_value for a in span.attributes}


@pytest.mark.slow
def test_real_daemons_export_one_trace_to_an_otlp_collector(tmp_path) -> None:
    """Two ``kvxfer serve`` processes with ``--otlp-endpoint``: a push inside the engine's
    trace reaches the collector as spans of both daemons in that trace, data phases included."""
    collector = _Collector()
    server = grpc.server(ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    trace_id = 0x0AF7651916CD43DD8448EB211C80319C
    try:
        args = ["--otlp-endpoint", f"http://127.0.0.1:{port}"]
        with LocalDaemon("prefill", [POOL], workdir=str(tmp_path / "p"), extra_args=args) as pre, \
                LocalDaemon("decode", [POOL], workdir=str(tmp_path / "d"), extra_args=args) as dec:
            with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d:
                expected = d.expect("exported", "kv", DST, timeout_s=20)
                engine = SpanContext(trace_id, 0x00F067AA0BA902B7, is_remote=True,
                                     trace_flags=TraceFlags(TraceFlags.SAMPLED))
                token = context.attach(trace.set_span_in_context(NonRecordingSpan(engine)))
                try:
                    p.push("exported", "kv", RUNS, peer=dec.peer_address, timeout_s=20, verify=True,
                           capability=expected.capability)
                finally:
                    context.detach(token)
                assert p.wait("exported").ok and d.wait("exported").ok
            daemons = {pre.peer_address: "prefill", dec.peer_address: "decode"}
        # Both daemons flushed their spans when they stopped.
        with collector.lock:
            spans = [(service, s) for service, s in collector.spans
                     if int.from_bytes(s.trace_id, "big") == trace_id]
        assert {service for service, _ in spans} == {"kvxfer"}
        seen = {(s.name, daemons.get(str(_attributes(s).get("kvxfer.daemon")))) for _, s in spans}
        assert {("kvxfer.transfer", "prefill"), ("kvxfer.data", "prefill"),
                ("kvxfer.claim", "prefill"), ("kvxfer.commit", "prefill"),
                ("kvxfer.transfer", "decode"), ("kvxfer.data", "decode"),
                ("kvxfer.commit", "decode")} <= seen, seen
    finally:
        server.stop(None)
