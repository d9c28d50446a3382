"""The image, built and run as it would be deployed: two sidecars and their engines.

``scripts/docker-image.sh`` builds the image from this checkout (once per change of its
sources). A prefill and a decode "pod" each have a sidecar container (the image's own
entry point, health check and non-root user, mutual TLS with certificates in the
cert-manager layout) and a worker container that shares its IPC namespace and its
socket and pool volumes. All containers use the host's network, and the daemons bind
127.0.0.1. Needs a Docker engine: skipped without one, unless ``KVXFER_REQUIRE_DOCKER=1``
(CI), where that fails.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvxfer.certs import DevCa

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parent.parent
IMAGE = "kvxfer:test"
UID = 10001  # the image's kvxfer user


def _docker_ready() -> str:
    """Why Docker cannot be used here ("" when it can)."""
    if shutil.which("docker") is None:
        return "no docker command"
    probe = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    return "" if probe.returncode == 0 else f"no Docker engine: {probe.stderr.strip()[:200]}"


def _docker(*args: str, timeout: float = 120, check: bool = True) -> str:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"docker {' '.join(args[:3])} failed: {out.stderr}{out.stdout}")
    return out.stdout.strip()


def _logs(container: str) -> str:
    """What the container wrote to stdout and stderr."""
    return subprocess.run(["docker", "logs", container], capture_output=True, text=True,
                          timeout=60).stderr


@pytest.fixture(scope="module")
def image() -> str:
    why = _docker_ready()
    if why:
        if os.environ.get("KVXFER_REQUIRE_DOCKER") == "1":
            pytest.fail(f"KVXFER_REQUIRE_DOCKER=1 but {why}")
        pytest.skip(why)
    subprocess.run([str(REPO / "scripts" / "docker-image.sh"), IMAGE], check=True, timeout=1100)
    return IMAGE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Pod:
    """A sidecar container and the volumes its worker containers share with it."""

    def __init__(self, role: str, root: Path, shm: Path, ca: DevCa, image: str) -> None:
        self.role, self.image = role, image
        self.name = f"kvxfer-test-{role}-{uuid.uuid4().hex[:6]}"
        self.run_dir, self.pools, self.tls = root / f"{role}-run", shm / role, root / f"{role}-tls"
        self.peer_port, self.ucx_port = _free_port(), _free_port()
        for d in (self.run_dir, self.pools, self.tls):
            d.mkdir(parents=True)
        files = ca.issue(role)
        for src, dst in ((files.cert, "tls.crt"), (files.key, "tls.key"), (ca.out / "ca.pem", "ca.crt")):
            shutil.copy(src, self.tls / dst)
        config = root / f"{role}.yaml"
        config.write_text(
            "worker_address: unix:///run/kvxfer/kvxfer.sock\n"
            f"peer_address: 127.0.0.1:{self.peer_port}\n"
            "peer_tls_cert: /etc/kvxfer/tls/tls.crt\npeer_tls_key: /etc/kvxfer/tls/tls.key\n"
            "peer_tls_ca: /etc/kvxfer/tls/ca.crt\npeer_allow: [prefill, decode]\n"
            f"ucx_host: 127.0.0.1\nucx_port: {self.ucx_port}\nshm_dir: /pools\ngrace_s: 5\n"
            "pools:\n  - {name: kv, kind: mha, layer_num: 4, head_num: 2, head_dim: 64,\n"
            "     v_head_dim: 64, dtype: bfloat16, page_size: 16, num_pages: 64}\n")
        for path in (self.run_dir, self.pools, self.tls, *self.tls.iterdir(), config):
            os.chown(path, UID, UID)
        self.config = config

    @property
    def peer_address(self) -> str:
        return f"127.0.0.1:{self.peer_port}"

    @property
    def socket(self) -> str:
        return f"unix://{self.run_dir}/kvxfer.sock"

    def volumes(self) -> list[str]:
        return ["-v", f"{self.run_dir}:/run/kvxfer", "-v", f"{self.pools}:/pools"]

    def start(self) -> None:
        _docker("run", "-d", "--name", self.name, "--network", "host", "--ipc", "shareable",
                "--health-interval", "1s", "--health-start-period", "0s",
                "-e", "UCX_NET_DEVICES=lo", *self.volumes(),
                "-v", f"{self.config}:/etc/kvxfer/kvxfer.yaml:ro",
                "-v", f"{self.tls}:/etc/kvxfer/tls:ro", self.image, "--log-format", "json")

    def health(self) -> str:
        return _docker("inspect", "-f", "{{.State.Health.Status}}", self.name)

    def worker(self, *args: str, detach: bool = False) -> str:
        """Run the test's worker script in a container of this pod."""
        return _docker("run", *(["-d"] if detach else ["--rm"]), "--network", "host",
                       "--ipc", f"container:{self.name}", "--user", f"{UID}:{UID}",
                       "-e", "UCX_NET_DEVICES=lo", *self.volumes(),
                       "-v", f"{REPO / 'tests' / 'container_worker.py'}:/work/worker.py:ro",
                       "--entrypoint", "python", self.image, "/work/worker.py", *args,
                       timeout=180)


