"""Daemons inside the test process, for fast unit tests of the state machine.

Each is a real ``kvxfer.server.daemon.Daemon`` (pools in a temporary directory,
both gRPC servers on port 0, real sessions and heartbeats between daemons) on
an in-memory ``FakeTransport``; the test drives its transfer coordinator
directly and its peers talk to it over real gRPC.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
from fake_transport import FakeNetwork

from kvxfer.server.config import load_config
from kvxfer.server.daemon import Bound, Daemon
from kvxfer.server.transfers.coordinator import TransferCoordinator
from kvxfer.status import TransferInfo, TransferState

TINY = "name=kv,preset=tiny"
T = TypeVar("T")


class Side:
    """A running in-process daemon: its coordinator, its pool's bytes and where it listens."""

    def __init__(self, daemon: Daemon, bound: Bound) -> None:
        self.daemon = daemon
        self.bound = bound
        assert daemon.transfers is not None and daemon.pools is not None
        self.transfers: TransferCoordinator = daemon.transfers
        self.raw = daemon.pools.get("kv").arena.raw
        self.page_bytes = daemon.pools.get("kv").descriptor.page_bytes

    @property
    def peer_address(self) -> str:
        return self.bound.peer_address

    def page(self, page: int) -> torch.Tensor:
        return self.raw[page * self.page_bytes:(page + 1) * self.page_bytes]

    def history(self, transfer_id: str) -> list[TransferState]:
        return self.transfers.registry.get(transfer_id).history

    async def final(self, transfer_id: str, timeout_s: float = 10) -> TransferInfo:
        """The transfer's status once final (fails the test after ``timeout_s``)."""
        return (await self.transfers.wait(transfer_id, timeout_s)).info()

    async def sever(self) -> None:
        """Drop off the network at once, as a dead process does: every call and stream, in
        and out, breaks, and nothing is told to anyone."""
        daemon = self.daemon
        await asyncio.gather(daemon._worker_server.stop(None), daemon._peer_server.stop(None),
                             daemon._clients.close())


@asynccontextmanager
async def side(tmp: Path, name: str, network: FakeNetwork, pool: str = TINY,
               **settings: Any) -> AsyncIterator[Side]:
    """A daemon named ``name`` on ``network``, stopped at the end."""
    shm = tmp / f"{name}-shm"
    shm.mkdir()
    config = load_config(pool_flags=[pool], overrides={
        "worker_address": f"unix://{tmp}/{name}.sock", "peer_address": "127.0.0.1:0",
        "shm_dir": str(shm), "heartbeat_s": 0.2, "default_timeout_s": 10, "grace_s": 0.5,
        **settings})
    daemon = Daemon(config, lambda c: network.transport(c.ucx_lanes))
    bound = await daemon.start()
    try:
        yield Side(daemon, bound)
    finally:
        await daemon.stop()


def run(body: Callable[[], Coroutine[Any, Any, None]], timeout_s: float = 30) -> None:
    """Run one async test body on a fresh event loop, bounded by ``timeout_s``."""
    asyncio.run(asyncio.wait_for(body(), timeout_s))


async def until(predicate: Callable[[], bool], timeout_s: float = 5, what: str = "") -> None:
    """Poll ``predicate`` until true (fails after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        await asyncio.sleep(0.01)


class DaemonThread:
    """An in-process daemon on an event loop in a thread of its own, for synchronous clients."""

    def __init__(self, tmp: Path, name: str, network: FakeNetwork) -> None:
        self._tmp, self._name, self._network = tmp, name, network
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._stack = AsyncExitStack()
        self.side: Side | None = None

    def __enter__(self) -> Side:
        self._thread.start()
        self.side = self.call(self._stack.enter_async_context(side(self._tmp, self._name, self._network)))
        return self.side

    def __exit__(self, *exc: object) -> None:
        try:
            self.call(self._stack.aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def call(self, work: Coroutine[Any, Any, T], timeout_s: float = 20) -> T:
        """Run ``work`` on the daemon's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(timeout_s)
