"""What an operator sees of real daemons: metrics, the dashboard's queries, JSON logs.

Two ``kvxfer serve`` processes on loopback move pages over UCX; one transfer is
pushed inside a trace (a ``traceparent`` the test makes up, as an engine's tracer
would send), one is aborted.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from pathlib import Path

import pytest
from opentelemetry import context, trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from prometheus_client.parser import text_string_to_metric_families

from kvxfer.client import KvxferClient
from kvxfer.client.spawn import LocalDaemon
from kvxfer.errors import TransferAbortedError
from kvxfer.pages import PageRuns
from kvxfer.status import TransferState

DASHBOARD = Path(__file__).parent.parent / "deploy" / "grafana" / "kvxfer.json"
TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
POOL = "name=kv,preset=tiny"


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """A prefill and a decode daemon (JSON logs, metrics) after a traced push and an abort."""
    root = tmp_path_factory.mktemp("observed")
    args = ["--log-format", "json"]
    with LocalDaemon("prefill", [POOL], workdir=str(root / "p"), metrics=True, log_level="info",
                     extra_args=args) as pre, \
            LocalDaemon("decode", [POOL], workdir=str(root / "d"), metrics=True,
                        log_level="info", extra_args=args) as dec, \
            KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d:
        expected = d.expect("observed", "kv", PageRuns.of([(8, 4)]), timeout_s=20)
        engine_span = SpanContext(TRACE_ID, 0x00F067AA0BA902B7, is_remote=True,
                                  trace_flags=TraceFlags(TraceFlags.SAMPLED))
        token = context.attach(trace.set_span_in_context(NonRecordingSpan(engine_span)))
        try:
            p.push("observed", "kv", PageRuns.of([(0, 4)]), peer=dec.peer_address, timeout_s=20,
                   verify=True, capability=expected.capability)
        finally:
            context.detach(token)
        assert p.wait("observed").state == d.wait("observed").state == TransferState.DONE
        d.expect("dropped", "kv", PageRuns.of([(20, 2)]), timeout_s=20)
        d.abort("dropped", "the engine dropped the request")
        assert isinstance(d.wait("dropped").failure, TransferAbortedError)
        yield pre, dec


def test_audit_lines_name_who_claimed_committed_and_aborted(observed) -> None:
    """On the decode daemon: the prefill daemon's claim and commit of the verified push, by
    its peer name (its host here: no mutual TLS), and the worker's abort of the dropped
    expect, by the name the library sends (its pid here) and its address; each with its
    outcome."""
    _, dec = observed
    lines = [str(r["message"]) for r in _json_lines(dec) if r["logger"] == "kvxfer.audit"]
    def having(*words: str) -> list[str]:
        return [line for line in lines if all(word in line for word in words)]
    assert len(having("peer=", "claim transfer='observed'", ": ok")) == 1, lines
    assert len(having("peer=", "commit transfer='observed'", ": ok")) == 1, lines
    assert len(having(f"worker='pid {os.getpid()}' at='unix:", "abort transfer='dropped'",
                      ": ok")) == 1, lines


def _scrape(daemon: LocalDaemon) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Every sample the daemon exports: name -> {sorted labels: value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def test_metrics_count_latency_round_trips_and_failures_by_reason(observed) -> None:
    pre, dec = observed
    sent, got = _scrape(pre), _scrape(dec)
    assert sent["kvxfer_transfer_seconds_count"][(("outcome", "done"), ("role", "sender"))] == 1
    assert got["kvxfer_transfer_seconds_count"][(("outcome", "done"), ("role", "receiver"))] == 1
    assert got["kvxfer_transfer_seconds_count"][(("outcome", "aborted"), ("role", "receiver"))] == 1
    assert got["kvxfer_transfer_failures_total"][(("reason", "TRANSFER_ABORTED"), ("role", "receiver"))] == 1
    assert (("reason", "TRANSFER_ABORTED"), ("role", "sender")) not in sent.get(
        "kvxfer_transfer_failures_total", {})
    for method in ("Handshake", "Claim", "Commit"):
        assert sent["kvxfer_peer_call_seconds_count"][(("method", method),)] == 1, method
    # Each side's session, with the data plane its transfers use.
    assert got["kvxfer_peer_sessions"] == {(("data_plane", "ucx-tagged"), ("direction", "inbound"),
                                            ("peer", pre.peer_address)): 1}
    assert sent["kvxfer_peer_sessions"] == {(("data_plane", "ucx-tagged"), ("direction", "outbound"),
                                             ("peer", dec.peer_address)): 1}
    assert sent["kvxfer_transfer_queue_seconds_count"][(("role", "sender"),)] == 1
    assert got["kvxfer_transfer_data_seconds_count"][(("role", "receiver"),)] == 1
    page_bytes = 4 * 2 * 64 * 2 * 2 * 16  # tiny: 4 layers, K and V, 2 heads x 64, bf16, 16 slots
    assert sent["kvxfer_transfer_size_bytes_sum"][(("role", "sender"),)] == 4 * page_bytes
    assert got["kvxfer_rpc_seconds_count"][(("method", "Claim"),)] == 1
    for samples in (sent, got):
        assert set(samples["kvxfer_active_transfers"].values()) == {0.0}
        assert samples["kvxfer_ucx_posted_requests"][()] == 0


def test_every_metric_the_dashboard_plots_is_exported(observed) -> None:
    pre, dec = observed
    exported = set(_scrape(pre)) | set(_scrape(dec))  # a labelled metric shows once it counted
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queries.append(dashboard["templating"]["list"][1]["query"]["query"])
    assert len(queries) >= 12
    used = {name for q in queries for name in re.findall(r"\bkvxfer_[a-z_]+", q)}
    assert used - exported == set(), "the dashboard queries metrics no daemon exports"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(set(ids)) == len(ids), f"panel ids repeat: {ids}"


def _json_lines(daemon: LocalDaemon) -> list[dict[str, object]]:
    lines = [line for line in daemon.log().splitlines() if line.startswith("{")]
    assert lines, daemon.log()
    return [json.loads(line) for line in lines]


def test_json_logs_carry_the_transfer_and_the_engines_trace_on_both_daemons(observed) -> None:
    pre, dec = observed
    trace_id = format(TRACE_ID, "032x")
    for daemon in (pre, dec):
        records = _json_lines(daemon)
        assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
        ended = [r for r in records if r.get("transfer_id") == "observed"
                 and "done" in str(r["message"])]
        assert len(ended) == 1, (daemon.name, records)
        assert ended[0]["trace_id"] == trace_id, (daemon.name, ended[0])
    # The decode daemon's audit line of the prefill daemon's claim is in the same trace.
    claims = [r for r in _json_lines(dec) if r["logger"] == "kvxfer.audit"
              and "claim" in str(r["message"]) and "'observed'" in str(r["message"])]
    assert [r.get("trace_id") for r in claims] == [trace_id]
    aborted = [r for r in _json_lines(dec) if r.get("transfer_id") == "dropped"]
    assert aborted and aborted[0]["level"] == "WARNING" and aborted[0]["trace_id"] == ""
