"""Engine blocks of several pages, or of more KV heads than a page: copies between them
through the pool's own views.

A token-paged pool (MHA, head-major MHA, MLA) describes a page's slots by its views:
``k[layer][page, slot, head, dim]`` and so on, with strides that say where each element
sits. An engine block of ``block_size = n * page_size`` slots and ``G * page_heads`` KV
heads, laid out as the same kind, is described by the same spec at ``page_size =
block_size`` and ``head_num = G * page_heads``: one layer of a block is then a "page" of a
one-layer pool. So slot ``s`` of head ``h`` of block ``b`` is slot ``s % page_size`` of
head ``h % page_heads`` of the page that holds part ``s // page_size`` and head group
``h // page_heads`` of that block (``Places`` says which page that is), and a copy between
them is a strided copy of typed views, whatever the kind keeps where (a head-major block's
K is transposed: its pages' slots interleave in it). ``BlockTiling`` does those copies, one
layer at a time; where a block is one page an engine copies whole layer spans instead
(``paged_blocks``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvxfer.errors import IncompatibleLayoutError
from kvxfer.layout import PoolLayout, ViewSpec
from kvxfer.layout.specs import MhaHeadMajorSpec, MhaSpec, MlaSpec

#: The kinds whose blocks tile into pages: token-paged, one layer a view's index.
TILED_KINDS = (MhaSpec, MhaHeadMajorSpec, MlaSpec)


@dataclass(frozen=True)
class Places:
    """Where each of a request's pages sits in its engine blocks: page ``i`` holds part
    ``parts[i]`` (of ``page_size`` slots) and head group ``groups[i]`` of block ``blocks[i]``."""

    blocks: tuple[int, ...]
    parts: tuple[int, ...]
    groups: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.blocks)

    @classmethod
    def of(cls, block_ids: Sequence[int], per_block: int, first: int, stop: int,
           groups: Sequence[int] = (0,)) -> Places:
        """Token pages ``first`` to ``stop`` of a request whose blocks from token page
        ``first`` on (a multiple of ``per_block``) are ``block_ids``, each token page's
        groups ``groups`` in order (the order a rank's transfer keeps, ``head_split``)."""
        rows = [(block_ids[(t - first) // per_block], t % per_block, group)
                for t in range(first, stop) for group in groups]
        blocks, parts, grouped = zip(*rows, strict=True) if rows else ((), (), ())
        return cls(tuple(blocks), tuple(parts), tuple(grouped))

    def without(self, block: int, pages: Sequence[int]) -> tuple[Places, list[int]]:
        """These places and their ``pages`` but those in block ``block`` (an engine's block
        that holds nothing, e.g. vLLM's null block)."""
        kept = [i for i, b in enumerate(self.blocks) if b != block]
        if len(kept) == len(self.blocks):
            return self, list(pages)
        return (Places(*(tuple(values[i] for i in kept)
                         for values in (self.blocks, self.parts, self.groups))),
                [pages[i] for i in kept])

    def plain(self) -> bool:
        """Whether page ``i`` is simply all of block ``blocks[i]``."""
        return not any(self.parts) and not any(self.groups)


class BlockTiling:
    """Blocks of ``block_size`` slots (``per_block`` pages) and ``block_heads`` KV heads
    (``groups`` of the pool's; None: the pool's heads) over pages of ``layout``."""

    def __init__(self, layout: PoolLayout, block_size: int, block_heads: int | None = None) -> None:
        spec = layout.spec
        if not isinstance(spec, TILED_KINDS):
            raise IncompatibleLayoutError(f"a {layout.kind.value} pool's pages are not token "
                                          "slots: an engine block cannot span several")
        if block_size % spec.page_size:
            raise IncompatibleLayoutError(f"blocks of {block_size} slots do not split into the "
                                          f"pool's pages of {spec.page_size}")
        self.per_block = block_size // spec.page_size
        self._block_spec: MhaSpec | MhaHeadMajorSpec | MlaSpec = dataclasses.replace(
            spec, layer_num=1, page_size=block_size, num_pages=1)
        self.groups = 1
        if (block_heads is not None and not isinstance(spec, MlaSpec)
                and block_heads != spec.head_num):
            if block_heads % spec.head_num:
                raise IncompatibleLayoutError(f"blocks of {block_heads} KV heads do not split "
                                              f"into the pool's pages of {spec.head_num}")
            self.groups = block_heads // spec.head_num
            self._block_spec = dataclasses.replace(spec, layer_num=1, page_size=block_size,
                                                   num_pages=1, head_num=block_heads)
        self._page_size = spec.page_size
        #: Per layer, the pool's views of it (in their order).
        self._pool_views: dict[int, list[ViewSpec]] = {}
        for view in layout.view_specs():
            self._pool_views.setdefault(view.index, []).append(view)

    def block_bytes(self) -> int:
        """Bytes of one layer of one engine block."""
        return self._block_spec.page_bytes

    def _engine_views(self, blocks: torch.Tensor) -> list[torch.Tensor]:
        """``blocks`` (``[num_blocks, block_bytes]``, contiguous) as the kind's views, each
        ``[num_blocks, per_block, page_size, groups, page_heads, ...]`` (views, never copies:
        a copy-in writes through them)."""
        if blocks.shape[-1] != self.block_bytes() or not blocks.is_contiguous():
            raise IncompatibleLayoutError(f"engine blocks {tuple(blocks.shape)} are not "
                                          f"contiguous blocks of {self.block_bytes()} bytes")
        spec = dataclasses.replace(self._block_spec, num_pages=blocks.shape[0])
        raw = blocks.reshape(-1)
        views = [view.build(raw) for view in spec.view_specs(0)]
        return [v.view(v.shape[0], self.per_block, self._page_size, self.groups,
                       v.shape[2] // self.groups, *v.shape[3:]) for v in views]

    def _where(self, places: Places, pages: Sequence[int]) -> tuple[torch.Tensor, ...]:
        if len(pages) != len(places):
            raise IncompatibleLayoutError(f"{len(pages)} pages for {len(places)} places")
        if any(p >= self.per_block for p in places.parts) or any(
                g >= self.groups for g in places.groups):
            raise IncompatibleLayoutError(f"a page's place is outside blocks of {self.per_block} "
                                          f"pages and {self.groups} head groups")
        return tuple(torch.tensor(list(values), dtype=torch.long) for values in (
            pages, places.blocks, places.parts, places.groups))

    def copy_out(self, raw: torch.Tensor, layer: int, blocks: torch.Tensor, places: Places,
                 pages: Sequence[int]) -> None:
        """Layer ``layer`` of a request's blocks (of ``blocks``, that layer's
        ``[num_blocks, block_bytes]``) into ``pages`` of the pool in ``raw``, page ``i`` from
        where ``places`` says."""
        page_t, block_t, part_t, group_t = self._where(places, pages)
        for pool_view, engine in zip(self._pool_views[layer], self._engine_views(blocks),
                                     strict=True):
            pool_view.build(raw)[page_t] = engine[block_t, part_t, :, group_t]

    def copy_in(self, raw: torch.Tensor, layer: int, blocks: torch.Tensor,
                pages: Sequence[int], places: Places) -> None:
        """``pages`` of the pool in ``raw`` into layer ``layer`` of a request's blocks, page
        ``i`` where ``places`` says."""
        page_t, block_t, part_t, group_t = self._where(places, pages)
        for pool_view, engine in zip(self._pool_views[layer], self._engine_views(blocks),
                                     strict=True):
            engine[block_t, part_t, :, group_t] = pool_view.build(raw)[page_t]
