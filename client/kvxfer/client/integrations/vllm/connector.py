"""``KvxferConnector``: vLLM's KV connector interface, served by a kvxfer daemon.

vLLM builds one connector in its scheduler (role SCHEDULER) and one per
worker (role WORKER); this class hands each call to the half that serves it
(``scheduler.SchedulerSide``, ``worker.WorkerSide``). ``kv_role`` limits what
it does: a ``kv_producer`` only hands KV off, a ``kv_consumer`` only loads it,
``kv_both`` does both. Settings come from ``kv_connector_extra_config``
(``settings.ConnectorSettings``).

Tensor parallelism: each rank has its own worker half and its shard of the KV
heads, the scheduler leases pages per rank, and each rank offers its own transfer
(``{engine}/{request}/tp{rank}``); a decode rank pulls the pages of its own KV heads
from the prefill ranks that hold them, whatever the two engines' TP sizes
(``engine_core.head_split``); vLLM counts a load finished once every rank reported it.
Both engines must have the same page layout and the same model (its fingerprint,
``model_identity``), whatever its path or the vLLM version.

Failure contract (``docs/trust.md``): no request may crash an engine. Every
entry point vLLM calls during serving runs under ``_guarded``: an exception is
logged with its traceback, counted in ``failures``, and answered with what
leaves the request correct: no external tokens, no save, or a failed load whose
blocks vLLM recomputes (or fails, with ``kv_load_failure_policy: fail``).
Only start-up (``__init__``, ``register_kv_caches``) may raise: a misconfigured
engine must not start.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.platforms import current_platform

from kvxfer.client.integrations.vllm.block_tables import layer_tables, transfer_groups, windowed
from kvxfer.client.integrations.vllm.layout import BlockLayout, cpu_block_format
from kvxfer.client.integrations.vllm.metrics import KvxferConnectorStats, KvxferPromMetrics
from kvxfer.client.integrations.vllm.model_identity import (
    ModelIdentity,
    checkpoint_config,
    fingerprint,
    model_directory,
    weights_of,
)
from kvxfer.client.integrations.vllm.offer_keeper import OfferKeeper
from kvxfer.client.integrations.vllm.protocol import StepPlan
from kvxfer.client.integrations.vllm.scheduler import SchedulerSide
from kvxfer.client.integrations.vllm.settings import load_settings
from kvxfer.client.integrations.vllm.stats import IntervalStats, empty_figures, merge
from kvxfer.client.integrations.vllm.worker import WorkerSide
from kvxfer.client.library import KvxferClient
from kvxfer.errors import InvalidSpecError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvxfer.integrations.vllm")
T = TypeVar("T")


@dataclass
class KvxferMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan, as vLLM carries it from the scheduler to the workers."""

    plan: StepPlan


