"""A soak: transfers among three daemons for a long time, with faults on a schedule.

Three daemons on loopback (mutual TLS), each with a 256-page pool. ``--concurrency``
threads each own a slice of every pool and run transfers back to back between random
pairs, in both directions: mostly verified pushes, some pulls, aborts by either side
and receivers nobody fills. Every ``--fault-every`` seconds a scheduler injects a
fault: ``kill -9`` of a daemon and a restart on the same ports, or a ``SIGSTOP`` past
the liveness limit and a ``SIGCONT``.

It checks that every transfer ends by its deadline (the worst overshoot is reported, and
apart that of transfers that overlapped a fault: a frozen daemon answers only once thawed),
that a DONE transfer's destination pages equal its source, that every failure that is
not an abort the soak asked for coincides with an injected fault, and at the end, with
everything idle, that no daemon holds a posted UCX request or an unfinished transfer.
It reports transfers and verified bytes, and each daemon's RSS and open file
descriptors over time (their drift).

usage: python benchmarks/soak.py [--seconds 600] [--concurrency 4] [--fault-every 20]
       [--seed 1] [--local-copy] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvxfer.client import KvxferClient
from kvxfer.client.library import AttachedPool
from kvxfer.client.spawn import LocalDaemon, dev_certs
from kvxfer.pages import PageRuns

POOL = "name=kv,preset=llama8b,num_pages=256"
NAMES = ("a", "b", "c")
SLICE = 64  # pages each thread owns in every pool
CASES = ["push"] * 6 + ["pull", "receiver-aborts", "sender-aborts", "unfilled"]
TIMEOUT_S = 20.0
LIVENESS_S = 4.0  # the default heartbeat's limit
#: A failure this long after a fault ended still counts as the fault's.
AFTERMATH_S = TIMEOUT_S + LIVENESS_S


def gauge(daemon: LocalDaemon, name: str) -> float:
    """The sum of every sample of ``name`` on the daemon's metrics endpoint."""
    url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError as exc:
        alive = daemon.process is not None and daemon.process.poll() is None
        raise RuntimeError(f"{daemon.name} (pid {daemon.pid}, alive {alive}): {url}: {exc}") from None
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def usage(pid: int) -> tuple[float, int]:
    """A process's resident memory (MB) and open file descriptors."""
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return (int(found.group(1)) / 1024 if found else 0.0), len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Node:
    """One daemon, its client and its attached pool; replaced whole when it restarts."""

    daemon: LocalDaemon
    client: KvxferClient
    pool: AttachedPool
    instance: int = 0


@dataclass
class Cluster:
    """The daemons, the faults injected so far, and a lock for swapping a restarted node."""

    nodes: dict[str, Node]
    seed: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    faults: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, what)
    samples: dict[str, list[tuple[float, float, int]]] = field(default_factory=dict)

    def node(self, name: str) -> Node:
        with self.lock:
            return self.nodes[name]

    def during_fault(self, start: float, end: float) -> bool:
        """Whether [start, end] (monotonic) overlaps a fault or its aftermath."""
        with self.lock:
            return any(s <= end and start <= e + AFTERMATH_S for s, e, _ in self.faults)


def attach(daemon: LocalDaemon, seed: int) -> Node:
    """Connect to ``daemon`` and fill its pool with seeded random bytes."""
    client = KvxferClient(daemon.worker_address)
    pool = client.attach("kv")
    pool.raw.copy_(torch.randint(0, 256, pool.raw.shape, dtype=torch.uint8,
                                 generator=torch.Generator().manual_seed(seed)))
    return Node(daemon, client, pool)


