"""kvxfer's data plane alone: UcxEngine to UcxEngine against the kernel copy, in one run.

Two processes, each a ``kvxfer.transport.UcxEngine`` over a populated /dev/shm
mapping of 256 MiB (the standard workload's bytes), no daemon and no gRPC: the
receiver posts one receive per chunk, the sender sends the chunks with the
daemon's 64 MiB window, and each transfer is timed at the sender (send posted
to the last send complete). Set beside ``transfer_bandwidth.py`` it tells how
much of kvxfer's gap to the kernel is the transport and how much the daemon.

The reference is ``kernel_copy.py`` on the transport UCX picked (read from
``UCX_PROTO_INFO``: process_vm_writev for cma, a loopback socket for tcp) in
pieces of the chunk size, run between rounds; the ratio printed is the median
of the per-round ratios. At the end both sides hash their buffers and the run
fails unless the bytes arrived. ``--idle-s S`` sleeps before every transfer and
every kernel copy, as a daemon between sporadic requests.

usage: python benchmarks/engine_bandwidth.py [--rounds 5] [--per-round 5] [--eh on|off]
       [--chunk-bytes 2097152] [--shm-dir /dev/shm] [--idle-s 0] [--json]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import IO

import numpy as np
import xxhash
from transfer_bandwidth import kernel_copy_gbps, print_result, protocol_for, rounds_parser, ucx_env

TRANSFER_BYTES = 256 << 20
WINDOW_BYTES = 64 << 20  # the daemon's default window


def shm_buffer(nbytes: int, shm_dir: str) -> np.ndarray:
    """A populated shared mapping of an unlinked file in ``shm_dir``, as a kvxfer arena."""
    # Not "kvxfer-": a daemon starting meanwhile sweeps unlocked /dev/shm/kvxfer-* files.
    with tempfile.NamedTemporaryFile(dir=shm_dir, prefix="bench-engine-") as f:
        os.posix_fallocate(f.fileno(), 0, nbytes)
        mapping = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    return np.frombuffer(mapping, dtype=np.uint8)


def engine_role(role: str, port: int, error_handling: bool, chunk_bytes: int, shm_dir: str) -> None:
    """One side, driven line by line over stdin: ``go`` runs one transfer, ``quit`` ends."""
    from kvxfer.transport import UcxEngine

    engine = UcxEngine(error_handling=error_handling)
    buffer = shm_buffer(TRANSFER_BYTES, shm_dir)
    offsets = range(0, TRANSFER_BYTES, chunk_bytes)
    endpoint = None
    if role == "send":
        buffer[:] = np.random.default_rng(0).integers(0, 256, TRANSFER_BYTES, dtype=np.uint8)
        endpoint = engine.connect("127.0.0.1", port)
    print(f"READY {engine.port}", flush=True)
    for number, line in enumerate(sys.stdin):
        if line.strip() == "quit":
            break
        messages = [(buffer[o:o + chunk_bytes], (number << 20) + i) for i, o in enumerate(offsets)]
        start = time.perf_counter()
        if endpoint is None:
            batch = engine.receive(messages)
            print("POSTED", flush=True)
        else:
            batch = engine.send(endpoint, messages, WINDOW_BYTES)
        batch.future.result(timeout=60)
        print(f"DONE {TRANSFER_BYTES / (time.perf_counter() - start) / 1e9:.4f}", flush=True)
    print(f"DIGEST {xxhash.xxh3_64_hexdigest(memoryview(buffer))}", flush=True)
    engine.close()


def expect(stream: IO[str], word: str, skipped: list[str] | None = None) -> str:
    """The rest of the next line of ``stream`` that starts with ``word``; other lines
    (UCX's own output) go to ``skipped``."""
    for line in stream:
        if line.startswith(word):
            return line[len(word):].strip()
        if skipped is not None:
            skipped.append(line)
    raise RuntimeError(f"engine process ended before saying {word}")


def main() -> int:
    parser = rounds_parser(__doc__, per_round=5)
    parser.add_argument("--chunk-bytes", type=int, default=2 << 20, help="message size (default 2 MiB)")
    parser.add_argument("--shm-dir", default="/dev/shm", help="where both buffers live")
    parser.add_argument("--idle-s", type=float, default=0.0,
                        help="seconds asleep before each transfer and kernel copy (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--role", choices=("send", "recv"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        engine_role(args.role, args.port, args.eh == "on", args.chunk_bytes, args.shm_dir)
        return 0

    env = {**os.environ, **ucx_env(), "UCX_PROTO_INFO": "y"}
    common = [sys.executable, __file__, "--eh", args.eh, "--chunk-bytes", str(args.chunk_bytes),
              "--shm-dir", args.shm_dir]
    sender_log: list[str] = []  # UCX_PROTO_INFO tables among the sender's lines
    receiver = subprocess.Popen([*common, "--role", "recv"], env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    sender = None
    try:
        port = int(expect(receiver.stdout, "READY"))
        sender = subprocess.Popen([*common, "--role", "send", "--port", str(port)], env=env,
                                  text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        expect(sender.stdout, "READY")

        def transfer() -> float:
            time.sleep(args.idle_s)
            receiver.stdin.write("go\n")
            receiver.stdin.flush()
            expect(receiver.stdout, "POSTED")
            sender.stdin.write("go\n")
            sender.stdin.flush()
            gbps = float(expect(sender.stdout, "DONE", sender_log))
            expect(receiver.stdout, "DONE")
            return gbps

        transfer()  # warm-up: the endpoint's final configuration, first touch
        protocol = protocol_for("".join(sender_log), args.chunk_bytes)
        if " over " not in protocol:
            raise RuntimeError("UCX_PROTO_INFO did not say which protocol the sends used")
        path = "tcp" if " over tcp" in protocol else "cma"
        engine: list[float] = []
        kernel: list[float] = []
        ratios: list[float] = []
        for _ in range(args.rounds):
            engine.append(statistics.median(transfer() for _ in range(args.per_round)))
            kernel.append(kernel_copy_gbps(path, args.chunk_bytes, args.shm_dir,
                                           idle_s=args.idle_s))
            ratios.append(engine[-1] / kernel[-1])
        for process in (receiver, sender):
            process.stdin.write("quit\n")
            process.stdin.flush()
        digests = {expect(p.stdout, "DIGEST") for p in (receiver, sender)}
        if len(digests) != 1:
            raise RuntimeError("the receiver's bytes differ from the sender's")
        for process in (receiver, sender):
            process.wait(30)
    finally:
        for process in (receiver, sender):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(10)
    result = {
        "eh": args.eh, "chunk_bytes": args.chunk_bytes, "shm_dir": args.shm_dir,
        "idle_s": args.idle_s,
        "ucx_protocol": protocol, "kernel_copy_path": path,
        "engine_gbps_median": round(statistics.median(engine), 3),
        "engine_gbps_rounds": [round(v, 3) for v in engine],
        "kernel_copy_gbps_median": round(statistics.median(kernel), 3),
        "kernel_copy_gbps_rounds": [round(v, 3) for v in kernel],
        "ratio_engine_vs_kernel_copy": round(statistics.median(ratios), 3),
        "bytes_verified": True,
    }
    print_result(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
