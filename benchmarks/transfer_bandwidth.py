"""kvxfer transfer bandwidth against ucx_perftest over the same UCX protocol, in one run.

Starts two daemons on loopback and moves the standard workload (128 pages of a
llama-8B-like pool, 2 MiB pages, seeded random runs of 1-16 pages; 256 MiB per
transfer) and its page_size=1 variant (2048 pages of 128 KiB, the same bytes),
timing each transfer as a client sees it (expect call to both waits returning).

The reference is ``ucx_perftest -t tag_bw`` (from the libucx wheel) over the
protocol and transport UCX picked for kvxfer's own sends: the benchmark runs
both with ``UCX_PROTO_INFO=y``, reads which protocol served kvxfer's messages
(e.g. "rendezvous zero-copy fenced write to remote" over tcp/lo), restricts
ucx_perftest to that transport and prints both, so the comparison is checked,
not assumed. ucx_perftest runs without ``-e``: with ``-e`` it connects by worker
address and UCX falls back to eager copy-in/copy-out on tcp, a protocol kvxfer
never uses (its listener-created endpoints keep rendezvous zero-copy).

ucx_perftest resends one buffer, never written, into private huge-page memory,
which flatters it; one 256 MiB message (the bytes of a whole transfer) is the
second reference, and the third is the kernel's own ceiling for the transport on
kvxfer's kind of memory (``kernel_copy.py``: process_vm_writev for cma, a loopback
socket for tcp, between /dev/shm mappings, 2 MiB per syscall). The same copy
resending one chunk-sized buffer, as ucx_perftest does, shows what cache
residency alone is worth on that memory (``kernel_copy_resend``), and the same
two copies on ucx_perftest's kind of memory (``kernel_copy.py --memory
perftest``: an untouched source, a huge-page destination) show the ceiling
ucx_perftest itself runs under (``kernel_copy_perftest_memory``, ``..._resend``).
The machine is shared and noisy, so the cases run interleaved, round by round,
and each ratio is the median of the per-round ratios:

    kvxfer page_size 16 / ucx_perftest, same protocol, same message size (target >= 0.9)
    kvxfer page_size 16 / the kernel copy ceiling on the same memory
    kvxfer page_size 16, data phase only / the kernel copy ceiling
    kvxfer page_size 1 / kvxfer page_size 16                               (target >= 0.8)
    kvxfer page_size 16 over --extra-lanes UCX lanes / over --lanes (what lanes buy)
    the kernel copy resending one buffer / the kernel copy (what resending is worth)
    ucx_perftest / the kernel copy on its own memory, resending as it does (and for
        one 256 MiB message, walking): how close UCX itself gets to its ceiling

The data phase is the receiver's ``data_seconds`` (its receives posted to the
last message arrived); the rest of a transfer is control plane (gRPC calls).

Every kvxfer case runs with ``--lanes`` data lanes (default 1, the daemon's) except
the one with ``--extra-lanes`` (default 2).

usage: python benchmarks/transfer_bandwidth.py [--rounds 5] [--eh on|off|both] [--lanes 1]
       [--extra-lanes 2] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvxfer.client import KvxferClient, TransferInfo, hand_off
from kvxfer.client.bench import random_runs
from kvxfer.client.spawn import LocalDaemon
from kvxfer.ucx_settings import LOOPBACK_ENV, UCX_DEFAULTS

#: The UCX transport names of a protocol row mapped to what UCX_TLS must allow.
TLS_OF = {"tcp": "tcp", "cma": "cma,tcp", "posix": "posix,tcp", "sysv": "sysv,tcp", "knem": "knem,tcp"}


def ucx_env() -> dict[str, str]:
    """The UCX settings both kvxfer and ucx_perftest run with."""
    return {**LOOPBACK_ENV, **UCX_DEFAULTS}


def _size(text: str) -> float:
    text = text.strip()
    if text == "inf":
        return float("inf")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
    return float(text.rstrip("KMG")) * scale


def protocol_for(log: str, message_bytes: int) -> str:
    """'protocol over transport' that served plain tag sends of this size, from UCX_PROTO_INFO.

    UCX prints a table per endpoint configuration; an endpoint made through a
    listener starts on a tcp-only configuration and switches to its final one once
    wired up, so the last table printed is the one the data moved with.
    """
    found = ""
    in_table = False
    for line in log.splitlines():
        if "|" not in line:
            continue
        if "tagged message by ucp_tag_send*" in line:
            in_table = "ucp_tag_send* from host memory" in line
            continue
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if not in_table or len(cells) != 3:
            continue
        low, _, high = cells[0].partition("..")
        if _size(low) <= message_bytes <= _size(high or low):
            found = f"{cells[1].removeprefix('(?) ')} over {cells[2]}"
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def perftest(message_bytes: int, iterations: int, env: dict[str, str]) -> tuple[float, str]:
    """``ucx_perftest -t tag_bw`` on loopback: (GB/s overall, the protocols its client used)."""
    import libucx

    root = Path(libucx.__file__).parent
    full_env = {**os.environ, **env, "LD_LIBRARY_PATH": str(root / "lib"), "UCX_PROTO_INFO": "y"}
    port = str(free_port())
    server = subprocess.Popen([str(root / "bin/ucx_perftest"), "-p", port], env=full_env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        out = subprocess.run(
            [str(root / "bin/ucx_perftest"), "127.0.0.1", "-p", port, "-t", "tag_bw",
             "-s", str(message_bytes), "-n", str(iterations), "-w", "2"],
            env=full_env, capture_output=True, text=True, timeout=120, check=True,
        )
    finally:
        server.kill()
        server.wait(10)
    final = [line for line in out.stdout.splitlines() if line.startswith("Final:")][-1]
    mb_per_s = float(final.split()[6])  # bandwidth overall, in MB/s of 2**20 bytes
    return mb_per_s * 2**20 / 1e9, protocol_for(out.stdout + out.stderr, message_bytes)


def rounds_parser(doc: str | None, per_round: int, eh_default: str = "on") -> argparse.ArgumentParser:
    """The flags every benchmark here shares: interleaved rounds, samples per round, and
    UCX error handling ("both" runs it on, then off, where ``eh_default`` is "both")."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved rounds (default 5; >= 5 for a note)")
    parser.add_argument("--per-round", type=int, default=per_round,
                        help=f"samples per case and round (default {per_round})")
    choices = ("on", "off", "both") if eh_default == "both" else ("on", "off")
    parser.add_argument("--eh", choices=choices, default=eh_default,
                        help=f"UCX peer error handling (default {eh_default}; on is the daemon's)")
    return parser


