"""Every transition of the transfer state machine, driven through real daemons in this process.

Two ``Daemon`` objects talk over real gRPC (sessions, heartbeats, claims,
commits, aborts) and move bytes over an in-memory transport the test controls:
it can hold messages on the wire, corrupt one, or cut a daemon off. Each
scenario names the transitions it drives and checks them in the transfers'
histories; ``test_the_scenarios_cover_every_transition_in_the_table`` checks
that together they drive every transition ``TRANSITIONS`` allows. Removing a
transition from the table makes the scenario that drives it fail.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch
from fake_transport import FakeNetwork
from inprocess import Side, run, side, until

from kvxfer.errors import (
    IncompatibleLayoutError,
    IntegrityError,
    InvalidArgumentError,
    PeerUnavailableError,
    TransferAbortedError,
    TransferDeadlineError,
    TransferNotFoundError,
)
from kvxfer.offer_parts import OfferPart
from kvxfer.pages import PageRuns
from kvxfer.server.peer_protocol import PeerAbort
from kvxfer.server.tls import Caller
from kvxfer.server.transfers.record import TRANSITIONS
from kvxfer.status import TransferState

W, T = TransferState.WAITING, TransferState.TRANSFERRING
DONE, FAILED = TransferState.DONE, TransferState.FAILED
ABORTED, LATE = TransferState.ABORTED, TransferState.DEADLINE_EXCEEDED
Transition = tuple[TransferState, TransferState]
Scenario = Callable[[Side, Side, FakeNetwork], Awaitable[None]]

SRC, DST = PageRuns.of([(0, 3)]), PageRuns.of([(10, 2), (20, 1)])


def fill(s: Side, seed: int) -> None:
    s.raw.copy_(torch.randint(0, 256, s.raw.shape, dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(seed)))


def moved(sender: Side, receiver: Side) -> bool:
    return all(torch.equal(sender.page(s), receiver.page(d)) for s, d in zip(SRC.pages(), DST.pages()))


def transitions(history: list[TransferState]) -> set[Transition]:
    return set(zip(history, history[1:]))


async def push(sender: Side, receiver: Side, tid: str, *, verify: bool = False,
               timeout_s: float = 10) -> None:
    expected = receiver.transfers.expect(tid, "kv", DST, timeout_s)
    sender.transfers.push(tid, "kv", SRC, receiver.peer_address, timeout_s, verify,
                          capability=expected.capability)


async def a_push_completes(sender: Side, receiver: Side, network: FakeNetwork) -> None:
    await push(sender, receiver, "ok")
    assert (await sender.final("ok")).ok and (await receiver.final("ok")).ok
    assert moved(sender, receiver)


async def a_verified_push_completes(sender: Side, receiver: Side, network: FakeNetwork) -> None:
    await push(sender, receiver, "ok", verify=True)
    sent, got = await sender.final("ok"), await receiver.final("ok")
    assert sent.ok and got.ok and sent.verified and got.verified
    assert moved(sender, receiver)


async def an_abort_before_the_sender_arrives(sender: Side, receiver: Side,
                                             network: FakeNetwork) -> None:
    receiver.transfers.expect("ok", "kv", DST, 10)
    receiver.transfers.abort("ok", "the request was cancelled")
    got = await receiver.final("ok")
    assert isinstance(got.failure, TransferAbortedError)
    assert "the request was cancelled" in got.error


async def the_sender_aborts_mid_transfer(sender: Side, receiver: Side, network: FakeNetwork) -> None:
    network.hold()
    before = receiver.raw.clone()
    await push(sender, receiver, "ok")
    await until(lambda: sender.transfers.registry.get("ok").state == T, what="the sends")
    sender.transfers.abort("ok", "prefill gave up")
    sent, got = await sender.final("ok"), await receiver.final("ok")
    assert isinstance(sent.failure, TransferAbortedError)
    assert isinstance(got.failure, TransferAbortedError) and "prefill gave up" in got.error
    network.release()  # the late messages find no receive posted
    assert network.dropped == len(receiver.transfers.registry.get("ok").chunks) == 2
    assert torch.equal(receiver.raw, before)


async def the_receiver_aborts_mid_transfer(sender: Side, receiver: Side, network: FakeNetwork) -> None:
    network.hold()
    await push(sender, receiver, "ok")
    await until(lambda: sender.transfers.registry.get("ok").state == T, what="the grant")
    receiver.transfers.abort("ok", "decode gave up")
    sent, got = await sender.final("ok"), await receiver.final("ok")
    assert isinstance(got.failure, TransferAbortedError)
    assert isinstance(sent.failure, TransferAbortedError) and "decode gave up" in sent.error
    assert receiver.daemon.transport is not None and receiver.daemon.transport.posted_requests() == 0


async def nobody_sends_before_the_deadline(sender: Side, receiver: Side,
                                           network: FakeNetwork) -> None:
    receiver.transfers.expect("ok", "kv", DST, 0.3)
    got = await receiver.final("ok")
    assert isinstance(got.failure, TransferDeadlineError) and "(it was WAITING)" in got.error


async def the_bytes_do_not_arrive_before_the_deadline(sender: Side, receiver: Side,
                                                      network: FakeNetwork) -> None:
    network.hold()
    await push(sender, receiver, "ok", timeout_s=1.0)
    sent, got = await sender.final("ok"), await receiver.final("ok")
    assert isinstance(sent.failure, TransferDeadlineError)
    assert isinstance(got.failure, TransferDeadlineError) and "(it was TRANSFERRING)" in got.error
    assert receiver.daemon.transport is not None and receiver.daemon.transport.posted_requests() == 0


async def the_receiver_dies_mid_transfer(sender: Side, receiver: Side, network: FakeNetwork) -> None:
    network.hold()
    await push(sender, receiver, "ok")
    await until(lambda: sender.transfers.registry.get("ok").state == T, what="the grant")
    await receiver.sever()
    sent = await sender.final("ok", timeout_s=5)
    assert isinstance(sent.failure, PeerUnavailableError), sent.error


async def the_sender_dies_mid_transfer(sender: Side, receiver: Side, network: FakeNetwork) -> None:
    network.hold()
    await push(sender, receiver, "ok")
    await until(lambda: receiver.transfers.registry.get("ok").state == T, what="the claim")
    await sender.sever()
    got = await receiver.final("ok", timeout_s=5)
    assert isinstance(got.failure, PeerUnavailableError), got.error
    assert f"sender {sender.peer_address} " in got.error, got.error


async def the_sender_dies_between_its_bytes_and_its_commit(sender: Side, receiver: Side,
                                                          network: FakeNetwork) -> None:
    network.hold()
    await push(sender, receiver, "ok", verify=True)
    await until(lambda: receiver.transfers.registry.get("ok").state == T, what="the claim")
    chunks = len(receiver.transfers.registry.get("ok").chunks)
    await until(lambda: len(network.held) == chunks, what="the sends")
    network.release()  # every byte lands; the sender's Commit has not been sent yet
    await sender.sever()
    got = await receiver.final("ok", timeout_s=5)  # by the session, not the 10 s deadline
    assert isinstance(got.failure, PeerUnavailableError), got.error
    assert f"sender {sender.peer_address} " in got.error, got.error
    assert moved(sender, receiver)  # the bytes are there, but unverified, so not DONE
    # The error was raised where the session was lost; the transfer keeps it without the
    # traceback, whose frames would keep what they held alive as long as the record.
    kept = receiver.transfers.registry.get("ok").error
    assert kept is not None and kept.__traceback__ is None


async def a_byte_is_corrupted_on_the_wire(sender: Side, receiver: Side, network: FakeNetwork) -> None:
    network.corrupt_next = True
    await push(sender, receiver, "ok", verify=True)
    sent, got = await sender.final("ok"), await receiver.final("ok")
    assert isinstance(got.failure, IntegrityError) and "checksum" in got.error
    assert isinstance(sent.failure, IntegrityError) and sent.error.startswith("receiver ")


async def the_peer_aborts_before_this_side_registers(sender: Side, receiver: Side,
                                                     network: FakeNetwork) -> None:
    """NOT_FOUND, and not remembered: the later registration runs to its own end."""
    with pytest.raises(TransferNotFoundError):
        receiver.transfers.abort_from_peer(PeerAbort("ok", "", "prefill aborted first"),
                                           Caller((), "127.0.0.1"))
    receiver.transfers.expect("ok", "kv", DST, 0.2)
    got = await receiver.final("ok")
    assert isinstance(got.failure, TransferDeadlineError), got.error


async def the_worker_aborts_before_it_registers(sender: Side, receiver: Side,
                                                network: FakeNetwork) -> None:
    """NOT_FOUND, but remembered (the worker's own abort, unlike a peer's): the
    registration that follows ends ABORTED at once."""
    with pytest.raises(TransferNotFoundError):
        receiver.transfers.abort("ok", "its request ended")
    receiver.transfers.expect("ok", "kv", DST, 0.2)
    got = await receiver.final("ok")
    assert isinstance(got.failure, TransferAbortedError), got.error
    assert "before it was registered: its request ended" in got.error


async def a_part_aborted_mid_transfer_ends_its_offer_and_the_other_part(
        sender: Side, receiver: Side, network: FakeNetwork) -> None:
    """An offer pulled in two parts: the receiver aborts part 0 mid-transfer; the offer ends
    at once (its lease with it), and so does part 1, on both daemons."""
    network.hold()
    offered = sender.transfers.offer("ok", "kv", SRC, 10, verify=False)
    for index, pages, dst in ((0, [(0, 2)], [(10, 2)]), (1, [(2, 1)], [(20, 1)])):
        receiver.transfers.pull("ok", sender.peer_address, "kv", PageRuns.of(dst), 10,
                                capability=offered.capability,
                                part=OfferPart(index, 2, PageRuns.of(pages)))
    await until(lambda: sender.transfers.registry.find("ok#1") is not None
                and sender.transfers.registry.get("ok#1").state == T, what="part 1's sends")
    receiver.transfers.abort("ok#0", "rank 0 gave up")
    offer, other = await sender.final("ok", timeout_s=5), await receiver.final("ok#1", timeout_s=5)
    assert isinstance(offer.failure, TransferAbortedError) and "rank 0 gave up" in offer.error
    assert isinstance(other.failure, TransferAbortedError), other.error
    assert "its offer 'ok' ended" in other.error
    network.release()


#: (scenario, transitions it drives on the sender, on the receiver).
SCENARIOS: list[tuple[Scenario, set[Transition], set[Transition]]] = [
    (a_push_completes, {(W, T), (T, DONE)}, {(W, T), (T, DONE)}),
    (a_verified_push_completes, {(W, T), (T, DONE)}, {(W, T), (T, DONE)}),
    (an_abort_before_the_sender_arrives, set(), {(W, ABORTED)}),
    (the_peer_aborts_before_this_side_registers, set(), {(W, LATE)}),
    (the_worker_aborts_before_it_registers, set(), {(W, ABORTED)}),
    (the_sender_aborts_mid_transfer, {(T, ABORTED)}, {(T, ABORTED)}),
    (the_receiver_aborts_mid_transfer, {(T, ABORTED)}, {(T, ABORTED)}),
    (nobody_sends_before_the_deadline, set(), {(W, LATE)}),
    (the_bytes_do_not_arrive_before_the_deadline, {(T, LATE)}, {(T, LATE)}),
    (the_receiver_dies_mid_transfer, {(W, T), (T, FAILED)}, set()),
    (the_sender_dies_mid_transfer, set(), {(W, T), (T, FAILED)}),
    (the_sender_dies_between_its_bytes_and_its_commit, set(), {(W, T), (T, FAILED)}),
    (a_byte_is_corrupted_on_the_wire, {(T, FAILED)}, {(T, FAILED)}),
    (a_part_aborted_mid_transfer_ends_its_offer_and_the_other_part, {(W, T), (T, ABORTED)},
     {(T, ABORTED)}),
]


def histories(s: Side) -> set[Transition]:
    return set().union(*(transitions(t.history) for t in s.transfers.registry.all()))


@pytest.mark.parametrize(("scenario", "on_sender", "on_receiver"), SCENARIOS,
                         ids=[s.__name__ for s, _, _ in SCENARIOS])
def test_scenario(tmp_path: Path, scenario: Scenario, on_sender: set[Transition],
                  on_receiver: set[Transition]) -> None:
    async def body() -> None:
        network = FakeNetwork()
        async with side(tmp_path, "prefill", network) as sender, \
                side(tmp_path, "decode", network) as receiver:
            fill(sender, 1)
            fill(receiver, 2)
            await scenario(sender, receiver, network)
            assert on_sender <= histories(sender), histories(sender)
            assert on_receiver <= histories(receiver), histories(receiver)
    run(body)


def test_incompatible_layouts_fail_both_sides_before_any_byte_moves(tmp_path: Path) -> None:
    """WAITING -> FAILED on both sides: the claim is refused before anything is posted."""
    async def body() -> None:
        network = FakeNetwork()
        async with side(tmp_path, "prefill", network) as sender, \
                side(tmp_path, "decode", network, pool="name=kv,preset=tiny,head_num=4") as receiver:
            fill(sender, 1)
            before = receiver.raw.clone()
            await push(sender, receiver, "ok")
            sent, got = await sender.final("ok"), await receiver.final("ok")
            assert isinstance(sent.failure, IncompatibleLayoutError) and "head_num differs" in sent.error
            assert isinstance(got.failure, IncompatibleLayoutError)
            assert torch.equal(receiver.raw, before)
            assert sender.history("ok") == [W, FAILED] and receiver.history("ok") == [W, FAILED]
    run(body)


def test_the_scenarios_cover_every_transition_in_the_table() -> None:
    table = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    driven = set().union(*(s | r for _, s, r in SCENARIOS)) | {(W, FAILED)}
    assert driven == table, f"not driven: {table - driven}; not allowed: {driven - table}"


def test_a_move_the_table_does_not_allow_is_refused(tmp_path: Path) -> None:
    async def body() -> None:
        network = FakeNetwork()
        async with side(tmp_path, "decode", network) as receiver:
            t = receiver.transfers.expect("ok", "kv", DST, 10)
            with pytest.raises(Exception, match="cannot move from WAITING to DONE"):
                t.advance(DONE)
            assert t.history == [W]
    run(body)


def test_naming_a_peer_identity_needs_mutual_tls(tmp_path: Path) -> None:
    """Without TLS no caller has a certificate name, so a named transfer could never be
    filled: it is refused at registration instead of timing out."""
    async def body() -> None:
        async with side(tmp_path, "decode", FakeNetwork()) as receiver:
            with pytest.raises(InvalidArgumentError, match="has no mutual TLS"):
                receiver.transfers.expect("ok", "kv", DST, 10, peer_identity="prefill")
            assert receiver.transfers.all() == []
    run(body)
