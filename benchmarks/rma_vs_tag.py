"""One-sided UCX reads against tagged sends between two processes, in alternating rounds.

    UCX_NET_DEVICES=lo .venv/bin/python benchmarks/rma_vs_tag.py [--rounds 5] [--json]

What issue #31 asks before a decode-initiated read path is built: what ``ucp_get_nbx``
gains over the tagged messages kvxfer's daemons send today, on this machine's transport
(tcp over loopback), with UCX error handling on (as daemons run), and what a per-transfer
registration would cost. Both move the standard workload, 128 pages of 2 MiB (256 MiB),
from a source process (the "prefill" side, this script with ``--source``) into this one:

- ``get``: the reader unpacks the source's remote key once and issues 128 ``ucp_get_nbx``
  at once, then one ``ucp_worker_flush_nbx``;
- ``tag``: the reader posts 128 tagged receives, then the source sends 128 tagged messages
  (ucxx's core API, as kvxfer's data plane does).

Per round, each mode moves the workload 3 times (the order alternating round by round);
printed: GB/s medians, the ratio get / tag (the median of per-round ratios), one page's
latency for each mode (p50), the source's CPU per GB moved in each mode (it sleeps in
epoll between events, as a daemon's data plane does; over tcp UCX emulates RMA in software:
the source's progress loop copies every byte), and what ``ucp_mem_map`` +
``ucp_rkey_pack`` + ``ucp_mem_unmap`` of one 2 MiB page costs (the price of a key per
transfer; on RDMA hardware registration pins memory and costs far more: nixl#1392).
Every move is checked: its first and last page must hold the source's bytes. Needs cffi
(the daemon install has it) and ucxx; no headers, no compiler.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import select
import statistics
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvxfer.ucx_settings import apply_ucx_defaults  # noqa: E402

apply_ucx_defaults()

import ucx_rma_confinement as rma  # noqa: E402 - the cffi binding of libucp, after UCX's environment
from ucxx._lib import libucxx as api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

PAGE = 2 << 20
PAGES = 128
REPEATS = 3
ffi, ucp = rma.ffi, rma.ucp


def address_of(buffer: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def wait(worker: Any, request: Any) -> None:
    """Progress ``worker`` until the UCP request ``request`` completes; raise if it failed."""
    pointer = int(ffi.cast("uintptr_t", request))
    if pointer == 0:
        return
    if pointer >= (1 << 64) - 1000:
        raise RuntimeError(rma.status(int(ffi.cast("intptr_t", request))))
    while (code := ucp.ucp_request_check_status(request)) == 1:  # UCS_INPROGRESS
        worker.progress()
    ucp.ucp_request_free(request)
    if code != 0:
        raise RuntimeError(rma.status(code))


def registration_us(ctx: Any, buffer: bytearray, count: int = 200) -> float:
    """Median microseconds to map, pack a key for, and unmap one page of ``buffer``."""
    base, key, size = address_of(buffer), ffi.new("void **"), ffi.new("size_t *")
    handle = ffi.cast("void*", ctx.handle)
    samples = []
    for i in range(count):
        start = time.perf_counter()
        params = ffi.new("ucp_mem_map_params_t *")
        params.field_mask, params.length, params.prot = 1 | 2 | 8, PAGE, rma.REMOTE_READ
        params.address = ffi.cast("void*", base + (i % PAGES) * PAGE)
        memh = ffi.new("ucp_mem_h *")
        assert rma.status(ucp.ucp_mem_map(handle, params, memh)) == "Success"
        ucp.ucp_rkey_pack(handle, memh[0], key, size)
        ucp.ucp_rkey_buffer_release(key[0])
        ucp.ucp_mem_unmap(handle, memh[0])
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def source() -> None:
    """The source process: its pages registered for reads, a listener for the reader, and
    on each "send N TAG" line from stdin, N tagged messages of its pages."""
    ctx, worker = rma.context(rma=True)
    accepted: list[Any] = []
    listener = api.UCXListener.create(
        worker=worker, port=0,
        cb_func=lambda request: accepted.append(listener.create_endpoint_from_conn_request(request, True)))
    pages = bytearray(os.urandom(PAGE)) * PAGES
    params = ffi.new("ucp_mem_map_params_t *")
    params.field_mask, params.length, params.prot = 1 | 2 | 8, len(pages), rma.REMOTE_READ
    params.address = ffi.cast("void*", address_of(pages))
    memh, key, size = ffi.new("ucp_mem_h *"), ffi.new("void **"), ffi.new("size_t *")
    assert rma.status(ucp.ucp_mem_map(ffi.cast("void*", ctx.handle), params, memh)) == "Success"
    ucp.ucp_rkey_pack(ffi.cast("void*", ctx.handle), memh[0], key, size)
    packed = bytes(ffi.buffer(key[0], size[0]))
    print(json.dumps({"port": listener.port, "address": address_of(pages), "key": packed.hex(),
                      "page_digest": hashlib.blake2b(pages[:PAGE]).hexdigest(),
                      "registration_us": registration_us(ctx, pages)}), flush=True)
    arrays = [Array(memoryview(pages)[i * PAGE:(i + 1) * PAGE]) for i in range(PAGES)]
    worker.init_blocking_progress_mode()  # as a daemon's data plane: sleep until UCX has work
    while True:
        worker.progress()
        ready = [sys.stdin] if select.select([sys.stdin], [], [], 0)[0] else []
        if not ready and worker.arm():
            ready = select.select([sys.stdin, worker.epoll_file_descriptor], [], [], 0.5)[0]
        if sys.stdin not in ready:
            continue
        line = sys.stdin.readline()
        if not line:
            return
        count, tag = map(int, line.split()[1:])
        requests = [accepted[0].tag_send(arrays[i], api.UCXXTag(tag + i)) for i in range(count)]
        while not all(r.completed for r in requests):
            worker.progress()
        for r in requests:
            r.check_error()
        print(json.dumps({"cpu_s": time.process_time()}), flush=True)


class Reader:
    """This process: reads (get) or receives (tag) the source's pages into its own."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, __file__, "--source"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None and self.process.stdin is not None
        info = json.loads(self.process.stdout.readline())
        self.registration_us = info["registration_us"]
        self.page_digest = info["page_digest"]  # every source page holds the same bytes
        self.remote = info["address"]
        self.ctx, self.worker = rma.context(rma=True)
        self.ep = api.UCXEndpoint.create(self.worker, "127.0.0.1", info["port"], True)
        for _ in range(300):
            self.worker.progress()
            time.sleep(0.001)
        self.rkey = ffi.new("ucp_rkey_h *")
        assert rma.status(ucp.ucp_ep_rkey_unpack(ffi.cast("void*", self.ep.handle),
                                                 bytes.fromhex(info["key"]), self.rkey)) == "Success"
        self.pages = bytearray(PAGE * PAGES)
        self.base = address_of(self.pages)
        self.arrays = [Array(memoryview(self.pages)[i * PAGE:(i + 1) * PAGE]) for i in range(PAGES)]
        self.params = ffi.new("ucp_request_param_t *")
        self.tag = 1 << 40
        self.source_cpu = {"get": 0.0, "tag": 0.0}
        self.moved = {"get": 0, "tag": 0}

    def _source_cpu(self) -> float:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("send 0 0\n")
        self.process.stdin.flush()
        return float(json.loads(self.process.stdout.readline())["cpu_s"])

    def _clear(self, count: int) -> None:
        """Zero the first and the last page ``count`` pages will land in."""
        for page in {0, count - 1}:
            self.pages[page * PAGE:(page + 1) * PAGE] = bytes(PAGE)

    def _check(self, count: int, mode: str) -> None:
        """The first and the last page landed with the source's bytes."""
        for page in {0, count - 1}:
            digest = hashlib.blake2b(self.pages[page * PAGE:(page + 1) * PAGE]).hexdigest()
            if digest != self.page_digest:
                raise RuntimeError(f"{mode}: page {page} did not arrive intact")

    def get(self, count: int) -> float:
        """Seconds to read ``count`` pages."""
        self._clear(count)
        before = self._source_cpu()
        start = time.perf_counter()
        handle = ffi.cast("void*", self.ep.handle)
        requests = [ucp.ucp_get_nbx(handle, ffi.cast("void*", self.base + i * PAGE), PAGE,
                                    self.remote + i * PAGE, self.rkey[0], self.params)
                    for i in range(count)]
        for request in requests:
            wait(self.worker, request)
        wait(self.worker, ucp.ucp_worker_flush_nbx(ffi.cast("void*", self.worker.handle), self.params))
        elapsed = time.perf_counter() - start
        self.source_cpu["get"] += self._source_cpu() - before
        self.moved["get"] += count * PAGE
        self._check(count, "get")
        return elapsed

    def receive(self, count: int) -> float:
        """Seconds from posting ``count`` receives to the last one completing."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self._clear(count)
        before = self._source_cpu()
        self.tag += PAGES
        start = time.perf_counter()
        requests = [self.ep.tag_recv(self.arrays[i], api.UCXXTag(self.tag + i)) for i in range(count)]
        self.process.stdin.write(f"send {count} {self.tag}\n")
        self.process.stdin.flush()
        while not all(r.completed for r in requests):
            self.worker.progress()
        elapsed = time.perf_counter() - start
        for r in requests:
            r.check_error()
        after = float(json.loads(self.process.stdout.readline())["cpu_s"])
        self.source_cpu["tag"] += after - before
        self.moved["tag"] += count * PAGE
        self._check(count, "tag")
        return elapsed

    def close(self) -> None:
        ucp.ucp_rkey_destroy(self.rkey[0])
        self.process.kill()
        self.process.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.source:
        source()
        return 0
    reader = Reader()
    try:
        gbps: dict[str, list[float]] = {"get": [], "tag": []}
        one_page: dict[str, list[float]] = {"get": [], "tag": []}
        ratios = []
        modes = {"get": reader.get, "tag": reader.receive}
        for index in range(args.rounds):
            order = ["get", "tag"] if index % 2 == 0 else ["tag", "get"]
            this_round: dict[str, float] = {}
            for mode in order:
                seconds = [modes[mode](PAGES) for _ in range(REPEATS)]
                this_round[mode] = PAGE * PAGES / statistics.median(seconds) / 1e9
                gbps[mode].append(this_round[mode])
                one_page[mode] += [modes[mode](1) for _ in range(10)]
            ratios.append(this_round["get"] / this_round["tag"])
        result = {
            "transport": f"UCX_NET_DEVICES={os.environ['UCX_NET_DEVICES']} "
                         f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}, error handling on",
            "rounds": args.rounds, "workload": f"{PAGES} pages of {PAGE >> 20} MiB",
            **{f"{mode}_gbps_median": round(statistics.median(v), 2) for mode, v in gbps.items()},
            "ratio_get_vs_tag": round(statistics.median(ratios), 2),
            "ratio_spread": [round(min(ratios), 2), round(max(ratios), 2)],
            **{f"{mode}_one_page_ms_p50": round(statistics.median(v) * 1e3, 3)
               for mode, v in one_page.items()},
            **{f"source_cpu_s_per_gb_{mode}": round(reader.source_cpu[mode] / (reader.moved[mode] / 1e9), 3)
               for mode in ("get", "tag")},
            "registration_us_per_page": round(reader.registration_us, 1),
        }
    finally:
        reader.close()
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:32s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
