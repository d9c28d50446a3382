"""Byte-level checks on attached pools, shared by the transfer tests."""

from __future__ import annotations

import random

import numpy as np
import torch

from kvxfer.client import AttachedPool
from kvxfer.client.bench import random_runs
from kvxfer.pages import PageRuns


def fill_random(pool: AttachedPool, seed: int) -> None:
    data = np.random.default_rng(seed).bytes(pool.raw.numel())
    pool.raw.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def assert_moved(src: AttachedPool, dst: AttachedPool, src_runs: PageRuns, dst_runs: PageRuns,
                 before: torch.Tensor) -> None:
    """Destination pages equal their source pages, and no other destination byte changed."""
    expected = before.clone()
    for s, d in zip(src_runs.pages(), dst_runs.pages(), strict=True):
        assert torch.equal(src.page_bytes_view(s), dst.page_bytes_view(d)), f"page {s} -> {d}"
        off = dst.descriptor.layout.page_offset(d)
        expected[off : off + dst.descriptor.page_bytes] = src.page_bytes_view(s)
    assert torch.equal(dst.raw, expected), "bytes outside the destination changed"


def standard_runs(seed: int, num_pages: int = 512, pages: int = 128) -> tuple[PageRuns, PageRuns]:
    """128 pages from seeded random runs of 1-16 pages to runs at other offsets."""
    rng = random.Random(seed)
    src = random_runs(rng, list(range(num_pages)), pages, (1, 16))
    dst = random_runs(rng, list(range(num_pages)), pages, (1, 16))
    return src, dst
