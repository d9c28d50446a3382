"""The connector's worker half: vLLM's side of the engine-neutral core (``engine_core``).

vLLM keeps one KV tensor per layer, ``[num_blocks, ...]`` with each block's
bytes contiguous; the daemon's pool holds pages of ``num_layers`` such blocks
(``BlockLayout``), each layer in its own span of the page (``engine_core.page_segments``).
So layer ``l`` of block ``b`` is one contiguous copy to or from a page
(``engine_core.paged_blocks``), whatever the engine's attention code keeps inside. Blocks
of several pages (``page_size`` below the block size) are copied through the pool's views
instead (``engine_core.block_tiling``). Each layer's blocks are those of its KV cache group's
block table (one table without vLLM's hybrid KV cache manager; ``block_tables``).

Prefill: ``save_kv_layer`` copies each planned request's blocks of that layer
into its leased pages as the forward computes them (copy-out); ``wait_for_save``
offers the pages as the request's transfer, lease ending with it, so the
engine's blocks are free at once. Decode: ``start_load_kv`` queues, per planned load, a
pull of each prefill rank's transfer that holds some of this rank's KV heads (one, the same
rank's, when both engines have the same TP size: ``pull_plan``), each leasing
its pages, and returns (``engine_core.loads``: the pulls start from a
thread and their endings come from a feed in another, so the step makes no call to the
daemon); ``get_finished`` has the finished ones copied into the request's blocks, each
page among this rank's heads (copy-in, in a thread too: ``engine_core.landings``) and
reports a load once all its pulls are copied; failed ones are
reported failed too (``take_failed``: vLLM's request-level ``failed_recving``), so vLLM
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

import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from kvxfer.client.engine_core.block_tiling import Places
from kvxfer.client.engine_core.endings import Endings
from kvxfer.client.engine_core.landings import Landed, Landings
from kvxfer.client.engine_core.loads import PageLoads, PullEnd, failure_reason
from kvxfer.client.engine_core.paged_blocks import PagedBlocks
from kvxfer.client.engine_core.reconnecting import Reconnecting
from kvxfer.client.integrations.vllm.block_tables import NULL_BLOCK, layer_tables
from kvxfer.client.integrations.vllm.layout import (
    BlockLayout,
    as_blocks,
    check_pool,
    engine_blocks,
)
from kvxfer.client.integrations.vllm.protocol import Load, Save, StepPlan, rank_transfer
from kvxfer.client.integrations.vllm.pull_plan import Loading, Part, planned_pulls
from kvxfer.client.integrations.vllm.settings import ConnectorSettings
from kvxfer.client.integrations.vllm.stats import IntervalStats, LoadTimeline, TransferStats
from kvxfer.client.library import KvxferClient
from kvxfer.errors import (
    KvxferError,
    StaleArenaError,
    TransferAbortedError,
    TransferExistsError,
)
from kvxfer.pages import PageRuns

log = logging.getLogger("kvxfer.integrations.vllm")

Params = ParamSpec("Params")
Result = TypeVar("Result")


def _timed(method: Callable[Concatenate[WorkerSide, Params], Result]
           ) -> Callable[Concatenate[WorkerSide, Params], Result]:
    """Count the time ``method`` takes in its step (``WorkerSide._step_s``)."""
    def timed(self: WorkerSide, /, *args: Params.args, **kwargs: Params.kwargs) -> Result:
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._step_s += time.perf_counter() - start
    functools.update_wrapper(timed, method)
    return timed


class WorkerSide:
    """Moves one engine worker's KV blocks to and from its daemon."""

    def __init__(self, settings: ConnectorSettings, layout: BlockLayout, engine_id: str,
                 rank: int = 0, interval: IntervalStats | None = None,
                 kv_cache_config: Any = None) -> None:
        self._settings = settings
        self._layout = layout
        self._engine_id = engine_id
        self._rank = rank
        self._client = KvxferClient(settings.daemon, name=f"vllm {engine_id} worker {rank}")
        self._stats = TransferStats(settings.stats_file)
        #: This interval's figures for vLLM's metrics (``metrics``), shared with the connector.
        self.interval = interval or IntervalStats()
        reach = Reconnecting(self._client)  # a restarting daemon is waited for, once
        self._endings = Endings(self._client)
        self._blocks = PagedBlocks(self._client, reach, settings.pool,
                                   check=lambda pool: check_pool(layout, pool),
                                   block_size=layout.block_size, block_heads=layout.num_kv_heads)
        self._loads: PageLoads[Part] = PageLoads(self._client, self._endings, reach,
                                                    timeout_s=settings.timeout_s,
                                                    remap=self._remap)
        self._landings: Landings[tuple[PullEnd[Part], float]] = Landings()
        self._kv_cache_config = kv_cache_config
        self._layers: dict[str, int] = {}
        self._kv: list[torch.Tensor] = []
        #: Per layer (in ``_kv``'s order), the block table its blocks follow (``block_tables``).
        self._tables: tuple[int, ...] = ()
        self._plan = StepPlan()
        self._unsaved: dict[str, tuple[str, str]] = {}  # transfer id -> (reason, why) its save failed
        self._layers_saved: Counter[str] = Counter()  # transfer id -> layers copied this step
        self._copy_out: dict[str, float] = {}
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        #: Failed loads by reason: a kvxfer error's (TRANSFER_NOT_FOUND, PROMPT_MISMATCH,
        #: DIAL_NOT_ALLOWED, ...), or REFUSED (by the scheduler half), DAEMON_RESTARTED,
        #: NO_ENDING (past its deadline), COPY_FAILED, or an exception's type.
        self.load_failures: Counter[str] = Counter()
        #: Seconds this step's connector calls took so far (``_timed``; see ``get_finished``).
        self._step_s = 0.0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map the daemon's pool and check that its pages are exactly this engine's blocks."""
        layers = engine_blocks(kv_caches, self._layout)
        self._tables = layer_tables(self._kv_cache_config, list(layers), self._layout.block_size)
        self._layers = {name: i for i, name in enumerate(layers)}
        self._kv = list(layers.values())
        self._attach()
        log.info("kvxfer: %d layers of %d-byte blocks in %d block tables through pool %r of %s",
                 len(layers), self._layout.block_bytes, len(set(self._tables)),
                 self._settings.pool, self._settings.daemon)

    def _attach(self) -> None:
        """Map the daemon's pool (dropping an earlier mapping first) and follow its endings
        from now: the loads of another memory epoch fail. Copies in flight from the old
        mapping finish first."""
        self._landings.drain()
        self._loads.stop_following()
        self._blocks.attach()
        for end in self._loads.follow(self._blocks.epoch):
            self._fail(end.pull.payload.loading, end.why, end.reason)

    def _remap(self) -> None:
        """The daemon refused a pull for its memory epoch: it restarted since we mapped it."""
        log.warning("kvxfer: daemon %s restarted since we mapped pool %r: re-attaching",
                    self._settings.daemon, self._settings.pool)
        self._attach()

    def _current(self, epoch: str) -> None:
        """Make the mapping the one of memory ``epoch`` (a lease's): re-attach when the daemon
        restarted since we mapped it; StaleArenaError if it restarted yet again."""
        if epoch == self._blocks.epoch:
            return
        log.warning("kvxfer: daemon %s restarted (memory epoch %s, ours %s): re-attaching pool %r",
                    self._settings.daemon, epoch[:12], self._blocks.epoch[:12], self._settings.pool)
        self._attach()
        if epoch != self._blocks.epoch:
            raise StaleArenaError(f"the daemon's memory epoch is now {self._blocks.epoch[:12]}, "
                                  f"the lease's {epoch[:12]}: it restarted again")

    # -- prefill -----------------------------------------------------------------------------

    @_timed
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
                self._unsaved[save.transfer_id] = (failure_reason(exc),
                                                   f"{type(exc).__name__}: {exc}")

    @_timed
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Copy this layer's blocks of every request saved this step into its pages."""
        if not self._plan.saves:
            return
        for save in self._plan.saves:
            if save.transfer_id in self._unsaved:
                continue
            start = time.perf_counter()
            try:
                pages = save.pages[self._rank]
                layer = self._layers[layer_name]
                places = Places.of(save.block_tables[self._tables[layer]],
                                   self._layout.token_pages_per_block, 0,
                                   len(pages) // self._layout.groups, range(self._layout.groups))
                self._blocks.copy_out(layer, as_blocks(kv_layer), places, pages)
                self._layers_saved[save.transfer_id] += 1
            except Exception as exc:  # noqa: BLE001 - no failure may reach vLLM's worker loop
                self._unsaved[save.transfer_id] = ("COPY_FAILED",
                                                   f"layer {layer_name}: {type(exc).__name__}: {exc}")
            self._copy_out[save.transfer_id] = (self._copy_out.get(save.transfer_id, 0.0)
                                                + time.perf_counter() - start)

    @_timed
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
        transfer_id = rank_transfer(save.transfer_id, self._rank, self._layout.tp_size)
        pages, lease_id = save.pages[self._rank], save.lease_ids[self._rank]
        nbytes = len(pages) * self._layout.num_layers * self._layout.page.layer_bytes
        start = time.perf_counter()
        try:
            self._client.offer(transfer_id, self._settings.pool, PageRuns.from_pages(pages),
                               timeout_s=self._settings.timeout_s, verify=save.verify,
                               lease_id=lease_id, release_lease=True,
                               arena_epoch=self._blocks.epoch,
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

    @_timed
    def start_load_kv(self) -> None:
        """Drop the loads of requests that ended (reporting them finished once no copy of
        theirs runs, so vLLM frees their blocks), and start this step's pulls."""
        if self._plan.cancels:
            ended = set(self._plan.cancels)
            for dropped in self._loads.cancel(lambda x: x.loading.load.req_id in ended,
                                              "its request ended"):
                self._settle(dropped.loading, ("", "CANCELLED"))
        for load in self._plan.loads:
            loading = Loading(load, LoadTimeline(load.planned_unix))
            if load.refused:
                self._fail(loading, load.refused, "REFUSED")
                continue
            try:
                self._start(loading)
            except Exception as exc:  # noqa: BLE001 - no failure may reach vLLM's worker loop
                self._fail(loading, f"{type(exc).__name__}: {exc}", failure_reason(exc))

    def _start(self, loading: Loading) -> None:
        """Queue ``loading``'s pulls, into pages leased for each, through our mapping's memory
        epoch (``engine_core.loads`` retries once, re-attached, if the daemon restarted
        since). A transfer id this worker is still loading (params used twice) is refused."""
        load = loading.load
        loading.timeline.mark("started")
        plans = planned_pulls(self._layout, load, self._rank)
        for plan in plans:
            self._loads.check_free(plan.transfer_id)
        if not self._blocks.attached:  # an earlier re-attach failed: try again before pulling
            self._attach()
        loading.parts = len(plans)
        for plan in plans:
            self._loads.start(
                Part(loading, plan), plan.offer_id, peer=load.peer, pool=self._settings.pool,
                pages=plan.num_pages, skip_pages=plan.skip_pages, part=plan.offer_part,
                capability=load.capabilities[plan.rank], prompt_digest=load.prompt_digest,
                epoch=self._blocks.epoch, lease_s=self._settings.lease_s,
                holder=f"vllm {self._engine_id}")

    def get_finished(self) -> set[str]:
        """Requests whose load ended since the last step (failed ones too: see take_failed).
        The step ends here: if it carried a save or a load, the connector's time in it (not
        counting an idle step's wait for endings) goes into the interval's figures."""
        if self._plan.idle:  # waiting, not holding up a step
            if self._landings:
                self._landings.wait(self._settings.idle_wait_s)
            else:
                self._loads.wait(self._settings.idle_wait_s)
        start = time.perf_counter()
        landings = self._landings.collect()
        for landed in landings:
            self._landed(landed)
        try:
            ends = self._loads.poll()
        except Exception as exc:  # noqa: BLE001 - the engine goes on; loads past their deadline fail
            log.warning("kvxfer: could not take the transfers that ended: %s: %s",
                        type(exc).__name__, exc)
            ends = []
        ends += self._loads.expire()
        for end in ends:
            if not end.ok:
                self._fail(end.pull.payload.loading, end.why, end.reason)
                continue
            try:
                self._land(end)
            except Exception as exc:  # noqa: BLE001 - the load fails, not the engine
                self._loads.release(end)
                self._fail(end.pull.payload.loading, f"copying it in failed: "
                           f"{type(exc).__name__}: {exc}", "COPY_FAILED")
        finished, self._finished = self._finished, set()
        if ends or landings or self._plan.saves or self._plan.loads:
            seconds = self._step_s + time.perf_counter() - start
            self.interval.step(seconds)
            self._stats.record(role="step", rank=self._rank, seconds=seconds,
                               saves=len(self._plan.saves), loads=len(self._plan.loads),
                               ended=len(ends), landed=len(landings))
        self._step_s = 0.0
        return finished

    def _land(self, end: PullEnd[Part]) -> None:
        """Have a finished pull's pages copied into its request's blocks, in the landing
        thread (``_landed`` counts it once copied); nothing for a load that already failed."""
        part, rows = end.pull.payload, self._blocks
        loading = part.loading
        assert end.pull.lease is not None
        if loading.outcome is not None:
            self._loads.release(end)
            return
        if end.pull.epoch != rows.epoch:  # re-attached since: its pages are another arena's
            self._loads.release(end)
            self._fail(loading, f"the daemon restarted (memory epoch {rows.epoch[:12]}, the "
                                f"load's {end.pull.epoch[:12]}): its transfer is gone",
                       "DAEMON_RESTARTED")
            return
        places = part.plan.places
        pages = list(end.pull.lease.runs.pages())[:part.plan.num_pages]
        loading.timeline.pulled = max(loading.timeline.pulled, end.pull.returned_unix)
        loading.timeline.mark("ended")  # the last of its pulls to end sets it
        self._landings.submit((end, time.perf_counter() - end.pull.started),
                              lambda: self._copy_in(rows, pages, places))
        loading.copying += 1

    def _copy_in(self, rows: PagedBlocks, pages: list[int], places: Sequence[Places]) -> None:
        """The landing thread's copy, each layer through its block table's ``places``, never
        into vLLM's null block; on a GPU it returns once the device finished it (the pages
        are released, and may be reused, when it returns)."""
        landing = [table.without(NULL_BLOCK, pages) for table in places]
        for layer, blocks in enumerate(self._kv):
            table_places, table_pages = landing[self._tables[layer]]
            rows.copy_in(layer, blocks, table_pages, table_places)
        if self._kv and self._kv[0].is_cuda:
            torch.cuda.current_stream(self._kv[0].device).synchronize()

    def _landed(self, landed: Landed[tuple[PullEnd[Part], float]]) -> None:
        """A copy-in finished: release its pages; the load is done once all its pulls are."""
        end, transfer_s = landed.payload
        loading, info = end.pull.payload.loading, end.info
        assert info is not None
        self._loads.release(end)
        loading.copying -= 1
        loading.copy_s += landed.seconds
        if landed.error is not None:
            self._fail(loading, f"copying it in failed: {type(landed.error).__name__}: "
                                f"{landed.error}", "COPY_FAILED")
            return
        loading.infos.append(info)
        loading.transfer_s = max(loading.transfer_s, transfer_s)
        self._settle(loading, ("", "") if len(loading.infos) == loading.parts else None)

    def _fail(self, loading: Loading, why: str, reason: str) -> None:
        """``loading`` failed: drop its other pulls, and, with tensor parallelism, abort the
        other ranks' transfers of it too: vLLM reports a request's load (failed or not) only
        once every rank has reported it, so a sibling's stalled transfer would hold the
        failed request until its deadline. Not for an abort (not passed on again), a refusal
        (no transfer exists) or a transfer id already being loaded (the transfers are another
        request's). Reported once no copy of it runs."""
        if loading.outcome is not None:
            self._settle(loading, None)  # a copy that just ended may have been the last
            return
        load = loading.load
        self.load_failures[reason] += 1
        self.interval.count("failed_loads", reason)
        self._loads.cancel(lambda x: x.loading is loading,
                           f"another pull of its load failed ({reason})")
        if reason not in ("REFUSED", TransferAbortedError.reason, TransferExistsError.reason):
            self._abort_siblings(load, reason)
        log.error("request %s: KV load of %s failed, the request is reported failed: %s",
                  load.req_id, load.transfer_id, why)
        self._stats.record(role="decode", transfer_id=load.transfer_id, req_id=load.req_id,
                           rank=self._rank, ok=False, error=why)
        self._settle(loading, (why, reason))

    def _abort_siblings(self, load: Load, reason: str) -> None:
        """Abort the pulls the other ranks make for ``load`` (on our daemon, which is theirs)."""
        try:
            siblings = [plan.transfer_id for rank in range(self._layout.tp_size)
                        if rank != self._rank for plan in planned_pulls(self._layout, load, rank)]
        except Exception as exc:  # noqa: BLE001 - no failure may reach vLLM's worker loop
            log.error("request %s: could not tell which transfers the other ranks pull (%s: "
                      "%s); they end at their deadline", load.req_id, type(exc).__name__, exc)
            return
        for transfer_id in siblings:
            self._endings.abort_soon(transfer_id, f"rank {self._rank}'s load of it failed "
                                                  f"({reason})")

    def _settle(self, loading: Loading, outcome: tuple[str, str] | None) -> None:
        """Record ``outcome`` (first one wins) and report the load once no copy of it runs:
        vLLM frees, or recomputes into, its blocks once told."""
        if loading.outcome is None:
            loading.outcome = outcome
        if loading.outcome is None or loading.copying or loading.reported:
            return
        loading.reported = True
        load = loading.load
        self._finished.add(load.req_id)
        why, reason = loading.outcome
        if reason:
            if reason != "CANCELLED":
                self._failed.add(load.req_id)
            return
        loading.timeline.mark("landed")
        nbytes = sum(info.bytes for info in loading.infos)
        self.interval.load(loading.timeline.landed - loading.timeline.started, nbytes,
                           load.pulled_pages)
        self._stats.record(role="decode", transfer_id=load.transfer_id, req_id=load.req_id,
                           rank=self._rank, ok=True, pages=load.pulled_pages, bytes=nbytes,
                           transfer_s=loading.transfer_s,
                           daemon_s=max(info.seconds for info in loading.infos),
                           daemon_data_s=max(info.data_seconds for info in loading.infos),
                           copy_s=loading.copy_s, pulls=loading.parts,
                           verified=all(info.verified for info in loading.infos),
                           **loading.timeline.fields())

    def take_failed(self) -> set[str]:
        """Requests whose load failed since the last call (each also in ``get_finished``):
        vLLM recomputes their prompt from its local cache hit, or fails them."""
        failed, self._failed = self._failed, set()
        return failed

    # -- both ------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Abort pending loads, finish the copies in flight and release their pages, unmap the
        pool (not while a copy still reads it), close the channel."""
        self._loads.close("the engine shut down")
        copies_done = True
        try:
            self._landings.close()
        except TimeoutError as exc:
            copies_done = False
            log.error("kvxfer: %s; the pool stays mapped", exc)
        for landed in self._landings.collect():
            self._loads.release(landed.payload[0])
        self._endings.close()
        if copies_done:
            self._blocks.detach()
        self._client.close()
