"""The daemon's Prometheus metrics, on a registry of its own (one per daemon object)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class DaemonMetrics:
    """Every metric one daemon exports; ``serve`` exposes them over HTTP on 127.0.0.1."""

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

    def track(self, posted_requests: Callable[[], int], inbound_sessions: Callable[[], int]) -> None:
        """Read the two gauges from these functions at every scrape."""
        self.posted.set_function(posted_requests)
        self.inbound_sessions.set_function(inbound_sessions)

    def serve(self, port: int) -> int:
        """Serve the metrics on 127.0.0.1:``port`` (0: any free port); the port bound."""
        server, _thread = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        return int(server.server_port)
