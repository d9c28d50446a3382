"""kvxfer transfer bandwidth against ucx_perftest, measured in the same run.

Starts two daemons on loopback, moves the standard workload (128 pages of a
llama-8B-like pool, 2 MiB pages, seeded random runs of 1-16 pages; 256 MiB per
transfer) repeatedly and reports the median GB/s seen by the client (push call
to both waits returning). Then it measures ``ucx_perftest -t tag_bw`` (from the
libucx wheel) with the same message size and UCX settings, and the page_size=1
variant (128 KiB pages, the same bytes), and prints the ratios:

    kvxfer / ucx_perftest      (target >= 0.9), with UCX error handling on and off
    page_size 1 / page_size 16 (target >= 0.8)

ucx_perftest resends one cache-resident buffer, so it is optimistic; a single
256 MiB message (the same bytes as one transfer) is measured as a second reference.

usage: python benchmarks/transfer_bandwidth.py [--tls tcp] [--repeats 7] [--json]
The machine is shared and noisy: compare ratios, not absolute figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvxfer.client import KvxferClient
from kvxfer.client.bench import random_runs
from kvxfer.client.spawn import LocalDaemon
from kvxfer.transport import UCX_DEFAULTS


def ucx_env(tls: str | None) -> dict[str, str]:
    """The UCX settings both kvxfer and ucx_perftest run with."""
    env = {"UCX_NET_DEVICES": "lo", **UCX_DEFAULTS}
    if tls:
        env["UCX_TLS"] = tls
    return env


def perftest_gbps(message_bytes: int, iterations: int, env: dict[str, str],
                  error_handling: bool) -> float:
    """``ucx_perftest -t tag_bw`` bandwidth between two processes on loopback, in GB/s."""
    import libucx

    root = Path(libucx.__file__).parent
    full_env = {**os.environ, **env, "LD_LIBRARY_PATH": str(root / "lib")}
    port = str(random.randint(20000, 30000))
    eh = ["-e"] if error_handling else []
    server = subprocess.Popen([str(root / "bin/ucx_perftest"), "-p", port, *eh], env=full_env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        out = subprocess.run(
            [str(root / "bin/ucx_perftest"), "127.0.0.1", "-p", port, *eh, "-t", "tag_bw",
             "-s", str(message_bytes), "-n", str(iterations)],
            env=full_env, capture_output=True, text=True, timeout=120, check=True,
        ).stdout
    finally:
        server.kill()
        server.wait(10)
    final = [line for line in out.splitlines() if line.startswith("Final:")][-1]
    fields = re.split(r"\s+", final.strip())
    mb_per_s = float(fields[6])  # bandwidth (MB/s), overall; ucx_perftest's MB is 2**20 bytes
    return mb_per_s * 2**20 / 1e9


def kvxfer_gbps(preset: str, pages_per_transfer: int, repeats: int, env: dict[str, str],
                chunk_bytes: int, error_handling: bool) -> list[float]:
    """GB/s of each measured push of the standard workload (after one warm-up)."""
    pool = f"name=kv,preset={preset}"
    args = ["--chunk-bytes", str(chunk_bytes),
            "--ucx-error-handling" if error_handling else "--no-ucx-error-handling"]
    with LocalDaemon("prefill", [pool], env=env, extra_args=args) as pre, \
            LocalDaemon("decode", [pool], env=env, extra_args=args) as dec, \
            KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
            p.attach("kv") as src:
        src.raw.copy_(torch.frombuffer(bytearray(np.random.default_rng(0).bytes(src.raw.numel())),
                                       dtype=torch.uint8))
        num_pages = src.descriptor.num_pages
        rng = random.Random(0)
        rates = []
        for i in range(repeats + 1):
            src_runs = random_runs(rng, list(range(num_pages)), pages_per_transfer, (1, 16))
            dst_runs = random_runs(rng, list(range(num_pages)), pages_per_transfer, (1, 16))
            tid = f"bw-{i}"
            start = time.perf_counter()
            d.expect(tid, "kv", dst_runs, timeout_s=120)
            p.push(tid, "kv", src_runs, peer=dec.peer_address, timeout_s=120)
            sent, got = p.wait(tid, timeout_s=120), d.wait(tid, timeout_s=120)
            elapsed = time.perf_counter() - start
            if not (sent.ok and got.ok):
                raise RuntimeError(f"transfer {tid} failed: {sent.error or got.error}")
            if i:
                rates.append(got.bytes / elapsed / 1e9)
        return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tls", help="UCX_TLS for both kvxfer and ucx_perftest (default: UCX picks)")
    parser.add_argument("--repeats", type=int, default=7, help="measured transfers per case (>= 5)")
    parser.add_argument("--chunk-bytes", type=int, default=2 << 20,
                        help="kvxfer's message size and ucx_perftest's (default 2 MiB)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    env = ucx_env(args.tls)
    result: dict[str, object] = {"tls": args.tls or "default", "chunk_bytes": args.chunk_bytes,
                                 "repeats": args.repeats}
    medians: dict[str, float] = {}

    def record(name: str, values: list[float]) -> None:
        medians[name] = statistics.median(values)
        result[f"{name}_gbps_median"] = round(medians[name], 3)
        result[f"{name}_gbps_all"] = [round(v, 3) for v in values]

    for eh in (True, False):
        tag = "eh_on" if eh else "eh_off"
        record(f"kvxfer_ps16_{tag}", kvxfer_gbps("llama8b", 128, args.repeats, env,
                                                 args.chunk_bytes, eh))
        record(f"kvxfer_ps1_{tag}", kvxfer_gbps("llama8b-ps1", 2048, args.repeats, env,
                                                args.chunk_bytes, eh))
        record(f"perftest_{tag}", [perftest_gbps(args.chunk_bytes, 2000, env, eh) for _ in range(3)])
    # One 256 MiB message: the same bytes as a transfer, walking memory instead of
    # resending one cache-resident buffer.
    record("perftest_256MiB_eh_off", [perftest_gbps(256 << 20, 20, env, False) for _ in range(3)])
    for tag in ("eh_on", "eh_off"):
        result[f"ratio_kvxfer_vs_perftest_{tag}"] = round(
            medians[f"kvxfer_ps16_{tag}"] / medians[f"perftest_{tag}"], 3)
        result[f"ratio_ps1_vs_ps16_{tag}"] = round(
            medians[f"kvxfer_ps1_{tag}"] / medians[f"kvxfer_ps16_{tag}"], 3)
    result["ratio_kvxfer_eh_off_vs_perftest_256MiB"] = round(
        medians["kvxfer_ps16_eh_off"] / medians["perftest_256MiB_eh_off"], 3)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:28s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
