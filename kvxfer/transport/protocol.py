"""The data plane as the transfer state machine sees it: ``Transport``, ``Batch``, ``Connection``.

A transport moves tagged messages between daemons: the receiver posts a
receive per message (a buffer and a tag) before the sender sends, and each
side gets one ``Batch`` per transfer that completes when all its messages have.
``kvxfer.transport.UcxLanes`` is the real one; the tests have an in-memory one.

Contract: every method is thread-safe and returns without waiting on the
network, except ``connect`` and ``close``. A batch's ``future`` completes with
None when every message completed, or with the first error (a
``kvxfer.errors`` type); ``abandon`` fails it at once and guarantees that none
of its receives stays posted (a message the network already matched may still
land, within the sender's window).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol

#: A buffer (host numpy array or device tensor, over pool memory) and its tag.
Message = tuple[Any, int]


class Batch(Protocol):
    """One transfer's messages in one direction, tracked as a unit."""

    @property
    def future(self) -> Future[None]:
        """Completes when every message did, or fails with the first error."""
        ...

    @property
    def bytes_done(self) -> int:
        """Bytes whose messages completed so far."""
        ...


class Connection(Protocol):
    """This daemon's connection to one peer's data plane (one endpoint per lane)."""

    @property
    def lanes(self) -> int:
        """How many lanes the connection has (the smaller count of the two sides)."""
        ...


class Transport(Protocol):
    """Moves tagged messages between this daemon and its peers."""

    @property
    def host(self) -> str:
        """The address peers connect to."""
        ...

    @property
    def ports(self) -> list[int]:
        """Each lane's listening port, lane 0 first."""
        ...

    @property
    def lanes(self) -> int:
        """How many lanes this side has."""
        ...

    def connect(self, host: str, ports: Sequence[int], timeout: float) -> Connection:
        """Connect to a peer's lanes (blocks up to ``timeout``)."""
        ...

    def send(self, connection: Connection, messages: list[Message], window_bytes: int,
             lanes: int) -> Batch:
        """Send message ``k`` on lane ``k % lanes``, ``window_bytes`` in flight per peer."""
        ...

    def receive(self, messages: list[Message], lanes: int) -> Batch:
        """Post a receive for message ``k`` on lane ``k % lanes``."""
        ...

    def abandon(self, batch: Batch, reason: str) -> Future[None]:
        """Fail ``batch`` now; cancel its receives that are still unmatched. The future
        resolves once none of its requests is in flight: a receive UCX matched before the
        abandon still writes its pages until then."""
        ...

    def discard(self, tag_base: int, count: int, lanes: int) -> None:
        """Take the messages tagged ``tag_base + k`` for ``k < count`` (message ``k`` on lane
        ``k % lanes``), should they arrive, and throw their bytes away: for a transfer whose
        sender may have sent before its receives were posted, and that ended first."""
        ...

    def close_connection(self, connection: Connection) -> None:
        """Close a connection (its unfinished sends fail); safe to call twice."""
        ...

    def posted_requests(self) -> int:
        """Requests posted and not yet complete (0 when idle: a leak gauge)."""
        ...

    def close(self) -> None:
        """Stop moving data and release every resource."""
        ...
