"""The kernel's own ceiling for moving one transfer's bytes between two processes.

UCX's shared-memory path (cma) is ``process_vm_writev`` and its tcp path is a
socket on loopback; this measures both directly, on the kind of memory kvxfer
pools are (a MAP_SHARED|MAP_POPULATE file in /dev/shm, 4 KiB pages), walking
256 MiB in 2 MiB pieces as a transfer does. No UCX, no Python per byte: one
syscall per piece. It is the reference ``transfer_bandwidth.py`` reports beside
ucx_perftest. ``--resend`` copies the first piece over and over instead, as
ucx_perftest does, to show what cache residency alone is worth on the same
memory. ``--idle-s S`` sleeps before each repeat, to show what an idle machine
costs a copy.

``--memory perftest`` copies between buffers of the kind ucx_perftest moves
instead: it allocates them with ``ucp_mem_map(ALLOCATE)``, which on this host
gives private anonymous memory advised for transparent huge pages (2 MiB pages:
its receive buffer shows as AnonHugePages in /proc/PID/smaps), and it never
writes its send buffer, so every byte it sends is read from the kernel's zero
page (its sender's resident set stays at 2 MiB of a 256 MiB buffer). Here the
source is such an untouched mapping and the destination such a huge-page
mapping, populated before the first repeat as perftest's warm-up does.

usage: python benchmarks/kernel_copy.py cma|tcp [--bytes N] [--piece N] [--repeats 5] [--shm-dir D]
       [--memory pool|perftest] [--resend] [--idle-s S]
Prints one JSON object: {"path": ..., "memory": ..., "gbps": [...], "gbps_median": ...,
"dst_huge_page_share": ...} (how much of the destination the kernel backed with huge pages).
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
MEMORY = "pool"  #: set by --memory: "pool" (kvxfer's) or "perftest" (ucx_perftest's)
RESEND = False  #: set by --resend: every piece is the buffer's first piece
IDLE_S = 0.0  #: set by --idle-s: seconds asleep before each repeat
HUGE_PAGE = 2 << 20


def at(off: int, piece: int) -> int:
    """Where the piece at ``off`` of a walk lives: ``off``, or the first piece under --resend."""
    return off % piece if RESEND else off


class Buffer:
    """``nbytes`` of memory of the kind ``MEMORY`` names, at ``addr`` (``view`` over the same)."""

    def __init__(self, nbytes: int, role: str) -> None:
        if MEMORY == "pool":
            # Not "kvxfer-": a daemon starting meanwhile sweeps unlocked /dev/shm/kvxfer-* files.
            with tempfile.NamedTemporaryFile(dir=SHM_DIR, prefix="bench-copy-") as f:
                os.posix_fallocate(f.fileno(), 0, nbytes)
                self._map = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        else:
            # Private and anonymous, advised for huge pages, one huge page of slack so the
            # used part starts on a huge-page boundary; kept from a forked child (whose
            # copy-on-write would otherwise tax the parent's first writes).
            self._map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._map.madvise(mmap.MADV_HUGEPAGE)
            self._map.madvise(mmap.MADV_DONTFORK)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        start = 0 if MEMORY == "pool" else -base % HUGE_PAGE
        self.addr = base + start
        self.view = memoryview(self._map)[start : start + nbytes]
        if role == "src" and MEMORY == "pool":
            self.view[:] = os.urandom(1 << 20) * (nbytes >> 20)
        elif role == "dst" and MEMORY == "perftest":
            ctypes.memset(self.addr, 0, nbytes)  # populated, as perftest's warm-up leaves it


#: smaps fields that count memory mapped with huge pages (anonymous THP, shmem/tmpfs, hugetlbfs)
HUGE_FIELDS = ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:", "Shared_Hugetlb:", "Private_Hugetlb:")


def huge_page_share(addr: int, nbytes: int) -> float:
    """The share of ``nbytes`` at ``addr`` that this process maps with huge pages (/proc/self/smaps)."""
    huge, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            key = line.split(None, 1)[0]
            if not key.endswith(":"):  # a mapping's first line: "start-end perms ..."
                low, high = (int(x, 16) for x in key.split("-"))
                inside = low < addr + nbytes and high > addr
            elif inside and key in HUGE_FIELDS:
                huge += int(line.split()[1]) * 1024
    return min(1.0, huge / nbytes)


def cma_child(parent: int, dst_addr: int, nbytes: int, piece: int, repeats: int, out: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    src = Buffer(nbytes, "src")
    rates = []
    for _ in range(repeats):
        time.sleep(IDLE_S)
        start = time.perf_counter()
        for off in range(0, nbytes, piece):
            size = min(piece, nbytes - off)  # the last piece may be short
            local, remote = IoVec(src.addr + at(off, piece), size), IoVec(dst_addr + at(off, piece), size)
            if libc.process_vm_writev(parent, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != size:
                raise OSError(ctypes.get_errno(), "process_vm_writev")
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    os.write(out, json.dumps(rates).encode())


def tcp_child(port: int, nbytes: int, piece: int, repeats: int) -> None:
    src = Buffer(nbytes, "src")
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(repeats):
            sock.recv(1)  # the receiver's go-ahead for this round
            for off in range(0, nbytes, piece):
                sock.sendall(src.view[at(off, piece) : at(off, piece) + min(piece, nbytes - off)])


def measure(path: str, nbytes: int, piece: int, repeats: int) -> tuple[list[float], float]:
    """Fork a sender; the parent owns the destination. GB/s of each repeat, and the share
    of the destination on huge pages."""
    dst = Buffer(nbytes, "dst")
    return copy(dst, path, nbytes, piece, repeats), huge_page_share(dst.addr, nbytes)


def copy(dst: Buffer, path: str, nbytes: int, piece: int, repeats: int) -> list[float]:
    """GB/s of each repeat of a forked sender's copy into ``dst``."""
    if path == "cma":
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                cma_child(os.getppid(), dst.addr, nbytes, piece, repeats, w)
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
    view = dst.view
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
    parser.add_argument("--memory", choices=("pool", "perftest"), default="pool",
                        help="kvxfer's pool memory (default) or ucx_perftest's (see above)")
    parser.add_argument("--resend", action="store_true",
                        help="copy the first piece every time (cache-resident, as ucx_perftest)")
    parser.add_argument("--idle-s", type=float, default=0.0, help="sleep before each repeat")
    args = parser.parse_args()
    global SHM_DIR, MEMORY, RESEND, IDLE_S
    SHM_DIR, MEMORY, RESEND, IDLE_S = args.shm_dir, args.memory, args.resend, args.idle_s
    rates, huge = measure(args.path, args.bytes, args.piece, args.repeats)
    print(json.dumps({"path": args.path, "memory": args.memory, "gbps": [round(r, 3) for r in rates],
                      "gbps_median": round(statistics.median(rates), 3),
                      "dst_huge_page_share": round(huge, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
