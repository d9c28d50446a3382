"""What a UCX remote key confines, measured: one-sided reads (``ucp_get_nbx``) of a
target process's memory over this machine's transports (issue #31's first question).

    UCX_NET_DEVICES=lo .venv/bin/python benchmarks/ucx_rma_confinement.py [--tls tcp]

A target process (this script with ``--target``) maps three 1 MiB pages A|B|C, registers
only B (``ucp_mem_map``, ``prot`` as given) with a UCX context that has RMA, packs B's
remote key and prints its listener port, B's address and the key. An initiator connects
(error handling on) and reads: inside B, straddling A|B, inside C, with a forged key (9
zero bytes: it never saw the real one), after the target unmapped B, and from a target
whose context has no RMA. Each read reports UCX's status and which pages' bytes arrived.

It calls libucp through cffi in ABI mode on ucxx's own handles (``UCXContext.handle``,
``UCXWorker.handle``, ``UCXEndpoint.handle``), the way a kvxfer RMA data plane would: no
UCX headers, no compiler. Needs cffi (the daemon install has it, through cryptography).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import cffi  # noqa: E402 - after UCX's environment
import libucx  # noqa: E402
from ucxx._lib import libucxx as api  # noqa: E402

PAGE = 1 << 20
REMOTE_READ, LOCAL = 1 << 8, (1 << 0) | (1 << 1)
CDEF = """
typedef int ucs_status_t; typedef void *ucp_context_h; typedef void *ucp_worker_h;
typedef void *ucp_ep_h; typedef void *ucp_mem_h; typedef void *ucp_rkey_h;
typedef uint64_t ucp_datatype_t; typedef int ucs_memory_type_t;
typedef struct { uint64_t field_mask; void *address; size_t length; unsigned flags; unsigned prot;
  ucs_memory_type_t memory_type; const void *exported_memh_buffer; } ucp_mem_map_params_t;
typedef void (*ucp_send_nbx_callback_t)(void *request, ucs_status_t status, void *user_data);
typedef struct { uint32_t op_attr_mask; uint32_t flags; void *request;
  union { ucp_send_nbx_callback_t send; void *other; } cb; ucp_datatype_t datatype; void *user_data;
  void *reply_buffer; ucs_memory_type_t memory_type; union { size_t *length; void *tag_info; } recv_info;
  ucp_mem_h memh; } ucp_request_param_t;
ucs_status_t ucp_mem_map(ucp_context_h, const ucp_mem_map_params_t *, ucp_mem_h *);
ucs_status_t ucp_mem_unmap(ucp_context_h, ucp_mem_h);
ucs_status_t ucp_rkey_pack(ucp_context_h, ucp_mem_h, void **, size_t *);
void ucp_rkey_buffer_release(void *);
ucs_status_t ucp_ep_rkey_unpack(ucp_ep_h, const void *, ucp_rkey_h *);
void ucp_rkey_destroy(ucp_rkey_h);
void *ucp_get_nbx(ucp_ep_h, void *, size_t, uint64_t, ucp_rkey_h, const ucp_request_param_t *);
void *ucp_worker_flush_nbx(ucp_worker_h, const ucp_request_param_t *);
ucs_status_t ucp_request_check_status(void *);
void ucp_request_free(void *);
const char *ucs_status_string(ucs_status_t);
"""
ffi = cffi.FFI()
ffi.cdef(CDEF)
LIB = Path(libucx.__file__).parent / "lib"
ucp: Any = ffi.dlopen(str(LIB / "libucp.so"))
ucs: Any = ffi.dlopen(str(LIB / "libucs.so"))


def status(code: int) -> str:
    return str(ffi.string(ucs.ucs_status_string(code)).decode())


def context(rma: bool) -> tuple[Any, Any]:
    features = (api.Feature.TAG, api.Feature.RMA, api.Feature.WAKEUP) if rma else \
        (api.Feature.TAG, api.Feature.WAKEUP)
    ctx = api.UCXContext(feature_flags=features)
    return ctx, api.UCXWorker(ctx)


def target(prot: int, rma: bool, unmap_after_s: float, live_s: float) -> None:
    """Register page B of A|B|C and serve reads for ``live_s`` seconds."""
    ctx, worker = context(rma)
    accepted: list[Any] = []
    listener = api.UCXListener.create(
        worker=worker, port=0,
        cb_func=lambda request: accepted.append(listener.create_endpoint_from_conn_request(request, True)))
    pages = bytearray(b"A" * PAGE + b"B" * PAGE + b"C" * PAGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(pages))
    params = ffi.new("ucp_mem_map_params_t *")
    params.field_mask, params.length, params.prot = 1 | 2 | 8, PAGE, prot  # address, length, prot
    params.address = ffi.cast("void*", address + PAGE)
    memh = ffi.new("ucp_mem_h *")
    key = b""
    if rma:
        assert status(ucp.ucp_mem_map(ffi.cast("void*", ctx.handle), params, memh)) == "Success"
        buffer, size = ffi.new("void **"), ffi.new("size_t *")
        ucp.ucp_rkey_pack(ffi.cast("void*", ctx.handle), memh[0], buffer, size)
        key = bytes(ffi.buffer(buffer[0], size[0]))
        ucp.ucp_rkey_buffer_release(buffer[0])
    print(json.dumps({"port": listener.port, "address": address, "key": key.hex()}), flush=True)
    start, unmapped = time.monotonic(), False
    while time.monotonic() - start < live_s:
        worker.progress()
        if rma and unmap_after_s and not unmapped and time.monotonic() - start > unmap_after_s:
            ucp.ucp_mem_unmap(ffi.cast("void*", ctx.handle), memh[0])
            unmapped = True


def spawn_target(*args: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    process = subprocess.Popen([sys.executable, __file__, "--target", *args], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("{"):
            return process, json.loads(line)
    raise RuntimeError("the target printed no address")


class Initiator:
    """One endpoint to a target, reading 1 MiB at a time."""

    def __init__(self, port: int) -> None:
        self.ctx, self.worker = context(rma=True)
        self.ep = api.UCXEndpoint.create(self.worker, "127.0.0.1", port, True)
        for _ in range(300):
            self.worker.progress()
            time.sleep(0.001)
        self.buffer = bytearray(PAGE)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))
        self.params = ffi.new("ucp_request_param_t *")

    def _wait(self, request: Any, timeout_s: float = 3.0) -> str:
        pointer = int(ffi.cast("uintptr_t", request))
        if pointer == 0:
            return "Success"
        if pointer >= (1 << 64) - 1000:
            return status(int(ffi.cast("intptr_t", request)))
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            code = ucp.ucp_request_check_status(request)
            if code != 1:  # UCS_INPROGRESS
                ucp.ucp_request_free(request)
                return status(code)
            self.worker.progress()
        return f"no answer in {timeout_s:g} s"

    def read(self, remote: int, key: bytes) -> dict[str, Any]:
        """Read 1 MiB at ``remote`` with the packed ``key``: UCX's status, the pages seen."""
        rkey = ffi.new("ucp_rkey_h *")
        unpacked = status(ucp.ucp_ep_rkey_unpack(ffi.cast("void*", self.ep.handle), key, rkey))
        self.buffer[:] = bytes(PAGE)
        start = time.perf_counter()
        got = self._wait(ucp.ucp_get_nbx(ffi.cast("void*", self.ep.handle), ffi.cast("void*", self.address),
                                         PAGE, remote, rkey[0], self.params))
        flushed = self._wait(ucp.ucp_worker_flush_nbx(ffi.cast("void*", self.worker.handle), self.params))
        seen = "".join(sorted({chr(b) for b in set(self.buffer)} - {"\x00"}))
        return {"unpack": unpacked, "get": got, "flush": flushed, "pages_read": seen or "none",
                "ms": round((time.perf_counter() - start) * 1e3, 2)}


