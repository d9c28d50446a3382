"""A process that reaches a daemon's UCX port and holds no session: what it tries (run by
test_ucx_port.py).

usage: python tests/ucx_intruder.py HOST PORT ADDRESS SECONDS

It connects to the UCX listener at HOST:PORT (error handling on, as daemons do), then:
1. reads 64 KiB at ADDRESS (the daemon's pool, as /proc showed the test) with
   ``ucp_get_nbx`` and a guessed remote key (9 zero bytes: on tcp UCX checks no key);
2. for SECONDS, sends tagged messages with random 64-bit tags, 4 KiB (eager: the daemon's
   UCX buffers them) and 256 KiB (rendezvous: the daemon must accept them to receive),
   to land in whatever receive the daemon posted.
Prints one JSON object: the read's UCX status, whether any byte arrived (and the first 32,
in hex), and how many messages it sent.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import sys
import time
from pathlib import Path

os.environ.setdefault("UCX_NET_DEVICES", "lo")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import ucx_rma_confinement as rma  # noqa: E402 - after UCX's environment
from ucxx._lib import libucxx as api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

READ = 64 << 10


def main() -> None:
    host, port, address, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    ctx, worker = rma.context(rma=True)
    ep = api.UCXEndpoint.create(worker, host, port, True)
    for _ in range(300):
        worker.progress()
        time.sleep(0.001)
    ffi, ucp = rma.ffi, rma.ucp
    rkey = ffi.new("ucp_rkey_h *")
    unpacked = rma.status(ucp.ucp_ep_rkey_unpack(ffi.cast("void*", ep.handle), bytes(9), rkey))
    landing = bytearray(READ)
    params = ffi.new("ucp_request_param_t *")
    request = ucp.ucp_get_nbx(ffi.cast("void*", ep.handle),
                              ffi.cast("void*", ctypes.addressof(ctypes.c_char.from_buffer(landing))),
                              READ, address, rkey[0], params)
    pointer = int(ffi.cast("uintptr_t", request))
    if pointer == 0:
        read = "Success"
    elif pointer >= (1 << 64) - 1000:
        read = rma.status(int(ffi.cast("intptr_t", request)))
    else:
        read = "no answer in 3 s"
        end = time.monotonic() + 3
        while time.monotonic() < end:
            code = ucp.ucp_request_check_status(request)
            if code != 1:  # UCS_INPROGRESS
                read = rma.status(code)
                break
            worker.progress()
    sent, requests = 0, []
    small, large = Array(bytearray(secrets.token_bytes(4096))), Array(bytearray(256 << 10))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for buffer in (small, large):
            requests.append(ep.tag_send(buffer, api.UCXXTag(secrets.randbits(64))))
            sent += 1
        for _ in range(20):
            worker.progress()
        time.sleep(0.002)
    print(json.dumps({"rkey_unpack": unpacked, "read": read, "bytes_read": any(landing),
                      "head": landing[:32].hex(), "messages_sent": sent}), flush=True)


if __name__ == "__main__":
    main()
