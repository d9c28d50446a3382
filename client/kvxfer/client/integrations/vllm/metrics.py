"""The connector's figures in vLLM's own metrics: its periodic log line and ``/metrics``.

vLLM collects ``get_kv_connector_stats`` from every worker after each step (and from the
scheduler), sums the ranks' with ``KvxferConnectorStats.aggregate``, and hands the plain
data to the API server, which rebuilds it with ``build_kv_connector_stats`` and records
it through ``KvxferPromMetrics.observe``. The series, each with vLLM's ``engine`` and
``model_name`` labels:

- ``vllm:kvxfer_load_time_seconds``: a load, from the worker starting it to its KV in the
  engine's blocks; ``vllm:kvxfer_load_bytes``, ``vllm:kvxfer_load_pages``;
- ``vllm:kvxfer_save_time_seconds``: a save's copy-out and offer; ``vllm:kvxfer_save_bytes``,
  ``vllm:kvxfer_save_pages``;
- ``vllm:kvxfer_step_time_seconds``: one observation per rank and model step that carried
  a save or a load, or reported a load copied in: the time the connector's worker calls took in it (not counting an idle
  step's wait for endings; the scheduler's calls are not in it);
- ``vllm:kvxfer_failed_loads_total{reason}``: loads reported failed to vLLM (its load
  errors, recomputed or failed by ``kv_load_failure_policy``), by reason
  (``worker.WorkerSide.load_failures``);
- ``vllm:kvxfer_failed_saves_total{reason}``: saves not offered, by reason;
- ``vllm:kvxfer_refused_params_total{reason}``: requests whose ``kv_transfer_params`` were
  refused before any block was allocated (malformed, another version, block layout or model):
  computed here like an ordinary prompt (``SchedulerSide.refusals``);
- ``vllm:kvxfer_connector_errors_total{entry_point}``: connector calls that raised and
  were answered safely (``KvxferConnector.failures``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvxfer.client.integrations.vllm.stats import (
    Figures,
    empty_figures,
    is_empty,
    merge,
    summary,
)

#: Seconds of a load or save: 1 ms to 30 s (a transfer's default deadline).
TIME_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
#: Seconds of the connector's calls in one step: 0.1 ms to 1 s.
STEP_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0]
#: Bytes of a load or save: 4 KiB to 16 GiB, by powers of 4.
BYTE_BUCKETS = [float(4 ** i) for i in range(6, 18)]
#: Pages of a load: 1 to 4096, by powers of 2.
PAGE_BUCKETS = [float(2 ** i) for i in range(13)]


@dataclass
class KvxferConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """One interval's ``stats.Figures``, as vLLM carries and sums them."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: Figures = empty_figures()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return summary(merge(empty_figures(), self.data))

    def is_empty(self) -> bool:
        return is_empty(self.data)


class KvxferPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """Registers the series listed above and records each interval's figures in them."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._histograms: dict[str, dict[int, Any]] = {}
        for key, name, documentation, buckets in (
            ("load_seconds", "load_time_seconds",
             "Seconds of a KV load: the worker starting it to its KV in the engine's blocks.",
             TIME_BUCKETS),
            ("load_bytes", "load_bytes", "Bytes of a KV load.", BYTE_BUCKETS),
            ("load_pages", "load_pages", "Daemon pages of a KV load.", PAGE_BUCKETS),
            ("save_seconds", "save_time_seconds",
             "Seconds of a KV save: copying the blocks into the daemon's pages and offering them.",
             TIME_BUCKETS),
            ("save_bytes", "save_bytes", "Bytes of a KV save.", BYTE_BUCKETS),
            ("save_pages", "save_pages", "Daemon pages of a KV save.", PAGE_BUCKETS),
            ("step_seconds", "step_time_seconds",
             "Seconds the kvxfer connector's calls took in a model step that carried a KV save "
             "or load, per rank.", STEP_BUCKETS),
        ):
            histogram = self._histogram_cls(name=f"vllm:kvxfer_{name}", documentation=documentation,
                                            buckets=buckets, labelnames=labelnames)
            self._histograms[key] = create_metric_per_engine(histogram, per_engine_labelvalues)
        #: stats.COUNTS key -> its counter, labelled with vLLM's labels and the key's label.
        self._counters = {
            key: self._counter_cls(name=f"vllm:kvxfer_{name}", documentation=documentation,
                                   labelnames=[*labelnames, label])
            for key, name, label, documentation in (
                ("failed_loads", "failed_loads", "reason",
                 "KV loads reported failed to vLLM (recomputed, or failed by "
                 "kv_load_failure_policy), by reason."),
                ("failed_saves", "failed_saves", "reason",
                 "KV saves not offered to a decode engine, by reason."),
                ("refused_params", "refused_params", "reason",
                 "Requests whose kv_transfer_params were refused before any block was "
                 "allocated (computed like an ordinary prompt), by reason."),
                ("errors", "connector_errors", "entry_point",
                 "kvxfer connector calls that raised and were answered safely, by entry point."),
            )
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        figures = merge(empty_figures(), transfer_stats_data)
        for key, per_engine in self._histograms.items():
            for value in figures[key]:
                per_engine[engine_idx].observe(value)
        engine_labels = self.per_engine_labelvalues[engine_idx]
        for key, counter in self._counters.items():
            for label, count in figures[key].items():
                counter.labels(*engine_labels, label).inc(count)
