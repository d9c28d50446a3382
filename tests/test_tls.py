"""Mutual TLS on the peer API: only peers with a certificate from the daemon's CA, and
only the identities it allows, reach any service there; the rightful peer's transfer
is untouched by everyone else's attempts."""

from __future__ import annotations

import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from peer_calls import PeerAs, channel_as, refused
from pool_checks import assert_moved, fill_random, standard_runs

from kvxfer.certs import issue_certs
from kvxfer.client import KvxferClient
from kvxfer.errors import InvalidSpecError, PeerNotAllowedError
from kvxfer.pages import PageRuns
from kvxfer.server.config import load_config
from kvxfer.server.daemon import Daemon
from kvxfer.server.tls import PeerTls, check_peer_binding
from kvxfer.ucx_settings import LOOPBACK_ENV
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from kvxfer.wire.codec import descriptor_to_proto
from kvxfer.wire.status import from_rpc_error

POOL = "name=kv,preset=tiny,num_pages=64"


def test_certs_name_the_node_and_keys_are_owner_only(tmp_path: Path) -> None:
    [node] = issue_certs(tmp_path, ["decode-0"], ("127.0.0.1", "kv.example"))
    cert = x509.load_pem_x509_certificate(node.cert.read_bytes())
    assert cert.subject.rfc4514_string() == "CN=decode-0"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["decode-0", "kv.example"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    for key in (node.key, tmp_path / "ca.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    with pytest.raises(InvalidSpecError, match="node name '../x'"):
        issue_certs(tmp_path, ["../x"])


def test_tls_files_that_are_not_what_they_claim_are_refused_by_name(tmp_path: Path) -> None:
    a, b = issue_certs(tmp_path, ["a", "b"])
    ca = str(tmp_path / "ca.pem")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    cases = {
        (str(junk), str(a.key), ca): "peer_tls_cert=",
        (str(a.cert), str(junk), ca): "peer_tls_key=",
        (str(a.cert), str(a.key), str(junk)): "peer_tls_ca=",
        (str(a.cert), str(b.key), ca): "is not the key of",
        (str(a.cert), str(tmp_path / "missing.key"), ca): "cannot read it",
        (str(a.cert), "", ca): "missing ['peer_tls_key']",
    }
    for files, message in cases.items():
        with pytest.raises(InvalidSpecError, match=re.escape(message)):
            PeerTls.load(*files)
    assert PeerTls.load(str(a.cert), str(a.key), ca) is not None
    assert PeerTls.load("", "", "") is None


def test_a_plaintext_peer_api_binds_to_loopback_only() -> None:
    for address in ("127.0.0.1:0", "localhost:7500", "[::1]:7500"):
        check_peer_binding(address, None, insecure_peer=False)
    check_peer_binding("0.0.0.0:7500", None, insecure_peer=True)  # the operator's explicit choice
    with pytest.raises(InvalidSpecError, match="--insecure-peer"):
        check_peer_binding("0.0.0.0:7500", None, insecure_peer=False)


def test_an_allow_list_without_tls_is_refused() -> None:
    config = load_config(overrides={"peer_allow": ["prefill"]}, pool_flags=[POOL])
    with pytest.raises(InvalidSpecError, match="peer_allow names certificate identities"):
        Daemon(config)


def test_serve_refuses_an_open_plaintext_peer_port_in_one_line(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvxfer.client.cli", "serve", "--pool", POOL,
         "--worker-address", f"unix://{tmp_path}/s.sock", "--peer-address", "0.0.0.0:0"],
        capture_output=True, text=True, timeout=60, env={**LOOPBACK_ENV})
    assert out.returncode == 2
    assert "refusing to serve the peer API on 0.0.0.0:0 without mutual TLS" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr


@pytest.fixture
def tls_pair(spawn, tmp_path: Path):
    """A prefill and a decode daemon with certificates of one CA; the decode daemon admits
    only the identity "prefill". Also certificates for "eve" (same CA, not admitted) and
    "mallory" (another CA), and the decode side expecting transfer "guarded"."""
    issue_certs(tmp_path / "ca", ["prefill", "decode", "eve"])
    issue_certs(tmp_path / "other-ca", ["mallory"])
    pre = spawn("prefill", [POOL], tls=tmp_path / "ca")
    dec = spawn("decode", [POOL], tls=tmp_path / "ca", extra_args=["--peer-allow", "prefill"])
    return pre, dec, tmp_path


def attempt_everything(channel: grpc.Channel) -> list[grpc.StatusCode]:
    """Health, reflection, a handshake, and an abort of the guarded transfer: each call's
    status code."""
    def code(call) -> grpc.StatusCode:
        try:
            call()
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    health = health_pb2_grpc.HealthStub(channel)
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    peer = pb_grpc.KvxferPeerStub(channel)
    return [
        code(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5)),
        code(lambda: list(reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))),
        code(lambda: peer.Handshake(pb.HandshakeRequest(protocol_version=1,
            session_id="evil", ucx_host="127.0.0.1", ucx_ports=[1]), timeout=5)),
        code(lambda: peer.AbortTransfer(pb.AbortTransferRequest(
            transfer_id="guarded", session_id="evil", reason="attacker"), timeout=5)),
    ]


