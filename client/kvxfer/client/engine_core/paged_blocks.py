"""A daemon pool mapped as rows of page bytes, and the copies between an engine's KV blocks
and spans of those rows.

A page of any page-major kind is one row of ``page_bytes``, and each layer of each state
sits in a known run of it (``page_segments``). An engine whose KV cache keeps each block's
bytes of a span together moves a block as one copy per span (``PageRows.copy_out``: an
engine's blocks into pages; ``copy_in``: pages into an engine's blocks), whatever its
attention code keeps inside the block. vLLM's blocks are whole layers (``layer_spans``, the
default); a Mamba engine's states would be one span per segment (``page_segments``). Whether the bytes inside a block
mean the same on both sides is the adapter's to check (vLLM's ``BlockLayout``).

An engine whose blocks are several pages long (``block_size`` a multiple of the pool's
``page_size``), or hold several pages' KV heads (``block_heads``, a multiple of a page's),
moves them through the pool's views instead (``block_tiling``): ``Places`` says which part
and head group of which block each page holds.

``PagedBlocks`` maps a daemon's pool for that, with a memory epoch (the daemon's when it
was mapped): ``attach`` maps it again, dropping the old mapping first, after a restart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvxfer.client.engine_core.block_tiling import BlockTiling, Places
from kvxfer.client.engine_core.page_segments import layer_spans
from kvxfer.client.engine_core.reconnecting import Reconnecting
from kvxfer.client.library import AttachedPool, KvxferClient
from kvxfer.descriptor import PoolDescriptor
from kvxfer.errors import IncompatibleLayoutError, StaleArenaError
from kvxfer.layout import PoolLayout
from kvxfer.memory import MemoryHandle

#: Where a block sits in a page: ``(offset, nbytes)``.
Span = tuple[int, int]


class PageRows:
    """The pages of ``layout`` in ``raw`` (a buffer's bytes) as ``[num_pages, page_bytes]``."""

    def __init__(self, raw: torch.Tensor, layout: PoolLayout) -> None:
        self.raw = raw
        start = layout.anchor_bytes
        self.rows = raw[start:start + layout.num_pages * layout.page_bytes].view(
            layout.num_pages, layout.page_bytes)

    def copy_out(self, span: Span, blocks: torch.Tensor, block_ids: Sequence[int],
                 pages: Sequence[int]) -> None:
        """Blocks ``block_ids`` of ``blocks`` (``[num_blocks, nbytes]``) into ``span`` of
        ``pages``, block ``i`` into page ``i``."""
        offset, nbytes = span
        self.rows[list(pages), offset:offset + nbytes] = blocks[list(block_ids)]

    def copy_in(self, span: Span, blocks: torch.Tensor, pages: Sequence[int],
                block_ids: Sequence[int]) -> None:
        """``span`` of ``pages`` into blocks ``block_ids`` of ``blocks``, page ``i`` into
        block ``i``."""
        offset, nbytes = span
        blocks[list(block_ids)] = self.rows[list(pages), offset:offset + nbytes]


class PagedBlocks:
    """One pool of ``client``'s daemon, mapped, whose page spans (``spans``: per layer by
    default, ``layer_spans``; an engine with Mamba state would name one per segment) hold
    an engine's block tensors, one tensor per span (``check`` refuses a pool that does not
    hold them). With ``block_size`` above the pool's page size, each block is several
    pages and a span is a layer (``block_tiling``); so with ``block_heads`` (an engine block's
    KV heads) above a page's."""

    def __init__(self, client: KvxferClient, reach: Reconnecting, pool: str, *,
                 check: Callable[[PoolDescriptor], None],
                 spans: Callable[[PoolLayout], Sequence[Span]] = layer_spans,
                 block_size: int | None = None, block_heads: int | None = None) -> None:
        self._client = client
        self._reach = reach
        self.pool = pool
        self._check = check
        self._spans_of = spans
        self._mapped: AttachedPool | None = None
        self._rows: PageRows | None = None
        self._spans: tuple[Span, ...] = ()
        self._block_size = block_size
        self._block_heads = block_heads
        self._tiling: BlockTiling | None = None
        #: The memory epoch of the mapping ("" when not mapped).
        self.epoch = ""

    @property
    def attached(self) -> bool:
        """Whether the pool is mapped."""
        return self._mapped is not None

    @property
    def memory(self) -> MemoryHandle | None:
        """The handle of the memory mapped (None when not mapped)."""
        return None if self._mapped is None else self._mapped.memory

    def attach(self) -> None:
        """Map the pool (dropping an earlier mapping first); IncompatibleLayoutError from
        ``check`` or ``layer_spans`` leaves it unmapped."""
        self.detach()
        mapped = self._reach.call(lambda: self._client.attach(self.pool))
        layout = mapped.descriptor.layout
        try:
            self._check(mapped.descriptor)
            spans = tuple(self._spans_of(layout))
            size, heads = self._block_size, self._block_heads
            tiled = ((size is not None and size != layout.spec.page_size)
                     or (heads is not None and heads != getattr(layout.spec, "head_num", heads)))
            tiling = BlockTiling(layout, size or layout.spec.page_size, heads) if tiled else None
        except IncompatibleLayoutError:
            mapped.detach()
            raise
        self._rows = PageRows(mapped.raw, layout)
        self._mapped, self._spans, self._tiling = mapped, spans, tiling
        self.epoch = mapped.epoch

    def detach(self) -> None:
        """Drop the mapping (its memory is freed once the daemon's arena is gone too)."""
        self.epoch = ""
        self._rows = None
        self._tiling = None
        if self._mapped is not None:
            self._mapped.detach()
            self._mapped = None

    def _mapped_rows(self) -> PageRows:
        if self._rows is None:
            raise StaleArenaError(f"pool {self.pool!r} is not mapped: its daemon restarted and "
                                  "mapping it again failed")
        return self._rows

    def copy_out(self, span: int, blocks: torch.Tensor, places: Places,
                 pages: Sequence[int]) -> None:
        """From ``blocks`` (``[num_blocks, bytes]``: the tensor of span number ``span``) into
        that span of ``pages``, page ``i`` from where ``places`` says."""
        rows = self._mapped_rows()
        if self._tiling is not None:
            self._tiling.copy_out(rows.raw, span, blocks, places, pages)
        else:
            _check_plain(places)
            rows.copy_out(self._spans[span], blocks, places.blocks, pages)

    def copy_in(self, span: int, blocks: torch.Tensor, pages: Sequence[int],
                places: Places) -> None:
        """Span number ``span`` of ``pages`` into ``blocks`` (that span's ``[num_blocks,
        bytes]`` tensor), page ``i`` where ``places`` says."""
        rows = self._mapped_rows()
        if self._tiling is not None:
            self._tiling.copy_in(rows.raw, span, blocks, pages, places)
        else:
            _check_plain(places)
            rows.copy_in(self._spans[span], blocks, pages, places.blocks)


def _check_plain(places: Places) -> None:
    if not places.plain():
        raise IncompatibleLayoutError("a page was placed in part of a block, but the engine's "
                                      "blocks are whole pages")
