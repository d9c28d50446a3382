"""Engine blocks of several pages: copies between them through the pool's own views.

A token-paged pool (MHA, head-major MHA, MLA) describes a page's slots by its views:
``k[layer][page, slot, head, dim]`` and so on, with strides that say where each element
sits. An engine block of ``block_size = n * page_size`` slots, laid out as the same kind,
is described by the same spec at ``page_size = block_size``: one layer of a block is then
a "page" of a one-layer pool. So slot ``s`` of block ``b`` is slot ``s % page_size`` of page
``s // page_size`` of that block's pages, and a copy between them is a strided copy of
typed views, whatever the kind keeps where (a head-major block's K is transposed: its
pages' slots interleave in it). ``BlockTiling`` does those copies, one layer at a time;
where ``n`` is 1 an engine copies whole layer spans instead (``paged_blocks``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvxfer.errors import IncompatibleLayoutError
from kvxfer.layout import PoolLayout, ViewSpec
from kvxfer.layout.specs import MhaHeadMajorSpec, MhaSpec, MlaSpec

#: The kinds whose blocks tile into pages: token-paged, one layer a view's index.
TILED_KINDS = (MhaSpec, MhaHeadMajorSpec, MlaSpec)


class BlockTiling:
    """Blocks of ``block_size`` slots over pages of ``layout`` (``per_block`` pages each):
    page ``k`` of a request is slots ``k * page_size`` on of its blocks, so it sits in block
    ``k // per_block`` at position ``k % per_block``."""

    def __init__(self, layout: PoolLayout, block_size: int) -> None:
        spec = layout.spec
        if not isinstance(spec, TILED_KINDS):
            raise IncompatibleLayoutError(f"a {layout.kind.value} pool's pages are not token "
                                          "slots: an engine block cannot span several")
        if block_size % spec.page_size:
            raise IncompatibleLayoutError(f"blocks of {block_size} slots do not split into the "
                                          f"pool's pages of {spec.page_size}")
        self.per_block = block_size // spec.page_size
        self._block_spec = dataclasses.replace(spec, layer_num=1, page_size=block_size,
                                               num_pages=1)
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
        ``[num_blocks, per_block, page_size, ...]`` (views, never copies: a copy-in writes
        through them)."""
        if blocks.shape[-1] != self.block_bytes() or not blocks.is_contiguous():
            raise IncompatibleLayoutError(f"engine blocks {tuple(blocks.shape)} are not "
                                          f"contiguous blocks of {self.block_bytes()} bytes")
        spec = dataclasses.replace(self._block_spec, num_pages=blocks.shape[0])
        raw = blocks.reshape(-1)
        views = [view.build(raw) for view in spec.view_specs(0)]
        return [v.view(v.shape[0], self.per_block, self._page_size, *v.shape[2:]) for v in views]

    def _where(self, block_ids: Sequence[int], pages: Sequence[int]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if len(pages) > len(block_ids) * self.per_block:
            raise IncompatibleLayoutError(f"{len(pages)} pages do not fit {len(block_ids)} "
                                          f"blocks of {self.per_block} pages")
        k = torch.arange(len(pages))
        blocks = torch.tensor(list(block_ids), dtype=torch.long)[k // self.per_block]
        return torch.tensor(list(pages), dtype=torch.long), blocks, k % self.per_block

    def copy_out(self, raw: torch.Tensor, layer: int, blocks: torch.Tensor,
                 block_ids: Sequence[int], pages: Sequence[int]) -> None:
        """Layer ``layer`` of the request's blocks ``block_ids`` (of ``blocks``, that layer's
        ``[num_blocks, block_bytes]``) into its ``pages`` of the pool in ``raw``."""
        page_t, block_t, at_t = self._where(block_ids, pages)
        for pool_view, engine in zip(self._pool_views[layer], self._engine_views(blocks),
                                     strict=True):
            pool_view.build(raw)[page_t] = engine[block_t, at_t]

    def copy_in(self, raw: torch.Tensor, layer: int, blocks: torch.Tensor,
                pages: Sequence[int], block_ids: Sequence[int]) -> None:
        """The request's ``pages`` of the pool in ``raw`` into layer ``layer`` of its blocks
        ``block_ids``."""
        page_t, block_t, at_t = self._where(block_ids, pages)
        for pool_view, engine in zip(self._pool_views[layer], self._engine_views(blocks),
                                     strict=True):
            engine[block_t, at_t] = pool_view.build(raw)[page_t]
