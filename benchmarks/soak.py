"""A soak: hours of transfers with faults mixed in, then a check that nothing leaked.

Two daemons on loopback with mutual TLS. ``--concurrency`` threads each run
transfers back to back for ``--seconds``, choosing for each: a verified push (most
of them), a pull, an abort by the receiver or by the sender mid-transfer, or a
receiver nobody fills (it must end by its deadline). Every transfer must end the
way its case says, by its deadline; a DONE one's destination pages must equal
their source. At the end, with everything idle, both daemons must hold no posted
UCX request, no unfinished transfer and one session, and their memory (VmRSS)
must not have grown by more than ``--max-growth-mb`` since the first minute.

usage: python benchmarks/soak.py [--seconds 3600] [--concurrency 4] [--seed 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from kvxfer.client import KvxferClient
from kvxfer.client.library import AttachedPool
from kvxfer.client.spawn import LocalDaemon, dev_certs
from kvxfer.pages import PageRuns

POOL = "name=kv,preset=llama8b,num_pages=256"
#: Pages each thread owns on both sides (threads never share pages).
SLICE = 64
CASES = ["push"] * 6 + ["pull", "receiver-aborts", "sender-aborts", "unfilled"]


def gauge(daemon: LocalDaemon, name: str) -> float:
    """The sum of every sample of ``name`` on the daemon's metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def rss_mb(daemon: LocalDaemon) -> float:
    """The daemon's resident memory, MB."""
    status = Path(f"/proc/{daemon.pid}/status").read_text()
    found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return int(found.group(1)) / 1024 if found else 0.0


class Worker(threading.Thread):
    """One thread of transfers on its own slice of pages."""

    def __init__(self, index: int, p: KvxferClient, d: KvxferClient, src: AttachedPool,
                 dst: AttachedPool, pre: LocalDaemon, dec: LocalDaemon, until: float,
                 seed: int) -> None:
        super().__init__(name=f"soak-{index}", daemon=True)
        self.index, self.p, self.d, self.src, self.dst = index, p, d, src, dst
        self.pre, self.dec, self.until = pre, dec, until
        self.rng = random.Random(seed * 1000 + index)
        self.outcomes: Counter[str] = Counter()
        self.failures: list[str] = []

    def run(self) -> None:
        n = 0
        while time.monotonic() < self.until and len(self.failures) < 5:
            case = self.rng.choice(CASES)
            tid = f"t{self.index}-{n}-{case}"
            n += 1
            try:
                self.one(tid, case)
                self.outcomes[case] += 1
            except Exception as exc:  # noqa: BLE001 - reported in the summary
                self.failures.append(f"{tid}: {type(exc).__name__}: {exc}")

    def one(self, tid: str, case: str) -> None:
        base = self.index * SLICE
        count = self.rng.randint(1, SLICE)
        src_runs = PageRuns.of([(base + self.rng.randint(0, SLICE - count), count)])
        dst_runs = PageRuns.of([(base + self.rng.randint(0, SLICE - count), count)])
        p, d = self.p, self.d
        if case == "unfilled":
            d.expect(tid, "kv", dst_runs, timeout_s=0.5)
            self.expect_end(d.wait(tid, timeout_s=5), "DEADLINE_EXCEEDED", 0.5)
            return
        d_timeout = 30.0
        if case == "pull":
            p.offer(tid, "kv", src_runs, timeout_s=d_timeout, verify=True)
            d.pull(tid, self.pre.peer_address, "kv", dst_runs, timeout_s=d_timeout)
        else:
            d.expect(tid, "kv", dst_runs, timeout_s=d_timeout)
            p.push(tid, "kv", src_runs, peer=self.dec.peer_address, timeout_s=d_timeout,
                   verify=True)
        if case == "receiver-aborts":
            d.abort(tid, "soak")
        elif case == "sender-aborts":
            p.abort(tid, "soak")
        sent, got = p.wait(tid, timeout_s=40), d.wait(tid, timeout_s=40)
        if case in ("push", "pull"):
            self.expect_end(got, "DONE", d_timeout)
            self.expect_end(sent, "DONE", d_timeout)
            for s, t in zip(src_runs.pages(), dst_runs.pages(), strict=True):
                if not self.src.page_bytes_view(s).equal(self.dst.page_bytes_view(t)):
                    raise AssertionError(f"page {s} -> {t} differs")
        else:  # an abort races the transfer: it may have finished first
            for info in (sent, got):
                if info.state.name not in ("DONE", "ABORTED", "FAILED"):
                    raise AssertionError(f"{info.role.name} ended {info.state.name}: {info.error}")

    @staticmethod
    def expect_end(info: Any, state: str, timeout_s: float) -> None:
        if info.state.name != state:
            raise AssertionError(f"{info.role.name} ended {info.state.name}: {info.error}")
        late = time.time() - (info.created_unix + timeout_s)
        if late > 2.0:
            raise AssertionError(f"{info.role.name} ended {late:.1f} s after its deadline")