def _until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.5)


@pytest.fixture
def pods(image: str, tmp_path: Path) -> Iterator[tuple[Pod, Pod]]:
    shm = Path("/dev/shm") / f"kvxfer-ct-{uuid.uuid4().hex[:8]}"
    ca = DevCa.create(tmp_path / "ca")
    made = [Pod(role, tmp_path, shm, ca, image) for role in ("prefill", "decode")]
    try:
        yield made[0], made[1]
    finally:
        for pod in made:
            _docker("rm", "-f", pod.name, check=False)
        shutil.rmtree(shm, ignore_errors=True)


def _watch_health(address: str, seen: list[str], stop: threading.Event) -> None:
    """Record every status the daemon's health Watch stream sends, until it ends."""
    with grpc.insecure_channel(address) as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(),
                                                           timeout=120)
        try:
            for reply in stream:
                seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
                if stop.is_set():
                    break
        except grpc.RpcError:
            seen.append("ENDED")


def test_sidecars_move_pages_between_worker_containers_and_drain_on_stop(pods) -> None:
    prefill, decode = pods
    for pod in pods:
        pod.start()
    for pod in pods:
        _until(lambda pod=pod: pod.health() == "healthy", 60, f"{pod.name} healthy")
    assert _docker("inspect", "-f", "{{.Config.User}}", prefill.name) == "10001:10001"

    receiver = decode.worker("receive", "ct-1", detach=True)
    try:
        _until(lambda: "capability" in _docker("logs", receiver), 60, "the receiver's expect")
        capability = json.loads(_docker("logs", receiver).splitlines()[0])["capability"]
        sent = json.loads(prefill.worker("send", "ct-1", decode.peer_address,
                                         capability).splitlines()[-1])
        assert sent["state"] == "DONE", sent
        status = _docker("wait", receiver, timeout=120)
        got = json.loads(_docker("logs", receiver).splitlines()[-1])
    finally:
        _docker("rm", "-f", receiver, check=False)
    assert (status, got["state"], got["byte_exact"], got["verified"]) == ("0", "DONE", True, True)
    logs = [json.loads(line) for line in _logs(decode.name).splitlines() if line.startswith("{")]
    assert any(r.get("transfer_id") == "ct-1" for r in logs)

    seen: list[str] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_health, args=(decode.socket, seen, stop), daemon=True)
    watcher.start()
    _until(lambda: seen[:1] == ["SERVING"], 10, "the health stream's first status")
    _docker("stop", "-t", "30", decode.name, timeout=60)
    watcher.join(10)
    assert seen[0] == "SERVING" and "NOT_SERVING" in seen, seen
    assert _docker("inspect", "-f", "{{.State.ExitCode}}", decode.name) == "0"
    assert list(decode.pools.iterdir()) == [], "the stopped sidecar left shared memory behind"
    assert not (decode.run_dir / "kvxfer.sock").exists()
    assert prefill.health() == "healthy"
