"""How a transfer's bytes become tagged messages: chunk planning and tag allocation.

Both sides plan a transfer identically (``plan_chunks``: the fewest byte
copies, cut to ``chunk_bytes``), so chunk ``i`` is the message tagged
``tag_base + i``. The receiver allocates the tag base; bases are unique for the
receiver's lifetime, so a late message of one transfer can never match a
receive of another.
"""

from __future__ import annotations

import random

from kvxfer.errors import InvalidRangeError
from kvxfer.layout import PoolLayout
from kvxfer.pages import Extent, PageRuns, map_extents, split_extents

#: Low bits of a tag that number a transfer's chunks; the high bits are its base.
CHUNK_BITS = 24


def plan_chunks(src_runs: PageRuns, src: PoolLayout, dst_runs: PageRuns, dst: PoolLayout,
                chunk_bytes: int) -> tuple[Extent, ...]:
    """The messages of a transfer: minimal extents cut to ``chunk_bytes``. Both sides agree."""
    extents = map_extents(src_runs, dst_runs, page_bytes=src.page_bytes,
                          src_anchor=src.anchor_bytes, dst_anchor=dst.anchor_bytes)
    chunks = split_extents(extents, chunk_bytes)
    if len(chunks) >= 1 << CHUNK_BITS:
        raise InvalidRangeError(
            f"transfer needs {len(chunks)} messages; at most {(1 << CHUNK_BITS) - 1} fit a tag "
            "space; use a larger chunk_bytes")
    return chunks


class TagAllocator:
    """Hands out tag bases: a counter from a random start, wrapping in 64 - CHUNK_BITS bits."""

    def __init__(self, start: int | None = None) -> None:
        self._next = random.getrandbits(64 - CHUNK_BITS) if start is None else start

    def next_base(self) -> int:
        """A tag base no earlier call returned (for 2**40 calls)."""
        base = self._next << CHUNK_BITS
        self._next = (self._next + 1) % (1 << (64 - CHUNK_BITS))
        return base