class Worker(threading.Thread):
    """Transfers back to back on this thread's slice of every pool."""

    def __init__(self, index: int, cluster: Cluster, until: float, seed: int) -> None:
        super().__init__(name=f"soak-{index}", daemon=True)
        self.index, self.cluster, self.until = index, cluster, until
        self.rng = random.Random(seed * 1000 + index)
        self.outcomes: Counter[str] = Counter()
        self.verified_bytes = 0
        self.worst_overshoot = 0.0  # of transfers that overlapped no fault
        self.worst_overshoot_in_fault = 0.0  # a frozen daemon answers only once thawed
        self.lates: list[float] = []
        self.violations: list[str] = []

    def run(self) -> None:
        n = 0
        while time.monotonic() < self.until and len(self.violations) < 5:
            case = self.rng.choice(CASES)
            sender, receiver = self.rng.sample(NAMES, 2)
            tid = f"t{self.index}-{n}-{case}"
            n += 1
            start = time.monotonic()
            self.lates = []
            try:
                self.outcomes[f"{case}: {self.one(tid, case, sender, receiver)}"] += 1
                failure = None
            except Exception as exc:  # noqa: BLE001 - judged against the faults below
                failure = exc
            in_fault = self.cluster.during_fault(start, time.monotonic())
            late = max(self.lates, default=0.0)
            if in_fault:
                self.worst_overshoot_in_fault = max(self.worst_overshoot_in_fault, late)
            else:
                self.worst_overshoot = max(self.worst_overshoot, late)
            if failure is not None and in_fault:
                self.outcomes[f"{case}: failed in a fault"] += 1
            elif failure is not None:
                self.violations.append(f"{tid} {sender}->{receiver}: {type(failure).__name__}: "
                                       f"{failure}")

    def one(self, tid: str, case: str, sender: str, receiver: str) -> str:
        p_node, d_node = self.cluster.node(sender), self.cluster.node(receiver)
        p, d = p_node.client, d_node.client
        base = self.index * SLICE
        count = self.rng.randint(1, SLICE)
        src_runs = PageRuns.of([(base + self.rng.randint(0, SLICE - count), count)])
        dst_runs = PageRuns.of([(base + self.rng.randint(0, SLICE - count), count)])
        if case == "unfilled":
            d.expect(tid, "kv", dst_runs, timeout_s=0.5)
            self.check_end(d.wait(tid, timeout_s=5), {"DEADLINE_EXCEEDED"}, 0.5)
            return "DEADLINE_EXCEEDED"
        if case == "pull":
            offered = p.offer(tid, "kv", src_runs, timeout_s=TIMEOUT_S, verify=True)
            d.pull(tid, p_node.daemon.peer_address, "kv", dst_runs, timeout_s=TIMEOUT_S,
                   capability=offered.capability)
        else:
            expected = d.expect(tid, "kv", dst_runs, timeout_s=TIMEOUT_S)
            p.push(tid, "kv", src_runs, peer=d_node.daemon.peer_address, timeout_s=TIMEOUT_S,
                   verify=True, capability=expected.capability)
        if case == "receiver-aborts":
            d.abort(tid, "soak")
        elif case == "sender-aborts":
            p.abort(tid, "soak")
        sent, got = p.wait(tid, timeout_s=TIMEOUT_S + 10), d.wait(tid, timeout_s=TIMEOUT_S + 10)
        if case in ("push", "pull"):
            self.check_end(sent, {"DONE"}, TIMEOUT_S)
            self.check_end(got, {"DONE"}, TIMEOUT_S)
            for s, t in zip(src_runs.pages(), dst_runs.pages(), strict=True):
                if not p_node.pool.page_bytes_view(s).equal(d_node.pool.page_bytes_view(t)):
                    raise AssertionError(f"page {s} -> {t} differs")
            self.verified_bytes += got.bytes
            return "DONE"
        for info in (sent, got):  # the abort races the transfer: it may have finished first
            self.check_end(info, {"DONE", "ABORTED", "FAILED"}, TIMEOUT_S)
        return got.state.name

    def check_end(self, info: Any, states: set[str], timeout_s: float) -> None:
        if info.state.name not in states:
            raise AssertionError(f"{info.role.name} ended {info.state.name}: {info.error}")
        late = time.time() - (info.created_unix + timeout_s)
        self.lates.append(late)
        if late > 2.0:
            raise AssertionError(f"{info.role.name} ended {late:.1f} s after its deadline")


class Faults(threading.Thread):
    """Every ``every`` seconds: kill -9 and restart a daemon, or freeze and thaw one."""

    def __init__(self, cluster: Cluster, until: float, every: float, seed: int,
                 restart: Any) -> None:
        super().__init__(name="faults", daemon=True)
        self.cluster, self.until, self.every = cluster, until, every
        self.rng = random.Random(seed)
        self.restart = restart
        self.errors: list[str] = []

    def run(self) -> None:
        while time.monotonic() + self.every + LIVENESS_S + 5 < self.until:
            time.sleep(self.every)
            name = self.rng.choice(NAMES)
            kind = self.rng.choice(["kill", "freeze"])
            start = time.monotonic()
            with self.cluster.lock:  # under way: it ends when it is over
                self.cluster.faults.append((start, math.inf, f"{kind} {name}"))
            try:
                if kind == "kill":
                    self.restart(name)
                else:
                    pid = self.cluster.node(name).daemon.pid
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(LIVENESS_S + 2)
                    os.kill(pid, signal.SIGCONT)
            except Exception as exc:  # noqa: BLE001 - reported
                self.errors.append(f"{kind} {name}: {type(exc).__name__}: {exc}")
            with self.cluster.lock:
                self.cluster.faults[-1] = (start, time.monotonic(), f"{kind} {name}")


