"""How a transfer's bytes become tagged messages: chunk planning and tag allocation.

Both sides plan a transfer identically (``plan_chunks``: the fewest byte
copies, cut to ``chunk_bytes``), so chunk ``i`` is the message tagged
``tag_base + i``. The receiver allocates the tag base; bases are unique for the
receiver's lifetime, so a late message of one transfer can never match a
receive of another, and unguessable, so a stranger cannot aim messages at a
transfer's receives.
"""

from __future__ import annotations

import hashlib
import secrets

from kvxfer.errors import InvalidArgumentError
from kvxfer.layout import PoolLayout
from kvxfer.pages import Extent, PageRuns, map_extents, split_extents

#: Low bits of a tag that number a transfer's chunks; the high bits are its base.
CHUNK_BITS = 24
#: Bits of a tag base, split in two halves by the tag allocator's permutation.
BASE_BITS = 64 - CHUNK_BITS
_HALF_BITS = BASE_BITS // 2
_HALF_MASK = (1 << _HALF_BITS) - 1


def plan_chunks(src_runs: PageRuns, src: PoolLayout, dst_runs: PageRuns, dst: PoolLayout,
                chunk_bytes: int) -> tuple[Extent, ...]:
    """The messages of a transfer: minimal extents cut to ``chunk_bytes``. Both sides agree."""
    extents = map_extents(src_runs, dst_runs, page_bytes=src.page_bytes,
                          src_anchor=src.anchor_bytes, dst_anchor=dst.anchor_bytes)
    chunks = split_extents(extents, chunk_bytes)
    if len(chunks) >= 1 << CHUNK_BITS:
        raise InvalidArgumentError(
            f"transfer needs {len(chunks)} messages; at most {(1 << CHUNK_BITS) - 1} fit a tag "
            "space; use a larger chunk_bytes")
    return chunks


def max_chunks(runs: PageRuns, layout: PoolLayout, chunk_bytes: int) -> int:
    """The most messages any plan of a transfer into (or out of) ``runs`` can have: every
    page an extent of its own, each cut to ``chunk_bytes``."""
    per_page = -(-layout.page_bytes // chunk_bytes)
    return min(runs.num_pages * per_page, (1 << CHUNK_BITS) - 1)


class TagAllocator:
    """Hands out tag bases that are unique and unguessable: a secret-keyed permutation of a
    counter (a 4-round Feistel network over BASE_BITS bits, keyed BLAKE2b as its round
    function), so no base repeats within 2**BASE_BITS calls, and a peer that saw some bases
    cannot tell the next one (it would need the daemon's key)."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = secrets.token_bytes(32) if key is None else key
        self._count = 0

    def _round(self, index: int, half: int) -> int:
        digest = hashlib.blake2b(bytes([index]) + half.to_bytes(4, "little"), key=self._key,
                                 digest_size=4).digest()
        return int.from_bytes(digest, "little") & _HALF_MASK

    def _permute(self, value: int) -> int:
        left, right = value >> _HALF_BITS, value & _HALF_MASK
        for index in range(4):
            left, right = right, left ^ self._round(index, right)
        return (left << _HALF_BITS) | right

    def next_base(self) -> int:
        """A tag base (its low CHUNK_BITS zero) no earlier call returned (for 2**BASE_BITS calls)."""
        base = self._permute(self._count)
        self._count = (self._count + 1) % (1 << BASE_BITS)
        return base << CHUNK_BITS
