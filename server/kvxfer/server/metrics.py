"""The daemon's Prometheus metrics, on a registry of its own (one per daemon object).

docs/how-to/observability.md lists them and ``deploy/grafana/kvxfer.json`` plots them;
a test checks that every metric the dashboard queries is one a daemon exports.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvxfer.errors import KvxferError
from kvxfer.server.transfers.record import Transfer
from kvxfer.status import PeerSessionInfo

#: Seconds, from a 1-page transfer on loopback (about 1 ms) to a deadline (the default is 30 s).
SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
           10.0, 30.0, 60.0, 300.0)
#: Bytes: one 4 KiB page to 4 GiB, by powers of 4.
SIZES = tuple(float(4 ** k) for k in range(6, 17))


class DaemonMetrics:
    """Every metric one daemon exports; ``serve`` exposes them over HTTP."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.transfers = Counter("kvxfer_transfers", "Finished transfers", ["role", "state"],
                                 registry=self.registry)
        self.bytes = Counter("kvxfer_bytes", "Bytes moved by finished transfers", ["role"],
                             registry=self.registry)
        self.active = Gauge("kvxfer_active_transfers", "Transfers not yet final", ["role"],
                            registry=self.registry)
        self.posted = Gauge("kvxfer_ucx_posted_requests",
                            "UCX sends and receives posted and not yet complete (0 when idle)",
                            registry=self.registry)
        self.inbound_sessions = Gauge("kvxfer_inbound_sessions",
                                      "Sessions peer daemons hold open to send to us",
                                      registry=self.registry)
        self.rpcs = Counter("kvxfer_rpcs", "gRPC calls handled, by method and status code",
                            ["method", "code"], registry=self.registry)
        self.rpc_seconds = Histogram("kvxfer_rpc_seconds", "Time to answer a gRPC call, by method",
                                     ["method"], buckets=SECONDS, registry=self.registry)
        self.peer_call_seconds = Histogram(
            "kvxfer_peer_call_seconds", "Round trips of this daemon's calls to peer daemons (the "
            "control plane of a transfer), by method", ["method"], buckets=SECONDS,
            registry=self.registry)
        self.transfer_seconds = Histogram(
            "kvxfer_transfer_seconds", "Registration to end of a transfer, by role and outcome",
            ["role", "outcome"], buckets=SECONDS, registry=self.registry)
        self.queue_seconds = Histogram(
            "kvxfer_transfer_queue_seconds", "Registration until its bytes start moving (waiting "
            "for the other side's registration, the session and the claim), by role", ["role"],
            buckets=SECONDS, registry=self.registry)
        self.data_seconds = Histogram(
            "kvxfer_transfer_data_seconds", "First message posted to last one complete, by role",
            ["role"], buckets=SECONDS, registry=self.registry)
        self.sizes = Histogram("kvxfer_transfer_size_bytes", "Bytes per transfer, by role",
                               ["role"], buckets=SIZES, registry=self.registry)
        self.dials_refused = Counter(
            "kvxfer_dials_refused", "Peer addresses this daemon refused to dial (outside "
            "--dial-allow)", registry=self.registry)
        self.failures = Counter(
            "kvxfer_transfer_failures", "Transfers that did not end DONE, by role and reason (the "
            "error's wire reason, e.g. PEER_UNAVAILABLE, TRANSFER_DEADLINE_EXCEEDED)",
            ["role", "reason"], registry=self.registry)

    def registered(self, t: Transfer) -> None:
        """Count ``t``, just registered, as active."""
        self.active.labels(t.role.name.lower()).inc()

    def ended(self, t: Transfer, error: KvxferError | None) -> None:
        """Count ``t``, which just ended with ``error`` (None: DONE), as no longer active."""
        role = t.role.name.lower()
        end = t.finished if t.finished is not None else t.registered
        self.active.labels(role).dec()
        self.transfers.labels(role, t.state.name.lower()).inc()
        self.transfer_seconds.labels(role, t.state.name.lower()).observe(end - t.registered)
        self.sizes.labels(role).observe(t.bytes_total)
        if t.started is not None:
            self.queue_seconds.labels(role).observe(t.started - t.registered)
        if error is None:
            self.bytes.labels(role).inc(t.bytes_total)
            if t.started is not None and t.data_finished is not None:
                self.data_seconds.labels(role).observe(t.data_finished - t.started)
        else:
            self.failures.labels(role, error.reason).inc()

    def track(self, posted_requests: Callable[[], int], inbound_sessions: Callable[[], int],
              sessions: Callable[[], list[PeerSessionInfo]]) -> None:
        """Read the gauges from these functions at every scrape."""
        self.posted.set_function(posted_requests)
        self.inbound_sessions.set_function(inbound_sessions)
        self.registry.register(PeerSessions(sessions))

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve the metrics on ``host``:``port`` (0: any free port); the port bound."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)


class PeerSessions(Collector):
    """``kvxfer_peer_sessions``: how many sessions are open, by peer, direction and the data
    plane their transfers use, read at every scrape."""

    def __init__(self, sessions: Callable[[], list[PeerSessionInfo]]) -> None:
        self._sessions = sessions

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "kvxfer_peer_sessions", "Open sessions with peer daemons, by peer, direction "
            "(outbound: we send) and data plane (local-copy, ucx-tagged)",
            labels=["peer", "direction", "data_plane"])
        counts = collections.Counter(
            (info.peer_address, "outbound" if info.outbound else "inbound", info.data_plane.label)
            for info in self._sessions())
        for labels, count in sorted(counts.items()):
            family.add_metric(list(labels), count)
        yield family
