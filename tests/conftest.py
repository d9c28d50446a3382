"""Shared fixtures: the reference layout module, daemons over mutual TLS, and hypothesis
settings."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from hypothesis import HealthCheck, settings

from kvxfer.certs import DevCa
from kvxfer.ucx_settings import LOOPBACK_ENV

settings.register_profile(
    "kvxfer", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("kvxfer")

for _key, _value in LOOPBACK_ENV.items():
    os.environ.setdefault(_key, _value)

REPO = Path(__file__).resolve().parent.parent


def _find_reference() -> Path | None:
    candidates = [os.environ.get("KVXFER_REFERENCE_LAYOUT", "")]
    candidates += [str(p / "shared/reference/page_major.py") for p in (REPO, REPO.parent)]
    for c in candidates:
        if c and Path(c).is_file():
            return Path(c)
    return None


@pytest.fixture(scope="session")
def reference() -> ModuleType:
    """SGLang's page-major layout (shared/reference/page_major.py), the spec we must match."""
    path = _find_reference()
    if path is None:
        pytest.skip("shared/reference/page_major.py not found; set KVXFER_REFERENCE_LAYOUT")
    spec = importlib.util.spec_from_file_location("page_major_reference", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def dev_ca(tmp_path_factory: pytest.TempPathFactory) -> DevCa:
    """One CA for the test session: daemons started by ``spawn`` get certificates from it."""
    return DevCa.create(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def peer_channel(dev_ca: DevCa):
    """Open a channel to a daemon's peer port as an authenticated peer named "tester"."""
    files = dev_ca.issue("tester")

    def open_channel(address: str) -> grpc.Channel:
        creds = grpc.ssl_channel_credentials((dev_ca.out / "ca.pem").read_bytes(),
                                             files.key.read_bytes(), files.cert.read_bytes())
        return grpc.secure_channel(address, creds)

    return open_channel


@pytest.fixture
def spawn(tmp_path: Path, dev_ca: DevCa):
    """Start ``LocalDaemon``s for one test, their peer APIs over mutual TLS with certificates
    of ``dev_ca`` (pass ``tls=`` to choose otherwise); every one is stopped (or killed) at
    teardown."""
    from kvxfer.client.spawn import LocalDaemon

    started: list[LocalDaemon] = []

    def start(name: str, pools: list[str], **kwargs) -> LocalDaemon:
        if "tls" not in kwargs:
            dev_ca.issue(name)
            kwargs["tls"] = dev_ca.out
        daemon = LocalDaemon(name, pools, workdir=str(tmp_path / name), **kwargs)
        started.append(daemon)
        return daemon.start()

    yield start
    for daemon in started:
        daemon.stop(timeout_s=15)
