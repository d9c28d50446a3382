"""Which KV heads each tensor-parallel rank holds, and which pages carry them between engines
of different TP sizes.

An engine splits its model's ``num_kv_heads`` KV heads over ``tp_size`` ranks in order, as
vLLM (and Megatron) do: ``num_kv_heads // tp_size`` consecutive heads per rank, or, with
fewer heads than ranks, each head on ``tp_size // num_kv_heads`` consecutive ranks. kvxfer's
pages hold ``page_heads`` of a rank's heads (a head *group*; groups are numbered across the
model), and a rank's transfer orders its pages token page by token page, each the rank's
groups in order: page ``t * groups + j`` holds token page ``t`` of the rank's group ``j``.

A group's bytes are the same whichever rank holds them, so a decode rank pulls, from each
prefill rank that holds some of its groups, the pages of those groups (``sources``), and
copies each page into its place among its own heads. Where several decode ranks pull from
one prefill rank (``pullers``: a decode engine of more ranks), each pulls its own part of
that rank's transfer. Two engines exchange KV this way when
they agree on the model's heads and on ``page_heads`` (which must divide both sides' heads
per rank: 1 always does).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxfer.errors import IncompatibleLayoutError, InvalidSpecError


@dataclass(frozen=True)
class HeadSplit:
    """``num_kv_heads`` KV heads over ``tp_size`` ranks, in pages of ``page_heads`` heads;
    InvalidSpecError unless the heads split evenly (or replicate evenly) and ``page_heads``
    divides a rank's heads."""

    num_kv_heads: int
    tp_size: int
    page_heads: int

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "tp_size", "page_heads"):
            if getattr(self, name) < 1:
                raise InvalidSpecError(f"{name}={getattr(self, name)} must be positive")
        heads, ranks = self.num_kv_heads, self.tp_size
        if (heads % ranks) if heads >= ranks else (ranks % heads):
            raise InvalidSpecError(f"{heads} KV heads do not split evenly over {ranks} "
                                   "tensor-parallel ranks")
        if self.rank_heads % self.page_heads:
            raise InvalidSpecError(f"page_heads={self.page_heads} does not divide a rank's "
                                   f"{self.rank_heads} KV heads ({heads} over {ranks} ranks)")

    @property
    def rank_heads(self) -> int:
        """KV heads each rank holds."""
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def groups(self) -> int:
        """Head groups (pages per token page) each rank holds."""
        return self.rank_heads // self.page_heads

    def first_group(self, rank: int) -> int:
        """The model-wide number of ``rank``'s first group."""
        if not 0 <= rank < self.tp_size:
            raise InvalidSpecError(f"rank {rank} is not one of {self.tp_size} ranks")
        return rank * self.num_kv_heads // self.tp_size // self.page_heads

    def holders(self, group: int) -> list[int]:
        """The ranks holding model-wide group ``group`` (several where heads replicate)."""
        return [rank for rank in range(self.tp_size)
                if self.first_group(rank) <= group < self.first_group(rank) + self.groups]


@dataclass(frozen=True)
class Source:
    """What one decode rank pulls from one prefill rank's transfer: of each token page, the
    prefill rank's groups ``groups`` (its offer's pages ``t * its groups + j``), landing as
    the decode rank's groups ``places`` (in the same order)."""

    rank: int
    groups: tuple[int, ...]
    places: tuple[int, ...]

    def offer_pages(self, prefill_groups: int, first: int, stop: int) -> list[int]:
        """The offer's page indices of token pages ``first`` to ``stop``, in pulling order."""
        return [t * prefill_groups + j for t in range(first, stop) for j in self.groups]

    def whole(self, prefill_groups: int) -> bool:
        """Whether it takes every group of the prefill rank, in order."""
        return self.groups == tuple(range(prefill_groups))


def sources(prefill: HeadSplit, decode: HeadSplit, rank: int) -> list[Source]:
    """Per prefill rank (ascending), the groups decode rank ``rank`` takes from it: each of its
    groups from one prefill rank holding it (where heads replicate on the prefill side, the
    holders take turns by decode rank). IncompatibleLayoutError unless both split the same
    heads into groups of the same size."""
    if (prefill.num_kv_heads, prefill.page_heads) != (decode.num_kv_heads, decode.page_heads):
        raise IncompatibleLayoutError(
            f"the prefill engine splits {prefill.num_kv_heads} KV heads into pages of "
            f"{prefill.page_heads}, the decode engine {decode.num_kv_heads} into pages of "
            f"{decode.page_heads}: both must be equal")
    taken: dict[int, tuple[list[int], list[int]]] = {}
    first = decode.first_group(rank)
    for place in range(decode.groups):
        group = first + place
        holders = prefill.holders(group)
        source = holders[rank % len(holders)]
        groups, places = taken.setdefault(source, ([], []))
        groups.append(group - prefill.first_group(source))
        places.append(place)
    return [Source(source, tuple(groups), tuple(places))
            for source, (groups, places) in sorted(taken.items())]


def pulled_ranks(prefill: HeadSplit, decode: HeadSplit) -> set[int]:
    """The prefill ranks some decode rank pulls from (the others' offers are not wanted)."""
    return {source.rank for rank in range(decode.tp_size)
            for source in sources(prefill, decode, rank)}


def pullers(prefill: HeadSplit, decode: HeadSplit, prefill_rank: int) -> list[int]:
    """The decode ranks that pull from prefill rank ``prefill_rank``, ascending: with more
    than one, each pulls its own part of that rank's transfer (``kvxfer.offer_parts``)."""
    return [rank for rank in range(decode.tp_size)
            if any(source.rank == prefill_rank for source in sources(prefill, decode, rank))]
