"""Loaded at start by every Python process whose ``PYTHONPATH`` names this folder: the
vLLM engines of ``vllm_unguarded.py``, with some of the connector's guards switched off as
``KVXFER_UNGUARDED`` (comma-separated) says. The tests' seam for the negative controls
through real engines; the connector has no such switch.

- ``epoch``: workers keep their first mapping of a daemon's pool and name no memory epoch
  (not even the library's default, its latest attach's), so a restarted daemon cannot
  refuse them;
- ``tiling``: a block of several pages is filled with its pages' bytes one after the other,
  and pages are cut from a block the same way, as if the in-block format kept each page's
  slots together (vLLM's head-major block does not: its K is transposed, so the pages'
  slots interleave);
- ``tables``: every layer's blocks are copied through the first KV cache group's block
  table (as a connector blind to vLLM's hybrid KV cache manager would), so a
  sliding-window layer's pages land in, and are cut from, the full-attention layers' blocks;
- ``window``: an engine with a sliding-window group loads the prompt's last token too (as
  if it had none), so vLLM sizes that group's table past the last token's window;
- ``parsing``: ``kv_transfer_params`` read leniently (as before params v1: fields taken as
  they come) and the connector's entry points unguarded, so a malformed request raises into
  vLLM's scheduler.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace
from typing import Any


def _unguard_epoch() -> None:
    from kvxfer.client.integrations.vllm.worker import WorkerSide
    from kvxfer.client.library import KvxferClient
    from kvxfer.status import LeaseUse
    from kvxfer.wire.codec import lease_use_to_proto

    completions = KvxferClient.completions
    WorkerSide._current = lambda self, epoch: None  # type: ignore[method-assign]
    KvxferClient.completions = lambda self, *a, **k: dataclasses.replace(  # type: ignore[method-assign]
        completions(self, *a, **k), epoch="")
    KvxferClient._lease = lambda self, pool, lease_id, release, epoch: lease_use_to_proto(  # type: ignore[method-assign]
        LeaseUse(lease_id, release, ""))
    started = WorkerSide.register_kv_caches

    def no_epoch(self: WorkerSide, *args: Any, **kwargs: Any) -> Any:
        answer = started(self, *args, **kwargs)
        self._blocks.epoch = ""
        self._loads._epoch = ""
        return answer

    WorkerSide.register_kv_caches = no_epoch  # type: ignore[method-assign]


def _unguard_parsing() -> None:
    from kvxfer.client.integrations.vllm import connector, scheduler

    def lenient(params: Any, ours: Any, our_model: Any) -> Any:
        if not params or not params.get("do_remote_prefill"):
            return None
        raw = params["kvxfer"]
        return SimpleNamespace(transfer_id=str(raw["transfer_id"]), peer=str(raw["peer"]),
                               capabilities=tuple(raw["capabilities"]), layout=ours,
                               model=our_model)

    scheduler.parse_remote_prefill = lenient  # type: ignore[assignment]
    connector.KvxferConnector._guarded = (  # type: ignore[method-assign]
        lambda self, what, call, fallback: call())


def _unguard_tiling() -> None:
    import torch

    from kvxfer.client.engine_core.block_tiling import BlockTiling
    from kvxfer.client.engine_core.page_segments import layer_spans
    from kvxfer.layout import PoolLayout

    init = BlockTiling.__init__

    def keeping_layout(self: BlockTiling, layout: PoolLayout, block_size: int,
                       block_heads: Any = None) -> None:
        init(self, layout, block_size, block_heads)
        self.seen_layout = layout  # type: ignore[attr-defined]

    def runs(self: BlockTiling, raw: torch.Tensor, layer: int, pages: Any, places: Any) -> Any:
        """Each page's span of ``layer``, and the byte run of its block it is taken for."""
        layout = self.seen_layout  # type: ignore[attr-defined]
        offset, nbytes = layer_spans(layout)[layer]
        rows = raw[layout.anchor_bytes:layout.anchor_bytes + layout.num_pages * layout.page_bytes]
        rows = rows.view(layout.num_pages, layout.page_bytes)
        for k, page in enumerate(pages):
            at = (places.parts[k] * self.groups + places.groups[k]) * nbytes
            yield rows[page, offset:offset + nbytes], places.blocks[k], at, nbytes

    def runs_in(self: BlockTiling, raw: torch.Tensor, layer: int, blocks: torch.Tensor,
                pages: Any, places: Any) -> None:
        for page, block, at, nbytes in runs(self, raw, layer, pages, places):
            blocks[block, at:at + nbytes] = page

    def runs_out(self: BlockTiling, raw: torch.Tensor, layer: int, blocks: torch.Tensor,
                 places: Any, pages: Any) -> None:
        for page, block, at, nbytes in runs(self, raw, layer, pages, places):
            page.copy_(blocks[block, at:at + nbytes])

    BlockTiling.__init__ = keeping_layout  # type: ignore[method-assign]
    BlockTiling.copy_in = runs_in  # type: ignore[method-assign]
    BlockTiling.copy_out = runs_out  # type: ignore[method-assign]


def _unguard_tables() -> None:
    from kvxfer.client.integrations.vllm import worker

    worker.layer_tables = lambda config, names, block_size: (0,) * len(names)  # type: ignore[assignment]


def _unguard_window() -> None:
    from kvxfer.client.integrations.vllm import connector

    connector.windowed = lambda config: False  # type: ignore[assignment]


_GUARDS = set(filter(None, os.environ.get("KVXFER_UNGUARDED", "").split(",")))
if _GUARDS:
    if "epoch" in _GUARDS:
        _unguard_epoch()
    if "parsing" in _GUARDS:
        _unguard_parsing()
    if "tiling" in _GUARDS:
        _unguard_tiling()
    if "tables" in _GUARDS:
        _unguard_tables()
    if "window" in _GUARDS:
        _unguard_window()
