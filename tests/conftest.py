"""Shared fixtures: the reference layout module, and hypothesis settings."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, settings

from kvxfer.transport import LOOPBACK_ENV

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


@pytest.fixture
def spawn(tmp_path: Path):
    """Start ``LocalDaemon``s for one test; every one is stopped (or killed) at teardown."""
    from kvxfer.client.spawn import LocalDaemon

    started: list[LocalDaemon] = []

    def start(name: str, pools: list[str], **kwargs) -> LocalDaemon:
        daemon = LocalDaemon(name, pools, workdir=str(tmp_path / name), **kwargs)
        started.append(daemon)
        return daemon.start()

    yield start
    for daemon in started:
        daemon.stop(timeout_s=15)
