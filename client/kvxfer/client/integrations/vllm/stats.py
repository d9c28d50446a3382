"""The connector's per-transfer records (``stats_file``): one JSON line per transfer.

A decode record carries its load's timeline, each step's seconds since the scheduler
planned the load (its request's blocks allocated): the worker started it
(``started_s``), the daemon leased its pages and took the pull, in one call
(``pulled_s``), the worker took the daemon's ending (``ended_s``), the bytes were
copied into the engine's blocks (``landed_s``); with ``planned_unix``, the wall clock
of the plan, to line it up with the prefill engine's record and a client's clock.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


class TransferStats:
    """Appends the records to ``path`` (nothing when empty)."""

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
