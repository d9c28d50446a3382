"""Pulls that cost one round trip: the ask carries a placement, and the sender sends at once.

Two in-process daemons (real gRPC, sessions and heartbeats; an in-memory transport the
test controls). A first push opens the prefill daemon's session to the decode daemon;
every later pull from it asks with a placement, which the sender takes without a Claim.
The sender's messages may come before the receives are posted (UCX keeps them, as the
fake network does), so a pull that ends in between must take them into scratch, never
into its pages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from fake_transport import FakeNetwork
from inprocess import Side, run, side, until
from test_state_machine import DST, SRC, fill, moved, push

from kvxfer.errors import (
    IncompatiblePeerError,
    IntegrityError,
    PeerUnavailableError,
    TransferAbortedError,
)
from kvxfer.server.peer_protocol import Claim, ClaimGrant
from kvxfer.server.tls import Caller
from kvxfer.status import TransferState

Body = Callable[[Side, Side, FakeNetwork, list[str]], Awaitable[None]]


async def pull(sender: Side, receiver: Side, tid: str, *, verify: bool = False) -> None:
    offered = sender.transfers.offer(tid, "kv", SRC, 10, verify)
    receiver.transfers.pull(tid, sender.peer_address, "kv", DST, 10,
                            capability=offered.capability)


def placed(tmp_path: Path, body: Body) -> None:
    """Run ``body`` once a push opened the session; it gets the claims the receiver saw."""
    async def main() -> None:
        network = FakeNetwork()
        async with side(tmp_path, "prefill", network) as sender, \
                side(tmp_path, "decode", network) as receiver:
            fill(sender, 1)
            await push(sender, receiver, "opens-the-session")
            assert (await receiver.final("opens-the-session")).ok
            claims: list[str] = []
            claim = receiver.transfers.claim

            async def counted(request: Claim, caller: Caller) -> ClaimGrant:
                claims.append(request.transfer_id)
                return await claim(request, caller)

            receiver.transfers.claim = counted  # type: ignore[method-assign]
            fill(receiver, 2)
            await body(sender, receiver, network, claims)
    run(main)


def test_a_pull_in_a_session_the_sender_holds_needs_no_claim(tmp_path: Path) -> None:
    async def body(sender: Side, receiver: Side, network: FakeNetwork, claims: list[str]) -> None:
        for tid, verify in (("plain", False), ("verified", True)):
            await pull(sender, receiver, tid, verify=verify)
            sent, got = await sender.final(tid), await receiver.final(tid)
            assert sent.ok and got.ok and got.verified is verify, (sent.error, got.error)
            assert moved(sender, receiver)
            fill(receiver, 3)
        assert claims == []
    placed(tmp_path, body)


def test_a_placed_pull_that_ends_before_the_answer_lands_nowhere(tmp_path: Path) -> None:
    """The sender sends at once; the decode side ends the pull before the answer comes back:
    the sender is told, and what it sent is taken into scratch, never into the pages."""
    async def body(sender: Side, receiver: Side, network: FakeNetwork, claims: list[str]) -> None:
        before = receiver.raw.clone()
        request_push = sender.transfers.request_push

        def then_abort(request: Any, caller: Caller) -> Any:
            started = request_push(request, caller)
            assert started is not None  # it took the placement, and has sent
            receiver.transfers.abort(request.transfer_id, "the request was cancelled")
            return started

        sender.transfers.request_push = then_abort  # type: ignore[method-assign]
        network.hold()  # the sends stay on the wire until both sides ended
        await pull(sender, receiver, "cut")
        got, sent = await receiver.final("cut"), await sender.final("cut")
        assert isinstance(got.failure, TransferAbortedError), got.error
        assert isinstance(sent.failure, TransferAbortedError), sent.error
        assert len(network.held) == 2
        network.release()
        transport = receiver.daemon.transport
        assert transport is not None
        assert network.dropped == 2 and not transport.unexpected  # type: ignore[attr-defined]
        assert torch.equal(receiver.raw, before)
        assert claims == []
    placed(tmp_path, body)


def test_a_placed_pull_fails_fast_when_its_sender_dies(tmp_path: Path) -> None:
    async def body(sender: Side, receiver: Side, network: FakeNetwork, claims: list[str]) -> None:
        network.hold()
        await pull(sender, receiver, "orphan")
        await until(lambda: receiver.transfers.registry.get("orphan").state
                    == TransferState.TRANSFERRING, what="the receives")
        await sender.sever()
        got = await receiver.final("orphan", timeout_s=5)
        assert isinstance(got.failure, PeerUnavailableError), got.error
        assert claims == []
    placed(tmp_path, body)


def test_a_placed_verified_pull_catches_a_corrupted_byte(tmp_path: Path) -> None:
    async def body(sender: Side, receiver: Side, network: FakeNetwork, claims: list[str]) -> None:
        network.corrupt_next = True
        await pull(sender, receiver, "corrupt", verify=True)
        sent, got = await sender.final("corrupt"), await receiver.final("corrupt")
        assert isinstance(got.failure, IntegrityError) and "checksum" in got.error
        assert isinstance(sent.failure, IntegrityError)
        assert claims == []
    placed(tmp_path, body)


def test_an_answer_that_does_not_fit_the_plan_fails_the_pull_before_a_receive_is_posted(
        tmp_path: Path) -> None:
    """The sender says it sends one chunk more than the decode side plans: the pull fails,
    nothing is posted into its pages, and every message the sender said it sends is taken."""
    async def body(sender: Side, receiver: Side, network: FakeNetwork, claims: list[str]) -> None:
        before = receiver.raw.clone()
        request_push = sender.transfers.request_push

        def one_more(request: Any, caller: Caller) -> Any:
            started = request_push(request, caller)
            return dataclasses.replace(started, chunks=started.chunks + 1)

        sender.transfers.request_push = one_more  # type: ignore[method-assign]
        await pull(sender, receiver, "misfit")
        got = await receiver.final("misfit")
        assert isinstance(got.failure, IncompatiblePeerError), got.error
        assert "3 chunks over 1 lanes; our plan has 2 over 1" in got.error
        transport = receiver.daemon.transport
        assert transport is not None
        assert network.dropped == 2 and not transport.unexpected  # type: ignore[attr-defined]
        assert set(range(min(transport.discarded), min(transport.discarded) + 3)) == \
            transport.discarded  # type: ignore[attr-defined]
        assert torch.equal(receiver.raw, before)
        assert (await sender.final("misfit")).state.final
    placed(tmp_path, body)