def test_strangers_reach_nothing_and_the_rightful_peer_still_transfers(tls_pair) -> None:
    pre, dec, tmp = tls_pair
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
            p.attach("kv") as src, d.attach("kv") as dst:
        fill_random(src, 7)
        src_runs, dst_runs = standard_runs(7, num_pages=64, pages=24)
        before = dst.raw.clone()
        expected = d.expect("guarded", "kv", dst_runs, timeout_s=60)

        ca, other = tmp / "ca", tmp / "other-ca"
        strangers = {
            "plaintext": (None, None, ca),
            "TLS without a client certificate": (ca, None, ca),
            "a certificate of another CA": (other, "mallory", ca),
        }
        for who, (ca_dir, name, trust) in strangers.items():
            with channel_as(dec, ca_dir, name, trust) as channel:
                assert attempt_everything(channel) == [grpc.StatusCode.UNAVAILABLE] * 4, who
        with channel_as(dec, ca, "eve", ca) as channel:
            assert attempt_everything(channel) == [grpc.StatusCode.PERMISSION_DENIED] * 4
            with pytest.raises(grpc.RpcError) as denied:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            error = from_rpc_error(denied.value)  # type: ignore[arg-type]
            assert isinstance(error, PeerNotAllowedError) and "'eve'" in str(error)

        [waiting] = d.transfers()
        assert waiting.state.name == "WAITING"
        p.push("guarded", "kv", src_runs, peer=dec.peer_address, timeout_s=60, verify=True,
               capability=expected.capability)
        sent, got = p.wait("guarded", timeout_s=60), d.wait("guarded", timeout_s=60)
        assert sent.ok and got.ok and got.verified, (sent.error, got.error)
        assert_moved(src, dst, src_runs, dst_runs, before)


def test_an_authenticated_peer_cannot_touch_another_sessions_or_peers_transfer(
        spawn, tmp_path: Path) -> None:
    ca = tmp_path / "ca"
    issue_certs(ca, ["prefill", "decode", "eve", "tester"])
    pre = spawn("prefill", [POOL], tls=ca)
    dec = spawn("decode", [POOL], tls=ca)
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
            p.attach("kv") as src, d.attach("kv") as dst:
        fill_random(src, 11)
        src_runs, dst_runs = standard_runs(11, num_pages=56, pages=16)  # pages 60, 61: "claimed"
        before = dst.raw.clone()
        pool = descriptor_to_proto(d.describe("kv")[0])
        expected = d.expect("named", "kv", dst_runs, timeout_s=60, peer_identity="prefill")
        claimed = d.expect("claimed", "kv", PageRuns.of([(60, 2)]), timeout_s=60)
        tester, eve = PeerAs(dec, ca, "tester", pool), PeerAs(dec, ca, "eve", pool)
        try:
            mine, evil = tester.open_session("tester-session"), eve.open_session("eve-session")
            tester.claim("claimed", mine, PageRuns.of([(0, 2)]), claimed.capability)

            # A transfer reserved for "prefill": eve may neither claim nor abort it, even
            # with its capability (both must match).
            for capability in ("", expected.capability):
                code, message = refused(eve.claim, "named", evil, src_runs, capability)
                assert (code, capability) in {(grpc.StatusCode.NOT_FOUND, ""),
                                              (grpc.StatusCode.PERMISSION_DENIED, capability)}
                code, _ = refused(eve.abort, "named", "", capability)
                assert code == grpc.StatusCode.NOT_FOUND
            # A transfer another session claimed: not through eve's session, not with the
            # stolen session id, not with its capability, not by claiming it again.
            for session in (evil, mine, ""):
                code, message = refused(eve.abort, "claimed", session, claimed.capability)
                assert code == grpc.StatusCode.NOT_FOUND and message.endswith("open to this caller")
            code, _ = refused(eve.claim, "claimed", mine, PageRuns.of([(0, 2)]), claimed.capability)
            assert code == grpc.StatusCode.UNAVAILABLE  # someone else's session is unknown to eve
            code, _ = refused(eve.claim, "claimed", evil, PageRuns.of([(0, 2)]), claimed.capability)
            assert code == grpc.StatusCode.ALREADY_EXISTS
            code, _ = refused(eve.open_session, mine)
            assert code == grpc.StatusCode.INVALID_ARGUMENT  # a session id is never reused

            states = {t.transfer_id: t.state.name for t in d.transfers()}
            assert states == {"named": "WAITING", "claimed": "TRANSFERRING"}
            tester.abort("claimed", mine)  # its own session may
            assert d.wait("claimed", timeout_s=10).state.name == "ABORTED"
        finally:
            tester.close()
            eve.close()

        p.push("named", "kv", src_runs, peer=dec.peer_address, timeout_s=60, verify=True,
               capability=expected.capability)
        sent, got = p.wait("named", timeout_s=60), d.wait("named", timeout_s=60)
        assert sent.ok and got.ok and got.verified, (sent.error, got.error)
        assert_moved(src, dst, src_runs, dst_runs, before)