def print_result(result: dict[str, object], as_json: bool) -> None:
    """A benchmark's figures: one JSON object, or a line per figure."""
    if as_json:
        print(json.dumps(result, indent=2))
        return
    width = max(map(len, result)) + 2
    for key, value in result.items():
        print(f"{key:<{width}}{value}")


def kernel_copy_gbps(path: str, piece: int, shm_dir: str, resend: bool = False,
                     idle_s: float = 0.0, memory: str = "pool") -> float:
    """Median GB/s of ``kernel_copy.py`` (run in a fresh process: it forks)."""
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("kernel_copy.py")), path,
                          "--piece", str(piece), "--repeats", "3", "--shm-dir", shm_dir,
                          "--idle-s", str(idle_s), "--memory", memory,
                          *(["--resend"] if resend else [])],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return float(json.loads(out)["gbps_median"])


@dataclass
class Pair:
    """A running prefill/decode daemon pair with a pool of one preset."""

    prefill: LocalDaemon
    decode: LocalDaemon
    sender: KvxferClient
    receiver: KvxferClient
    num_pages: int
    pages_per_transfer: int
    rng: random.Random
    count: int = 0

    def move(self, pages: int, verify: bool = False) -> tuple[TransferInfo, float]:
        """Push one transfer of ``pages`` pages in seeded random runs; the receiver's status
        and the seconds from the expect call to both waits returning."""
        src = random_runs(self.rng, list(range(self.num_pages)), pages, (1, 16))
        dst = random_runs(self.rng, list(range(self.num_pages)), pages, (1, 16))
        self.count += 1
        start = time.perf_counter()
        done = hand_off(self.sender, self.receiver, f"bw-{self.count}", pool="kv", src=src,
                        dst=dst, decode_peer=self.decode.peer_address, verify=verify,
                        timeout_s=120)
        elapsed = time.perf_counter() - start
        if not done.ok:
            raise RuntimeError(f"transfer bw-{self.count} failed: {done.why}: "
                               f"{done.sent.error or done.received.error}")
        return done.received, elapsed

    def pull(self, pages: int, verify: bool = False) -> tuple[TransferInfo, float]:
        """Pull one transfer of ``pages`` pages in seeded random runs (as ``move`` pushes
        one: ``hand_off``); the receiver's status and the seconds from the offer call to
        both waits returning."""
        src = random_runs(self.rng, list(range(self.num_pages)), pages, (1, 16))
        dst = random_runs(self.rng, list(range(self.num_pages)), pages, (1, 16))
        self.count += 1
        start = time.perf_counter()
        done = hand_off(self.sender, self.receiver, f"pull-{self.count}", pool="kv", src=src,
                        dst=dst, prefill_peer=self.prefill.peer_address, mode="pull",
                        verify=verify, timeout_s=120)
        elapsed = time.perf_counter() - start
        if not done.ok:
            raise RuntimeError(f"transfer pull-{self.count} failed: {done.why}: "
                               f"{done.sent.error or done.received.error}")
        return done.received, elapsed

    def transfer_gbps(self) -> tuple[float, float]:
        """Move one transfer: its GB/s as the client saw it, and over the receiver's data
        phase alone (receives posted to the last arrived)."""
        got, elapsed = self.move(self.pages_per_transfer)
        return got.bytes / elapsed / 1e9, got.bytes / got.data_seconds / 1e9


