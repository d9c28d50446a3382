"""An engine's part in the container test, run inside the kvxfer image as a worker
container that shares a sidecar's socket and pool volumes (as in a pod).

    python container_worker.py receive TRANSFER_ID                # decode: expect, wait, check
    python container_worker.py send TRANSFER_ID PEER CAPABILITY   # prefill: write pages, push

The receiver first prints ``{"capability": ...}`` (its expect's, which the push must
present) and the test hands it to the sender. Each prints one JSON line at the end and
exits 0 only if the transfer ended DONE (and, receiving, every destination page holds
the seeded bytes and every other page is untouched).
"""

from __future__ import annotations

import json
import sys

import torch

from kvxfer.client import KvxferClient
from kvxfer.pages import PageRuns

SOCKET = "unix:///run/kvxfer/kvxfer.sock"
SRC = PageRuns.of([(0, 3), (7, 5)])
DST = PageRuns.of([(20, 8)])
SEED = 1234


def pattern(page_bytes: int, pages: int) -> torch.Tensor:
    """The seeded bytes the sender writes, page after page."""
    generator = torch.Generator().manual_seed(SEED)
    return torch.randint(0, 256, (pages * page_bytes,), dtype=torch.uint8, generator=generator)


def send(transfer_id: str, peer: str, capability: str) -> bool:
    with KvxferClient(SOCKET) as kv, kv.attach("kv") as pool:
        size = pool.descriptor.page_bytes
        data = pattern(size, SRC.num_pages)
        for i, page in enumerate(SRC.pages()):
            pool.page_bytes_view(page).copy_(data[i * size:(i + 1) * size])
        kv.push(transfer_id, "kv", SRC, peer=peer, timeout_s=60, verify=True, capability=capability)
        info = kv.wait(transfer_id, 60)
    print(json.dumps({"state": info.state.name, "error": info.error, "bytes": info.bytes}))
    return info.ok


def receive(transfer_id: str) -> bool:
    with KvxferClient(SOCKET) as kv, kv.attach("kv") as pool:
        before = pool.raw.clone()
        expected = kv.expect(transfer_id, "kv", DST, timeout_s=60)
        print(json.dumps({"capability": expected.capability}), flush=True)
        info = kv.wait(transfer_id, 60)
        size = pool.descriptor.page_bytes
        expected = before.clone()
        data = pattern(size, DST.num_pages)
        for i, page in enumerate(DST.pages()):
            start = pool.descriptor.layout.page_offset(page)
            expected[start:start + size] = data[i * size:(i + 1) * size]
        exact = bool(torch.equal(pool.raw, expected))
    print(json.dumps({"state": info.state.name, "error": info.error, "byte_exact": exact,
                      "verified": info.verified}))
    return info.ok and exact


if __name__ == "__main__":
    role, transfer_id, *rest = sys.argv[1:]
    ok = send(transfer_id, *rest) if role == "send" else receive(transfer_id)
    sys.exit(0 if ok else 1)