def test_an_admitted_peer_without_the_capability_cannot_pull_or_abort_an_offer(
        spawn, tmp_path: Path, caplog) -> None:
    """vLLM's offers name no peer identity: mutual TLS admits eve, but without the offer's
    capability she can neither pull nor abort it, nor pre-abort an id not offered yet; each
    answer is the same NOT_FOUND as for an id that does not exist. The capability appears in
    no log line. The rightful pull then moves the pages byte-exact."""
    ca = tmp_path / "ca"
    issue_certs(ca, ["prefill", "decode", "eve"])
    pre = spawn("prefill", [POOL], tls=ca, log_level="info")
    dec = spawn("decode", [POOL], tls=ca)
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
            p.attach("kv") as src, d.attach("kv") as dst:
        fill_random(src, 12)
        src_runs, dst_runs = standard_runs(12, num_pages=56, pages=16)
        before = dst.raw.clone()
        offered = p.offer("vllm-like", "kv", src_runs, timeout_s=60, verify=True)
        eve = PeerAs(pre, ca, "eve", descriptor_to_proto(p.describe("kv")[0]))
        try:
            answers = [refused(eve.request_push, "vllm-like"),
                       refused(eve.request_push, "vllm-like", "0" * 32),
                       refused(eve.abort, "vllm-like", ""),
                       refused(eve.abort, "vllm-like", "", "f" * 32),
                       refused(eve.abort, "not-offered-yet", ""),
                       refused(eve.request_push, "no-such-id", offered.capability)]
        finally:
            eve.close()
        for code, message in answers:
            assert code == grpc.StatusCode.NOT_FOUND and message.endswith("here is open to this caller")
        assert {m.split("'")[2] for _, m in answers} == {" here is open to this caller"}
        assert p.transfers()[0].state.name == "WAITING"
        p.offer("not-offered-yet", "kv", PageRuns.of([(60, 1)]), timeout_s=60)
        got = d.pull("vllm-like", pre.peer_address, "kv", dst_runs, timeout_s=60,
                     capability=offered.capability, wait=True)
        assert got.ok and got.verified, got.error
        assert_moved(src, dst, src_runs, dst_runs, before)
        assert {t.transfer_id: t.state.name for t in p.transfers()}["not-offered-yet"] == "WAITING"
    assert offered.capability not in pre.log() and offered.capability not in dec.log()
    assert "request-push transfer='vllm-like'" in pre.log()  # audited, capability left out


def test_an_admitted_peer_without_the_capability_cannot_fill_a_pull(spawn, tmp_path: Path) -> None:
    """A pull waits for its sender's claim; eve, admitted and with a session of her own,
    claims it first without the capability: NOT_FOUND, and no byte of its pages changes."""
    ca = tmp_path / "ca"
    issue_certs(ca, ["decode", "eve"])
    dec = spawn("decode", [POOL], tls=ca)
    with socket.socket() as silent, KvxferClient(dec.worker_address) as d, d.attach("kv") as dst:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # connects, never answers: the pull waits for its deadline
        before = dst.raw.clone()
        d.pull("waiting", f"127.0.0.1:{silent.getsockname()[1]}", "kv", PageRuns.of([(0, 2)]),
               timeout_s=20, capability="a" * 32)
        eve = PeerAs(dec, ca, "eve", descriptor_to_proto(d.describe("kv")[0]))
        try:
            session = eve.open_session("eve-session")
            for capability in ("", "b" * 32):
                code, message = refused(eve.claim, "waiting", session, PageRuns.of([(0, 2)]), capability)
                assert code == grpc.StatusCode.NOT_FOUND and message.endswith("here is open to this caller")
        finally:
            eve.close()
        assert d.transfers()[0].state.name == "WAITING"
        assert torch.equal(dst.raw, before)