@contextlib.contextmanager
def daemon_pair(preset: str, pages_per_transfer: int, env: dict[str, str],
                chunk_bytes: int, error_handling: bool, shm_dir: str,
                lanes: int = 1, local_copy: bool = False) -> Iterator[Pair]:
    """Two daemons with pool ``kv`` of ``preset`` (``local_copy``: with ``--local-copy``);
    the source pages hold random bytes."""
    pool = f"name=kv,preset={preset}"
    args = ["--chunk-bytes", str(chunk_bytes), "--ucx-lanes", str(lanes),
            "--ucx-error-handling" if error_handling else "--no-ucx-error-handling",
            "--local-copy" if local_copy else "--no-local-copy"]
    env = {**env, "UCX_PROTO_INFO": "y"}
    with LocalDaemon("prefill", [pool], env=env, extra_args=args, shm_dir=shm_dir) as pre, \
            LocalDaemon("decode", [pool], env=env, extra_args=args, shm_dir=shm_dir) as dec, \
            KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
            p.attach("kv") as src:
        noise = np.random.default_rng(0).bytes(src.raw.numel())
        src.raw.copy_(torch.frombuffer(bytearray(noise), dtype=torch.uint8))
        pair = Pair(pre, dec, p, d, src.descriptor.num_pages, pages_per_transfer, random.Random(0))
        pair.transfer_gbps()  # warm-up: connection set-up, first-touch of UCX resources
        yield pair


