"""Offers pulled in parts: several pullers share one offer, each taking its own part.

An offer is pulled once, whole (or from its ``skip_pages``-th page on). Where several
pullers need pages of one offer (decode ranks of an engine with more tensor-parallel ranks
than the prefill engine, each taking the pages of its own KV heads), each pulls *part*
``index`` of ``count``: the offer's pages ``pages`` (indices into its page sequence). Each
part is pulled at most once; every puller names the same ``count``; the offer ends, its
lease with it, once all ``count`` parts have ended. On both daemons a part is a transfer of
its own, named ``part_id(offer, index)`` (``#`` is reserved in the ids workers name); the
offer itself then counts as a transfer that moved no bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvxfer.errors import InvalidArgumentError
from kvxfer.pages import PageRuns

#: The most parts one offer may be pulled in (the most pullers it may have).
MAX_PARTS: Final = 64
#: What separates an offer's id from a part's index; reserved in the ids workers name.
PART_MARK: Final = "#"


def part_id(offer_id: str, index: int) -> str:
    """The transfer id of part ``index`` of the offer ``offer_id``, on both daemons."""
    return f"{offer_id}{PART_MARK}{index}"


def check_not_a_part(transfer_id: str) -> None:
    """InvalidArgumentError if a worker's ``transfer_id`` holds ``PART_MARK`` (ids of parts
    are the daemons' to make)."""
    if PART_MARK in transfer_id:
        raise InvalidArgumentError(f"transfer_id {transfer_id!r} holds {PART_MARK!r}, which is "
                                   "reserved for the parts of offers (<offer id>#<index>)")


@dataclass(frozen=True)
class OfferPart:
    """Which of an offer's pages a pull takes: part ``index`` of ``count`` (a ``count`` of 0
    or 1: the offer is pulled once), the offer's pages ``pages`` (empty: all, or from
    ``skip_pages`` on); InvalidArgumentError unless ``index < count <= MAX_PARTS``."""

    index: int = 0
    count: int = 0
    pages: PageRuns | None = None

    def __post_init__(self) -> None:
        if self.count > MAX_PARTS or (self.count > 1 and self.index >= self.count) or (
                self.count <= 1 and self.index):
            raise InvalidArgumentError(
                f"part {self.index} of {self.count}: expected an index below a count of at "
                f"most {MAX_PARTS} (a count of 0 or 1, index 0: the whole offer)")

    @property
    def shared(self) -> bool:
        """Whether the offer is shared by several pullers."""
        return self.count > 1

    def of(self, runs: PageRuns, skip_pages: int) -> PageRuns:
        """The pages of an offer of ``runs`` this pull takes: ``pages`` of it, in their order,
        or those from ``skip_pages`` on (InvalidArgumentError for pages it does not have)."""
        if self.pages is None:
            return runs.after(skip_pages)
        if skip_pages:
            raise InvalidArgumentError("skip_pages and part.pages both say which pages to "
                                       "take; give one")
        if self.pages.num_pages > runs.num_pages:
            raise InvalidArgumentError(f"part.pages name {self.pages.num_pages} pages; the offer "
                                       f"has {runs.num_pages}")
        last = max(run.stop for run in self.pages.runs) - 1
        if last >= runs.num_pages:
            raise InvalidArgumentError(f"part.pages reach page {last} of the offer, which has "
                                       f"{runs.num_pages} pages (0 to {runs.num_pages - 1})")
        offered = list(runs.pages())
        return PageRuns.from_pages(offered[k] for k in self.pages.pages())


#: A pull of a whole offer (or of its pages from ``skip_pages`` on), once.
WHOLE_OFFER: Final = OfferPart()
