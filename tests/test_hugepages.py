"""Pools on hugetlbfs: the huge-page volumes Kubernetes gives pods (``medium: HugePages``).

hugetlbfs rounds every file up to whole huge pages, so a pool smaller than one
huge page lives in a larger file; workers must still attach and transfers move
the right bytes. Needs root (to reserve huge pages and mount hugetlbfs); skipped
otherwise, with the reason. Restores the huge-page reservation it found.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from pool_checks import assert_moved, fill_random

from kvxfer.client import KvxferClient
from kvxfer.client.spawn import LocalDaemon
from kvxfer.pages import PageRuns

pytestmark = pytest.mark.slow  # see docs/development.md

POOL = "name=kv,preset=tiny,num_pages=3"  # 3 pages of 32 KiB: well under one huge page
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")


def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


@pytest.fixture
def hugetlbfs(tmp_path: Path) -> Iterator[Path]:
    """A hugetlbfs mount with at least 4 free huge pages; unmounted at teardown (lazily:
    this process may still map a file there until its views are collected)."""
    if os.geteuid() != 0:
        pytest.skip("hugetlbfs tests need root (huge-page reservation and mount)")
    reserved = int(NR_HUGEPAGES.read_text())
    missing = max(0, 4 - _meminfo("HugePages_Free"))
    if missing:
        try:
            NR_HUGEPAGES.write_text(str(reserved + missing))
        except OSError as exc:
            pytest.skip(f"cannot reserve huge pages here: {exc}")
    mount = tmp_path / "hugetlbfs"
    mount.mkdir()
    try:
        if _meminfo("HugePages_Free") < 4:
            pytest.skip("the kernel could not reserve 4 huge pages (memory fragmented?)")
        done = subprocess.run(["mount", "-t", "hugetlbfs", "none", str(mount)],
                              capture_output=True, text=True, timeout=10)
        if done.returncode != 0:
            pytest.skip(f"cannot mount hugetlbfs here: {done.stderr.strip()}")
        try:
            yield mount
        finally:
            subprocess.run(["umount", "--lazy", str(mount)], capture_output=True, timeout=10)
    finally:
        if missing:
            NR_HUGEPAGES.write_text(str(reserved))


def test_pools_on_hugetlbfs_attach_and_move_pages(hugetlbfs: Path, tmp_path: Path) -> None:
    huge_page = _meminfo("Hugepagesize") * 1024
    daemons = {name: LocalDaemon(name, [POOL], workdir=str(tmp_path / name), shm_dir=str(hugetlbfs))
               for name in ("prefill", "decode")}
    with daemons["prefill"] as pre, daemons["decode"] as dec, \
            KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
            p.attach("kv") as src, d.attach("kv") as dst:
        _, memory = d.describe("kv")
        assert memory.size_bytes < huge_page
        assert os.stat(memory.shm.path).st_size == huge_page, "hugetlbfs did not round the file up"
        fill_random(src, 5)
        src_runs, dst_runs = PageRuns.of([(0, 2)]), PageRuns.of([(1, 2)])
        before = dst.raw.clone()
        expected = d.expect("huge", "kv", dst_runs, timeout_s=30)
        p.push("huge", "kv", src_runs, peer=dec.peer_address, timeout_s=30, verify=True, capability=expected.capability)
        sent, got = p.wait("huge", timeout_s=30), d.wait("huge", timeout_s=30)
        assert sent.ok and got.ok and got.verified, (sent.error, got.error)
        assert_moved(src, dst, src_runs, dst_runs, before)
