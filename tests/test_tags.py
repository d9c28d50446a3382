"""Tag bases: unique for a receiver's lifetime, and unguessable without its key."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvxfer.server.transfers.planning import BASE_BITS, CHUNK_BITS, TagAllocator


def bases(allocator: TagAllocator, count: int) -> list[int]:
    return [allocator.next_base() for _ in range(count)]


def test_a_hundred_thousand_bases_are_distinct_and_leave_the_chunk_bits_free() -> None:
    got = bases(TagAllocator(), 100_000)
    assert len(set(got)) == len(got)
    assert all(b % (1 << CHUNK_BITS) == 0 and 0 <= b < 1 << 64 for b in got)


@given(st.binary(min_size=32, max_size=32), st.binary(min_size=32, max_size=32))
def test_the_sequence_is_fixed_by_the_key_and_differs_between_keys(a: bytes, b: bytes) -> None:
    assert bases(TagAllocator(a), 8) == bases(TagAllocator(a), 8)
    if a != b:
        assert bases(TagAllocator(a), 8) != bases(TagAllocator(b), 8)


def test_bases_do_not_follow_from_the_previous_ones() -> None:
    got = [b >> CHUNK_BITS for b in bases(TagAllocator(), 10_000)]
    steps = {b - a for a, b in zip(got, got[1:])}
    assert len(steps) > 9_900  # a counter (from any start, any stride) has one step
    top = sum(b >> (BASE_BITS - 1) for b in got)
    assert 4_500 < top < 5_500  # the top bit is a coin toss
