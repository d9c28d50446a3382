"""The UCX data plane: one worker, driven by one thread, moving tagged messages.

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

Messages travel in ``MessageBatch``es, one per transfer and direction: the
thread posts them (sends within one byte window per endpoint that all sends to
that peer share, taking turns, refilled as sends complete),
counts the bytes that completed, and settles one future when all are done or
one failed. Per message the caller's thread does no work at all, which is what
keeps thousands of small pages (page_size 1) from costing an event-loop wakeup
each.

Data only ever flows from an endpoint's creator to the listener's owner: a
sender connects to the receiver's listener; the receiver posts worker-level
tag receives straight into its pool memory. Tags are chosen by the receiver,
unique for its lifetime, so a late message of one transfer can never match a
receive posted by another.

ucxx is imported lazily: importing kvxfer does not load UCX.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvxfer.errors import PeerUnavailableError

log = logging.getLogger("kvxfer.transport")

#: Settings that make UCX fast on loopback tcp and shared memory (see the README).
UCX_DEFAULTS = {
    "UCX_RNDV_SCHEME": "put_zcopy",
    "UCX_RNDV_THRESH": "32K",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}


def apply_ucx_defaults() -> None:
    """Set kvxfer's UCX defaults unless the operator already set them. Call before UCX loads."""
    for key, value in UCX_DEFAULTS.items():
        os.environ.setdefault(key, value)


def _find_request_cancel() -> Callable[[int], None] | None:
    """``ucxx::RequestTag::cancel()`` from libucxx, which ucxx's Python API does not expose.

    Without it a receive posted for a transfer that then failed stays posted for
    the daemon's lifetime, and a message of that transfer still in flight could
    land in its pages after the failure was reported. Called with the C++ object
    pointer that ``UCXRequest.ucxx_ptr`` gives. None (and the old behaviour) if
    this libucxx build lacks the symbol.
    """
    try:
        import libucxx

        lib = ctypes.CDLL(os.path.join(os.path.dirname(libucxx.__file__), "lib64", "libucxx.so"))
        cancel = lib["_ZN4ucxx10RequestTag6cancelEv"]
    except (ImportError, OSError, AttributeError) as exc:
        log.warning("cannot cancel UCX requests (%s): receives of failed transfers stay posted", exc)
        return None
    cancel.argtypes = [ctypes.c_void_p]
    cancel.restype = None
    return cancel


def _settle(fut: Future[None], error: BaseException | None = None) -> None:
    """Complete ``fut`` unless its waiter already gave up on it (cancelled)."""
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


@dataclass(frozen=True)
class EndpointId:
    """A connection from this engine to a peer's listener."""

    number: int
    host: str
    port: int


class MessageBatch:
    """The messages of one transfer in one direction, tracked as a unit.

    ``future`` completes when every message completed, or fails with the first
    error. ``bytes_done`` counts completed bytes (written by the progress thread,
    read by anyone). Only the progress thread touches the other fields.
    """

    def __init__(self, messages: list[tuple[Any, int]], window: int | None,
                 endpoint: EndpointId | None) -> None:
        self.future: Future[None] = Future()
        self.bytes_done = 0
        self.messages = messages
        self.window = window
        self.endpoint = endpoint
        self.next = 0
        self.posted: deque[tuple[Any, int, Any]] = deque()
        self.posted_bytes = 0


