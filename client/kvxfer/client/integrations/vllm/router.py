"""vLLM's own router (``vllm-router``, the Rust router on PyPI) in front of local engines,
with the policy kvxfer's failure modes call for (``ROUTER_POLICY``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import TracebackType

import httpx

from kvxfer.client.integrations.vllm.processes import (
    free_port,
    http_client,
    stop_process,
    wait_healthy,
)

#: How vllm-router treats kvxfer's engines (``VllmRouter.pd``, and deploy/k8s/base/router):
#: a load that fails recomputes inside the decode engine and answers normally, so a
#: retry is only for an engine that did not answer at all (a pod restarting), at most
#: once, after a short backoff; an engine that fails 5 requests in a row is left alone
#: for 30 s (the circuit breaker), and one that fails 3 health checks 10 s apart is taken
#: out until it passes 2.
ROUTER_POLICY = [
    "--policy", "round_robin",
    "--retry-max-retries", "2", "--retry-initial-backoff-ms", "200",
    "--retry-max-backoff-ms", "2000",
    "--cb-failure-threshold", "5", "--cb-success-threshold", "2",
    "--cb-timeout-duration-secs", "30", "--cb-window-duration-secs", "60",
    "--health-check-endpoint", "/health", "--health-check-interval-secs", "10",
    "--health-check-timeout-secs", "5", "--health-failure-threshold", "3",
    "--health-success-threshold", "2",
]


class VllmRouter:
    """``vllm-router`` (from the vLLM environment) on a loopback port, in front of engines
    that listen on TCP ports: ``pd`` routes each request to a prefill and then a decode
    engine, passing ``kv_transfer_params`` along as it does for NixlConnector (kvxfer
    follows that convention); ``single`` round-robins plain engines."""

    def __init__(self, args: list[str], log: Path, port: int | None = None) -> None:
        self.address = f"http://127.0.0.1:{port or free_port()}"
        self._args = [str(Path(sys.executable).parent / "vllm-router"), *args, "--host",
                      "127.0.0.1", "--port", self.address.rsplit(":", 1)[1],
                      "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        self._log = log
        self._process: subprocess.Popen[bytes] | None = None

    @classmethod
    def pd(cls, prefill: str, decode: str, log: Path, port: int | None = None) -> VllmRouter:
        """A router that disaggregates: ``prefill`` and ``decode`` are the engines' addresses;
        it listens on ``port`` (None: a free one)."""
        return cls(["--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
                    "--kv-connector", "nixl", *ROUTER_POLICY], log, port)

    @classmethod
    def single(cls, engine: str, log: Path) -> VllmRouter:
        """A router in front of one plain engine (the same hop as a disaggregated one)."""
        return cls(["--worker-urls", engine, "--policy", "round_robin"], log)

    def __enter__(self) -> VllmRouter:
        with open(self._log, "wb") as log:
            self._process = subprocess.Popen(self._args, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.address, self._process, "vllm-router", self._log, 60.0)
        except BaseException:
            stop_process(self._process)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._process is not None:
            stop_process(self._process)

    def client(self, timeout_s: float = 300.0) -> httpx.Client:
        """An HTTP client of the router."""
        return http_client(self.address, timeout_s)
