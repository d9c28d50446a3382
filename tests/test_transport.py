"""The UCX engine and its lanes on their own: real UCX workers, listeners and endpoints in one process."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvxfer.errors import InvalidArgumentError
from kvxfer.transport.engine import UcxEngine
from kvxfer.transport.lanes import UcxLanes


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


def test_sends_to_one_peer_share_its_window_and_other_peers_have_their_own(engines) -> None:
    receiver, sender = engines
    other = UcxEngine()
    try:
        chunk = 1 << 20
        src = np.random.default_rng(2).integers(0, 256, 48 * chunk, dtype=np.uint8)
        dst, dst_other = np.zeros(32 * chunk, dtype=np.uint8), np.zeros(16 * chunk, dtype=np.uint8)
        messages = [(src[i * chunk:(i + 1) * chunk], 100 + i) for i in range(48)]
        to_receiver = sender.connect(receiver.host, receiver.port)
        to_other = sender.connect(other.host, other.port)
        first = sender.send(to_receiver, messages[:16], 4 * chunk)
        second = sender.send(to_receiver, messages[16:32], 4 * chunk)
        elsewhere = sender.send(to_other, messages[32:], 4 * chunk)
        # Nothing is received yet, so no (rendezvous) send can complete: what is posted is
        # what the windows let through. The first transfer filled its peer's window; the
        # second may post its one message beside it, not a window of its own; the other
        # peer's window is untouched by both.
        deadline = time.monotonic() + 10
        while sender.posted_requests() < 9:
            assert time.monotonic() < deadline, f"only {sender.posted_requests()} sends posted"
            time.sleep(0.01)
        time.sleep(0.3)
        assert sender.posted_requests() == 9
        assert (first.next, second.next, elsewhere.next) == (4, 1, 4)
        arrived = receiver.receive([(dst[i * chunk:(i + 1) * chunk], 100 + i) for i in range(32)])
        arrived_other = other.receive([(dst_other[i * chunk:(i + 1) * chunk], 132 + i)
                                       for i in range(16)])
        for batch in (first, second, elsewhere, arrived, arrived_other):
            batch.future.result(timeout=30)
        assert np.array_equal(dst, src[:32 * chunk]) and np.array_equal(dst_other, src[32 * chunk:])
        assert sender.posted_requests() == 0
        assert receiver.posted_requests() == 0 and other.posted_requests() == 0
    finally:
        sender.close()
        other.close()


def test_lanes_deal_one_transfer_over_both_sides_lanes() -> None:
    sender, receiver = UcxLanes(2), UcxLanes(3)
    try:
        connection = sender.connect(receiver.host, receiver.ports)
        assert connection.lanes == 2  # the smaller lane count of the two
        src = np.random.default_rng(2).integers(0, 256, 6 << 20, dtype=np.uint8)
        dst = np.zeros_like(src)
        piece = 1 << 20
        tags = range(100, 106)
        got = receiver.receive([(dst[i * piece:(i + 1) * piece], t) for i, t in enumerate(tags)],
                               connection.lanes)
        sent = sender.send(connection, [(src[i * piece:(i + 1) * piece], t)
                                        for i, t in enumerate(tags)], 2 << 20, connection.lanes)
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
        with pytest.raises(InvalidArgumentError, match="over 2 lanes; this daemon has 1"):
            receiver.receive([(np.zeros(16, dtype=np.uint8), 1)], 2)
        assert receiver.posted_requests() == 0
    finally:
        receiver.close()


def test_abandoning_a_receive_cancels_its_posted_receives_and_others_still_arrive(engines) -> None:
    receiver, sender = engines
    doomed_dst, kept_dst = np.zeros(8 << 20, dtype=np.uint8), np.zeros(1 << 20, dtype=np.uint8)
    doomed = receiver.receive([(doomed_dst[i << 20:(i + 1) << 20], 500 + i) for i in range(8)])
    kept = receiver.receive([(kept_dst, 600)])
    deadline = time.monotonic() + 10
    while receiver.posted_requests() < 9:
        assert time.monotonic() < deadline, f"only {receiver.posted_requests()} receives posted"
        time.sleep(0.01)
    receiver.abandon(doomed, "the transfer was aborted")
    with pytest.raises(Exception, match="aborted"):
        doomed.future.result(timeout=10)
    while receiver.posted_requests() > 1:
        assert time.monotonic() < deadline, f"{receiver.posted_requests()} receives still posted"
        time.sleep(0.01)
    src = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
    endpoint = sender.connect(receiver.host, receiver.port)
    sender.send(endpoint, [(src, 600)], 1 << 20).future.result(timeout=20)
    kept.future.result(timeout=20)
    assert np.array_equal(kept_dst, src) and not doomed_dst.any()
    assert receiver.posted_requests() == 0