def run(prot: int) -> list[dict[str, Any]]:
    rows = []
    cases = [("inside B, the real key", 1.0, False, 0.0), ("straddling A|B, the real key", 0.5, False, 0.0),
             ("inside C (not registered)", 2.0, False, 0.0), ("inside B, a forged key", 1.0, True, 0.0)]
    process, info = spawn_target(f"{prot:#x}", "1", "0", "8")
    try:
        reader = Initiator(info["port"])
        for name, offset, forged, _ in cases:
            key = bytes(9) if forged else bytes.fromhex(info["key"])
            rows.append({"case": name, **reader.read(info["address"] + int(offset * PAGE), key)})
    finally:
        process.kill()
        process.wait()
    process, info = spawn_target(f"{prot:#x}", "1", "0.5", "6")
    try:
        reader = Initiator(info["port"])
        time.sleep(1.0)
        rows.append({"case": "inside B after the target unmapped it",
                     **reader.read(info["address"] + PAGE, bytes.fromhex(info["key"]))})
    finally:
        process.kill()
        process.wait()
    process, info = spawn_target(f"{prot:#x}", "0", "0", "6")
    try:
        rows.append({"case": "a target whose context has no RMA",
                     **Initiator(info["port"]).read(info["address"] + PAGE, bytes(9))})
    finally:
        process.kill()
        process.wait()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", nargs=4, metavar=("PROT", "RMA", "UNMAP_AFTER_S", "LIVE_S"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--prot", default="remote-read", choices=["remote-read", "local-only"],
                        help="the registration's protection: REMOTE_READ, or local access only")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    if args.target:
        prot, rma, unmap_after_s, live_s = args.target
        target(int(prot, 0), rma == "1", float(unmap_after_s), float(live_s))
        return
    rows = run(REMOTE_READ if args.prot == "remote-read" else LOCAL)
    if args.json:
        print(json.dumps({"prot": args.prot, "ucx_net_devices": os.environ["UCX_NET_DEVICES"],
                          "ucx_tls": os.environ.get("UCX_TLS", ""), "reads": rows}, indent=2))
        return
    print(f"registration prot={args.prot}, UCX_NET_DEVICES={os.environ['UCX_NET_DEVICES']}, "
          f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}")
    for row in rows:
        print(f"  {row['case']:40s} get={row['get']:20s} flush={row['flush']:10s} "
              f"pages read: {row['pages_read']:5s} {row['ms']:7.2f} ms")


if __name__ == "__main__":
    main()
