"""Data lanes: several UCX engines side by side, so several threads move one transfer.

A ``UcxEngine`` is one UCX worker driven by one thread, and over shared memory
(cma) and CUDA IPC the thread that progresses a send is the one that copies its
bytes. One lane therefore moves at most one core's worth of copying; with two
lanes on two vCPUs a 256 MiB transfer over cma went from 4.4 to 6.1 GB/s here.
Over tcp on the same two cores a second lane made transfers ~20 % slower (both
cores are already busy there, one writing and one reading the sockets), so the
daemon's default is one lane.

Lane ``i`` of a sender connects to lane ``i`` of the receiver (each lane has its
own listener), and both sides deal a transfer's messages out the same way:
message ``k`` travels on lane ``k % lanes``. The receiver posts it on that lane's
worker, so each receiving thread serves one sender thread. ``lanes`` is the
smaller of the two daemons' lane counts, agreed per session.

``UcxLanes`` is the daemon's ``Transport``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from kvxfer.errors import InvalidArgumentError, PeerUnavailableError
from kvxfer.transport.batches import EndpointId, MessageBatch
from kvxfer.transport.engine import UcxEngine
from kvxfer.transport.protocol import Batch, Connection, Message


@dataclass(frozen=True)
class LaneConnection:
    """One endpoint per lane to a peer's lanes, lane ``i`` at index ``i``."""

    endpoints: tuple[EndpointId, ...]

    @property
    def lanes(self) -> int:
        """How many lanes this connection has."""
        return len(self.endpoints)


class LaneBatch:
    """One transfer's messages in one direction, spread over lanes, tracked as a unit.

    ``future`` completes when every lane's messages completed, or fails with the
    first lane's error; ``bytes_done`` sums the lanes.
    """

    def __init__(self, parts: Sequence[MessageBatch]) -> None:
        self.parts = tuple(parts)
        self.future: Future[None] = Future()
        self._left = len(self.parts)
        self._lock = threading.Lock()
        for part in self.parts:
            part.future.add_done_callback(self._part_done)

    @property
    def bytes_done(self) -> int:
        """Bytes whose messages completed, over all lanes."""
        return sum(part.bytes_done for part in self.parts)

    def _part_done(self, part: Future[None]) -> None:
        # Runs on the lane's progress thread (or here, if the part was already done).
        error = part.exception() if not part.cancelled() else PeerUnavailableError("cancelled")
        with self._lock:
            self._left -= 1
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            elif self._left == 0:
                self.future.set_result(None)


class UcxLanes:
    """``lanes`` UCX engines, each a worker, a listener and a progress thread.

    Contract: ``kvxfer.transport.Transport``'s.
    """

    def __init__(self, lanes: int = 1, *, host: str = "127.0.0.1", port: int = 0,
                 error_handling: bool = True) -> None:
        if lanes < 1:
            raise InvalidArgumentError(f"lanes={lanes}; expected at least 1")
        self.engines: list[UcxEngine] = []
        try:
            for i in range(lanes):
                self.engines.append(UcxEngine(host=host, port=port + i if port else 0,
                                              error_handling=error_handling))
        except BaseException:
            self.close()
            raise

    @property
    def host(self) -> str:
        """The address every lane's listener was asked to serve."""
        return self.engines[0].host

    @property
    def ports(self) -> list[int]:
        """Each lane's listener port, lane 0 first."""
        return [engine.port for engine in self.engines]

    @property
    def lanes(self) -> int:
        """How many lanes this side has."""
        return len(self.engines)

    def connect(self, host: str, ports: Sequence[int], timeout: float = 10.0) -> LaneConnection:
        """Connect lane ``i`` to the peer's lane ``i`` listener, for as many lanes as both have."""
        endpoints: list[EndpointId] = []
        try:
            for engine, port in zip(self.engines, ports):
                endpoints.append(engine.connect(host, port, timeout))
        except BaseException:
            self.close_connection(LaneConnection(tuple(endpoints)))
            raise
        return LaneConnection(tuple(endpoints))

    def send(self, connection: Connection, messages: list[Message], window_bytes: int,
             lanes: int) -> LaneBatch:
        """Send message ``k`` on lane ``k % lanes``; ``window_bytes`` in flight to this peer
        in all, split evenly between the lanes."""
        assert isinstance(connection, LaneConnection)
        if not 1 <= lanes <= connection.lanes:
            raise InvalidArgumentError(f"cannot send over {lanes} lanes; the connection has "
                                    f"{connection.lanes}")
        window = max(1, window_bytes // lanes)
        return LaneBatch([self.engines[i].send(connection.endpoints[i], messages[i::lanes], window)
                          for i in range(lanes)])

    def receive(self, messages: list[Message], lanes: int) -> LaneBatch:
        """Post a receive for message ``k`` on lane ``k % lanes``, as a sender over ``lanes``
        lanes sends it."""
        if not 1 <= lanes <= len(self.engines):
            raise InvalidArgumentError(
                f"the sender spreads this transfer over {lanes} lanes; this daemon has "
                f"{len(self.engines)} (expected 1 to {len(self.engines)})")
        return LaneBatch([self.engines[i].receive(messages[i::lanes]) for i in range(lanes)])

    def abandon(self, batch: Batch, reason: str) -> Future[None]:
        """Fail ``batch`` on every lane now (see ``UcxEngine.abandon``); the future resolves
        once no lane has a request of it in flight."""
        assert isinstance(batch, LaneBatch)
        quiet: Future[None] = Future()
        left = [len(batch.parts)]
        lock = threading.Lock()

        def lane_quiet(_: Future[None]) -> None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    quiet.set_result(None)

        for engine, part in zip(self.engines, batch.parts):
            engine.abandon(part, reason).add_done_callback(lane_quiet)
        return quiet

    def discard(self, tag_base: int, count: int, lanes: int) -> None:
        """Take and drop messages ``tag_base + k``, ``k < count``, each on lane ``k % lanes``."""
        for i, engine in enumerate(self.engines[:lanes]):
            engine.discard([tag_base + k for k in range(i, count, lanes)])

    def close_connection(self, connection: Connection) -> None:
        """Close each lane's endpoint; safe to call twice."""
        assert isinstance(connection, LaneConnection)
        for engine, endpoint in zip(self.engines, connection.endpoints):
            engine.close_endpoint(endpoint)

    def posted_requests(self) -> int:
        """UCX requests posted and not yet complete, over all lanes (a leak gauge)."""
        return sum(engine.posted_requests() for engine in self.engines)

    def close(self) -> None:
        """Stop every lane's thread and release its UCX resources."""
        for engine in self.engines:
            engine.close()
