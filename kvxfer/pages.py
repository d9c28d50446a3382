"""Page-range algebra: ordered runs of pages, and their mapping to byte extents.

A transfer names its pages as ``PageRuns``: an ordered sequence of
``(start, count)`` runs. The i-th page of the source sequence goes to the i-th
page of the destination sequence. Because a page-major page is one contiguous
block, a stretch of pages that is consecutive on both sides is one byte copy:
``map_extents`` turns two run lists into the fewest ``Extent`` copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from kvxfer.errors import InvalidArgumentError, PageOutOfRangeError


@dataclass(frozen=True)
class PageRun:
    """``count`` consecutive pages starting at page ``start``."""

    start: int
    count: int

    def __post_init__(self) -> None:
        start, count = self.start, self.count
        if type(start) is int and type(count) is int and start >= 0 and count >= 1:
            return  # the common case, checked cheaply: a page_size=1 transfer has thousands
        for name in ("start", "count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgumentError(f"page run {name}={value!r} must be an integer")
        if self.start < 0:
            raise InvalidArgumentError(f"page run start={self.start} must be >= 0")
        if self.count < 1:
            raise InvalidArgumentError(f"page run count={self.count} must be >= 1")

    @property
    def stop(self) -> int:
        """One past the run's last page."""
        return self.start + self.count


@dataclass(frozen=True)
class PageRuns:
    """An ordered, normalized sequence of page runs.

    Normalized means adjacent runs that continue each other are merged, so two
    equal page sequences always have equal ``PageRuns``.
    """

    runs: tuple[PageRun, ...]

    def __post_init__(self) -> None:
        if not self.runs:
            raise InvalidArgumentError("page ranges are empty; expected at least one (start, count)")
        merged: list[PageRun] = []
        for run in self.runs:
            if not isinstance(run, PageRun):
                raise InvalidArgumentError(f"expected a PageRun, got {run!r}")
            if merged and merged[-1].stop == run.start:
                merged[-1] = PageRun(merged[-1].start, merged[-1].count + run.count)
            else:
                merged.append(run)
        object.__setattr__(self, "runs", tuple(merged))

    @classmethod
    def of(cls, pairs: Iterable[tuple[int, int]]) -> PageRuns:
        """Runs from ``(start, count)`` pairs."""
        return cls(tuple(PageRun(start, count) for start, count in pairs))

    @classmethod
    def from_pages(cls, pages: Iterable[int]) -> PageRuns:
        """Runs from an ordered list of page indices (consecutive ones merge)."""
        return cls(tuple(PageRun(int(p), 1) for p in pages))

    @property
    def num_pages(self) -> int:
        """Pages in the sequence, counting repeats."""
        return sum(run.count for run in self.runs)

    def pairs(self) -> list[tuple[int, int]]:
        """The runs as ``(start, count)`` pairs."""
        return [(run.start, run.count) for run in self.runs]

    def pages(self) -> Iterator[int]:
        """Every page index, in sequence order."""
        for run in self.runs:
            yield from range(run.start, run.stop)

    def after(self, skip: int) -> PageRuns:
        """The sequence without its first ``skip`` pages; InvalidArgumentError unless
        0 <= ``skip`` < ``num_pages`` (some page must remain)."""
        if not 0 <= skip < self.num_pages:
            raise InvalidArgumentError(
                f"skip_pages={skip}, but there are {self.num_pages} pages; expected 0 to "
                f"{self.num_pages - 1}")
        kept: list[PageRun] = []
        for run in self.runs:
            if skip >= run.count:
                skip -= run.count
                continue
            kept.append(PageRun(run.start + skip, run.count - skip))
            skip = 0
        return PageRuns(tuple(kept))

    def check_bounds(self, num_pages: int, *, what: str = "pages") -> None:
        """Raise PageOutOfRangeError unless every page is in ``[0, num_pages)``."""
        for run in self.runs:
            if run.stop > num_pages:
                raise PageOutOfRangeError(
                    f"{what} run (start={run.start}, count={run.count}) reaches page "
                    f"{run.stop - 1} but the pool has pages 0..{num_pages - 1}"
                )

    def first_overlap(self) -> tuple[PageRun, PageRun] | None:
        """Two runs that share a page, or None if the sequence has no repeated page."""
        ordered = sorted(self.runs, key=lambda r: r.start)
        for a, b in zip(ordered, ordered[1:]):
            if b.start < a.stop:
                return a, b
        return None

    def check_disjoint(self, *, what: str = "destination pages") -> None:
        """Raise InvalidArgumentError if any page appears twice (it would be written twice)."""
        overlap = self.first_overlap()
        if overlap is not None:
            a, b = overlap
            raise InvalidArgumentError(
                f"{what} overlap: run (start={a.start}, count={a.count}) and run "
                f"(start={b.start}, count={b.count}) share page {b.start}; expected disjoint runs"
            )


class Extent(NamedTuple):
    """One contiguous byte copy: ``nbytes`` from ``src_offset`` to ``dst_offset``.

    A named tuple, not a dataclass: a page_size=1 transfer plans thousands of them
    on the hot path, and tuples are built several times faster.
    """

    src_offset: int
    dst_offset: int
    nbytes: int


def map_extents(
    src: PageRuns,
    dst: PageRuns,
    *,
    page_bytes: int,
    src_anchor: int = 0,
    dst_anchor: int = 0,
) -> tuple[Extent, ...]:
    """The fewest byte copies that move page sequence ``src`` onto page sequence ``dst``.

    Offsets are absolute in each side's raw buffer (pool anchor included). An
    extent breaks only where a run ends on either side, so no two consecutive
    extents could be merged. Raises InvalidArgumentError if the sequences differ in length.
    """
    if src.num_pages != dst.num_pages:
        raise InvalidArgumentError(
            f"source has {src.num_pages} pages but destination has {dst.num_pages}; "
            "expected equal page counts"
        )
    if page_bytes <= 0:
        raise InvalidArgumentError(f"page_bytes={page_bytes} must be positive")
    extents: list[Extent] = []
    # Plain (start, count) tuples and locals: this loop is on every transfer's critical path.
    src_runs = [(r.start, r.count) for r in src.runs]
    dst_runs = [(r.start, r.count) for r in dst.runs]
    i = j = 0
    src_used = dst_used = 0
    n_src = len(src_runs)
    while i < n_src:
        s_start, s_count = src_runs[i]
        d_start, d_count = dst_runs[j]
        count = min(s_count - src_used, d_count - dst_used)
        extents.append(Extent(src_anchor + (s_start + src_used) * page_bytes,
                              dst_anchor + (d_start + dst_used) * page_bytes,
                              count * page_bytes))
        src_used += count
        dst_used += count
        if src_used == s_count:
            i, src_used = i + 1, 0
        if dst_used == d_count:
            j, dst_used = j + 1, 0
    return tuple(extents)


def split_extents(extents: Iterable[Extent], max_bytes: int) -> tuple[Extent, ...]:
    """Cut every extent into pieces of at most ``max_bytes`` (for bounded in-flight messages)."""
    if max_bytes <= 0:
        raise InvalidArgumentError(f"max_bytes={max_bytes} must be positive")
    pieces = []
    for extent in extents:
        if extent.nbytes <= max_bytes:
            pieces.append(extent)
            continue
        for start in range(0, extent.nbytes, max_bytes):
            n = min(max_bytes, extent.nbytes - start)
            pieces.append(Extent(extent.src_offset + start, extent.dst_offset + start, n))
    return tuple(pieces)
