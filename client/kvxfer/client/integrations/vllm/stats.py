"""What the connector measures: per-interval figures for vLLM's ``/metrics``, and the
per-transfer records of ``stats_file`` (an opt-in debugging aid, one JSON line per transfer).

``IntervalStats`` gathers, between two of vLLM's collections, each load's and save's
seconds, bytes and pages, the failed loads and saves by reason and the connector entry
points that raised; as a plain dict of lists and counts (``Figures``), because vLLM
pickles it from the workers to the scheduler and sums the ranks' (``merge``).
``metrics.KvxferConnectorStats`` and ``metrics.KvxferPromMetrics`` hand them to vLLM.

A decode record carries its load's timeline, each step's seconds since the scheduler
planned the load (its request's blocks allocated): the worker queued it (``started_s``),
the daemon leased its pages and took the pull, in the one call of the worker's start
thread (``pulled_s``: the call returned), the worker took the daemon's ending
(``ended_s``), the bytes were copied into the engine's blocks (``landed_s``); with ``planned_unix``, the wall clock
of the plan, to line it up with the prefill engine's record and a client's clock.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

log = logging.getLogger("kvxfer.integrations.vllm")

#: The steps of a load's timeline, in order.
LOAD_STEPS = ("started", "pulled", "ended", "landed")


@dataclass
class LoadTimeline:
    """When each step of one load happened (``time.time()``); 0: not (yet)."""

    planned: float
    started: float = 0.0
    pulled: float = 0.0
    ended: float = 0.0
    landed: float = 0.0

    def mark(self, step: str) -> None:
        """``step`` (one of ``LOAD_STEPS``) happened now."""
        setattr(self, step, time.time())

    def fields(self) -> dict[str, float]:
        """The record's fields: ``planned_unix`` and each step's seconds since the plan."""
        steps = {f"{step}_s": round(getattr(self, step) - self.planned, 6)
                 for step in LOAD_STEPS if getattr(self, step) and self.planned}
        return {"planned_unix": self.planned, **steps}


#: One interval's figures: the lists ``LISTS`` (one value per load or save) and the
#: counts by key ``COUNTS``. Plain data, so vLLM can pickle it between processes.
Figures: TypeAlias = dict[str, Any]
#: Per load or save: seconds (the worker starting a load to its KV in the engine's blocks;
#: a save's copy-out and offer), bytes and pages; per step that carried a save or a load
#: (per rank), the seconds the worker's connector calls took in it.
LISTS = ("load_seconds", "load_bytes", "load_pages", "save_seconds", "save_bytes", "save_pages",
         "step_seconds")
#: Counts by key: failed loads and saves by reason, params refused before any load (by
#: reason), connector entry points that raised.
COUNTS = ("failed_loads", "failed_saves", "refused_params", "errors")


def empty_figures() -> Figures:
    """An interval in which nothing happened."""
    return {**{name: [] for name in LISTS}, **{name: {} for name in COUNTS}}


def is_empty(figures: Figures) -> bool:
    """Nothing was recorded (a failure counts as something)."""
    return not any(figures.get(name) for name in LISTS + COUNTS)


def merge(into: Figures, other: Figures) -> Figures:
    """Add ``other``'s figures (another rank's, or a later interval's) to ``into``; returns
    ``into``. Keys either lacks count as empty."""
    for name in LISTS:
        into.setdefault(name, []).extend(other.get(name, ()))
    for name in COUNTS:
        counts = into.setdefault(name, {})
        for key, count in other.get(name, {}).items():
            counts[key] = counts.get(key, 0) + count
    return into


def summary(figures: Figures) -> dict[str, int | float]:
    """The interval in a few numbers, for vLLM's periodic log line."""
    loads, saves, steps = figures["load_seconds"], figures["save_seconds"], figures["step_seconds"]
    load_s, load_mb = sum(loads), sum(figures["load_bytes"]) / 2**20
    out: dict[str, int | float] = {
        "Loads": len(loads),
        "Avg load time (ms)": round(1e3 * load_s / len(loads), 3) if loads else 0,
        "Max load time (ms)": round(1e3 * max(loads), 3) if loads else 0,
        "Load throughput (MB/s)": round(load_mb / load_s, 3) if load_s else 0,
        "Saves": len(saves),
        "Avg save time (ms)": round(1e3 * sum(saves) / len(saves), 3) if saves else 0,
        "Max connector time in a step (ms)": round(1e3 * max(steps), 3) if steps else 0,
    }
    for name in COUNTS:
        out[f"{name.replace('_', ' ').capitalize()}"] = sum(figures[name].values())
    return out


class IntervalStats:
    """The figures since the last ``take``. Used from one thread (vLLM's step)."""

    def __init__(self) -> None:
        self._figures = empty_figures()

    def load(self, seconds: float, nbytes: int, pages: int) -> None:
        """A load landed: ``seconds`` from its start to its KV in the engine's blocks."""
        self._add("load", seconds, nbytes, pages)

    def save(self, seconds: float, nbytes: int, pages: int) -> None:
        """A save was offered: ``seconds`` of copy-out and offer."""
        self._add("save", seconds, nbytes, pages)

    def _add(self, kind: str, seconds: float, nbytes: int, pages: int) -> None:
        self._figures[f"{kind}_seconds"].append(seconds)
        self._figures[f"{kind}_bytes"].append(nbytes)
        self._figures[f"{kind}_pages"].append(pages)

    def step(self, seconds: float) -> None:
        """A step carried a save or a load: the worker's connector calls took ``seconds``."""
        self._figures["step_seconds"].append(seconds)

    def count(self, name: str, key: str) -> None:
        """One more ``key`` (a reason, an entry point) in ``name`` (one of ``COUNTS``)."""
        counts = self._figures[name]
        counts[key] = counts.get(key, 0) + 1

    def take(self) -> Figures | None:
        """The figures since the last call (None when nothing happened), and start anew."""
        if is_empty(self._figures):
            return None
        figures, self._figures = self._figures, empty_figures()
        return figures


class TransferStats:
    """Appends the per-transfer records to ``path`` (nothing when empty)."""

    def __init__(self, path: str) -> None:
        self._path = Path(path) if path else None

    def record(self, **fields: Any) -> None:
        """Append one record; never raises (a full disk must not stop the engine's step)."""
        if self._path is None:
            return
        try:
            with self._path.open("a") as out:
                out.write(json.dumps({"unix_time": time.time(), **fields}) + "\n")
        except OSError as exc:
            log.warning("kvxfer: could not write %s: %s", self._path, exc)