class UcxEngine:
    """A UCX worker and listener served by one progress thread.

    Contract: every method is thread-safe and returns without waiting on the
    network, except ``connect`` and ``close`` which wait for the thread.
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, error_handling: bool = True):
        apply_ucx_defaults()
        from ucxx._lib import libucxx as ucx_api

        self._api = ucx_api
        self._host = host
        self._error_handling = error_handling
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._batches: list[MessageBatch] = []
        self._send_queue: deque[MessageBatch] = deque()  # sends with messages not yet posted
        self._endpoints: dict[int, Any] = {}
        self._accepted: list[Any] = []
        self._abandoned: list[MessageBatch] = []  # failed; some requests not yet complete
        self._cancel = _find_request_cancel()
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

    def send(self, endpoint: EndpointId, messages: list[tuple[Any, int]],
             window_bytes: int) -> MessageBatch:
        """Send each ``(buffer, tag)`` as one tagged message, in order, while the sends in
        flight on ``endpoint``, this batch's and every other's, stay under
        ``window_bytes`` (batches take turns, and each may always have one in flight)."""
        batch = MessageBatch(messages, window_bytes, endpoint)
        self._submit(lambda: self._open(batch))
        return batch

    def receive(self, messages: list[tuple[Any, int]]) -> MessageBatch:
        """Post a receive of each ``(buffer, tag)``: the message tagged ``tag`` lands in ``buffer``."""
        batch = MessageBatch(messages, None, None)
        self._submit(lambda: self._open(batch))
        return batch

    def close_endpoint(self, endpoint: EndpointId) -> None:
        """Close an endpoint (its unfinished sends fail); safe to call twice."""
        self._submit(lambda: self._close_ep(endpoint.number))

    def abandon(self, batch: MessageBatch, reason: str) -> None:
        """Fail ``batch`` now, post none of its remaining messages, stop tracking it.

        For transfers that ended early (abort, deadline, dead peer: without UCX
        error handling a dead peer's requests just stay pending). Receives already
        posted stay posted under tags nobody will send again.
        """
        self._submit(lambda: self._abandon(batch, reason))

    def posted_requests(self) -> int:
        """UCX requests posted and not yet complete, failed transfers' included (a leak gauge)."""
        return self._posted

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread and release UCX resources; unfinished requests fail."""
        if self._stopping:
            return
        self._stopping = True
        self._wake()
        self._thread.join(timeout)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the progress thread -----------------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake()

    def _call(self, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()

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
        except (BlockingIOError, OSError):
            pass

    def _run(self, port: int, ready: Future[int]) -> None:
        api = self._api
        try:
            self._context = api.UCXContext(feature_flags=(api.Feature.TAG, api.Feature.WAKEUP))
            self._worker = api.UCXWorker(self._context)
            self._worker.init_blocking_progress_mode()
            self._listener = api.UCXListener.create(
                worker=self._worker, port=port, cb_func=self._on_connect
            )
        except BaseException as exc:  # noqa: BLE001 - reported to the constructor
            ready.set_exception(exc)
            return
        ready.set_result(self._listener.port)
        while not self._stopping:
            try:
                self._step()
            except Exception:  # noqa: BLE001 - one bad request must not stop the data plane
                log.exception("UCX progress step failed; continuing")
        self._shutdown()

    def _step(self) -> None:
        self._drain_commands()
        self._worker.progress()
        if self._abandoned:
            self._reap_abandoned()
        if self._batches:
            self._reap()
            if any(batch.endpoint is not None for batch in self._batches):
                return
        if self._worker.arm() and self._commands.empty():
            # While receives are posted, wake at least every 10 ms anyway: a missed
            # wake-up then costs a pause, never a hang.
            timeout = 0.01 if self._batches else 0.5
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

    def _open(self, batch: MessageBatch) -> None:
        if batch.future.done():
            return
        self._batches.append(batch)
        if batch.endpoint is None:
            while batch.next < len(batch.messages) and self._post_next(batch):
                pass
        else:
            self._send_queue.append(batch)
            self._post_sends()
        self._settle_if_finished(batch)

    def _post_next(self, batch: MessageBatch) -> bool:
        """Post the batch's next message; False if UCX refused it (the batch has failed)."""
        buffer, tag = batch.messages[batch.next]
        try:
            array = self._api_array(buffer)
            if batch.endpoint is None:
                request = self._worker.tag_recv(array, tag=self._api.UCXXTag(tag))
            else:
                request = self._ep(batch.endpoint).tag_send(array, tag=self._api.UCXXTag(tag))
        except Exception as exc:  # noqa: BLE001 - delivered to the waiter
            self._fail(batch, PeerUnavailableError(f"UCX request could not start: {exc}"))
            return False
        batch.next += 1
        self._posted += 1
        batch.posted.append((request, array.nbytes, (array, buffer)))
        batch.posted_bytes += array.nbytes
        return True

    def _post_sends(self) -> None:
        """Post waiting sends, one message per batch in turn, while the bytes in flight on
        each endpoint stay under the window. UCX sends an endpoint's messages in order, so
        a transfer that starts while others send to the same peer waits behind at most
        one window of their bytes, however many they are; other peers are not held up.
        A batch with nothing in flight may always post one, so none starves."""
        queue = self._send_queue
        in_flight: dict[EndpointId | None, int] = {}
        for b in self._batches:
            in_flight[b.endpoint] = in_flight.get(b.endpoint, 0) + b.posted_bytes
        passed = 0  # batches in a row that had to wait for their endpoint's window
        while queue and passed < len(queue):
            batch = queue[0]
            if batch.future.done() or batch.next == len(batch.messages):
                queue.popleft()
                continue
            if batch.posted and in_flight[batch.endpoint] >= batch.window:
                passed += 1
            elif self._post_next(batch):
                in_flight[batch.endpoint] += batch.posted[-1][1]
                passed = 0
            queue.rotate(-1)

    def _reap(self) -> None:
        """Retire completed requests, oldest first (they complete roughly in order)."""
        sent = False
        for batch in list(self._batches):
            posted = batch.posted
            while posted and posted[0][0].completed:
                request, nbytes, _ = posted.popleft()
                self._posted -= 1
                try:
                    request.check_error()
                except Exception as exc:  # noqa: BLE001 - delivered to the waiter
                    self._fail(batch, PeerUnavailableError(f"UCX request failed: {exc}"))
                    break
                batch.bytes_done += nbytes
                batch.posted_bytes -= nbytes
                sent = sent or batch.endpoint is not None
        if sent:
            self._post_sends()
        for batch in list(self._batches):
            self._settle_if_finished(batch)

    def _settle_if_finished(self, batch: MessageBatch) -> None:
        if batch in self._batches and not batch.posted and batch.next == len(batch.messages):
            self._batches.remove(batch)
            batch.messages = []
            _settle(batch.future)

    def _fail(self, batch: MessageBatch, error: BaseException) -> None:
        if batch in self._batches:
            self._batches.remove(batch)
            if batch.posted:
                # Unmatched receives are cancelled; a message UCX already matched still
                # completes (within the sender's window). Their buffers stay referenced
                # until then.
                if self._cancel is not None:
                    for request, _, _ in batch.posted:
                        if not request.completed:
                            self._cancel(request.ucxx_ptr)
                self._abandoned.append(batch)
        batch.messages = batch.messages[: batch.next]
        _settle(batch.future, error)

    def _abandon(self, batch: MessageBatch, reason: str) -> None:
        self._fail(batch, PeerUnavailableError(reason))

    def _reap_abandoned(self) -> None:
        for batch in self._abandoned:
            while batch.posted and batch.posted[0][0].completed:
                batch.posted.popleft()
                self._posted -= 1
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
        for batch in list(self._batches):
            self._fail(batch, PeerUnavailableError("the UCX engine is shutting down"))
        self._worker.cancel_inflight_requests()
        del self._listener
        del self._worker
        del self._context