def soak(seconds: float, concurrency: int, every: float, seed: int, workdir: Path,
         local_copy: bool = False) -> dict[str, Any]:
    """Run the soak (``local_copy``: daemons with ``--local-copy``); what it counted and
    checked."""
    if concurrency * SLICE > 256:
        raise SystemExit(f"--concurrency at most {256 // SLICE}")
    with dev_certs(*NAMES) as tls, ExitStack() as stack:
        def start(name: str, extra: list[str]) -> LocalDaemon:
            daemon = LocalDaemon(name, [POOL], workdir=str(workdir / name), tls=tls, metrics=True,
                                 extra_args=extra)
            stack.callback(daemon.stop)
            return daemon.start()

        options = ["--local-copy"] if local_copy else []
        daemons = {name: start(name, options) for name in NAMES}
        cluster = Cluster({n: attach(d, seed + i) for i, (n, d) in enumerate(daemons.items())}, seed)

        def restart(name: str) -> None:
            old = cluster.node(name)
            old.daemon.kill()
            ports = ["--peer-address", old.daemon.peer_address,
                     "--ucx-port", str(old.daemon.ready_info["ucx_port"])]
            fresh = LocalDaemon(name, [POOL], workdir=str(workdir / name), tls=tls,
                                metrics=True, extra_args=ports + options)
            stack.callback(fresh.stop)
            fresh.start()
            node = attach(fresh, seed + 100 + old.instance)
            node.instance = old.instance + 1
            with cluster.lock:
                cluster.nodes[name] = node
            old.pool.detach()
            old.client.close()

        began = time.monotonic()
        until = began + seconds
        workers = [Worker(i, cluster, until, seed) for i in range(concurrency)]
        faults = Faults(cluster, until, every, seed, restart)
        for thread in (*workers, faults):
            thread.start()
        drift: dict[str, list[tuple[float, float, int]]] = {}
        while any(w.is_alive() for w in workers):
            for name in NAMES:
                node = cluster.node(name)
                key = f"{name}#{node.instance}"
                try:
                    rss, fds = usage(node.daemon.pid)
                except OSError:
                    continue  # restarting
                drift.setdefault(key, []).append((round(time.monotonic() - began), round(rss, 1), fds))
            time.sleep(10)
        faults.join(60)
        elapsed = time.monotonic() - began
        time.sleep(2)  # late messages of aborted transfers drain
        idle: dict[str, dict[str, float]] = {}
        for name in NAMES:
            daemon = cluster.node(name).daemon
            try:
                idle[name] = {"posted_requests": gauge(daemon, "kvxfer_ucx_posted_requests"),
                              "active_transfers": gauge(daemon, "kvxfer_active_transfers")}
            except RuntimeError as exc:
                faults.errors.append(f"idle gauges: {exc}")
        for node in cluster.nodes.values():
            node.pool.detach()
            node.client.close()
    outcomes: Counter[str] = sum((w.outcomes for w in workers), Counter())
    violations = [v for w in workers for v in w.violations] + faults.errors
    ok = not violations and all(v == 0 for x in idle.values() for v in x.values())
    return {
        "seconds": round(elapsed, 1), "transfers": sum(outcomes.values()),
        "verified_gb": round(sum(w.verified_bytes for w in workers) / 1e9, 2),
        "outcomes": dict(sorted(outcomes.items())),
        "faults": [what for _, _, what in cluster.faults],
        "worst_overshoot_s": round(max(w.worst_overshoot for w in workers), 3),
        "worst_overshoot_in_fault_s": round(max(w.worst_overshoot_in_fault for w in workers), 3),
        "violations": violations, "idle_gauges": idle,
        "rss_mb_and_fds": {k: {"first": v[0], "last": v[-1]} for k, v in drift.items()},
        "ok": ok,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=600, help="how long (default 10 min)")
    parser.add_argument("--concurrency", type=int, default=4, help="threads of transfers (<= 4)")
    parser.add_argument("--fault-every", type=float, default=20,
                        help="seconds between injected faults (default 20)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", default="", help="where the daemons' logs go")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--local-copy", action="store_true",
                        help="run the daemons with --local-copy (same-host copy, no UCX)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvxfer-soak-") as tmp:
        result = soak(args.seconds, args.concurrency, args.fault_every, args.seed,
                      Path(args.workdir or tmp), args.local_copy)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['transfers']} transfers ({result['verified_gb']} GB verified) in "
              f"{result['seconds']} s; faults: {result['faults']}")
        for case, n in result["outcomes"].items():
            print(f"  {n:6d}  {case}")
        print(f"worst deadline overshoot {result['worst_overshoot_s']} s (of transfers that "
              f"overlapped a fault: {result['worst_overshoot_in_fault_s']} s); idle gauges "
              f"{result['idle_gauges']}")
        for key, v in result["rss_mb_and_fds"].items():
            print(f"  {key}: RSS MB and fds {v['first'][1:]} at {v['first'][0]} s -> "
                  f"{v['last'][1:]} at {v['last'][0]} s")
        for line in result["violations"]:
            print(f"  ! {line}")
        print("ok" if result["ok"] else "FAILED")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
