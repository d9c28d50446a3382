"""What a process that reaches a daemon's UCX port, with no session, can do (issue #31's
"UCX port" question, measured against today's tagged data plane).

The intruder (``ucx_intruder.py``) connects to the decode daemon's UCX listener, tries a
one-sided read of the daemon's pool at its real address with a guessed key, and floods
the daemon with tagged messages of random tags while verified transfers run. Over tcp UCX
checks no remote key (benchmarks/reports/2026-12-06-ucx-rma-confinement.md), so the read
is refused only because the daemons' UCX contexts have no RMA feature; and a message
lands in a transfer's pages only with that transfer's tag, which a peer cannot guess
(``TagAllocator``). The UCX payload is not encrypted, in kvxfer as in NIXL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from daemon_pairs import attached_pair
from pool_checks import assert_moved, standard_runs

from kvxfer.client import KvxferClient
from kvxfer.client.spawn import LocalDaemon
from kvxfer.ucx_settings import LOOPBACK_ENV

HERE = Path(__file__).resolve().parent
POOL = "name=kv,preset=llama8b,num_pages=160"

pytestmark = pytest.mark.timeout(180)


def mapped_at(pid: int, path: str) -> int:
    """Where process ``pid`` maps the file at ``path``."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if line.rstrip().endswith(path) or line.rstrip().endswith(f"{path} (deleted)"):
            return int(line.split("-", 1)[0], 16)
    raise AssertionError(f"process {pid} does not map {path}")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_an_unauthenticated_ucx_peer_reads_nothing_and_lands_nothing(tmp_path: Path, dev_ca) -> None:
    with attached_pair(tmp_path, dev_ca, POOL, [], seed=5) as (pre, dec, p, d, src, dst):
        _, memory = d.describe("kv")
        address = mapped_at(dec.process.pid, memory.shm.path)
        rss_before = rss_mib(dec.process.pid)
        intruder = subprocess.Popen(
            [sys.executable, str(HERE / "ucx_intruder.py"), "127.0.0.1", str(dec.ready_info["ucx_port"]),
             str(address), "6"], stdout=subprocess.PIPE, text=True, env={**os.environ, **LOOPBACK_ENV})
        try:
            moved = 0
            for seed in range(6):  # while the intruder sends: every transfer verified, exact
                src_runs, dst_runs = standard_runs(seed, num_pages=160, pages=32)
                before = dst.raw.clone()
                expected = d.expect(f"t{seed}", "kv", dst_runs, timeout_s=60)
                p.push(f"t{seed}", "kv", src_runs, peer=dec.peer_address, timeout_s=60,
                       verify=True, capability=expected.capability)
                sent, got = p.wait(f"t{seed}", 60), d.wait(f"t{seed}", 60)
                assert sent.ok and got.ok and got.verified, (sent.error, got.error)
                assert_moved(src, dst, src_runs, dst_runs, before)
                moved += 1
            out, _ = intruder.communicate(timeout=60)
        finally:
            intruder.kill()
            intruder.wait(10)
        tried = json.loads(out.strip().splitlines()[-1])
        assert tried["read"] != "Success" and tried["bytes_read"] is False, tried
        assert tried["messages_sent"] > 100, tried
        assert d.health() == "SERVING" and moved == 6
        grown = rss_mib(dec.process.pid) - rss_before
        print(f"intruder: read {tried['read']!r}, {tried['messages_sent']} stray messages; "
              f"decode daemon RSS grew {grown:.0f} MiB")
        assert grown < 256, f"the decode daemon grew {grown:.0f} MiB from stray messages"


def test_negative_control_a_daemon_with_rma_lets_it_read_the_pool(tmp_path: Path) -> None:
    """The same read against a daemon whose UCX context has RMA (``rma_daemon.py``): the
    guessed key reads the pool's bytes."""
    with LocalDaemon("exposed", [POOL], workdir=str(tmp_path / "x"),
                     launcher=[sys.executable, str(HERE / "rma_daemon.py")]) as daemon, \
            KvxferClient(daemon.worker_address) as client, client.attach("kv") as pool:
        pool.raw[:32] = torch.arange(1, 33, dtype=torch.uint8)
        _, memory = client.describe("kv")
        address = mapped_at(daemon.process.pid, memory.shm.path)
        out = subprocess.run(
            [sys.executable, str(HERE / "ucx_intruder.py"), "127.0.0.1", str(daemon.ready_info["ucx_port"]),
             str(address), "0.2"], capture_output=True, text=True, timeout=60,
            env={**os.environ, **LOOPBACK_ENV})
        tried = json.loads(out.stdout.strip().splitlines()[-1])
        assert tried["read"] == "Success" and tried["head"] == bytes(range(1, 33)).hex(), tried
