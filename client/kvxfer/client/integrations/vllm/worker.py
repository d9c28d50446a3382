"""The connector's worker half: copy KV between vLLM's blocks and the daemon's pages.

vLLM keeps one KV tensor per layer, ``[num_blocks, ...]`` with each block's
bytes contiguous; the daemon's pool holds pages of ``num_layers`` such blocks
(``BlockLayout``). So layer ``l`` of block ``b`` is one contiguous copy to or
from layer ``l`` of a page, whatever the engine's attention code keeps inside.

Prefill: ``save_kv_layer`` copies each planned request's blocks of that layer
into its leased pages as the forward computes them (copy-out); ``wait_for_save``
offers the pages as the request's transfer, lease ending with it, so the
engine's blocks are free at once. Decode: ``start_load_kv`` leases pages and
starts a pull per planned load and returns; ``get_finished`` asks the daemon
which transfers ended (a ``CompletionFeed``, in a thread of its own, long-polls the
daemon for them, so the step makes no call), copies finished ones
into the request's blocks (copy-in) and reports them; failed ones are reported
failed too (``take_failed``: vLLM's request-level ``failed_recving``), so vLLM
recomputes or fails them, never serves them. A load dropped because its request
ended is reported finished too, so vLLM frees the blocks it held for it.

Memory identity: the worker maps the daemon's pool once, and remembers the
mapping's memory epoch. A daemon that restarted has another epoch (on its
leases and completions): the worker re-attaches before it writes or reads
pages, passes its epoch with every offer and pull (a daemon of another epoch
refuses them), and fails the loads of a restarted daemon at once. It never
reads or writes a stale mapping, and dropping it frees the old arena's memory.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

import torch

from kvxfer.client.completion_feed import CompletionFeed
from kvxfer.client.integrations.vllm.endings import Endings
from kvxfer.client.integrations.vllm.layout import (
    BlockLayout,
    as_blocks,
    check_pool,
    engine_blocks,
)
from kvxfer.client.integrations.vllm.protocol import Load, Save, StepPlan, rank_transfer
from kvxfer.client.integrations.vllm.reconnecting import Reconnecting
from kvxfer.client.integrations.vllm.settings import ConnectorSettings
from kvxfer.client.integrations.vllm.stats import IntervalStats, LoadTimeline, TransferStats
from kvxfer.client.library import AttachedPool, KvxferClient
from kvxfer.errors import (
    IncompatibleLayoutError,
    KvxferError,
    StaleArenaError,
    TransferAbortedError,
    TransferExistsError,
)
from kvxfer.pages import PageRuns
from kvxfer.status import LeaseInfo, TransferInfo

log = logging.getLogger("kvxfer.integrations.vllm")

#: How long past its deadline a load may stay unreported before the worker fails it itself.
EXPIRY_GRACE_S = 10.0


@dataclass
class PendingLoad:
    """A pull in flight: where its pages land, when it started, the memory epoch of the
    mapping it lands in, and when the daemon registered it (a completion of an earlier
    registration of the same id is not its own)."""

    load: Load
    lease: LeaseInfo
    started: float
    epoch: str
    registered_unix: float
    timeline: LoadTimeline


class WorkerSide:
    """Moves one engine worker's KV blocks to and from its daemon."""

    def __init__(self, settings: ConnectorSettings, layout: BlockLayout, engine_id: str,
                 rank: int = 0, interval: IntervalStats | None = None) -> None:
        self._settings = settings
        self._layout = layout
        self._engine_id = engine_id
        self._rank = rank
        self._client = KvxferClient(settings.daemon, name=f"vllm {engine_id} worker {rank}")
        self._stats = TransferStats(settings.stats_file)
        #: This interval's figures for vLLM's metrics (``metrics``), shared with the connector.
        self.interval = interval or IntervalStats()
        self._pool: AttachedPool | None = None
        self._epoch = ""
        self._pages = torch.empty(0, dtype=torch.uint8)
        self._layers: dict[str, int] = {}
        self._kv: list[torch.Tensor] = []
        self._plan = StepPlan()
        self._unsaved: dict[str, tuple[str, str]] = {}  # transfer id -> (reason, why) its save failed
        self._layers_saved: Counter[str] = Counter()  # transfer id -> layers copied this step
        self._copy_out: dict[str, float] = {}
        self._pending: dict[str, PendingLoad] = {}
        self._releasing: dict[str, PendingLoad] = {}  # dropped loads whose end is not told yet
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        #: Failed loads by reason: a kvxfer error's (TRANSFER_NOT_FOUND, PROMPT_MISMATCH,
        #: DIAL_NOT_ALLOWED, ...), or REFUSED (by the scheduler half), DAEMON_RESTARTED,
        #: NO_ENDING (past its deadline), COPY_FAILED, or an exception's type.
        self.load_failures: Counter[str] = Counter()
        self._cursor = 0
        self._feed: CompletionFeed | None = None  # from the first load on
        self._resync = False  # some endings were missed: ask for every ended transfer
        self._endings = Endings(self._client)
        self._reach = Reconnecting(self._client)  # a restarting daemon is waited for, once

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map the daemon's pool and check that its pages are exactly this engine's blocks."""
        layers = engine_blocks(kv_caches, self._layout)
        self._layers = {name: i for i, name in enumerate(layers)}
        self._kv = list(layers.values())
        self._attach()
        log.info("kvxfer: %d layers of %d-byte blocks through pool %r of %s", len(layers),
                 self._layout.block_bytes, self._settings.pool, self._settings.daemon)

    def _attach(self) -> None:
        """Map the daemon's pool (dropping an earlier mapping first) and start following its
        completions from now."""
        self._detach()
        pool = self._reach.call(lambda: self._client.attach(self._settings.pool))
        try:
            check_pool(self._layout, pool.descriptor)
        except IncompatibleLayoutError:
            pool.detach()
            raise
        start = pool.descriptor.layout.anchor_bytes
        pages = pool.raw[start:start + pool.descriptor.num_pages * pool.descriptor.page_bytes]
        self._pages = pages.view(pool.descriptor.num_pages, len(self._kv), self._layout.block_bytes)
        self._pool, self._epoch = pool, pool.epoch
        self._cursor = self._client.completions().cursor
        self._lost(self._epoch)

    def _detach(self) -> None:
        self._epoch = ""
        if self._feed is not None:  # it followed the daemon we mapped: start anew from now
            self._feed.close(wait=False)  # not on the step: its call in flight ends it
            self._feed = None
        if self._pool is not None:
            self._pages = torch.empty(0, dtype=torch.uint8)
            self._pool.detach()
            self._pool = None

    def _current(self, epoch: str) -> None:
        """Make the mapping the one of memory ``epoch`` (a lease's): re-attach when the daemon
        restarted since we mapped it; StaleArenaError if it restarted yet again."""
        if epoch == self._epoch:
            return
        log.warning("kvxfer: daemon %s restarted (memory epoch %s, ours %s): re-attaching pool %r",
                    self._settings.daemon, epoch[:12], self._epoch[:12], self._settings.pool)
        self._attach()
        if epoch != self._epoch:
            raise StaleArenaError(f"the daemon's memory epoch is now {self._epoch[:12]}, the "
                                  f"lease's {epoch[:12]}: it restarted again")

    # -- prefill -----------------------------------------------------------------------------

    def bind(self, plan: StepPlan) -> None:
        """This step's plan, from the scheduler half; saves into pages of another memory
        epoch than our mapping's re-attach first (a save that cannot is dropped)."""
        self._plan = plan
        self._unsaved.clear()
        self._layers_saved.clear()
        for save in plan.saves:
            try:
                self._current(save.arena_epoch)
            except Exception as exc:  # noqa: BLE001 - no failure may reach vLLM's worker loop
                self._unsaved[save.transfer_id] = (_reason(exc), f"{type(exc).__name__}: {exc}")

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Copy this layer's blocks of every request saved this step into its pages."""
        if not self._plan.saves:
            return
        for save in self._plan.saves:
            if save.transfer_id in self._unsaved:
                continue
            start = time.perf_counter()
            try:
                layer = self._layers[layer_name]
                blocks = as_blocks(kv_layer)
                self._pages[list(save.pages[self._rank]), layer] = blocks[list(save.block_ids)]
                self._layers_saved[save.transfer_id] += 1
            except Exception as exc:  # noqa: BLE001 - no failure may reach vLLM's worker loop
                self._unsaved[save.transfer_id] = ("COPY_FAILED",
                                                   f"layer {layer_name}: {type(exc).__name__}: {exc}")
            self._copy_out[save.transfer_id] = (self._copy_out.get(save.transfer_id, 0.0)
                                                + time.perf_counter() - start)

    def wait_for_save(self) -> None:
        """Offer every page saved this step; the lease ends with the transfer. A save that
        failed part way is never offered: its pages go back and the decode side's pull fails."""
        for save in self._plan.saves:
            saved = self._layers_saved.pop(save.transfer_id, 0)
            failed = self._unsaved.get(save.transfer_id)
            if failed is None and saved != self._layout.num_layers:
                failed = ("INCOMPLETE", f"{saved} of its {self._layout.num_layers} layers were saved")
            if failed is None:
                self._offer(save)
                continue
            self.interval.count("failed_saves", failed[0])
            log.error("request %s: its KV was not saved (%s); not offered, so its decode engine "
                      "computes the prompt itself", save.req_id, failed[1])
            self._endings.release(save.lease_ids[self._rank])
            self._copy_out.pop(save.transfer_id, None)

    def _offer(self, save: Save) -> None:
        nbytes = len(save.block_ids) * self._layout.num_layers * self._layout.block_bytes
        transfer_id = rank_transfer(save.transfer_id, self._rank, self._layout.tp_size)
        pages, lease_id = save.pages[self._rank], save.lease_ids[self._rank]
        start = time.perf_counter()
        try:
            self._client.offer(transfer_id, self._settings.pool, PageRuns.from_pages(pages),
                               timeout_s=self._settings.timeout_s, verify=save.verify,
                               lease_id=lease_id, release_lease=True, arena_epoch=self._epoch,
                               prompt_digest=save.prompt_digest)
        except KvxferError as exc:
            log.error("request %s: could not offer its KV (%s: %s); its decode will fail or "
                      "recompute", save.req_id, type(exc).__name__, exc)
            self._endings.release(lease_id)
            self.interval.count("failed_saves", exc.reason)
        else:
            self.interval.save(self._copy_out.get(save.transfer_id, 0.0)
                               + time.perf_counter() - start, nbytes, len(pages))
        self._stats.record(role="prefill", transfer_id=transfer_id, req_id=save.req_id,
                           rank=self._rank, pages=len(pages), bytes=nbytes,
                           copy_s=self._copy_out.pop(save.transfer_id, 0.0),
                           offer_s=time.perf_counter() - start)

    # -- decode ------------------------------------------------------------------------------

    def start_load_kv(self) -> None:
        """Drop the loads of requests that ended (reporting them finished, so vLLM frees their
        blocks), and start this step's pulls."""
        for req_id in self._plan.cancels:
            for tid, pending in list(self._pending.items()):
                if pending.load.req_id == req_id:
                    del self._pending[tid]
                    self._finished.add(req_id)
                    self._endings.abort(tid, "its request ended")
                    self._release_after(tid, pending)
        for load in self._plan.loads:
            if load.refused:
                self._fail(load, load.refused, "REFUSED")
                continue
            try:
                self._start(load)
            except Exception as exc:  # noqa: BLE001 - no failure may reach vLLM's worker loop
                self._fail(load, f"{type(exc).__name__}: {exc}", _reason(exc))

    def _start(self, load: Load) -> None:
        """Lease pages for ``load`` and pull into them, in one call, through our mapping's
        memory epoch (a daemon that restarted since refuses it: re-attach, then try once
        more). A transfer id this worker is still loading (params used twice) is refused."""
        transfer_id = rank_transfer(load.transfer_id, self._rank, self._layout.tp_size)
        if transfer_id in self._pending or transfer_id in self._releasing:
            raise TransferExistsError(f"transfer {transfer_id!r} is already being loaded here")
        timeline = LoadTimeline(load.planned_unix)
        timeline.mark("started")
        if self._pool is None:  # an earlier re-attach failed: try again before pulling
            self._attach()
        try:
            lease, pulled = self._reach.call(lambda: self._lease_and_pull(load, transfer_id))
        except StaleArenaError:
            log.warning("kvxfer: daemon %s restarted since we mapped pool %r: re-attaching",
                        self._settings.daemon, self._settings.pool)
            self._attach()
            lease, pulled = self._lease_and_pull(load, transfer_id)
        timeline.mark("pulled")
        self._pending[transfer_id] = PendingLoad(load, lease, time.perf_counter(), self._epoch,
                                                 pulled.created_unix, timeline)
        if self._feed is None:
            self._feed = CompletionFeed(self._client, self._cursor)

    def _lease_and_pull(self, load: Load, transfer_id: str) -> tuple[LeaseInfo, TransferInfo]:
        return self._client.lease_and_pull(
            transfer_id, load.peer, self._settings.pool, load.pulled_pages,
            timeout_s=self._settings.timeout_s, lease_s=self._settings.lease_s,
            holder=f"vllm {self._engine_id}", arena_epoch=self._epoch,
            capability=load.capabilities[self._rank], prompt_digest=load.prompt_digest,
            skip_pages=load.first_page)

    def _release_after(self, transfer_id: str, pending: PendingLoad) -> None:
        """Release ``pending``'s lease once the daemon reports its transfer ended: until then
        bytes already on their way may still land in its pages."""
        self._releasing[transfer_id] = pending

    def get_finished(self) -> set[str]:
        """Requests whose load ended since the last step (failed ones too: see take_failed)."""
        try:
            self._poll()
        except Exception as exc:  # noqa: BLE001 - the engine goes on; loads past their deadline fail
            log.warning("kvxfer: could not ask the daemon which transfers ended: %s: %s",
                        type(exc).__name__, exc)
        self._expire()
        finished, self._finished = self._finished, set()
        return finished

    def _poll(self) -> None:
        """Settle what the feed gathered (taken every step, so it never piles up). When the
        daemon no longer kept some endings, ask it for every ended transfer, until that call
        succeeds."""
        if self._feed is None:
            return
        if self._plan.idle and self._pending:
            self._feed.wait(self._settings.idle_wait_s)
        batches, error = self._feed.take()
        if error is not None:
            log.warning("kvxfer: could not ask the daemon which transfers ended: %s: %s",
                        type(error).__name__, error)
        for ended in batches:
            if ended.epoch != self._epoch:
                self._lost(ended.epoch)
                continue
            self._resync = self._resync or ended.missed
            self._settle(ended.transfers)
        if self._resync and (self._pending or self._releasing):
            self._settle([i for i in self._client.transfers() if i.state.final])
        self._resync = False

    def _settle(self, infos: list[TransferInfo]) -> None:
        """Settle the loads and dropped loads whose transfers ``infos`` say ended."""
        for info in infos:
            dropped = self._releasing.get(info.transfer_id)
            if dropped is not None and info.created_unix == dropped.registered_unix:
                del self._releasing[info.transfer_id]
                self._endings.release(dropped.lease.lease_id)
            pending = self._pending.get(info.transfer_id)
            if pending is None or info.created_unix != pending.registered_unix:
                continue  # not ours, or an earlier registration of the same id
            del self._pending[info.transfer_id]
            try:
                self._land(pending, info)
            except Exception as exc:  # noqa: BLE001 - the load fails, not the engine
                self._endings.release(pending.lease.lease_id)
                self._fail(pending.load, f"copying it in failed: {type(exc).__name__}: {exc}",
                           "COPY_FAILED")

    def _lost(self, epoch: str) -> None:
        """The daemon's memory epoch is ``epoch``: fail at once every pending load of another
        (the daemon that held their transfers is gone, and their pages with it)."""
        for tid, pending in list(self._pending.items()):
            if pending.epoch != epoch:
                del self._pending[tid]
                self._fail(pending.load, f"the daemon restarted (memory epoch {epoch[:12]}, "
                                         f"the load's {pending.epoch[:12]}): its transfer is gone",
                           "DAEMON_RESTARTED")
        for tid, dropped in list(self._releasing.items()):
            if dropped.epoch != epoch:
                del self._releasing[tid]  # its lease went with the daemon

    def _expire(self) -> None:
        """Fail the loads the daemon has not ended well past their deadline (it did not
        answer, or lost them): their blocks must not wait forever."""
        limit = self._settings.timeout_s + EXPIRY_GRACE_S
        now = time.perf_counter()
        for tid, pending in list(self._pending.items()):
            if now - pending.started > limit:
                del self._pending[tid]
                self._endings.abort(tid, "no ending reported by its deadline")
                self._release_after(tid, pending)
                self._fail(pending.load, f"the daemon reported no ending within {limit:.0f}s",
                           "NO_ENDING")
        for tid, dropped in list(self._releasing.items()):
            if now - dropped.started > 2 * limit:  # its end never came: the lease expires anyway
                del self._releasing[tid]
                self._endings.release(dropped.lease.lease_id)

    def _land(self, pending: PendingLoad, info: TransferInfo) -> None:
        load = pending.load
        transfer_s = time.perf_counter() - pending.started
        pending.timeline.mark("ended")
        if not info.ok:
            self._endings.release(pending.lease.lease_id)
            self._fail(load, f"transfer {info.state.name}: {info.error}",
                       _reason(info.failure) if info.failure is not None else info.state.name)
            return
        start = time.perf_counter()
        pages = list(pending.lease.runs.pages())[:len(load.block_ids)]
        blocks = list(load.block_ids)
        for layer, kv in enumerate(self._kv):
            kv[blocks] = self._pages[pages, layer]
        copy_s = time.perf_counter() - start
        pending.timeline.mark("landed")
        self._endings.release(pending.lease.lease_id)
        self._finished.add(load.req_id)
        self.interval.load(pending.timeline.landed - pending.timeline.started, info.bytes,
                           load.pulled_pages)
        self._stats.record(role="decode", transfer_id=info.transfer_id, req_id=load.req_id,
                           rank=self._rank, ok=True, pages=load.pulled_pages, bytes=info.bytes,
                           transfer_s=transfer_s, daemon_s=info.seconds,
                           daemon_data_s=info.data_seconds, copy_s=copy_s,
                           verified=info.verified, **pending.timeline.fields())

    def _fail(self, load: Load, why: str, reason: str) -> None:
        """Report ``load`` failed; with tensor parallelism, abort the other ranks' transfers
        of it too: vLLM reports a request's load (failed or not) only once every rank has
        reported it, so a sibling's stalled transfer would hold the failed request until
        its deadline. Not for an abort (not passed on again), a refusal (no transfer
        exists) or a transfer id already being loaded (the transfers are another
        request's)."""
        self.load_failures[reason] += 1
        self.interval.count("failed_loads", reason)
        if reason not in ("REFUSED", TransferAbortedError.reason, TransferExistsError.reason):
            for rank in range(self._layout.tp_size):
                if rank != self._rank:
                    self._endings.abort_soon(
                        rank_transfer(load.transfer_id, rank, self._layout.tp_size),
                        f"rank {self._rank}'s load of it failed ({reason})")
        log.error("request %s: KV load of %s failed, the request is reported failed: %s",
                  load.req_id, load.transfer_id, why)
        self._failed.add(load.req_id)
        self._finished.add(load.req_id)
        self._stats.record(role="decode", transfer_id=load.transfer_id, req_id=load.req_id,
                           rank=self._rank, ok=False, error=why)

    def take_failed(self) -> set[str]:
        """Requests whose load failed since the last call (each also in ``get_finished``):
        vLLM recomputes their prompt from its local cache hit, or fails them."""
        failed, self._failed = self._failed, set()
        return failed

    # -- both ------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Abort pending loads, unmap the pool, close the channel."""
        for tid, pending in list(self._pending.items()):
            self._endings.abort(tid, "the engine shut down")
            self._endings.release(pending.lease.lease_id)
        self._pending.clear()
        self._endings.close()
        if self._feed is not None:
            self._feed.close()
            self._feed = None
        self._detach()
        self._client.close()


def _reason(exc: BaseException) -> str:
    """A failure's reason: a kvxfer error's own, else the exception's type."""
    return exc.reason if isinstance(exc, KvxferError) else type(exc).__name__
