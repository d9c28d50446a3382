"""Page-range algebra: normalization, bounds, overlap, and minimal byte extents."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import disjoint_runs_pairs, page_runs_pairs

from kvxfer.errors import InvalidArgumentError, PageOutOfRangeError
from kvxfer.pages import Extent, PageRun, PageRuns, map_extents, split_extents


def test_adjacent_runs_merge() -> None:
    assert PageRuns.of([(0, 2), (2, 3), (9, 1)]).pairs() == [(0, 5), (9, 1)]


def test_runs_keep_their_order() -> None:
    assert PageRuns.of([(5, 1), (0, 1)]).pairs() == [(5, 1), (0, 1)]


@pytest.mark.parametrize("pairs", [[], [(0, 0)], [(-1, 2)], [(1, -3)]])
def test_malformed_runs_are_refused(pairs) -> None:
    with pytest.raises(InvalidArgumentError):
        PageRuns.of(pairs)


def test_out_of_bounds_names_the_run_and_the_pool_size() -> None:
    with pytest.raises(PageOutOfRangeError, match=r"start=8, count=4.*pages 0\.\.9"):
        PageRuns.of([(0, 1), (8, 4)]).check_bounds(10)


def test_overlapping_destination_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="overlap"):
        PageRuns.of([(0, 4), (9, 1), (3, 2)]).check_disjoint()


def test_unequal_lengths_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="3 pages but destination has 2"):
        map_extents(PageRuns.of([(0, 3)]), PageRuns.of([(5, 2)]), page_bytes=8)


def naive_copy(src_raw, dst_raw, src: PageRuns, dst: PageRuns, page_bytes: int, sa: int, da: int):
    for s, d in zip(src.pages(), dst.pages(), strict=True):
        dst_raw[da + d * page_bytes : da + (d + 1) * page_bytes] = src_raw[
            sa + s * page_bytes : sa + (s + 1) * page_bytes
        ]


@given(data=st.data(), num_pages=st.integers(1, 24), page_bytes=st.integers(1, 32))
def test_extents_copy_exactly_what_a_page_by_page_copy_does(data, num_pages, page_bytes) -> None:
    src = PageRuns.of(data.draw(page_runs_pairs(num_pages)))
    total = min(src.num_pages, num_pages)
    src = PageRuns.of(list(_take(src, total)))
    dst = PageRuns.of(data.draw(disjoint_runs_pairs(num_pages, total)))
    sa, da = data.draw(st.integers(0, 16)), data.draw(st.integers(0, 16))
    src_raw = torch.randint(0, 256, (sa + num_pages * page_bytes,), dtype=torch.uint8)
    expected = torch.randint(0, 256, (da + num_pages * page_bytes,), dtype=torch.uint8)
    actual = expected.clone()
    naive_copy(src_raw, expected, src, dst, page_bytes, sa, da)
    extents = map_extents(src, dst, page_bytes=page_bytes, src_anchor=sa, dst_anchor=da)
    for e in extents:
        actual[e.dst_offset : e.dst_offset + e.nbytes] = src_raw[e.src_offset : e.src_offset + e.nbytes]
    assert torch.equal(actual, expected)
    assert sum(e.nbytes for e in extents) == src.num_pages * page_bytes
    # Minimal: no two consecutive extents are contiguous on both sides.
    for a, b in zip(extents, extents[1:]):
        assert not (a.src_offset + a.nbytes == b.src_offset and a.dst_offset + a.nbytes == b.dst_offset)


def _take(runs: PageRuns, n: int):
    for run in runs.runs:
        if n <= 0:
            return
        take = min(n, run.count)
        yield run.start, take
        n -= take


def test_contiguous_on_both_sides_is_one_extent() -> None:
    extents = map_extents(PageRuns.of([(0, 4)]), PageRuns.of([(10, 4)]), page_bytes=100)
    assert extents == (Extent(0, 1000, 400),)


def test_extents_break_where_either_side_breaks() -> None:
    extents = map_extents(PageRuns.of([(0, 4)]), PageRuns.of([(10, 1), (20, 3)]), page_bytes=1)
    assert extents == (Extent(0, 10, 1), Extent(1, 20, 3))


@given(sizes=st.lists(st.integers(1, 100), min_size=1, max_size=5), limit=st.integers(1, 40))
def test_split_extents_caps_size_and_keeps_bytes(sizes, limit) -> None:
    extents, offset = [], 0
    for n in sizes:
        extents.append(Extent(offset, offset + 1000, n))
        offset += n + 3
    pieces = split_extents(extents, limit)
    assert all(p.nbytes <= limit for p in pieces)
    assert sum(p.nbytes for p in pieces) == sum(sizes)


def test_page_run_fields_must_be_integers() -> None:
    with pytest.raises(InvalidArgumentError, match="start"):
        PageRun("3", 1)  # type: ignore[arg-type]


@given(pairs=page_runs_pairs(num_pages=64), skip=st.integers(-2, 80))
def test_after_drops_exactly_the_first_pages_or_refuses_naming_the_count(pairs, skip) -> None:
    runs = PageRuns.of(pairs)
    if 0 <= skip < runs.num_pages:
        assert list(runs.after(skip).pages()) == list(runs.pages())[skip:]
    else:
        with pytest.raises(InvalidArgumentError, match=f"skip_pages={skip}, but there are "
                                                       f"{runs.num_pages} pages"):
            runs.after(skip)
