"""A decode rank's pulls of a load, and the load's state while they run.

A decode rank pulls, for each load, from each prefill rank that holds some of its KV heads
(``engine_core.head_split``): all of that rank's transfer, or, where several decode ranks
share it, its part of the offer (``kvxfer.offer_parts``). Each pull's pages go where
``Places`` say, one ``Places`` per block table (``block_tables``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvxfer.client.engine_core.block_tiling import Places
from kvxfer.client.engine_core.head_split import HeadSplit, pullers, sources
from kvxfer.client.integrations.vllm.layout import BlockLayout
from kvxfer.client.integrations.vllm.protocol import Load, rank_transfer
from kvxfer.client.integrations.vllm.stats import LoadTimeline
from kvxfer.offer_parts import WHOLE_OFFER, OfferPart, part_id
from kvxfer.pages import PageRuns
from kvxfer.status import TransferInfo


@dataclass
class Loading:
    """A load in flight: the load, its timeline, its pulls (one per prefill rank holding some
    of this rank's KV heads) not landed yet, its copies running, and how it ended (once
    ``outcome`` is set and no copy runs, it is reported)."""

    load: Load
    timeline: LoadTimeline
    parts: int = 1
    copying: int = 0
    outcome: tuple[str, str] | None = None  # ("", "") landed; else (why, reason) it failed
    reported: bool = False
    infos: list[TransferInfo] = field(default_factory=list)
    transfer_s: float = 0.0  # the longest of its pulls, from queued to ended
    copy_s: float = 0.0  # its copies' seconds, added up


@dataclass(frozen=True)
class PlannedPull:
    """One pull of a load: of prefill rank ``rank``'s transfer ``offer_id``, past its first
    ``skip_pages`` or its part ``offer_part`` (shared with other decode ranks), where its pages
    go (``places``, per block table), and its transfer id on our daemon."""

    rank: int
    offer_id: str
    offer_part: OfferPart
    places: tuple[Places, ...]
    skip_pages: int

    @property
    def num_pages(self) -> int:
        """Pages it pulls."""
        return len(self.places[0]) if self.places else 0

    @property
    def transfer_id(self) -> str:
        """The pull's transfer id on our daemon."""
        shared = self.offer_part.shared
        return part_id(self.offer_id, self.offer_part.index) if shared else self.offer_id


@dataclass(frozen=True)
class Part:
    """A pull in flight: the load it serves and what it pulls."""

    loading: Loading
    plan: PlannedPull


def planned_pulls(layout: BlockLayout, load: Load, rank: int) -> list[PlannedPull]:
    """``load``'s pulls on decode rank ``rank``: one per prefill rank holding some of its
    KV heads, all of that rank's transfer or, shared with other decode ranks, a part."""
    ours = layout.page.split
    theirs = HeadSplit(ours.num_kv_heads, load.prefill_tp, ours.page_heads)
    parts = []
    for source in sources(theirs, ours, rank):
        offer = rank_transfer(load.transfer_id, source.rank, load.prefill_tp)
        places = tuple(Places.of(table, layout.token_pages_per_block,
                                 load.first_page, load.num_pages, source.places)
                       for table in load.block_tables)
        sharing = pullers(theirs, ours, source.rank)
        whole = len(sharing) == 1 and source.whole(theirs.groups)
        part = WHOLE_OFFER if whole else OfferPart(
            sharing.index(rank), len(sharing), PageRuns.from_pages(
                source.offer_pages(theirs.groups, load.first_page, load.num_pages)))
        parts.append(PlannedPull(source.rank, offer, part, places,
                                 load.first_page * theirs.groups if whole else 0))
    return parts
