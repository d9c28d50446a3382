"""The processes of a local deployment: HTTP clients of them, waiting for them to be
healthy, stopping them, and loopback ports for them."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx


def http_client(address: str, timeout_s: float) -> httpx.Client:
    """An HTTP client of the server at ``http://host:port`` or ``unix:/path``."""
    if address.startswith("unix:"):
        transport = httpx.HTTPTransport(uds=address.removeprefix("unix:"))
        return httpx.Client(transport=transport, base_url="http://server", timeout=timeout_s)
    return httpx.Client(base_url=address, timeout=timeout_s)


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM ``process`` if it runs, SIGKILL it after ``timeout_s``, and reap it."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout_s)


def wait_healthy(address: str, process: subprocess.Popen[bytes], what: str, log: Path,
                 timeout_s: float) -> None:
    """Wait until ``address`` answers ``/health``; raise with the log's tail if ``process``
    exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    with http_client(address, timeout_s=2) as http:
        while True:
            if process.poll() is not None:
                tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
                raise RuntimeError(f"{what} exited with {process.returncode}:\n{tail}")
            try:
                if http.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
                raise TimeoutError(f"{what} not healthy after {timeout_s:.0f}s:\n{tail}")
            time.sleep(0.3)


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (vllm-router reaches engines over TCP)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
