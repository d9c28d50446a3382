"""Start and stop local daemons as subprocesses (for the demo, ``bench --spawn`` and tests),
with certificates for their peer APIs' mutual TLS."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

from kvxfer.memory import remove_stale_arenas
from kvxfer.ucx_settings import LOOPBACK_ENV


@contextmanager
def dev_certs(*names: str) -> Iterator[Path]:
    """A temporary directory with a new CA and a certificate per name (``tls`` of local
    daemons that talk over mutual TLS); removed on exit."""
    from kvxfer.certs import issue_certs  # the daemon install's (cryptography)

    with tempfile.TemporaryDirectory(prefix="kvxfer-tls-") as out:
        issue_certs(Path(out), list(names))
        yield Path(out)


class LocalDaemon:
    """A ``kvxfer serve`` subprocess on loopback; a context manager that always stops it."""

    def __init__(self, name: str, pool_flags: list[str], *, workdir: str | None = None,
                 env: dict[str, str] | None = None, extra_args: list[str] | None = None,
                 log_level: str = "warning", host: str = "127.0.0.1",
                 command_prefix: list[str] | None = None, shm_dir: str = "/dev/shm",
                 metrics: bool = False, tls: Path | None = None,
                 launcher: list[str] | None = None) -> None:
        """``host`` is the address the peer port and UCX listen on (every port is picked by
        the daemon and read back from its ready file); ``command_prefix`` wraps the command
        (e.g. ``ip netns exec NS`` to run it in a network namespace); ``shm_dir`` is where
        its CPU pools live (swept of its files if it is killed); ``metrics`` serves its
        Prometheus metrics on a free port (``metrics_port``); ``tls`` is a directory made by
        ``kvxfer certs`` with a certificate named ``name``: the peer API uses mutual TLS;
        ``launcher`` is the command that takes ``serve``'s arguments (default: the ``kvxfer``
        command line of this interpreter)."""
        self.name = name
        self.shm_dir = shm_dir
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=f"kvxfer-{name}-")
            workdir = self._tmp.name
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._ready = self.workdir / f"{name}.ready.json"
        self.log_path = self.workdir / f"{name}.log"
        self.args = [
            *(command_prefix or []), *(launcher or [sys.executable, "-m", "kvxfer.client.cli"]),
            "serve",
            "--worker-address", f"unix://{self.workdir / (name + '.sock')}",
            "--peer-address", f"{host}:0", "--ucx-host", host,
            "--ready-file", str(self._ready), "--log-level", log_level, "--shm-dir", shm_dir,
            *[a for p in pool_flags for a in ("--pool", p)],
            *(["--metrics-port", "0"] if metrics else []),
            *(["--peer-tls-cert", str(tls / f"{name}.pem"), "--peer-tls-key",
               str(tls / f"{name}.key"), "--peer-tls-ca", str(tls / "ca.pem")] if tls else []),
            *(extra_args or []),
        ]
        self.env = {**os.environ, **LOOPBACK_ENV, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None
        self.worker_address = ""
        self.peer_address = ""
        self.metrics_port: int | None = None
        self.ready_info: dict[str, Any] = {}  # what the daemon wrote to its ready file

    @property
    def pid(self) -> int:
        """The daemon's process id."""
        assert self.process is not None
        return self.process.pid

    def start(self, timeout_s: float = 60.0) -> LocalDaemon:
        """Start the daemon and wait until it serves (or raise with its log)."""
        self._ready.unlink(missing_ok=True)
        log = open(self.log_path, "wb")
        self.process = subprocess.Popen(self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while not self._ready.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"daemon {self.name} exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"daemon {self.name} not ready after {timeout_s}s:\n{self.log()}")
            time.sleep(0.05)
        self.ready_info = json.loads(self._ready.read_text())
        self.worker_address = self.ready_info["worker_address"]
        self.peer_address = self.ready_info["peer_address"]
        self.metrics_port = self.ready_info["metrics_port"]
        return self

    def restart(self, timeout_s: float = 60.0) -> LocalDaemon:
        """SIGKILL the daemon and start it again on the same worker socket and peer address,
        as a crashed sidecar container is restarted: its pools are new memory."""
        self.kill()
        where = self.args.index("--peer-address") + 1
        self.args[where] = self.peer_address
        return self.start(timeout_s)

    def log(self) -> str:
        """What the daemon printed so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; returns the exit code."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        remove_stale_arenas(self.shm_dir, pid=self.process.pid)
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL the daemon, reap it, and delete the shared memory it could not."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        if self.process is not None:
            remove_stale_arenas(self.shm_dir, pid=self.process.pid)

    def __enter__(self) -> LocalDaemon:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
