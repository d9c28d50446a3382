"""Taking the messages a failed receive will never take, so their senders can finish.

When a receive batch fails (its transfer was aborted, ran out of time, or lost its
lease), its unmatched receives are cancelled at once, so its pages can be given to
another transfer the same moment: a message that arrives later carries the failed
transfer's tag, which no receive matches any more (tags are never reused), so it
cannot land in those pages. But such a message then waits in UCX's unexpected
queue, and its sender's request never completes (a rendezvous send waits for its
receiver): up to a window of requests and buffers held on the sender, and queue
entries on the receiver, for every transfer aborted mid-way.

``LateMessages`` remembers the tags of the cancelled receives for ``DRAIN_S``
seconds; at every step of the engine's loop (a message arriving wakes it) it probes
for those tags and receives any it finds into a scratch buffer, whose bytes are
thrown away. The sender's requests then complete, and both sides' gauges of posted
requests return to zero.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np

#: How long the tags of cancelled receives are watched for late messages.
DRAIN_S = 30.0
#: Tags probed per failed batch and step (late messages come in order, at most a window).
PROBES_PER_STEP = 64


@dataclass
class _Watched:
    tags: deque[int]
    until: float


@dataclass
class LateMessages:
    """The tags of cancelled receives, and the sink receives taking their late messages."""

    api: Any
    worker: Any
    _watched: list[_Watched] = field(default_factory=list)
    _requests: list[tuple[Any, Any]] = field(default_factory=list)  # (request, its sink array)

    def watch(self, tags: list[int]) -> None:
        """Take late messages with these tags (of receives just cancelled) for ``DRAIN_S``."""
        if tags:
            self._watched.append(_Watched(deque(tags), time.monotonic() + DRAIN_S))

    @property
    def in_flight(self) -> int:
        """Sink receives started and not yet complete."""
        return len(self._requests)

    @property
    def idle(self) -> bool:
        """Nothing watched and nothing in flight."""
        return not self._watched and not self._requests

    def step(self) -> None:
        """Receive the late messages that arrived; retire completed sink receives and
        watches that expired or have nothing left to take."""
        self._requests = [(r, sink) for r, sink in self._requests if not r.completed]
        now = time.monotonic()
        self._watched = [w for w in self._watched if w.tags and w.until > now]
        for watched in self._watched:
            for tag in list(islice(watched.tags, PROBES_PER_STEP)):
                found = self.worker.tag_probe(self.api.UCXXTag(tag), remove=True)
                if not found.matched:
                    continue
                watched.tags.remove(tag)
                self._take(found)

    def _take(self, found: Any) -> None:
        from ucxx._lib.arr import Array

        sink = Array(np.empty(max(1, found.length), dtype=np.uint8))
        self._requests.append((self.worker.tag_recv_with_handle(sink, found), sink))