def run_mode(error_handling: bool, rounds: int, per_round: int, chunk_bytes: int,
             shm_dir: str, lanes: int, extra_lanes: int) -> dict[str, object]:
    """Interleaved rounds of kvxfer ps16, kvxfer ps1 and ucx_perftest for one error-handling mode."""
    env = ucx_env()
    samples: dict[str, list[float]] = {k: [] for k in ("kvxfer_ps16", "kvxfer_ps16_data",
                                                       "kvxfer_ps16_extra_lanes",
                                                       "kvxfer_ps1", "perftest_chunk",
                                                       "perftest_256MiB", "perftest_128KiB",
                                                       "kernel_copy", "kernel_copy_resend",
                                                       "kernel_copy_perftest_memory",
                                                       "kernel_copy_perftest_memory_resend")}
    ratios: dict[str, list[float]] = {"kvxfer_vs_perftest": [], "kvxfer_vs_perftest_256MiB": [],
                                      "kvxfer_vs_kernel_copy": [], "kvxfer_data_vs_kernel_copy": [],
                                      "ps1_vs_ps16": [], "extra_lanes_vs_lanes": [],
                                      "perftest_128KiB_vs_chunk": [],
                                      "kernel_copy_resend_vs_kernel_copy": [],
                                      "perftest_vs_kernel_copy_perftest_memory_resend": [],
                                      "perftest_256MiB_vs_kernel_copy_perftest_memory": []}
    with daemon_pair("llama8b", 128, env, chunk_bytes, error_handling, shm_dir, lanes) as ps16, \
            daemon_pair("llama8b", 128, env, chunk_bytes, error_handling, shm_dir,
                        extra_lanes) as more, \
            daemon_pair("llama8b-ps1", 2048, env, chunk_bytes, error_handling, shm_dir,
                        lanes) as ps1:
        kvxfer_protocol = protocol_for(ps16.prefill.log(), chunk_bytes)
        transport = kvxfer_protocol.rpartition(" over ")[2].split("/")[0]
        if transport not in TLS_OF:
            raise RuntimeError(f"cannot tell which transport kvxfer used: {kvxfer_protocol!r}")
        pt_env = {**env, "UCX_TLS": TLS_OF[transport]}
        perftest_protocols: set[str] = set()
        for _ in range(rounds):
            runs16 = [ps16.transfer_gbps() for _ in range(per_round)]
            a = statistics.median(client for client, _ in runs16)
            a_data = statistics.median(data for _, data in runs16)
            b = statistics.median(client for client, _ in (ps1.transfer_gbps()
                                                            for _ in range(per_round)))
            c = statistics.median(client for client, _ in (more.transfer_gbps()
                                                            for _ in range(per_round)))
            ref, protos = perftest(chunk_bytes, 2000, pt_env)
            ref_big, _ = perftest(256 << 20, 20, pt_env)
            ref_small, _ = perftest(128 << 10, 20000, pt_env)
            path = "tcp" if transport == "tcp" else "cma"
            kernel = kernel_copy_gbps(path, chunk_bytes, shm_dir)
            kernel_resend = kernel_copy_gbps(path, chunk_bytes, shm_dir, resend=True)
            kernel_pt = kernel_copy_gbps(path, chunk_bytes, shm_dir, memory="perftest")
            kernel_pt_resend = kernel_copy_gbps(path, chunk_bytes, shm_dir, resend=True,
                                                memory="perftest")
            perftest_protocols.add(protos)
            for name, value in (("kvxfer_ps16", a), ("kvxfer_ps16_data", a_data),
                                ("kvxfer_ps16_extra_lanes", c),
                                ("kvxfer_ps1", b), ("perftest_chunk", ref),
                                ("perftest_256MiB", ref_big), ("perftest_128KiB", ref_small),
                                ("kernel_copy", kernel), ("kernel_copy_resend", kernel_resend),
                                ("kernel_copy_perftest_memory", kernel_pt),
                                ("kernel_copy_perftest_memory_resend", kernel_pt_resend)):
                samples[name].append(value)
            ratios["kvxfer_vs_perftest"].append(a / ref)
            ratios["kvxfer_vs_perftest_256MiB"].append(a / ref_big)
            ratios["kvxfer_vs_kernel_copy"].append(a / kernel)
            ratios["kvxfer_data_vs_kernel_copy"].append(a_data / kernel)
            ratios["ps1_vs_ps16"].append(b / a)
            ratios["extra_lanes_vs_lanes"].append(c / a)
            ratios["perftest_128KiB_vs_chunk"].append(ref_small / ref)
            ratios["kernel_copy_resend_vs_kernel_copy"].append(kernel_resend / kernel)
            ratios["perftest_vs_kernel_copy_perftest_memory_resend"].append(ref / kernel_pt_resend)
            ratios["perftest_256MiB_vs_kernel_copy_perftest_memory"].append(ref_big / kernel_pt)
    result: dict[str, object] = {
        "kvxfer_protocol": kvxfer_protocol,
        "perftest_protocol": " / ".join(sorted(perftest_protocols)),
        "perftest_UCX_TLS": pt_env["UCX_TLS"],
        "kernel_copy_path": "tcp socket" if transport == "tcp" else "process_vm_writev",
        "same_protocol": perftest_protocols == {kvxfer_protocol},
    }
    for name, values in samples.items():
        result[f"{name}_gbps_median"] = round(statistics.median(values), 3)
        result[f"{name}_gbps_rounds"] = [round(v, 3) for v in values]
    for name, values in ratios.items():
        result[f"ratio_{name}"] = round(statistics.median(values), 3)
    return result


def main() -> int:
    parser = rounds_parser(__doc__, per_round=3, eh_default="both")
    parser.add_argument("--chunk-bytes", type=int, default=2 << 20,
                        help="kvxfer's largest message and ucx_perftest's message size (default 2 MiB)")
    parser.add_argument("--shm-dir", default="/dev/shm",
                        help="the daemons' and the kernel copy's shared-memory directory; a tmpfs "
                             "mounted with huge=always backs pools with 2 MiB pages (default /dev/shm)")
    parser.add_argument("--lanes", type=int, default=1,
                        help="the daemons' UCX data lanes (--ucx-lanes; default 1, the daemon's)")
    parser.add_argument("--extra-lanes", type=int, default=2,
                        help="UCX data lanes of the one extra page_size 16 case (default 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.eh]
    result: dict[str, object] = {"chunk_bytes": args.chunk_bytes, "rounds": args.rounds,
                                 "per_round": args.per_round, "shm_dir": args.shm_dir,
                                 "lanes": args.lanes, "extra_lanes": args.extra_lanes}
    for eh in modes:
        result[f"eh_{'on' if eh else 'off'}"] = run_mode(eh, args.rounds, args.per_round,
                                                         args.chunk_bytes, args.shm_dir,
                                                         args.lanes, args.extra_lanes)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for key, value in result.items():
        if isinstance(value, dict):
            print(f"== UCX error handling {key.removeprefix('eh_')}")
            for name, figure in value.items():
                print(f"  {name:34s} {figure}")
        else:
            print(f"{key:36s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
