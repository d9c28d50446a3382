"""The daemon's trust guards, each with its negative control (docs/trust.md).

Two real daemons in this process talk over real gRPC and move bytes over the in-memory
transport. For each guard (capability, prompt digest, dial policy, protocol version,
memory epoch) a test shows the refusal and that nothing moved, and a negative control
switches the guard off through a test-only seam (``monkeypatch`` of the one function
that implements it) and shows the bad outcome it prevents: bytes delivered to a forger,
KV of another prompt delivered, a peer dialled, a stranger's handshake accepted, a
stranger's claim filling a pull. (The memory epoch's negative control is the connector's,
in ``test_vllm_trust.py``: a restart then changes the KV.)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from fake_transport import FakeNetwork
from inprocess import Side, run, side

from kvxfer.certs import issue_certs
from kvxfer.errors import (
    DialNotAllowedError,
    InvalidSpecError,
    PromptMismatchError,
    ProtocolVersionError,
    StaleArenaError,
    TransferNotFoundError,
)
from kvxfer.pages import PageRuns
from kvxfer.server.config import load_config
from kvxfer.server.daemon import Daemon
from kvxfer.server.dial_policy import DialPolicy
from kvxfer.server.peer_protocol import Claim, Commit, PeerAbort, hello_from_request
from kvxfer.server.tls import Caller
from kvxfer.status import LeaseUse, TransferInfo, TransferState
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc

SRC, DST = PageRuns.of([(0, 3)]), PageRuns.of([(10, 3)])
STRANGER = Caller(("eve",), "127.0.0.1")


@asynccontextmanager
async def daemons(tmp: Path, **decode_settings: Any) -> AsyncIterator[tuple[Side, Side]]:
    network = FakeNetwork()
    async with side(tmp, "prefill", network) as sender, \
            side(tmp, "decode", network, **decode_settings) as receiver:
        fill(sender)
        yield sender, receiver


def fill(sender: Side) -> None:
    sender.raw.copy_(torch.randint(0, 256, sender.raw.shape, dtype=torch.uint8,
                                   generator=torch.Generator().manual_seed(1)))


def delivered(sender: Side, receiver: Side) -> bool:
    return all(torch.equal(sender.page(s), receiver.page(d)) for s, d in zip(SRC.pages(), DST.pages()))


async def pull(sender: Side, receiver: Side, tid: str, *, capability: str | None = None,
               digest: bytes = b"", offered_digest: bytes = b"", timeout_s: float = 10) -> TransferInfo:
    """Offer ``SRC`` on the sender and pull it into ``DST``, presenting ``capability`` (the
    offer's when None); the receiver's final status."""
    offer = sender.transfers.offer(tid, "kv", SRC, timeout_s, False, prompt_digest=offered_digest)
    receiver.transfers.pull(tid, sender.peer_address, "kv", DST, timeout_s,
                            capability=offer.capability if capability is None else capability,
                            prompt_digest=digest)
    return await receiver.final(tid)


def test_a_pull_must_present_the_offers_capability(tmp_path: Path) -> None:
    async def body() -> None:
        async with daemons(tmp_path) as (sender, receiver):
            forged = await pull(sender, receiver, "forged", capability="0" * 32)
            assert isinstance(forged.failure, TransferNotFoundError), forged.error
            assert sender.transfers.registry.get("forged").state == TransferState.WAITING
            assert not delivered(sender, receiver)
            assert (await pull(sender, receiver, "rightful")).ok and delivered(sender, receiver)
    run(body)


def test_negative_control_without_the_capability_check_a_forger_gets_the_pages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvxfer.server.transfers.sender.presents", lambda given, held: True)
    monkeypatch.setattr("kvxfer.server.transfers.receiver.presents", lambda given, held: True)

    async def body() -> None:
        async with daemons(tmp_path) as (sender, receiver):
            forged = await pull(sender, receiver, "forged", capability="0" * 32)
            assert forged.ok and delivered(sender, receiver)
    run(body)


async def push(sender: Side, receiver: Side, tid: str, *, capability: str | None = None) -> TransferInfo:
    """Expect ``DST`` on the receiver and push ``SRC`` into it, presenting ``capability``
    (the expect's when None); the sender's final status."""
    expect = receiver.transfers.expect(tid, "kv", DST, 10)
    sender.transfers.push(tid, "kv", SRC, receiver.peer_address, 10, False,
                          capability=expect.capability if capability is None else capability)
    return await sender.final(tid)


def test_a_push_must_present_the_expects_capability(tmp_path: Path) -> None:
    """Not the expect's capability: NOT_FOUND, the expect still waits, no byte arrives."""
    async def body() -> None:
        async with daemons(tmp_path) as (sender, receiver):
            forged = await push(sender, receiver, "forged", capability="0" * 32)
            assert isinstance(forged.failure, TransferNotFoundError), forged.error
            assert receiver.transfers.registry.get("forged").state == TransferState.WAITING
            assert not delivered(sender, receiver)
            assert (await push(sender, receiver, "rightful")).ok and delivered(sender, receiver)
    run(body)


def test_negative_control_without_the_capability_check_a_forger_fills_the_pages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvxfer.server.transfers.receiver.presents", lambda given, held: True)

    async def body() -> None:
        async with daemons(tmp_path) as (sender, receiver):
            forged = await push(sender, receiver, "forged", capability="0" * 32)
            assert forged.ok and delivered(sender, receiver)
    run(body)


def test_a_pull_for_another_prompt_is_refused_and_ends_the_offer(tmp_path: Path) -> None:
    async def body() -> None:
        async with daemons(tmp_path) as (sender, receiver):
            got = await pull(sender, receiver, "other", digest=b"B" * 32, offered_digest=b"A" * 32)
            assert isinstance(got.failure, PromptMismatchError), got.error
            assert "another prompt" in got.error and not delivered(sender, receiver)
            assert sender.transfers.registry.get("other").state == TransferState.FAILED
            same = await pull(sender, receiver, "same", digest=b"A" * 32, offered_digest=b"A" * 32)
            assert same.ok and delivered(sender, receiver)
    run(body)


def test_negative_control_without_the_digest_check_kv_of_another_prompt_arrives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvxfer.server.transfers.sender.same_prompt", lambda a, b: True)

    async def body() -> None:
        async with daemons(tmp_path) as (sender, receiver):
            got = await pull(sender, receiver, "other", digest=b"B" * 32, offered_digest=b"A" * 32)
            assert got.ok and delivered(sender, receiver)
    run(body)


@pytest.mark.parametrize("verb", ["offer", "expect"])
def test_a_transfer_is_aborted_from_a_peer_only_with_its_capability(tmp_path: Path, verb: str) -> None:
    """An offer (prefill side) or an expect (decode side) not yet claimed; an abort for an id
    nobody registered is NOT_FOUND, and not remembered."""
    async def body() -> None:
        async with daemons(tmp_path) as (prefill, decode):
            register = (partial(prefill.transfers.offer, verify=False) if verb == "offer"
                        else decode.transfers.expect)
            side_ = prefill if verb == "offer" else decode
            mine = register("mine", "kv", SRC, 10)
            for capability in ("", "f" * 32):
                with pytest.raises(TransferNotFoundError):
                    side_.transfers.abort_from_peer(PeerAbort("mine", "", "eve", capability), STRANGER)
            with pytest.raises(TransferNotFoundError):
                side_.transfers.abort_from_peer(PeerAbort("later", "", "eve"), STRANGER)
            assert mine.state == TransferState.WAITING
            assert register("later", "kv", SRC, 10).state == TransferState.WAITING
            side_.transfers.abort_from_peer(PeerAbort("mine", "", "peer", mine.capability), STRANGER)
            assert mine.state == TransferState.ABORTED
    run(body)


def test_negative_control_without_the_capability_check_anyone_aborts_an_offer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvxfer.server.transfers.coordinator.presents", lambda given, held: True)

    async def body() -> None:
        async with daemons(tmp_path) as (sender, _):
            offer = sender.transfers.offer("mine", "kv", SRC, 10, False)
            sender.transfers.abort_from_peer(PeerAbort("mine", "", "eve"), STRANGER)
            assert offer.state == TransferState.ABORTED
    run(body)


def test_a_peer_learns_nothing_of_which_transfer_ids_exist(tmp_path: Path) -> None:
    """From a session of its own, a peer that does not hold a transfer gets one answer, word
    for word, whatever it tries: a claim without the capability, a commit of a transfer
    its session did not claim, an abort without the capability; for an id registered here
    and for one that is not."""
    async def body() -> None:
        async with daemons(tmp_path) as (sender, receiver):
            assert (await pull(sender, receiver, "opens-a-session")).ok
            assert receiver.daemon.sessions is not None and receiver.transfers is not None
            session = next(iter(receiver.daemon.sessions._inbound.values()))
            receiver.transfers.expect("held", "kv", DST, 10)  # registered, not the peer's
            answers: dict[str, list[str]] = {}
            for tid in ("held", "nobody-registered"):
                attempts = {
                    "claim": receiver.transfers.claim(Claim(tid, session.session_id, "kv", SRC,
                                                            False, 0, 1, "f" * 32), session.caller),
                    "commit": receiver.transfers.commit(Commit(tid, session.session_id, ()),
                                                        session.caller),
                }
                for verb, attempt in attempts.items():
                    with pytest.raises(TransferNotFoundError) as refused:
                        await attempt
                    answers.setdefault(verb, []).append(str(refused.value).replace(tid, "ID"))
                with pytest.raises(TransferNotFoundError) as refused:
                    receiver.transfers.abort_from_peer(PeerAbort(tid, "", "eve", "f" * 32), STRANGER)
                answers.setdefault("abort", []).append(str(refused.value).replace(tid, "ID"))
            everything = {answer for pair in answers.values() for answer in pair}
            assert everything == {"no transfer 'ID' here is open to this caller"}, answers
    run(body)


def requests_push_seen(side_: Side) -> float:
    return side_.daemon.metrics.rpcs.labels("RequestPush", "OK")._value.get() + \
        side_.daemon.metrics.rpcs.labels("RequestPush", "NOT_FOUND")._value.get()


@pytest.mark.parametrize(("policy", "refusal"), [
    ({"dial_allow": ["127.0.0.2/32"]}, "outside this daemon's dial_allow (127.0.0.2/32)"),
    ({"dial_ports": ["1-2"]}, "outside this daemon's dial_ports (1-2)"),
], ids=["host", "port"])
def test_a_peer_outside_the_dial_policy_is_never_dialled(tmp_path: Path, policy: dict[str, Any],
                                                        refusal: str) -> None:
    """The prefill daemon is at 127.0.0.1 at a port the daemon picked: the decode daemon may
    dial 127.0.0.2 only, or ports 1-2 only. Refused before any connection, counted, and the
    offer never asked for."""
    async def body() -> None:
        async with daemons(tmp_path, **policy) as (sender, receiver):
            got = await pull(sender, receiver, "far")
            assert isinstance(got.failure, DialNotAllowedError), got.error
            assert refusal in got.error
            assert receiver.daemon.metrics.dials_refused._value.get() == 1
            assert requests_push_seen(sender) == 0 and not delivered(sender, receiver)
    run(body)


def test_negative_control_without_the_dial_policy_the_peer_is_dialled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def allow(self: object, address: str) -> None:
        return None

    monkeypatch.setattr("kvxfer.server.dial_policy.DialPolicy.check", allow)

    async def body() -> None:
        async with daemons(tmp_path, dial_allow=["127.0.0.2/32"]) as (sender, receiver):
            assert (await pull(sender, receiver, "far")).ok
            assert requests_push_seen(sender) == 1 and delivered(sender, receiver)
    run(body)


def handshake(version: int) -> pb.HandshakeRequest:
    return pb.HandshakeRequest(protocol_version=version, session_id=f"v{version}",
                               ucx_host="127.0.0.1", ucx_ports=[1], peer_address="127.0.0.1:1")


@asynccontextmanager
async def tls_daemons(tmp: Path, sender_name: str) -> AsyncIterator[tuple[Side, Side]]:
    """A sender with ``sender_name``'s certificate; a receiver that admits and dials only
    "prefill" and "decode"; one CA."""
    ca = tmp / "ca"
    issue_certs(ca, ["prefill", "decode", "eve"])

    def tls(name: str) -> dict[str, str]:
        return {"peer_tls_cert": str(ca / f"{name}.pem"), "peer_tls_key": str(ca / f"{name}.key"),
                "peer_tls_ca": str(ca / "ca.pem")}

    network = FakeNetwork()
    async with side(tmp, sender_name, network, **tls(sender_name)) as sender, \
            side(tmp, "decode", network, peer_allow=["prefill", "decode"], **tls("decode")) as receiver:
        fill(sender)
        yield sender, receiver


def test_a_peer_whose_certificate_names_no_allowed_identity_is_never_called(tmp_path: Path) -> None:
    """eve's certificate is the CA's and names its address, but eve is not in peer_allow:
    the pull fails before any call reaches eve (its capability stays with the decode side)."""
    async def body() -> None:
        async with tls_daemons(tmp_path / "eve", "eve") as (eve, receiver):
            got = await pull(eve, receiver, "to-eve")
            assert isinstance(got.failure, DialNotAllowedError), got.error
            assert "presents a certificate for ['eve', 'localhost']" in got.error
            assert requests_push_seen(eve) == 0 and not delivered(eve, receiver)
            assert receiver.daemon.metrics.dials_refused._value.get() == 1
        async with tls_daemons(tmp_path / "prefill", "prefill") as (prefill, receiver):
            assert (await pull(prefill, receiver, "to-prefill")).ok and delivered(prefill, receiver)
    run(body)


def test_negative_control_without_the_identity_check_the_capability_reaches_eve(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def unchecked(self: object, address: str) -> None:
        return None

    monkeypatch.setattr("kvxfer.server.peer_client.PeerClients._check_identity", unchecked)

    async def body() -> None:
        async with tls_daemons(tmp_path, "eve") as (eve, receiver):
            await pull(eve, receiver, "to-eve", timeout_s=1)
            assert requests_push_seen(eve) == 1
    run(body)


def test_a_handshake_of_another_protocol_version_is_refused_naming_both(tmp_path: Path) -> None:
    async def body() -> None:
        async with daemons(tmp_path) as (sender, _):
            async with grpc.aio.insecure_channel(sender.peer_address) as channel:
                stub = pb_grpc.KvxferPeerStub(channel)
                for version in (0, 2):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await stub.Handshake(handshake(version), timeout=5)
                    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                    assert "speaks peer protocol version" in (refused.value.details() or "")
                    assert "this daemon speaks version 1" in (refused.value.details() or "")
                assert (await stub.Handshake(handshake(1), timeout=5)).protocol_version == 1
    run(body)


def test_negative_control_without_the_version_check_any_hello_is_taken(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ProtocolVersionError):
        hello_from_request(handshake(2))
    monkeypatch.setattr("kvxfer.server.peer_protocol.check_version", lambda theirs: None)
    assert hello_from_request(handshake(2)).session_id == "v2"


def answering_version(version: int) -> Any:
    """The peer servicer's answer to a handshake, as a daemon of ``version`` would give it."""
    from kvxfer.server.peer_protocol import hello_to_response

    def answer(hello: Any) -> pb.HandshakeResponse:
        response = hello_to_response(hello)
        response.protocol_version = version
        return response
    return answer


def test_a_peer_answering_another_protocol_version_is_refused_and_the_pull_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon answers a handshake as version 2 (both daemons' peer servicers patched): the
    prefill daemon, which opens the session to push a pull's pages, refuses that answer,
    naming both versions; the transfer fails (a vLLM request then computes its prompt) and
    nothing is delivered."""
    monkeypatch.setattr("kvxfer.server.servicers.peer.hello_to_response", answering_version(2))

    async def body() -> None:
        async with daemons(tmp_path) as (sender, receiver):
            offer = sender.transfers.offer("v2-peer", "kv", SRC, 10, False)
            receiver.transfers.pull("v2-peer", sender.peer_address, "kv", DST, 10,
                                    capability=offer.capability)
            offered = sender.transfers.registry.get("v2-peer")
            got = await sender.final("v2-peer")
            assert isinstance(got.failure, ProtocolVersionError), got.error
            assert "version 2" in got.error and "version 1" in got.error
            assert offered.state == TransferState.FAILED and not delivered(sender, receiver)
    run(body)


def test_negative_control_without_the_answers_version_check_the_pull_completes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvxfer.server.servicers.peer.hello_to_response", answering_version(2))
    monkeypatch.setattr("kvxfer.server.peer_protocol.check_version", lambda theirs: None)

    async def body() -> None:
        async with daemons(tmp_path) as (sender, receiver):
            assert (await pull(sender, receiver, "v2-peer")).ok and delivered(sender, receiver)
    run(body)


def test_a_verb_through_a_mapping_of_an_earlier_daemon_is_refused(tmp_path: Path) -> None:
    async def body() -> None:
        async with daemons(tmp_path) as (sender, _):
            epoch = sender.daemon.pools.epoch  # type: ignore[union-attr]
            assert len(epoch) == 32
            with pytest.raises(StaleArenaError, match="restarted since"):
                sender.transfers.offer("stale", "kv", SRC, 10, False, LeaseUse(arena_epoch="0" * 32))
            assert sender.transfers.registry.find("stale") is None
            current = sender.transfers.offer("current", "kv", SRC, 10, False, LeaseUse(arena_epoch=epoch))
            assert current.state == TransferState.WAITING
    run(body)


@pytest.mark.parametrize(("address", "allowed"), [
    ("127.0.0.1:7500", True), ("127.0.0.1:7510", True), ("[::1]:7505", True), ("127.0.0.1", True),
    ("127.0.0.1:7499", False), ("127.0.0.1:22", False), ("[::1]:7511", False),
    ("localhost:6379", False)])
def test_dial_ports_limit_the_port_and_a_bare_ucx_host_passes(address: str, allowed: bool) -> None:
    policy = DialPolicy(["127.0.0.1/32", "::1/128"], ["7500-7510"])

    async def check() -> None:
        await policy.check(address)

    if allowed:
        run(check)
    else:
        with pytest.raises(DialNotAllowedError, match=r"outside this daemon's dial_ports \(7500-7510\)"):
            run(check)


@pytest.mark.parametrize(("allow", "ports", "warned"), [
    (["10.0.0.0/8"], [], True), (["10.0.0.0/8"], ["7500"], False), (["127.0.0.0/8"], [], False)])
def test_a_daemon_warns_when_params_may_aim_it_at_any_port_beyond_this_host(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, allow: list[str], ports: list[str],
        warned: bool) -> None:
    config = load_config(pool_flags=["name=kv,preset=tiny"], overrides={
        "worker_address": f"unix://{tmp_path}/w.sock", "peer_address": "127.0.0.1:0",
        "shm_dir": str(tmp_path), "dial_allow": allow, "dial_ports": ports})
    async def build() -> None:  # its gRPC servers need a running loop
        Daemon(config)

    with caplog.at_level(logging.WARNING, logger="kvxfer.server"):
        run(build)
    assert ("set dial_ports to your daemons' peer port" in caplog.text) is warned


@pytest.mark.parametrize("ports", [["0"], ["7510-7500"], ["http"], ["70000"], ["1-2-3"]])
def test_dial_ports_that_are_not_ports_are_refused_at_start(ports: list[str]) -> None:
    with pytest.raises(InvalidSpecError, match="dial_ports .* is not a port or a range"):
        DialPolicy(["127.0.0.1/32"], ports)


@pytest.mark.parametrize(("address", "allowed"), [
    ("127.0.0.1:7500", True), ("localhost:7500", True), ("[::1]:7500", True),
    ("[::ffff:127.0.0.1]:7500", True), ("::1", True), ("127.0.0.2:7500", False),
    ("10.1.2.3:7500", False), ("[fe80::1%lo]:7500", False)])
def test_the_dial_policy_reads_every_address_form(address: str, allowed: bool) -> None:
    """Literals are checked as they are (no lookup), names by what they resolve to; IPv6,
    IPv4-mapped IPv6 and bare hosts included. Only 127.0.0.1 and ::1 are allowed here."""
    policy = DialPolicy(["127.0.0.1/32", "::1/128"])

    async def check() -> None:
        await policy.check(address)

    if allowed:
        run(check)
    else:
        with pytest.raises(DialNotAllowedError, match="outside this daemon's dial_allow"):
            run(check)
