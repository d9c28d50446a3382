"""The kvxfer command line, run as an operator would (subprocesses)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from kvxfer.client.bench import random_runs
from kvxfer.pages import PageRuns
from kvxfer.ucx_settings import LOOPBACK_ENV

ENV = {**os.environ, **LOOPBACK_ENV}


def kvxfer(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvxfer.client.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=ENV)


@pytest.mark.parametrize("command", ["serve", "pools", "describe", "health", "transfers", "bench", "demo",
                                     "vllm", "certs"])
def test_every_command_explains_itself_with_an_example(command: str) -> None:
    out = kvxfer(command, "--help", timeout=60)
    assert out.returncode == 0
    assert "example:" in out.stdout and f"kvxfer {command}" in out.stdout


@pytest.mark.slow
def test_bench_spawn_json_numbers_are_consistent() -> None:
    out = kvxfer("bench", "--spawn", "--preset", "tiny", "--pages", "8", "--run-length", "1-4",
                 "--transfers", "6", "--concurrency", "2", "--verify", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(out.stdout)
    assert r["transfers"] == 6 and r["errors"] == {} and r["verified"] is True
    assert r["bytes_per_transfer"] == 8 * r["page_bytes"] == 8 * 4 * 2 * 2 * 64 * 2 * 16
    assert r["bytes"] == r["transfers"] * r["bytes_per_transfer"]
    assert r["gbps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9, rel=1e-2)
    assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
    assert r["gbps_per_transfer_min"] <= r["gbps_per_transfer_median"] <= r["gbps_per_transfer_max"]
    assert r["copied_locally"] == 0  # over UCX: the spawned pair has no --local-copy


@pytest.mark.slow
@pytest.mark.parametrize("local_copy", [False, True])
def test_bench_pull_mode(local_copy: bool) -> None:
    out = kvxfer("bench", "--spawn", "--preset", "tiny", "--pages", "4", "--run-length", "1-2",
                 "--transfers", "3", "--mode", "pull", "--verify", "--json",
                 *(["--local-copy"] if local_copy else []))
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(out.stdout)
    assert r["mode"] == "pull" and r["transfers"] == 3 and r["verified"] is True
    assert r["copied_locally"] == (3 if local_copy else 0)


def test_bench_exits_nonzero_and_counts_errors_when_transfers_fail(spawn) -> None:
    pre, dec = spawn("pre", ["name=kv,preset=tiny"]), spawn("dec", ["name=kv,preset=tiny"])
    out = kvxfer("bench", "--prefill", pre.worker_address, "--decode", dec.worker_address,
                 "--decode-peer", "127.0.0.1:1", "--pages", "2", "--transfers", "2", "--warmup", "0",
                 "--timeout", "3", "--json")
    assert out.returncode == 1
    r = json.loads(out.stdout)
    assert r["transfers"] == 0 and r["errors"] == {"UNAVAILABLE": 2}


@pytest.mark.slow
def test_demo_exits_zero() -> None:
    out = kvxfer("demo")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "demo OK" in out.stdout and "mutual TLS" in out.stdout


def test_certs_writes_a_ca_and_node_certificates_and_prints_their_flags(tmp_path) -> None:
    out = kvxfer("certs", "--out", str(tmp_path), "--node", "p0", "--node", "d0", timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(f.name for f in tmp_path.iterdir()) == ["ca.key", "ca.pem", "d0.key", "d0.pem",
                                                         "p0.key", "p0.pem"]
    assert f"p0: --peer-tls-cert {tmp_path}/p0.pem --peer-tls-key {tmp_path}/p0.key " \
           f"--peer-tls-ca {tmp_path}/ca.pem" in out.stdout


@pytest.mark.slow
def test_operations_against_a_daemon(spawn) -> None:
    d = spawn("ops", ["name=kv,preset=tiny", "name=lat,preset=mla-small"])
    health = kvxfer("health", "--address", d.worker_address, "--json")
    assert health.returncode == 0 and json.loads(health.stdout)["status"] == "SERVING"
    pools = json.loads(kvxfer("pools", "--address", d.worker_address, "--json").stdout)
    assert [p["name"] for p in pools] == ["kv", "lat"]
    desc = json.loads(kvxfer("describe", "lat", "--address", d.worker_address, "--json").stdout)
    assert desc["kind"] == "mla" and len(desc["views"]) == 4 and desc["views"][0]["role"] == "latent"
    table = kvxfer("describe", "kv", "--address", d.worker_address)
    assert "k[0]" in table.stdout and "page_bytes" in table.stdout or "B, anchor" in table.stdout
    missing = kvxfer("describe", "nope", "--address", d.worker_address)
    assert missing.returncode == 2 and "no pool named 'nope'" in missing.stdout
    transfers = json.loads(kvxfer("transfers", "--address", d.worker_address, "--json").stdout)
    assert transfers == []


@pytest.mark.slow
def test_bench_spawns_its_daemons_in_the_given_shm_dir(tmp_path) -> None:
    shm_dir = tmp_path / "shm"
    missing = kvxfer("bench", "--spawn", "--preset", "tiny", "--pages", "4", "--transfers", "1",
                     "--shm-dir", str(shm_dir), "--json")
    assert missing.returncode == 1 and missing.stdout == ""
    assert "cannot create shared memory for arena 'kv'" in missing.stderr
    assert str(shm_dir) in missing.stderr and "Traceback" not in missing.stderr

    shm_dir.mkdir()
    out = kvxfer("bench", "--spawn", "--preset", "tiny", "--pages", "4", "--transfers", "2",
                 "--shm-dir", str(shm_dir), "--no-ucx-error-handling", "--verify", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["verified"] is True
    assert list(shm_dir.iterdir()) == []  # the daemons removed their arenas on exit


def test_random_runs_may_use_a_pool_up_to_its_last_page() -> None:
    for seed in range(20):
        assert random_runs(random.Random(seed), [0, 1, 2], 1, (1, 1)) == PageRuns.of([(0, 1)])
    with pytest.raises(SystemExit, match="do not fit in 3"):
        random_runs(random.Random(0), [0, 1, 2], 3, (1, 1))


def test_bench_says_why_when_the_runs_do_not_fit_the_pool(spawn) -> None:
    pre, dec = spawn("pre", ["name=kv,preset=tiny"]), spawn("dec", ["name=kv,preset=tiny"])
    out = kvxfer("bench", "--prefill", pre.worker_address, "--decode", dec.worker_address,
                 "--decode-peer", dec.peer_address, "--pages", "60", "--run-length", "1-1",
                 "--transfers", "2", "--json")
    assert out.returncode == 1 and out.stdout == ""
    assert "pool too small for the workload" in out.stderr and "Traceback" not in out.stderr
