"""Two "hosts": daemons in separate network namespaces joined by a veth pair.

The prefill daemon lives in namespace A (10.R.S.1), the decode daemon in B
(10.R.S.2); each sees only its end of the veth and its own loopback, so gRPC
between them and the UCX data plane (forced to tcp) cross the veth link, as
they would cross a NIC between nodes. The test client stays in the root
namespace and reaches both daemons over their unix sockets (pathname sockets
are not bound to a network namespace). The daemons talk over mutual TLS, as
they must off loopback. Needs root and iproute2; skipped
otherwise, with the reason.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pool_checks import assert_moved, fill_random, standard_runs

from kvxfer.certs import issue_certs
from kvxfer.client import KvxferClient
from kvxfer.client.spawn import LocalDaemon
from kvxfer.pages import PageRuns

pytestmark = pytest.mark.slow  # see docs/development.md

POOL = "name=kv,preset=llama8b,num_pages=128"


@dataclass(frozen=True)
class Host:
    """One end of the veth pair: a namespace, its interface and address."""

    netns: str
    device: str
    address: str

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]

    def rx_bytes(self) -> int:
        out = subprocess.run([*self.exec_prefix(), "cat", f"/sys/class/net/{self.device}/statistics/rx_bytes"],
                             capture_output=True, text=True, timeout=10, check=True)
        return int(out.stdout)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=True)


@pytest.fixture
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Namespaces A and B with a veth pair between them; deleted at teardown."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network-namespace tests need root and iproute2 (ip)")
    tag = secrets.token_hex(3)
    subnet = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
    a = Host(f"kvx-a-{tag}", f"kva{tag}", f"{subnet}.1")
    b = Host(f"kvx-b-{tag}", f"kvb{tag}", f"{subnet}.2")
    made: list[str] = []
    try:
        for host in (a, b):
            _ip("netns", "add", host.netns)
            made.append(host.netns)
        _ip("link", "add", a.device, "type", "veth", "peer", "name", b.device)
        for host in (a, b):
            _ip("link", "set", host.device, "netns", host.netns)
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.device)
            _ip("-n", host.netns, "link", "set", host.device, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        for netns in made:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=10)
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.strip()}")
    try:
        yield a, b
    finally:
        for netns in made:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=10)


def namespaced_daemon(name: str, host: Host, workdir: Path) -> LocalDaemon:
    """A daemon on ``host``'s address, its peer API over mutual TLS (``workdir/tls``), that
    may dial the other end of the veth (its /30) and nothing else."""
    return LocalDaemon(
        name, [POOL], workdir=str(workdir / name), host=host.address,
        command_prefix=host.exec_prefix(), tls=workdir / "tls",
        env={"UCX_NET_DEVICES": host.device, "UCX_TLS": "tcp"},
        extra_args=["--dial-allow", f"{host.address}/30"],
    )


def test_push_and_pull_across_a_veth_link(two_hosts, tmp_path: Path) -> None:
    a, b = two_hosts
    issue_certs(tmp_path / "tls", ["prefill", "decode"], (a.address, b.address))
    with namespaced_daemon("prefill", a, tmp_path) as pre, namespaced_daemon("decode", b, tmp_path) as dec:
        assert pre.peer_address.startswith(a.address) and dec.peer_address.startswith(b.address)
        with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
                p.attach("kv") as src, d.attach("kv") as dst:
            fill_random(src, 21)
            rx_before = b.rx_bytes()
            src_runs, dst_runs = standard_runs(21, num_pages=128, pages=48)
            before = dst.raw.clone()
            expected = d.expect("veth-push", "kv", dst_runs, timeout_s=60)
            p.push("veth-push", "kv", src_runs, peer=dec.peer_address, timeout_s=60, verify=True,
                   capability=expected.capability)
            sent, got = p.wait("veth-push", timeout_s=60), d.wait("veth-push", timeout_s=60)
            assert sent.ok and got.ok, (sent.error, got.error)
            assert got.verified
            assert_moved(src, dst, src_runs, dst_runs, before)
            moved = got.bytes
            assert b.rx_bytes() - rx_before >= moved, "the pages did not cross the veth link"

            src_runs, dst_runs = standard_runs(22, num_pages=128, pages=16)
            before = dst.raw.clone()
            offered = p.offer("veth-pull", "kv", src_runs, timeout_s=60, verify=True)
            d.pull("veth-pull", pre.peer_address, "kv", dst_runs, timeout_s=60,
                   capability=offered.capability)
            sent, got = p.wait("veth-pull", timeout_s=60), d.wait("veth-pull", timeout_s=60)
            assert sent.ok and got.ok, (sent.error, got.error)
            assert_moved(src, dst, src_runs, dst_runs, before)


LIVENESS_S = 4.0  # the default heartbeat (1 s): 3 heartbeats + 1 s
MARGIN_S = 2.0


def wait_until_claimed(d: KvxferClient, transfer_id: str) -> None:
    deadline = time.monotonic() + 20
    while next(t for t in d.transfers() if t.transfer_id == transfer_id).state.name == "WAITING":
        assert time.monotonic() < deadline, "the transfer was never claimed"
        time.sleep(0.005)


def test_a_cut_link_fails_transfers_by_liveness_and_sessions_heal_after(two_hosts,
                                                                      tmp_path: Path) -> None:
    a, b = two_hosts
    issue_certs(tmp_path / "tls", ["prefill", "decode"], (a.address, b.address))
    with namespaced_daemon("prefill", a, tmp_path) as pre, namespaced_daemon("decode", b, tmp_path) as dec:
        with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
                p.attach("kv") as src, d.attach("kv") as dst:
            fill_random(src, 23)
            whole = PageRuns.of([(0, 128)])
            expected = d.expect("cut", "kv", whole, timeout_s=60)
            p.push("cut", "kv", whole, peer=dec.peer_address, timeout_s=60, capability=expected.capability)
            wait_until_claimed(d, "cut")
            _ip("-n", a.netns, "link", "set", a.device, "down")
            try:
                cut_at = time.monotonic()
                sent, got = p.wait("cut", timeout_s=60), d.wait("cut", timeout_s=60)
                took = time.monotonic() - cut_at
            finally:
                _ip("-n", a.netns, "link", "set", a.device, "up")
            if sent.ok and got.ok:
                pytest.skip("the transfer completed before the link went down")
            assert "UNAVAILABLE" in (sent.error_code, got.error_code), (sent.error, got.error)
            assert not got.ok and not sent.ok
            assert took <= LIVENESS_S + MARGIN_S, f"both sides ended {took:.1f} s after the cut"

            # The sessions re-open by themselves; right after the link comes back, UCX may
            # still find the peer unreachable for a while (seen in CI: 3 tries 1 s apart
            # were not enough once), so up to 6 tries of 10 s, 2 s apart.
            src_runs, dst_runs = standard_runs(24, num_pages=128, pages=32)
            errors = []
            for attempt in range(6):
                before = dst.raw.clone()
                tid = f"healed-{attempt}"
                expected = d.expect(tid, "kv", dst_runs, timeout_s=10)
                p.push(tid, "kv", src_runs, peer=dec.peer_address, timeout_s=10, verify=True,
                       capability=expected.capability)
                sent, got = p.wait(tid, timeout_s=15), d.wait(tid, timeout_s=15)
                if sent.ok and got.ok:
                    break
                errors.append((sent.error, got.error))
                time.sleep(2)
            assert sent.ok and got.ok and got.verified, errors
            assert_moved(src, dst, src_runs, dst_runs, before)
    print(f"link cut: both sides failed the transfer {took:.1f} s after the cut; healed on "
          f"try {len(errors) + 1}")


def shape_link(hosts: tuple[Host, Host], choices: list[list[str]]) -> str:
    """Apply the first queueing discipline in ``choices`` the kernel has to both ends of the
    link; which one it was (skips if none)."""
    errors = []
    for qdisc in choices:
        done = []
        for host in hosts:
            out = subprocess.run([*host.exec_prefix(), "tc", "qdisc", "add", "dev", host.device,
                                  "root", *qdisc], capture_output=True, text=True, timeout=10)
            if out.returncode != 0:
                errors.append(f"{qdisc[0]}: {out.stderr.strip()}")
                break
            done.append(host)
        else:
            return " ".join(qdisc)
        for host in done:
            subprocess.run([*host.exec_prefix(), "tc", "qdisc", "del", "dev", host.device, "root"],
                           capture_output=True, timeout=10)
    pytest.skip(f"no link shaping here: {errors}")


def test_a_lossy_slow_link_delivers_exact_bytes_or_fails_by_deadline(two_hosts,
                                                                    tmp_path: Path) -> None:
    """Loss, delay and reordering with netem where the kernel has it; where it does not
    (sch_netem missing, as on the machines here), a slow link: a 400 Mbit/s token bucket."""
    a, b = two_hosts
    link = shape_link((a, b), [
        ["netem", "loss", "1%", "delay", "5ms", "1ms", "reorder", "5%", "50%"],
        ["tbf", "rate", "400mbit", "burst", "256kb", "latency", "100ms"],
    ])
    issue_certs(tmp_path / "tls", ["prefill", "decode"], (a.address, b.address))
    with namespaced_daemon("prefill", a, tmp_path) as pre, namespaced_daemon("decode", b, tmp_path) as dec:
        with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
                p.attach("kv") as src, d.attach("kv") as dst:
            fill_random(src, 25)
            src_runs, dst_runs = standard_runs(25, num_pages=128, pages=32)
            before = dst.raw.clone()
            expected = d.expect("lossy", "kv", dst_runs, timeout_s=60)
            start = time.monotonic()
            p.push("lossy", "kv", src_runs, peer=dec.peer_address, timeout_s=60, verify=True,
                   capability=expected.capability)
            sent, got = p.wait("lossy", timeout_s=70), d.wait("lossy", timeout_s=70)
            seconds = time.monotonic() - start
            if got.ok:
                assert sent.ok and got.verified
                assert_moved(src, dst, src_runs, dst_runs, before)
            else:
                assert got.error_code == "DEADLINE_EXCEEDED", got.error
                assert seconds <= 60 + MARGIN_S
    print(f"link {link}: {got.state.name}, {got.bytes / seconds / 1e6:.0f} MB/s")