def soak(seconds: float, concurrency: int, seed: int, max_growth_mb: float) -> dict[str, Any]:
    """Run the soak; what it counted and checked."""
    if concurrency * SLICE > 256:
        raise SystemExit(f"--concurrency at most {256 // SLICE}")
    with dev_certs("prefill", "decode") as tls, \
            LocalDaemon("prefill", [POOL], tls=tls, metrics=True) as pre, \
            LocalDaemon("decode", [POOL], tls=tls, metrics=True) as dec, \
            KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
            p.attach("kv") as src, d.attach("kv") as dst:
        src.raw.copy_(torch.randint(0, 256, src.raw.shape, dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(seed)))
        start = time.monotonic()
        workers = [Worker(i, p, d, src, dst, pre, dec, start + seconds, seed)
                   for i in range(concurrency)]
        for w in workers:
            w.start()
        baseline: dict[str, float] = {}
        while any(w.is_alive() for w in workers):
            time.sleep(1)
            if not baseline and time.monotonic() - start > min(60.0, seconds / 2):
                baseline = {"prefill": rss_mb(pre), "decode": rss_mb(dec)}
        elapsed = time.monotonic() - start
        time.sleep(1)  # late messages of aborted transfers drain
        leaks = {x.name: {"posted_requests": gauge(x, "kvxfer_ucx_posted_requests"),
                          "active_transfers": gauge(x, "kvxfer_active_transfers")}
                 for x in (pre, dec)}
        leaks["decode"]["inbound_sessions"] = gauge(dec, "kvxfer_inbound_sessions")
        growth = {x.name: round(rss_mb(x) - baseline.get(x.name, rss_mb(x)), 1) for x in (pre, dec)}
        outcomes: Counter[str] = sum((w.outcomes for w in workers), Counter())
        failures = [f for w in workers for f in w.failures]
    ok = (not failures and all(v == 0 for x in leaks.values() for k, v in x.items()
                               if k != "inbound_sessions")
          and leaks["decode"]["inbound_sessions"] <= 1
          and all(g <= max_growth_mb for g in growth.values()))
    return {"seconds": round(elapsed, 1), "transfers": sum(outcomes.values()),
            "by_case": dict(outcomes), "failures": failures, "idle_gauges": leaks,
            "rss_growth_mb": growth, "ok": ok}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3600, help="how long (default 1 h)")
    parser.add_argument("--concurrency", type=int, default=4, help="threads of transfers (<= 4)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-growth-mb", type=float, default=64,
                        help="resident memory either daemon may gain after the first minute")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    result = soak(args.seconds, args.concurrency, args.seed, args.max_growth_mb)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['transfers']} transfers in {result['seconds']} s: {result['by_case']}")
        print(f"idle gauges {result['idle_gauges']}, memory growth {result['rss_growth_mb']} MB")
        for line in result["failures"]:
            print(f"  ! {line}")
        print("ok" if result["ok"] else "FAILED")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
