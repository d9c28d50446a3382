"""Message batches: one transfer's messages in one direction, as the UCX thread tracks them.

A ``SendBatch`` goes to one peer endpoint within a byte window that all sends to
that endpoint share; a ``ReceiveBatch`` posts its receives through an owner
endpoint, so that closing the owner cancels exactly this batch's receives.
Only the engine's progress thread touches a batch's fields, except ``future``
and ``bytes_done``, which anyone may read.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvxfer.transport.protocol import Message


@dataclass(frozen=True)
class EndpointId:
    """A connection from one engine to a peer's listener."""

    number: int
    host: str
    port: int


class Posted(NamedTuple):
    """A UCX request in flight, its size, and what must stay alive until it completes."""

    request: Any
    nbytes: int
    keepalive: tuple[Any, Any]


def settle(fut: Future[None], error: BaseException | None = None) -> None:
    """Complete ``fut`` unless its waiter already gave up on it (cancelled)."""
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


class MessageBatch:
    """What sends and receives share: the messages, those posted, and the bytes done."""

    def __init__(self, messages: list[Message]) -> None:
        self.future: Future[None] = Future()
        # Resolved once none of its requests is in flight any more (after success or failure).
        self.quiet: Future[None] = Future()
        self.bytes_done = 0
        self.messages = messages
        self.next = 0
        self.posted: deque[Posted] = deque()
        self.posted_bytes = 0

    @property
    def all_posted(self) -> bool:
        """True once every message was posted."""
        return self.next == len(self.messages)

    @property
    def finished(self) -> bool:
        """True once every message was posted and completed."""
        return self.all_posted and not self.posted

    def complete(self, nbytes: int) -> None:
        """The oldest posted message completed."""
        self.posted.popleft()
        self.bytes_done += nbytes
        self.posted_bytes -= nbytes


class SendBatch(MessageBatch):
    """Messages to one peer endpoint, at most ``window`` bytes in flight with its other sends."""

    def __init__(self, messages: list[Message], endpoint: EndpointId, window: int) -> None:
        super().__init__(messages)
        self.endpoint = endpoint
        self.window = window


class ReceiveBatch(MessageBatch):
    """Receives posted through ``owner`` (an endpoint the engine lends for this batch alone)."""

    def __init__(self, messages: list[Message]) -> None:
        super().__init__(messages)
        self.owner: Any = None
