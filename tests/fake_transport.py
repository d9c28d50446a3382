"""An in-memory ``Transport`` for unit tests of the transfer state machine (never instead of UCX).

Transports on one ``FakeNetwork`` reach each other by port. A receive posts
its buffers under their tags; a send copies each message into the buffer
posted under its tag on the peer, at once or, while the network ``holds``,
when the test calls ``release``. A message whose receive is not posted yet waits
for it (as UCX keeps unexpected messages); one whose receive was cancelled, or
whose tag was discarded, is dropped, as a late message must be, and counted. The test can
make the network corrupt the next message it delivers, or fail every send.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.errors import PeerUnavailableError
from kvxfer.transport import Batch, Connection, Message


@dataclass(eq=False)
class FakeBatch:
    """One transfer's messages in one direction."""

    total: int
    future: Future[None] = field(default_factory=Future)
    bytes_done: int = 0
    tags: list[int] = field(default_factory=list)

    def add(self, nbytes: int) -> None:
        self.bytes_done += nbytes
        if self.bytes_done >= self.total and not self.future.done():
            self.future.set_result(None)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


@dataclass(frozen=True)
class FakeConnection:
    """A connection to a peer transport."""

    peer: FakeTransport
    lanes: int


@dataclass
class FakeNetwork:
    """The wire between fake transports, and the test's controls over it."""

    transports: dict[int, FakeTransport] = field(default_factory=dict)
    holding: bool = False
    # Out of repr: a held message views its sender's pool, which a stopped daemon unmapped
    # (pytest prints a failing frame's arguments, and reading unmapped memory crashes it).
    held: list[tuple[FakeTransport, Any, int, FakeBatch]] = field(default_factory=list,
                                                                  repr=False)
    corrupt_next: bool = False
    fail_sends: bool = False
    dropped: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def transport(self, lanes: int = 1) -> FakeTransport:
        """A new transport on this network."""
        port = 40000 + len(self.transports)
        self.transports[port] = FakeTransport(self, port, lanes)
        return self.transports[port]

    def hold(self) -> None:
        """Keep sent messages on the wire until ``release``."""
        self.holding = True

    def release(self) -> None:
        """Deliver every held message, and deliver at once from now on."""
        with self.lock:
            self.holding = False
            held, self.held = self.held, []
        for peer, buffer, tag, batch in held:
            self.deliver(peer, buffer, tag, batch)

    def deliver(self, peer: FakeTransport, buffer: Any, tag: int, sent: FakeBatch) -> None:
        """One message arrives at ``peer``: it lands in the receive posted for ``tag``, if any."""
        data = np.asarray(buffer).view(np.uint8).reshape(-1)
        with self.lock:
            posted = peer.posted.pop(tag, None)
            if posted is None and tag not in peer.cancelled and tag not in peer.discarded:
                peer.unexpected[tag] = (data.copy(), sent)  # UCX keeps it until a receive matches
                return
            corrupt, self.corrupt_next = self.corrupt_next and posted is not None, False
        nbytes = data.size
        if posted is None:
            self.dropped += 1
        else:
            target, received = posted
            view = np.asarray(target).view(np.uint8).reshape(-1)
            view[:] = data
            if corrupt:
                view[0] ^= 0xFF
            received.add(nbytes)
        sent.add(nbytes)


class FakeTransport:
    """One daemon's end of a ``FakeNetwork``."""

    host = "127.0.0.1"  # never dialled: the daemons' dial policy still checks it

    def __init__(self, network: FakeNetwork, port: int, lanes: int) -> None:
        self._network = network
        self._port = port
        self._lanes = lanes
        self.posted: dict[int, tuple[Any, FakeBatch]] = {}
        # Messages that came before their receive was posted (never for a cancelled one).
        self.unexpected: dict[int, tuple[Any, FakeBatch]] = {}
        self.discarded: set[int] = set()
        self.cancelled: set[int] = set()

    @property
    def ports(self) -> list[int]:
        return [self._port + i for i in range(self._lanes)]

    @property
    def lanes(self) -> int:
        return self._lanes

    def connect(self, host: str, ports: Sequence[int], timeout: float) -> Connection:
        peer = self._network.transports.get(ports[0])
        if peer is None:
            raise PeerUnavailableError(f"nothing listens on fake port {ports[0]}")
        return FakeConnection(peer, min(self._lanes, len(ports)))

    def send(self, connection: Connection, messages: list[Message], window_bytes: int,
             lanes: int) -> Batch:
        assert isinstance(connection, FakeConnection)
        batch = FakeBatch(sum(np.asarray(b).nbytes for b, _ in messages))
        if self._network.fail_sends:
            batch.fail(PeerUnavailableError("the fake network fails every send"))
            return batch
        for buffer, tag in messages:
            with self._network.lock:
                if self._network.holding:
                    self._network.held.append((connection.peer, buffer, tag, batch))
                    continue
            self._network.deliver(connection.peer, buffer, tag, batch)
        if not messages:
            batch.add(0)
        return batch

    def receive(self, messages: list[Message], lanes: int) -> Batch:
        batch = FakeBatch(sum(np.asarray(b).nbytes for b, _ in messages))
        with self._network.lock:
            for buffer, tag in messages:
                self.posted[tag] = (buffer, batch)
                batch.tags.append(tag)
            early = [(t, self.unexpected.pop(t)) for t in batch.tags if t in self.unexpected]
        for tag, (data, sent) in early:
            self._network.deliver(self, data, tag, sent)
        return batch

    def abandon(self, batch: Batch, reason: str) -> Future[None]:
        assert isinstance(batch, FakeBatch)
        with self._network.lock:
            for tag in batch.tags:
                self.posted.pop(tag, None)
            self.cancelled.update(batch.tags)
        batch.fail(PeerUnavailableError(reason))
        quiet: Future[None] = Future()
        quiet.set_result(None)  # nothing is ever half-delivered here
        return quiet

    def discard(self, tag_base: int, count: int, lanes: int) -> None:
        with self._network.lock:
            self.discarded.update(range(tag_base, tag_base + count))
            waiting = [self.unexpected.pop(t) for t in list(self.unexpected) if t in self.discarded]
        for data, sent in waiting:
            self._network.dropped += 1
            sent.add(data.size)

    def close_connection(self, connection: Connection) -> None:
        pass

    def posted_requests(self) -> int:
        return len(self.posted)

    def close(self) -> None:
        self.posted.clear()