def block_format(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str:
    """How K and V sit inside this engine's blocks: on CPU, ``layout.cpu_block_format`` of
    its KV cache layout, attention kernel and cache dtype; on GPU, vLLM's KV cache layout
    (e.g. ``NHD``)."""
    resolved = (getattr(kv_cache_config, "kv_cache_layout", None)
                or vllm_config.cache_config.kv_cache_layout or "unresolved")
    layout = str(getattr(resolved, "name", resolved))
    if current_platform.device_type != "cpu":
        return layout
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model, cache = vllm_config.model_config, vllm_config.cache_config
    kernel = _get_attn_isa(model.dtype, cache.block_size, model.get_head_size())
    return cpu_block_format(layout, kernel, str(cache.cache_dtype))


def block_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
                 page_size: int | None = None, page_heads: int | None = None) -> BlockLayout:
    """This engine's block layout, from its config, in pages of ``page_size`` tokens and
    ``page_heads`` KV heads (None: a block's; see ``layout.BlockLayout``)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    if getattr(model, "use_mla", False):
        raise InvalidSpecError("MLA models (one latent per token, replicated on every rank) are "
                               "not supported by the kvxfer connector yet")
    dtype = model.dtype if cache.cache_dtype == "auto" else cache.cache_dtype
    return BlockLayout(
        dtype=str(dtype).removeprefix("torch."), block_size=int(cache.block_size),
        num_layers=model.get_num_layers(parallel), num_kv_heads=model.get_num_kv_heads(parallel),
        head_size=model.get_head_size(), tp_size=parallel.tensor_parallel_size,
        block_format=block_format(vllm_config, kv_cache_config), page_size=page_size or 0,
        model_kv_heads=model.get_total_num_kv_heads(), page_heads=page_heads or 0)


def model_identity(vllm_config: VllmConfig) -> ModelIdentity:
    """This engine's model (see ``model_identity``): its checkpoint config with vLLM's
    overrides, weights, online quantization and speculative draft, fingerprinted; its name
    and the vLLM version, for the logs."""
    model = vllm_config.model_config
    cache_dir = vllm_config.load_config.download_dir
    directory = model_directory(str(model.model), model.revision, cache_dir)
    config = checkpoint_config(directory) or model.hf_config.to_dict()
    overrides = model.hf_overrides
    if isinstance(overrides, dict) and overrides:
        config = {**config, "vllm_hf_overrides": overrides}
    online = None if "quantization_config" in config else model.quantization
    spec = vllm_config.speculative_config
    draft = ({"draft": weights_of(spec.model, getattr(spec, "revision", None), cache_dir)}
             if spec and spec.model else None)
    return ModelIdentity(
        fingerprint=fingerprint(config, weights_of(str(model.model), model.revision, cache_dir),
                                online, draft),
        name=str(model.model), vllm_version=vllm.__version__)


def _plan_of(metadata: KVConnectorMetadata) -> StepPlan:
    """The plan a scheduler of this connector sent (TypeError for anything else)."""
    if not isinstance(metadata, KvxferMetadata):
        raise TypeError(f"connector metadata is a {type(metadata).__name__}, not KvxferMetadata")
    return metadata.plan


class KvxferConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """A vLLM KV connector whose KV travels through the node's kvxfer daemon; with vLLM's
    hybrid KV cache manager too (``SupportsHMA``: a block table per KV cache group,
    ``block_tables``)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        settings = load_settings(dict(transfer.kv_connector_extra_config))
        layout = block_layout(vllm_config, kv_cache_config, settings.page_size,
                              settings.page_heads)
        engine_id = str(transfer.engine_id)
        if kv_cache_config is not None:  # refuses groups kvxfer cannot page, at start
            every_layer = [n for g in kv_cache_config.kv_cache_groups for n in g.layer_names]
            layer_tables(kv_cache_config, every_layer, layout.block_size)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        #: Entry points that raised (and were answered safely), by name.
        self.failures: Counter[str] = Counter()
        #: This interval's figures for vLLM's metrics (``metrics``).
        self._interval = IntervalStats()
        self._keeper: OfferKeeper | None = None
        if role == KVConnectorRole.SCHEDULER:
            producer, consumer = bool(transfer.is_kv_producer), bool(transfer.is_kv_consumer)
            if consumer and settings.keep_every_s > 0:
                self._keeper = OfferKeeper(
                    KvxferClient(settings.daemon, name=f"vllm {engine_id} offer keeper"),
                    every_s=settings.keep_every_s, keep_s=settings.timeout_s)
            self._scheduler = SchedulerSide(
                settings, layout, model_identity(vllm_config), engine_id, producer=producer,
                consumer=consumer,
                client=KvxferClient(settings.daemon, name=f"vllm {engine_id} scheduler")
                if producer else None, interval=self._interval, keeper=self._keeper,
                computes_last_token=windowed(kv_cache_config))
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = WorkerSide(settings, layout, engine_id, get_tensor_model_parallel_rank(),
                                      self._interval, kv_cache_config)

    def _guarded(self, what: str, call: Callable[[], T], fallback: Callable[[], T]) -> T:
        """``call()``; if it raises, log and count it and answer ``fallback()`` instead."""
        try:
            return call()
        except Exception:  # noqa: BLE001 - the failure contract: nothing reaches vLLM's loops
            self.failures[what] += 1
            self._interval.count("errors", what)
            log.exception("kvxfer: %s failed; answered so that the request stays correct", what)
            return fallback()

    # -- scheduler half ----------------------------------------------------------------------

    def _sched(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler call reached a worker connector"
        return self._scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._manager = kv_cache_manager

    def on_new_request(self, request: Request) -> None:
        self._guarded("on_new_request", lambda: self._sched().on_new_request(request),
                      lambda: None)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._guarded(
            "get_num_new_matched_tokens",
            lambda: self._sched().get_num_new_matched_tokens(request, num_computed_tokens),
            lambda: self._sched().forget(request))

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Every KV cache group that takes part in transfers: a load restores each layer's
        blocks of the request (vLLM may zero new blocks of the others)."""
        return self._guarded("get_loaded_kv_cache_group_ids",
                             lambda: transfer_groups(self._kv_cache_config), tuple)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._guarded(
            "update_state_after_alloc",
            lambda: self._sched().update_state_after_alloc(
                request, blocks.get_block_ids(), num_external_tokens),
            lambda: self._sched().fail_load(request, blocks.get_block_ids(),
                                            num_external_tokens, "update_state_after_alloc failed"))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._guarded("build_connector_meta", lambda: self._build_meta(scheduler_output),
                             lambda: KvxferMetadata(self._sched().failed_plan(
                                 "build_connector_meta failed")))

    def _build_meta(self, scheduler_output: SchedulerOutput) -> KvxferMetadata:
        scheduled: dict[str, tuple[int, int]] = {}
        for new in scheduler_output.scheduled_new_reqs:
            scheduled[new.req_id] = (new.num_computed_tokens,
                                     scheduler_output.num_scheduled_tokens[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            scheduled[req_id] = (computed, scheduler_output.num_scheduled_tokens[req_id])
        plan = self._sched().build_plan(scheduled, self._manager.get_block_ids)
        return KvxferMetadata(plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        finished = set(connector_output.finished_recving or ())
        self._guarded("update_connector_output", lambda: self._sched().finished_loading(finished),
                      lambda: None)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = self._guarded("request_finished", lambda: self._sched().request_finished(request),
                               lambda: None)
        return False, params

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished``, as vLLM's hybrid KV cache manager calls it."""
        params = self._guarded("request_finished_all_groups",
                               lambda: self._sched().request_finished(request), lambda: None)
        return False, params

    # -- worker half -------------------------------------------------------------------------

    def _work(self) -> WorkerSide:
        assert self._worker is not None, "a worker call reached the scheduler connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._guarded("bind_connector_metadata",
                      lambda: self._work().bind(_plan_of(connector_metadata)), lambda: None)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._guarded("start_load_kv", self._work().start_load_kv, lambda: None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads land whole, before the request is scheduled again

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._guarded("save_kv_layer", lambda: self._work().save_kv_layer(layer_name, kv_layer),
                      lambda: None)

    def wait_for_save(self) -> None:
        self._guarded("wait_for_save", self._work().wait_for_save, lambda: None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Loads that ended this step, the failed ones also in ``failed_recving``: vLLM then
        recomputes the request from its local cache hit (or fails it). Per request, not per
        block: see docs/trust.md."""
        def results() -> KVConnectorTransferResults:
            worker = self._work()
            return KVConnectorTransferResults(finished_recving=worker.get_finished(),
                                              failed_recving=worker.take_failed())
        return self._guarded("get_transfer_results", results, KVConnectorTransferResults)

    # -- vLLM's metrics ---------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This half's figures since vLLM last asked (None when nothing happened)."""
        def take() -> KVConnectorStats | None:
            figures = self._interval.take()
            return KvxferConnectorStats(data=figures) if figures is not None else None
        return self._guarded("get_kv_connector_stats", take, lambda: None)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """The figures vLLM carried, in a copy of their own (vLLM hands the same dict to
        its Prometheus logger after its log line sums into this one)."""
        return KvxferConnectorStats(data=merge(empty_figures(), data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvxferPromMetrics:
        return KvxferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._guarded("shutdown", self._worker.shutdown, lambda: None)
        if self._keeper is not None:
            self._guarded("shutdown", self._keeper.close, lambda: None)
