"""One UCX worker, driven by one thread, moving tagged messages.

``UcxEngine`` owns a UCX context, worker and listener and runs them from a
single thread (UCX workers are not thread-safe, and on 2 cores one progress
thread is all we can afford). Other threads, such as the daemon's asyncio loop,
submit sends and receives and get ``concurrent.futures.Future`` objects back.

The thread polls the worker while sends are in flight (the sender's progress
calls are what issue its copies) and otherwise sleeps on the worker's event fd:
everything a receiver has to do is triggered by a message arriving, which wakes
the fd. A receiving daemon that polled would burn a core and hold the GIL its
own event loop needs (measured on 2 vCPUs: the receiver's UCX thread went from
83 % to 10 % of a core over cma, and handling a Claim from 3.9 to 1.4 ms).

Messages travel in batches (``kvxfer.transport.batches``), one per transfer and
direction; per message the caller's thread does no work at all, which keeps
thousands of small pages (page_size 1) from costing an event-loop wakeup each.
Sends to one peer share one byte window, taking turns. Receives are posted
through an owner endpoint lent to their batch alone (``kvxfer.transport.owners``),
so failing a batch cancels exactly its unmatched receives.

Data only ever flows from an endpoint's creator to the listener's owner. Tags
are chosen by the receiver, unique for its lifetime, so a late message of one
transfer can never match a receive posted by another.

ucxx is imported lazily: importing kvxfer does not load UCX.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from kvxfer.errors import PeerUnavailableError
from kvxfer.transport.batches import (
    EndpointId,
    MessageBatch,
    Posted,
    ReceiveBatch,
    SendBatch,
    settle,
)
from kvxfer.transport.drain import LateMessages
from kvxfer.transport.owners import ReceiveOwners
from kvxfer.transport.protocol import Message
from kvxfer.ucx_settings import apply_ucx_defaults

log = logging.getLogger("kvxfer.transport")

T = TypeVar("T")
#: Longest pause after the progress loop failed repeatedly (it backs off, never spins).
MAX_BACKOFF_S = 1.0


class UcxEngine:
    """A UCX worker and listener served by one progress thread.

    Contract: every method is thread-safe and returns without waiting on the
    network, except ``connect`` and ``close`` which wait for the thread.
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0,
                 error_handling: bool = True) -> None:
        apply_ucx_defaults()
        try:
            from ucxx._lib import libucxx as ucx_api
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                f"kvxfer's UCX data plane needs ucxx ({exc.name} is missing): pip install "
                "'kvxfer[ucx]' (the daemon install, 'kvxfer[daemon]', has it)", name=exc.name) from exc

        self._api = ucx_api
        self._host = host
        self._error_handling = error_handling
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sends: list[SendBatch] = []
        self._receives: list[ReceiveBatch] = []
        self._send_queue: deque[SendBatch] = deque()  # sends with messages not yet posted, in turn
        self._endpoints: dict[int, Any] = {}
        self._accepted: list[Any] = []
        self._abandoned: list[MessageBatch] = []  # failed; some requests not yet complete
        self._posted = 0
        self._dead: list[Any] = []
        self._next_ep = 0
        self._stopping = False
        ready: Future[int] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(port, ready), name="kvxfer-ucx", daemon=True
        )
        self._thread.start()
        self.port = ready.result(timeout=30)

    @property
    def host(self) -> str:
        """The address the listener was asked to serve (peers connect here)."""
        return self._host

    # -- public API (any thread) -------------------------------------------------

    def connect(self, host: str, port: int, timeout: float = 10.0) -> EndpointId:
        """Open an endpoint to a peer engine's listener."""
        return self._call(lambda: self._connect(host, port)).result(timeout=timeout)

    def send(self, endpoint: EndpointId, messages: list[Message],
             window_bytes: int) -> SendBatch:
        """Send each ``(buffer, tag)`` as one tagged message, in order, while the sends in
        flight on ``endpoint``, this batch's and every other's, stay under
        ``window_bytes`` (batches take turns, and each may always have one in flight)."""
        batch = SendBatch(messages, endpoint, window_bytes)
        self._submit(lambda: self._open_send(batch))
        return batch

    def receive(self, messages: list[Message]) -> ReceiveBatch:
        """Post a receive of each ``(buffer, tag)``: the message tagged ``tag`` lands in ``buffer``."""
        batch = ReceiveBatch(messages)
        self._submit(lambda: self._open_receive(batch))
        return batch

    def discard(self, tags: list[int]) -> None:
        """Take the messages with these tags, should they arrive (for ``DRAIN_S``), and
        drop their bytes (``kvxfer.transport.drain``)."""
        self._submit(lambda: self._late.watch(tags))

    def close_endpoint(self, endpoint: EndpointId) -> None:
        """Close an endpoint (its unfinished sends fail); safe to call twice."""
        self._submit(lambda: self._close_ep(endpoint.number))

    def abandon(self, batch: MessageBatch, reason: str) -> Future[None]:
        """Fail ``batch`` now and post none of its remaining messages.

        For transfers that ended early (abort, deadline, dead peer: without UCX
        error handling a dead peer's requests just stay pending). Its unmatched
        receives are cancelled; the future resolves once no request of it is in flight.
        """
        self._submit(lambda: self._fail(batch, PeerUnavailableError(reason)))
        return batch.quiet

    def posted_requests(self) -> int:
        """UCX requests posted and not yet complete, failed transfers' included, and late
        messages being taken (a leak gauge)."""
        return self._posted + self._late.in_flight

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread and release UCX resources; unfinished requests fail.

        If the thread does not stop within ``timeout`` its wake-up pipe stays
        open (the thread may still use it) and the failure is logged.
        """
        if self._stopping:
            return
        self._stopping = True
        self._wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("the UCX thread did not stop within %.0f s; leaving it to the process exit",
                      timeout)
            return
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the progress thread -----------------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake()

    def _call(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - delivered to the caller
                fut.set_exception(exc)

        self._submit(run)
        return fut

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # the pipe is full (a wake-up is pending anyway) or closed (we are stopping)

    def _run(self, port: int, ready: Future[int]) -> None:
        api = self._api
        try:
            self._context = api.UCXContext(feature_flags=(api.Feature.TAG, api.Feature.WAKEUP))
            self._worker = api.UCXWorker(self._context)
            self._worker.init_blocking_progress_mode()
            self._owners = ReceiveOwners(api, self._worker, self._error_handling)
            self._late = LateMessages(api, self._worker)
            self._listener = api.UCXListener.create(
                worker=self._worker, port=port, cb_func=self._on_connect
            )
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor
            ready.set_exception(exc)
            return
        ready.set_result(self._listener.port)
        backoff = 0.0
        while not self._stopping:
            try:
                self._step()
                backoff = 0.0
            except Exception as exc:  # noqa: BLE001 - the data plane fails its batches, not the daemon
                backoff = min(MAX_BACKOFF_S, max(0.01, 2 * backoff))
                log.exception("UCX progress step failed; failing in-flight batches, retrying in "
                              "%.2f s", backoff)
                for batch in [*self._sends, *self._receives]:
                    self._fail(batch, PeerUnavailableError(f"the UCX data plane failed: {exc}"))
                time.sleep(backoff)
        self._shutdown()

    def _step(self) -> None:
        self._drain_commands()
        self._worker.progress()
        if self._abandoned:
            self._reap_abandoned()
        if not self._late.idle:
            self._late.step()
        if self._sends or self._receives:
            self._reap()
            if self._sends:
                return  # sends progress only while we poll
        if self._worker.arm() and self._commands.empty():
            # While receives are posted, wake at least every 10 ms anyway: a missed
            # wake-up then costs a pause, never a hang.
            timeout = 0.01 if self._receives or not self._late.idle else 0.5
            select.select([self._worker.epoll_file_descriptor, self._wake_r], [], [], timeout)
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _open_send(self, batch: SendBatch) -> None:
        if batch.future.done():
            return
        self._sends.append(batch)
        self._send_queue.append(batch)
        self._post_sends()
        self._settle_if_finished(batch)

    def _open_receive(self, batch: ReceiveBatch) -> None:
        if batch.future.done():
            return
        self._receives.append(batch)
        try:
            batch.owner = self._owners.lend()
        except Exception as exc:  # noqa: BLE001 - delivered to the waiter
            self._fail(batch, PeerUnavailableError(f"UCX cannot post receives: {exc}"))
            return
        while not batch.all_posted and self._post_next(batch):
            pass
        self._settle_if_finished(batch)

    def _post_next(self, batch: MessageBatch) -> bool:
        """Post the batch's next message; False if UCX refused it (the batch has failed)."""
        buffer, tag = batch.messages[batch.next]
        try:
            array = self._api_array(buffer)
            if isinstance(batch, SendBatch):
                request = self._ep(batch.endpoint).tag_send(array, tag=self._api.UCXXTag(tag))
            else:
                assert isinstance(batch, ReceiveBatch)
                request = batch.owner.tag_recv(array, tag=self._api.UCXXTag(tag))
        except Exception as exc:  # noqa: BLE001 - delivered to the waiter
            self._fail(batch, PeerUnavailableError(f"UCX request could not start: {exc}"))
            return False
        batch.next += 1
        self._posted += 1
        batch.posted.append(Posted(request, array.nbytes, (array, buffer)))
        batch.posted_bytes += array.nbytes
        return True

    def _post_sends(self) -> None:
        """Post waiting sends, one message per batch in turn, while the bytes in flight on
        each endpoint stay under the window. UCX sends an endpoint's messages in order, so
        a transfer that starts while others send to the same peer waits behind at most
        one window of their bytes, however many they are; other peers are not held up.
        A batch with nothing in flight may always post one, so none starves."""
        in_flight: dict[EndpointId, int] = {}
        for b in self._sends:
            in_flight[b.endpoint] = in_flight.get(b.endpoint, 0) + b.posted_bytes
        turn = self._send_queue
        waited = 0  # batches in a row that had to wait for their endpoint's window
        while turn and waited < len(turn):
            batch = turn[0]
            if batch.future.done() or batch.all_posted:
                turn.popleft()
                continue
            if batch.posted and in_flight[batch.endpoint] >= batch.window:
                waited += 1
            elif self._post_next(batch):
                in_flight[batch.endpoint] += batch.posted[-1].nbytes
                waited = 0
            turn.rotate(-1)

    def _reap(self) -> None:
        """Retire completed requests, oldest first (they complete roughly in order)."""
        sent = False
        for batch in [*self._sends, *self._receives]:
            while batch.posted and batch.posted[0].request.completed:
                posted = batch.posted[0]
                self._posted -= 1
                try:
                    posted.request.check_error()
                except Exception as exc:  # noqa: BLE001 - delivered to the waiter
                    batch.posted.popleft()
                    self._fail(batch, PeerUnavailableError(f"UCX request failed: {exc}"))
                    break
                batch.complete(posted.nbytes)
                sent = sent or isinstance(batch, SendBatch)
        if sent:
            self._post_sends()
        for batch in [*self._sends, *self._receives]:
            self._settle_if_finished(batch)

    def _settle_if_finished(self, batch: MessageBatch) -> None:
        if not batch.finished or batch.future.done():
            return
        if isinstance(batch, SendBatch):
            self._sends.remove(batch)
        else:
            assert isinstance(batch, ReceiveBatch)
            self._receives.remove(batch)
            owner, batch.owner = batch.owner, None
            if owner is not None:
                self._owners.give_back(owner)
        batch.messages = []
        settle(batch.future)
        settle(batch.quiet)

    def _fail(self, batch: MessageBatch, error: BaseException) -> None:
        if isinstance(batch, SendBatch) and batch in self._sends:
            self._sends.remove(batch)
        if isinstance(batch, ReceiveBatch) and batch in self._receives:
            self._receives.remove(batch)
            if batch.owner is not None:
                # Its unmatched receives are cancelled; a message UCX already matched still
                # completes (within the sender's window). Both are retired by _reap_abandoned.
                # Messages that arrive later go to a scratch buffer (kvxfer.transport.drain).
                first = batch.next - len(batch.posted)
                self._late.watch([batch.messages[first + i][1] for i, p in enumerate(batch.posted)
                                  if not p.request.completed])
                owner, batch.owner = batch.owner, None
                self._owners.cancel(owner)
        if batch.posted and batch not in self._abandoned:
            self._abandoned.append(batch)
        batch.messages = batch.messages[: batch.next]
        settle(batch.future, error)
        if not batch.posted:
            settle(batch.quiet)

    def _reap_abandoned(self) -> None:
        for batch in self._abandoned:
            while batch.posted and batch.posted[0].request.completed:
                batch.posted.popleft()
                self._posted -= 1
            if not batch.posted:
                settle(batch.quiet)
        self._abandoned = [b for b in self._abandoned if b.posted]

    def _api_array(self, buffer: Any) -> Any:
        from ucxx._lib.arr import Array

        return Array(buffer)

    def _ep(self, endpoint: EndpointId) -> Any:
        try:
            return self._endpoints[endpoint.number]
        except KeyError:
            raise PeerUnavailableError(
                f"endpoint to {endpoint.host}:{endpoint.port} is closed"
            ) from None

    def _connect(self, host: str, port: int) -> EndpointId:
        ep = self._api.UCXEndpoint.create(self._worker, host, port, self._error_handling)
        self._next_ep += 1
        self._endpoints[self._next_ep] = ep
        log.debug("connected UCX endpoint %d to %s:%d", self._next_ep, host, port)
        return EndpointId(self._next_ep, host, port)

    def _close_ep(self, number: int) -> None:
        ep = self._endpoints.pop(number, None)
        if ep is not None:
            self._close_if_alive(ep)

    def _close_if_alive(self, ep: Any) -> None:
        if ep.alive:
            ep.close()
        else:
            # Closing an endpoint whose peer already failed crashes ucxx 0.52; UCX has torn
            # its transport down already, so keep the handle and never close it.
            self._dead.append(ep)

    def _on_connect(self, conn_request: Any) -> None:
        ep = self._listener.create_endpoint_from_conn_request(conn_request, self._error_handling)
        self._accepted.append(ep)

    def _shutdown(self) -> None:
        for batch in [*self._sends, *self._receives]:
            self._fail(batch, PeerUnavailableError("the UCX engine is shutting down"))
        self._owners.close()
        for number in list(self._endpoints):
            self._close_ep(number)
        # Let UCX notice peers that already closed or died, so that _close_if_alive
        # skips their endpoints (a test that closed the sender first crashed here).
        for _ in range(20):
            self._worker.progress()
            time.sleep(0.001)
        for ep in self._accepted:
            self._close_if_alive(ep)
        self._accepted.clear()
        self._worker.cancel_inflight_requests(0, 10)
        del self._listener
        del self._worker
        del self._context
