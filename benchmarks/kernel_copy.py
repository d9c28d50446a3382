"""The kernel's own ceiling for moving one transfer's bytes between two processes.

UCX's shared-memory path (cma) is ``process_vm_writev`` and its tcp path is a
socket on loopback; this measures both directly, on the kind of memory kvxfer
pools are (a MAP_SHARED|MAP_POPULATE file in /dev/shm, 4 KiB pages), walking
256 MiB in 2 MiB pieces as a transfer does. No UCX, no Python per byte: one
syscall per piece. It is the reference ``transfer_bandwidth.py`` reports beside
ucx_perftest, which resends one cache-resident buffer from private memory.
``--resend`` copies the first piece over and over instead, as ucx_perftest does,
to show what cache residency alone is worth on the same memory. ``--idle-s S``
sleeps before each repeat, to show what an idle machine costs a copy.

usage: python benchmarks/kernel_copy.py cma|tcp [--bytes N] [--piece N] [--repeats 5] [--shm-dir D]
       [--resend] [--idle-s S]
Prints one JSON object: {"path": ..., "gbps": [...], "gbps_median": ...}.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


SHM_DIR = "/dev/shm"  #: set by --shm-dir (a tmpfs mounted with huge=always gives 2 MiB pages)
RESEND = False  #: set by --resend: every piece is the buffer's first piece
IDLE_S = 0.0  #: set by --idle-s: seconds asleep before each repeat


def at(off: int, piece: int) -> int:
    """Where the piece at ``off`` of a walk lives: ``off``, or the first piece under --resend."""
    return off % piece if RESEND else off


def shm_buffer(nbytes: int) -> mmap.mmap:
    """A populated shared mapping of a file in SHM_DIR, as a kvxfer arena is."""
    with tempfile.NamedTemporaryFile(dir=SHM_DIR, prefix="kvxfer-bench-") as f:
        os.posix_fallocate(f.fileno(), 0, nbytes)
        return mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)


def address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def cma_child(parent: int, dst_addr: int, nbytes: int, piece: int, repeats: int, out: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    src = shm_buffer(nbytes)
    src[:] = os.urandom(1 << 20) * (nbytes >> 20)
    src_addr = address(src)
    rates = []
    for _ in range(repeats):
        time.sleep(IDLE_S)
        start = time.perf_counter()
        for off in range(0, nbytes, piece):
            local, remote = IoVec(src_addr + at(off, piece), piece), IoVec(dst_addr + at(off, piece), piece)
            if libc.process_vm_writev(parent, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != piece:
                raise OSError(ctypes.get_errno(), "process_vm_writev")
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    os.write(out, json.dumps(rates).encode())


def tcp_child(port: int, nbytes: int, piece: int, repeats: int) -> None:
    src = shm_buffer(nbytes)
    view = memoryview(src)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(repeats):
            sock.recv(1)  # the receiver's go-ahead for this round
            for off in range(0, nbytes, piece):
                sock.sendall(view[at(off, piece) : at(off, piece) + piece])


def measure(path: str, nbytes: int, piece: int, repeats: int) -> list[float]:
    """Fork a sender; the parent owns the destination. GB/s of each repeat."""
    dst = shm_buffer(nbytes)
    if path == "cma":
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                cma_child(os.getppid(), address(dst), nbytes, piece, repeats, w)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            os._exit(0)
        os.close(w)
        data = b"".join(iter(lambda: os.read(r, 65536), b""))
        os.waitpid(pid, 0)
        return json.loads(data)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)
    port = listener.getsockname()[1]
    pid = os.fork()
    if pid == 0:
        listener.close()
        try:
            tcp_child(port, nbytes, piece, repeats)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    conn, _ = listener.accept()
    conn.settimeout(60)
    view = memoryview(dst)
    rates = []
    for _ in range(repeats):
        time.sleep(IDLE_S)
        conn.sendall(b"k")
        got = 0
        start = time.perf_counter()
        while got < nbytes:
            n = conn.recv_into(view[at(got, piece) : at(got, piece) + piece - got % piece])
            if n == 0:
                raise ConnectionError("the sender went away")
            got += n
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    conn.close()
    listener.close()
    os.waitpid(pid, 0)
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", choices=("cma", "tcp"))
    parser.add_argument("--bytes", type=int, default=256 << 20)
    parser.add_argument("--piece", type=int, default=2 << 20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shm-dir", default="/dev/shm", help="where the buffers' files live")
    parser.add_argument("--resend", action="store_true",
                        help="copy the first piece every time (cache-resident, as ucx_perftest)")
    parser.add_argument("--idle-s", type=float, default=0.0, help="sleep before each repeat")
    args = parser.parse_args()
    global SHM_DIR, RESEND, IDLE_S
    SHM_DIR, RESEND, IDLE_S = args.shm_dir, args.resend, args.idle_s
    rates = measure(args.path, args.bytes, args.piece, args.repeats)
    print(json.dumps({"path": args.path, "gbps": [round(r, 3) for r in rates],
                      "gbps_median": round(statistics.median(rates), 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
