"""The UCX engine and its lanes on their own: real UCX workers, listeners and endpoints in one process."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvxfer.errors import InvalidRangeError
from kvxfer.lanes import UcxLanes
from kvxfer.transport import UcxEngine


def thread_cpu_seconds(native_id: int) -> float:
    """User + system CPU time one thread of this process has used."""
    fields = open(f"/proc/self/task/{native_id}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def engines() -> Iterator[tuple[UcxEngine, UcxEngine]]:
    receiver, sender = UcxEngine(), UcxEngine()
    yield receiver, sender
    sender.close()
    receiver.close()


def test_a_waiting_receiver_sleeps_and_still_gets_its_messages(engines) -> None:
    receiver, sender = engines
    dst = np.zeros(4 << 20, dtype=np.uint8)
    src = np.random.default_rng(1).integers(0, 256, dst.size, dtype=np.uint8)
    halves = [(dst[: dst.size // 2], 11), (dst[dst.size // 2 :], 12)]
    batch = receiver.receive(halves)
    time.sleep(0.2)  # let the progress thread post the receives and settle

    thread_id = receiver._thread.native_id
    assert thread_id is not None
    before = thread_cpu_seconds(thread_id)
    time.sleep(1.0)
    spent = thread_cpu_seconds(thread_id) - before
    assert spent < 0.3, f"the receiver's UCX thread used {spent:.2f} s of CPU in 1 s while waiting"
    assert not batch.future.done()

    endpoint = sender.connect(receiver.host, receiver.port)
    sent = sender.send(endpoint, [(src[: src.size // 2], 11), (src[src.size // 2 :], 12)], 1 << 20)
    sent.future.result(timeout=20)
    batch.future.result(timeout=20)
    assert batch.bytes_done == dst.size
    assert np.array_equal(dst, src)
    assert receiver.posted_requests() == 0 and sender.posted_requests() == 0


def test_concurrent_sends_share_one_window(engines) -> None:
    receiver, sender = engines
    chunk = 1 << 20
    src = np.random.default_rng(2).integers(0, 256, 32 * chunk, dtype=np.uint8)
    dst = np.zeros_like(src)
    messages = [(src[i * chunk:(i + 1) * chunk], 100 + i) for i in range(32)]
    endpoint = sender.connect(receiver.host, receiver.port)
    first = sender.send(endpoint, messages[:16], 4 * chunk)
    second = sender.send(endpoint, messages[16:], 4 * chunk)
    # Nothing is received yet, so no (rendezvous) send can complete: what is posted is
    # what the window let through. The first transfer filled it; the second may post
    # its one message beside it, not a window of its own.
    deadline = time.monotonic() + 10
    while sender.posted_requests() < 5:
        assert time.monotonic() < deadline, f"only {sender.posted_requests()} sends posted"
        time.sleep(0.01)
    time.sleep(0.3)
    assert sender.posted_requests() == 5
    assert (first.next, second.next) == (4, 1)
    arrived = receiver.receive([(dst[i * chunk:(i + 1) * chunk], 100 + i) for i in range(32)])
    for batch in (first, second, arrived):
        batch.future.result(timeout=30)
    assert np.array_equal(dst, src)
    assert receiver.posted_requests() == 0 and sender.posted_requests() == 0


def test_lanes_deal_one_transfer_over_both_sides_lanes() -> None:
    sender, receiver = UcxLanes(2), UcxLanes(3)
    try:
        endpoints = sender.connect(receiver.host, receiver.ports)
        assert len(endpoints) == 2  # the smaller lane count of the two
        src = np.random.default_rng(2).integers(0, 256, 6 << 20, dtype=np.uint8)
        dst = np.zeros_like(src)
        piece = 1 << 20
        tags = range(100, 106)
        got = receiver.receive([(dst[i * piece:(i + 1) * piece], t) for i, t in enumerate(tags)],
                               len(endpoints))
        sent = sender.send(endpoints, [(src[i * piece:(i + 1) * piece], t)
                                       for i, t in enumerate(tags)], 2 << 20)
        sent.future.result(timeout=20)
        got.future.result(timeout=20)
        assert np.array_equal(dst, src)
        assert got.bytes_done == sent.bytes_done == src.size
        # Messages 0, 2, 4 went over lane 0 and 1, 3, 5 over lane 1, on both sides.
        assert [part.bytes_done for part in got.parts] == [3 * piece, 3 * piece]
        assert [part.bytes_done for part in sent.parts] == [3 * piece, 3 * piece]
        assert receiver.posted_requests() == sender.posted_requests() == 0
    finally:
        sender.close()
        receiver.close()


def test_a_receive_over_more_lanes_than_this_side_has_is_refused() -> None:
    receiver = UcxLanes(1)
    try:
        with pytest.raises(InvalidRangeError, match="over 2 lanes; this daemon has 1"):
            receiver.receive([(np.zeros(16, dtype=np.uint8), 1)], 2)
        assert receiver.posted_requests() == 0
    finally:
        receiver.close()
