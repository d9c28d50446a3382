"""Daemon-to-daemon transfers over UCX between real daemon processes on loopback."""

from __future__ import annotations

import os
import random
import re
import shutil
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from daemon_pairs import attached_pair
from pool_checks import assert_moved, fill_random, standard_runs

from kvxfer.client import KvxferClient
from kvxfer.client.bench import random_runs
from kvxfer.errors import InvalidArgumentError, TransferNotFoundError
from kvxfer.pages import PageRuns
from kvxfer.status import TransferState
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from kvxfer.wire.codec import descriptor_to_proto

STANDARD = "name=kv,preset=llama8b"  # 32 layers, 8 heads, 128 dim, bf16, 2 MiB pages, 512 pages
SMALL = "name=kv,preset=llama8b,num_pages=64"
#: The tests' fault double: a daemon whose receiver flips a byte of what it receives.
CORRUPTING = Path(__file__).resolve().parent / "corrupting_daemon.py"


@pytest.fixture(scope="module")
def pair(tmp_path_factory, dev_ca):
    """A prefill and a decode daemon with the standard pool, shared by this module's tests.

    They run two UCX lanes, so every test here moves its chunks over both, and talk over
    mutual TLS.
    """
    with attached_pair(tmp_path_factory.mktemp("pair"), dev_ca, STANDARD, ["--ucx-lanes", "2"],
                       seed=1) as pair:
        yield pair


def test_standard_workload_push_is_byte_exact(pair) -> None:
    pre, dec, p, d, src, dst = pair
    for seed in range(2):
        src_runs, dst_runs = standard_runs(seed)
        before = dst.raw.clone()
        expected = d.expect(f"std-{seed}", "kv", dst_runs, timeout_s=60)
        p.push(f"std-{seed}", "kv", src_runs, peer=dec.peer_address, timeout_s=60, verify=True,
               capability=expected.capability)
        sent, got = p.wait(f"std-{seed}"), d.wait(f"std-{seed}")
        assert sent.ok and got.ok, (sent.error, got.error)
        assert got.verified and got.bytes == 128 * 2 * 2**20
        assert sent.lanes == got.lanes == 2
        for side in (sent, got):  # the data phase is part of, and shorter than, the whole
            assert 0 < side.data_seconds < side.seconds, (side.data_seconds, side.seconds)
        assert_moved(src, dst, src_runs, dst_runs, before)


def test_a_one_chunk_transfer_uses_one_lane(pair) -> None:
    pre, dec, p, d, src, dst = pair
    before = dst.raw.clone()
    expected = d.expect("one-chunk", "kv", PageRuns.of([(300, 1)]), timeout_s=30)
    p.push("one-chunk", "kv", PageRuns.of([(9, 1)]), peer=dec.peer_address, timeout_s=30,
           capability=expected.capability)
    sent, got = p.wait("one-chunk"), d.wait("one-chunk")
    assert sent.ok and got.ok, (sent.error, got.error)
    assert sent.lanes == got.lanes == 1 and got.extents == 1
    assert_moved(src, dst, PageRuns.of([(9, 1)]), PageRuns.of([(300, 1)]), before)


def test_a_push_presents_the_expects_capability(pair) -> None:
    """The expect's answer holds a capability; a push presenting it fills the pages. A push
    before the expect, or with a wrong capability, fails NOT_FOUND at once (the same
    message) and leaves the expect waiting; once filled, the capability opens nothing."""
    pre, dec, p, d, src, dst = pair
    src_runs, dst_runs = PageRuns.of([(3, 5)]), PageRuns.of([(100, 2), (7, 3)])
    before = dst.raw.clone()
    with pytest.raises(InvalidArgumentError, match="capability is empty"):
        p.push("late-expect", "kv", src_runs, peer=dec.peer_address, timeout_s=30)
    early = p.push("late-expect", "kv", src_runs, peer=dec.peer_address, timeout_s=30,
                   capability="0" * 32, wait=True)
    expected = d.expect("late-expect", "kv", dst_runs, timeout_s=30)
    assert len(expected.capability) == 32 and not d.transfers()[-1].capability  # never listed
    wrong = p.push("late-expect", "kv", src_runs, peer=dec.peer_address, timeout_s=30,
                   capability="f" * 32, wait=True)
    assert d.transfers()[-1].state == TransferState.WAITING and torch.equal(dst.raw, before)
    sent = p.push("late-expect", "kv", src_runs, peer=dec.peer_address, timeout_s=30,
                  capability=expected.capability, wait=True)
    assert sent.ok and d.wait("late-expect").ok
    assert_moved(src, dst, src_runs, dst_runs, before)
    moved = dst.raw.clone()
    again = p.push("late-expect", "kv", src_runs, peer=dec.peer_address, timeout_s=30,
                   capability=expected.capability, wait=True)
    for refused in (early, wrong, again):
        assert isinstance(refused.failure, TransferNotFoundError), refused.error
        assert refused.error.endswith("here is open to this caller") and refused.seconds < 5
    assert torch.equal(dst.raw, moved)


def test_a_pull_presents_the_offers_capability_once(pair) -> None:
    """The offer's answer holds a capability; a pull presenting it moves the pages. A pull
    before the offer, with a wrong capability, or with a spent one fails NOT_FOUND at
    once, all with the same message, and no byte of the destination changes."""
    pre, dec, p, d, src, dst = pair
    src_runs, dst_runs = PageRuns.of([(40, 4), (2, 2)]), PageRuns.of([(200, 6)])
    before = dst.raw.clone()
    early = d.pull("not-yet", pre.peer_address, "kv", dst_runs, timeout_s=30, capability="0" * 32,
                   wait=True)
    offered = p.offer("real", "kv", src_runs, timeout_s=30, verify=True)
    assert len(offered.capability) == 32 and not p.transfers()[-1].capability  # never listed
    wrong = d.pull("real", pre.peer_address, "kv", dst_runs, timeout_s=30,
                   capability="f" * 32, wait=True)
    got = d.pull("real", pre.peer_address, "kv", dst_runs, timeout_s=30,
                 capability=offered.capability, wait=True)
    assert got.ok and p.wait("real").ok and got.verified, got.error
    assert_moved(src, dst, src_runs, dst_runs, before)
    moved = dst.raw.clone()
    again = d.pull("real", pre.peer_address, "kv", PageRuns.of([(210, 6)]), timeout_s=30,
                   capability=offered.capability, wait=True)
    for refused in (early, wrong, again):
        assert isinstance(refused.failure, TransferNotFoundError), refused.error
        assert refused.error.endswith("here is open to this caller") and refused.seconds < 5
    assert torch.equal(dst.raw, moved)


def test_verbs_sent_with_wait_answer_with_the_final_status(pair) -> None:
    """Both sides' verbs sent at once with wait: each answer is that side's end, no Wait."""
    pre, dec, p, d, src, dst = pair
    cases = [("fold-push", PageRuns.of([(20, 3)]), PageRuns.of([(250, 3)])),
             ("fold-pull", PageRuns.of([(60, 2)]), PageRuns.of([(260, 2)]))]
    with ThreadPoolExecutor(1) as other_side:
        for tid, src_runs, dst_runs in cases:
            before = dst.raw.clone()
            if tid == "fold-push":  # the expect's capability lets the push go out
                expected = d.expect(tid, "kv", dst_runs, 30)
                sent = p.push(tid, "kv", src_runs, peer=dec.peer_address, timeout_s=30,
                              verify=True, wait=True, capability=expected.capability)
                got = d.wait(tid, 35)
            else:  # the lease's capability lets the pull go out with the offer
                lease = p.allocate("kv", src_runs.num_pages)
                sending = other_side.submit(p.offer, tid, "kv", lease.runs, 30, True,
                                            lease_id=lease.lease_id, release_lease=True, wait=True)
                src_runs = lease.runs
                got = d.pull(tid, pre.peer_address, "kv", dst_runs, timeout_s=30,
                             capability=lease.capability, wait=True)
                sent = sending.result(35)
            assert sent.state == got.state == TransferState.DONE, (sent.error, got.error)
            assert got.verified
            assert_moved(src, dst, src_runs, dst_runs, before)


@pytest.mark.parametrize("refused", ["expect", "push"])
def test_hand_off_ends_the_other_side_at_once_when_one_is_refused(pair, refused: str) -> None:
    """hand_off registers the expect, then sends the push; when one is refused (here a page
    out of range), the refusal is raised and the other side is never registered (a refused
    expect) or aborted at once, not left to its deadline (a refused push)."""
    from kvxfer.client.handoff import hand_off
    from kvxfer.errors import InvalidArgumentError

    pre, dec, p, d, src, dst = pair
    tid = f"refused-{refused}"
    bad = PageRuns.of([(10_000, 1)])
    good = PageRuns.of([(0, 1)])
    before = dst.raw.clone()
    start = time.monotonic()
    with pytest.raises(InvalidArgumentError, match="10000"):
        hand_off(p, d, tid, pool="kv", src=bad if refused == "push" else good,
                 dst=bad if refused == "expect" else good, decode_peer=dec.peer_address,
                 timeout_s=30)
    assert time.monotonic() - start < 5
    if refused == "push":
        assert d.wait(tid, timeout_s=1).state == TransferState.ABORTED
    else:
        assert tid not in {t.transfer_id for t in p.transfers()}
    assert torch.equal(dst.raw, before)


@pytest.mark.slow
def test_sixteen_concurrent_transfers_in_both_directions(pair) -> None:
    pre, dec, p, d, src, dst = pair
    fill_random(dst, 2)
    jobs = []
    for i in range(16):
        forward = i % 2 == 0
        lane = i // 2
        # Sources come from pages 0-255 of one pool, destinations are 8 disjoint lanes of
        # 32 pages in 256-511 of the other, so no transfer reads what another writes.
        rng = random.Random(100 + i)
        s_runs = random_runs(rng, list(range(256)), 8, (1, 4))
        d_runs = random_runs(rng, list(range(256 + lane * 32, 256 + (lane + 1) * 32)), 8, (1, 4))
        jobs.append((f"conc-{i}", forward, s_runs, d_runs))
    src_before, dst_before = src.raw.clone(), dst.raw.clone()

    def run(job) -> tuple:
        tid, forward, s_runs, d_runs = job
        sender, receiver = (p, d) if forward else (d, p)
        peer = dec.peer_address if forward else pre.peer_address
        expected = receiver.expect(tid, "kv", d_runs, timeout_s=60)
        sender.push(tid, "kv", s_runs, peer=peer, timeout_s=60, verify=True, capability=expected.capability)
        return sender.wait(tid), receiver.wait(tid)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, jobs))
    assert all(s.ok and r.ok and r.verified for s, r in results), [
        (s.error, r.error) for s, r in results if not (s.ok and r.ok)]
    for tid, forward, s_runs, d_runs in jobs:
        s_raw, d_view = (src_before, dst) if forward else (dst_before, src)
        page = 2 * 2**20
        for s, dd in zip(s_runs.pages(), d_runs.pages()):
            assert torch.equal(s_raw[s * page : (s + 1) * page], d_view.page_bytes_view(dd)), tid
    fill_random(src, 1)


def test_incompatible_layout_is_refused_before_any_byte_moves(pair, spawn) -> None:
    pre, dec, p, d, src, dst = pair
    other = spawn("other", ["name=kv,preset=llama8b,num_pages=16,head_num=4"])
    with KvxferClient(other.worker_address) as o, o.attach("kv") as odst:
        before = odst.raw.clone()
        expected = o.expect("incompat", "kv", PageRuns.of([(0, 4)]), timeout_s=20)
        p.push("incompat", "kv", PageRuns.of([(0, 4)]), peer=other.peer_address, timeout_s=20,
               capability=expected.capability)
        sent, got = p.wait("incompat"), o.wait("incompat")
        assert sent.state == got.state == TransferState.FAILED
        assert sent.error_code == got.error_code == "FAILED_PRECONDITION"
        assert "head_num differs" in sent.error and "has 8" in sent.error
        assert torch.equal(odst.raw, before)


def test_lane_i_listens_on_the_given_port_plus_i(spawn) -> None:
    """Run in a network namespace of its own, where no other process can hold the ports."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs root, unshare and ip: the daemon runs in a private network namespace")
    private_netns = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$0" "$@"']
    port = 7600
    three = spawn("three-lanes-fixed", [SMALL], command_prefix=private_netns,
                  extra_args=["--ucx-lanes", "3", "--ucx-port", str(port)])
    assert three.ready_info["ucx_ports"] == [port, port + 1, port + 2]
    with KvxferClient(three.worker_address) as kv:
        assert kv.health() == "SERVING"


def test_daemons_with_different_lane_counts_use_the_smaller(spawn) -> None:
    one = spawn("one-lane", [SMALL], extra_args=["--ucx-lanes", "1"])
    three = spawn("three-lanes", [SMALL], extra_args=["--ucx-lanes", "3"])
    assert len(set(three.ready_info["ucx_ports"])) == 3
    with KvxferClient(one.worker_address) as a, KvxferClient(three.worker_address) as b, \
            a.attach("kv") as a_pool, b.attach("kv") as b_pool:
        fill_random(a_pool, 4)
        fill_random(b_pool, 5)
        for (sender, s_pool), (receiver, r_pool, r_daemon), tid in (
            ((a, a_pool), (b, b_pool, three), "one-to-three"),
            ((b, b_pool), (a, a_pool, one), "three-to-one"),
        ):
            src_runs, dst_runs = PageRuns.of([(0, 5)]), PageRuns.of([(30, 3), (50, 2)])
            before = r_pool.raw.clone()
            expected = receiver.expect(tid, "kv", dst_runs, timeout_s=30)
            sender.push(tid, "kv", src_runs, peer=r_daemon.peer_address, timeout_s=30, verify=True,
                        capability=expected.capability)
            sent, got = sender.wait(tid), receiver.wait(tid)
            assert sent.ok and got.ok and got.verified, (sent.error, got.error)
            assert sent.lanes == got.lanes == 1
            assert_moved(s_pool, r_pool, src_runs, dst_runs, before)


def test_a_claim_from_a_pool_the_handshake_did_not_describe_is_refused(pair, peer_channel) -> None:
    pre, dec, p, d, src, dst = pair
    before = dst.raw.clone()
    expected = d.expect("ghost-pool", "kv", PageRuns.of([(0, 1)]), timeout_s=20)
    with peer_channel(dec.peer_address) as channel:
        peer = pb_grpc.KvxferPeerStub(channel)
        peer.Handshake(pb.HandshakeRequest(protocol_version=1, session_id="no-pools", ucx_host="127.0.0.1",
                                           ucx_port=1, ucx_error_handling=True,
                                           peer_address="127.0.0.1:1"), timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            peer.Claim(pb.ClaimRequest(transfer_id="ghost-pool", session_id="no-pools",
                                       src_pool="kv", src_runs=[pb.PageRun(start=0, count=1)],
                                       capability=expected.capability),
                       timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "did not describe" in refused.value.details()
    got = d.wait("ghost-pool", timeout_s=10)
    assert got.error_code == "FAILED_PRECONDITION"
    assert torch.equal(dst.raw, before)
    assert p.health() == "SERVING" and d.health() == "SERVING"


def test_a_claim_over_more_lanes_than_the_receiver_has_is_refused(pair, peer_channel) -> None:
    pre, dec, p, d, src, dst = pair
    before = dst.raw.clone()
    expected = d.expect("many-lanes", "kv", PageRuns.of([(0, 1)]), timeout_s=20)
    descriptor, _ = p.describe("kv")
    with peer_channel(dec.peer_address) as channel:
        peer = pb_grpc.KvxferPeerStub(channel)
        peer.Handshake(pb.HandshakeRequest(protocol_version=1, session_id="greedy", ucx_host="127.0.0.1", ucx_port=1,
                                           ucx_error_handling=True, pools=[descriptor_to_proto(descriptor)],
                                           peer_address="127.0.0.1:1"), timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            peer.Claim(pb.ClaimRequest(transfer_id="many-lanes", session_id="greedy", src_pool="kv",
                                       src_runs=[pb.PageRun(start=0, count=1)], lanes=9,
                                       capability=expected.capability),
                       timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "offers 9 UCX lanes; this daemon has 2" in refused.value.details()
    assert d.wait("many-lanes", timeout_s=10).error_code == "INVALID_ARGUMENT"
    assert torch.equal(dst.raw, before)


def test_unequal_page_counts_fail_both_sides(pair) -> None:
    pre, dec, p, d, src, dst = pair
    before = dst.raw.clone()
    expected = d.expect("unequal", "kv", PageRuns.of([(0, 3)]), timeout_s=20)
    p.push("unequal", "kv", PageRuns.of([(0, 4)]), peer=dec.peer_address, timeout_s=20, capability=expected.capability)
    sent, got = p.wait("unequal"), d.wait("unequal")
    assert sent.error_code == got.error_code == "INVALID_ARGUMENT"
    assert "4 pages but destination has 3" in got.error
    assert torch.equal(dst.raw, before)


def test_deadline_expires_on_both_sides(pair) -> None:
    pre, dec, p, d, src, dst = pair
    start = time.monotonic()
    d.expect("lonely-expect", "kv", PageRuns.of([(0, 1)]), timeout_s=1.0)
    p.offer("lonely-offer", "kv", PageRuns.of([(0, 1)]), timeout_s=1.0)
    got, sent = d.wait("lonely-expect", timeout_s=10), p.wait("lonely-offer", timeout_s=10)
    assert got.state == sent.state == TransferState.DEADLINE_EXCEEDED
    assert "within its 1s deadline" in got.error
    assert time.monotonic() - start < 5


def test_receiver_abort_ends_the_sender(pair) -> None:
    pre, dec, p, d, src, dst = pair
    expected = d.expect("abort-r", "kv", PageRuns.of([(0, 2)]), timeout_s=30)
    assert d.abort("abort-r", "request cancelled").state == TransferState.ABORTED
    p.push("abort-r", "kv", PageRuns.of([(0, 2)]), peer=dec.peer_address, timeout_s=30, capability=expected.capability)
    sent = p.wait("abort-r", timeout_s=10)
    assert sent.state == TransferState.ABORTED and "request cancelled" in sent.error


def test_abort_mid_transfer_ends_both_sides(pair) -> None:
    pre, dec, p, d, src, dst = pair
    src_runs, dst_runs = standard_runs(5)
    expected = d.expect("abort-mid", "kv", dst_runs, timeout_s=30)
    p.push("abort-mid", "kv", src_runs, peer=dec.peer_address, timeout_s=30, verify=True,
           capability=expected.capability)
    d.abort("abort-mid", "decode gave up")
    got, sent = d.wait("abort-mid", timeout_s=10), p.wait("abort-mid", timeout_s=10)
    assert got.state == TransferState.ABORTED
    assert sent.state in (TransferState.ABORTED, TransferState.FAILED)


def test_checksum_mismatch_fails_the_transfer(pair, spawn) -> None:
    pre, dec, p, d, src, dst = pair
    bad = spawn("corrupting", [SMALL], launcher=[sys.executable, str(CORRUPTING), "1"])
    with KvxferClient(bad.worker_address) as b:
        expected = b.expect("corrupt", "kv", PageRuns.of([(0, 8)]), timeout_s=20)
        p.push("corrupt", "kv", PageRuns.of([(8, 8)]), peer=bad.peer_address, timeout_s=20, verify=True,
               capability=expected.capability)
        got, sent = b.wait("corrupt"), p.wait("corrupt")
    assert got.state == sent.state == TransferState.FAILED
    assert got.error_code == sent.error_code == "DATA_LOSS"
    assert "checksum" in got.error


def test_killing_the_receiver_fails_the_sender_fast_and_others_still_complete(pair, spawn) -> None:
    pre, dec, p, d, src, dst = pair
    victim = spawn("victim", [STANDARD])
    third = spawn("third", [SMALL])
    with KvxferClient(victim.worker_address) as v, KvxferClient(third.worker_address) as t:
        ids = [f"doomed-{i}" for i in range(4)]
        for i, tid in enumerate(ids):
            expected = v.expect(tid, "kv", PageRuns.of([(i * 128, 128)]), timeout_s=60)
            p.push(tid, "kv", PageRuns.of([(i * 128, 128)]), peer=victim.peer_address, timeout_s=60,
                   capability=expected.capability)
        deadline = time.monotonic() + 20
        while not any(x.state == TransferState.TRANSFERRING for x in p.transfers() if x.transfer_id in ids):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        victim.kill()
        killed_at = time.monotonic()
        outcomes = [p.wait(tid, timeout_s=30) for tid in ids]
        waited = time.monotonic() - killed_at
        failed = [o for o in outcomes if not o.ok]
        assert failed, "every transfer finished before the kill; nothing was tested"
        assert all(o.error_code == "UNAVAILABLE" for o in failed), [o.error for o in failed]
        assert waited < 10, f"sender took {waited:.1f}s to notice the dead peer (deadline 60s)"
        print(f"kill -9 of the receiver: the sender failed its transfers {waited * 1e3:.0f} ms after")
        expected = t.expect("survivor", "kv", PageRuns.of([(0, 16)]), timeout_s=30)
        p.push("survivor", "kv", PageRuns.of([(16, 16)]), peer=third.peer_address, timeout_s=30,
               capability=expected.capability)
        assert p.wait("survivor").ok and t.wait("survivor").ok
    assert p.health() == "SERVING"


def test_killing_the_sender_fails_the_receiver_fast(pair, spawn) -> None:
    pre, dec, p, d, src, dst = pair
    doomed = spawn("doomed-sender", [STANDARD])
    with KvxferClient(doomed.worker_address) as s:
        expected = d.expect("orphan", "kv", PageRuns.of([(0, 256)]), timeout_s=60)
        s.push("orphan", "kv", PageRuns.of([(0, 256)]), peer=dec.peer_address, timeout_s=60,
               capability=expected.capability)
        deadline = time.monotonic() + 20
        while d.transfers()[-1].state == TransferState.WAITING:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        doomed.kill()
        start = time.monotonic()
        got = d.wait("orphan", timeout_s=30)
    if got.ok:
        pytest.skip("the transfer completed before the kill landed")
    assert got.error_code == "UNAVAILABLE"
    waited = time.monotonic() - start
    assert waited < 10
    print(f"kill -9 of the sender: the receiver failed its transfer {waited * 1e3:.0f} ms after")


def metric(metrics_port: int, sample: str) -> float:
    """One sample (``name{labels}`` as exposed) from a daemon's Prometheus endpoint; 0 if absent."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    found = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def posted_requests(metrics_port: int) -> float:
    """The daemon's kvxfer_ucx_posted_requests gauge."""
    return metric(metrics_port, "kvxfer_ucx_posted_requests")


def rpcs_ok(method: str) -> str:
    """The kvxfer_rpcs sample counting ``method`` calls that returned OK."""
    return f'kvxfer_rpcs_total{{code="OK",method="{method}"}}'


def spawn_with_metrics(spawn, name: str, pool: str):
    """A daemon serving Prometheus metrics, and the port they are on (it picks the port)."""
    daemon = spawn(name, [pool], metrics=True)
    return daemon, daemon.metrics_port


def test_only_a_verified_push_costs_a_commit_round_trip(spawn) -> None:
    dec, port = spawn_with_metrics(spawn, "decode-rpcs", SMALL)
    pre = spawn("prefill-rpcs", [SMALL])
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
            p.attach("kv") as src, d.attach("kv") as dst:
        fill_random(src, 3)
        for verify in (False, True):
            tid = f"commit-{verify}"
            src_runs, dst_runs = PageRuns.of([(1, 3)]), PageRuns.of([(60, 2), (9, 1)])
            before = dst.raw.clone()
            expected = d.expect(tid, "kv", dst_runs, timeout_s=30)
            p.push(tid, "kv", src_runs, peer=dec.peer_address, timeout_s=30, verify=verify,
                   capability=expected.capability)
            sent, got = p.wait(tid), d.wait(tid)
            assert sent.ok and got.ok, (sent.error, got.error)
            assert got.verified is verify and sent.verified is verify
            assert_moved(src, dst, src_runs, dst_runs, before)
        assert metric(port, rpcs_ok("Claim")) == 2
        assert metric(port, rpcs_ok("Commit")) == 1


def test_a_pull_over_a_session_the_sender_holds_costs_one_round_trip(spawn) -> None:
    dec, port = spawn_with_metrics(spawn, "decode-placed", SMALL)
    pre = spawn("prefill-placed", [SMALL])
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
            p.attach("kv") as src, d.attach("kv") as dst:
        fill_random(src, 5)
        cases = [("first", False, [(1, 3)], [(60, 2), (9, 1)]),  # opens the session: claims
                 ("placed", False, [(4, 2), (20, 1)], [(30, 3)]),
                 ("placed-verified", True, [(7, 1), (2, 2)], [(40, 1), (50, 2)])]
        for tid, verify, src_pages, dst_pages in cases:
            src_runs, dst_runs = PageRuns.of(src_pages), PageRuns.of(dst_pages)
            before = dst.raw.clone()
            offered = p.offer(tid, "kv", src_runs, timeout_s=30, verify=verify)
            d.pull(tid, pre.peer_address, "kv", dst_runs, timeout_s=30,
                   capability=offered.capability)
            sent, got = p.wait(tid), d.wait(tid)
            assert sent.ok and got.ok, (sent.error, got.error)
            assert got.verified is verify
            assert_moved(src, dst, src_runs, dst_runs, before)
        assert metric(port, rpcs_ok("Claim")) == 1  # the first pull's alone
        assert metric(port, rpcs_ok("Commit")) == 1  # the verified one's


def test_a_handshake_without_a_watch_stream_is_dropped_and_a_watched_one_kept(spawn, peer_channel) -> None:
    dec, port = spawn_with_metrics(spawn, "decode-sessions", SMALL)
    pre = spawn("prefill-sessions", [SMALL])
    sessions = "kvxfer_inbound_sessions"
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d, \
            peer_channel(dec.peer_address) as channel:
        runs = PageRuns.of([(0, 1)])
        expected = d.expect("watched-1", "kv", runs, timeout_s=20)
        p.push("watched-1", "kv", runs, peer=dec.peer_address, timeout_s=20, capability=expected.capability)
        assert p.wait("watched-1").ok and d.wait("watched-1").ok
        peer = pb_grpc.KvxferPeerStub(channel)
        peer.Handshake(pb.HandshakeRequest(protocol_version=1, session_id="never-watched", ucx_host="127.0.0.1",
                                           ucx_port=1, ucx_error_handling=True,
                                           peer_address="127.0.0.1:1"), timeout=10)
        assert metric(port, sessions) == 2
        # The silence limit is 3 heartbeats + 1 s = 4 s with the default 1 s heartbeat.
        deadline = time.monotonic() + 15
        while metric(port, sessions) > 1:
            assert time.monotonic() < deadline, "the unwatched session was never dropped"
            time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as refused:
            peer.Claim(pb.ClaimRequest(transfer_id="x", session_id="never-watched", src_pool="kv",
                                       src_runs=[pb.PageRun(start=0, count=1)]), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "unknown; handshake first" in refused.value.details()
        with pytest.raises(grpc.RpcError) as late:
            next(peer.Watch(iter([pb.WatchRequest(session_id="never-watched")]), timeout=10))
        assert late.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "without a Watch stream" in late.value.details()
        expected = d.expect("watched-2", "kv", runs, timeout_s=20)
        p.push("watched-2", "kv", runs, peer=dec.peer_address, timeout_s=20, capability=expected.capability)
        assert p.wait("watched-2").ok and d.wait("watched-2").ok
        assert metric(port, sessions) == 1
        assert metric(port, rpcs_ok("Handshake")) == 2  # the prefill daemon's session outlived the limit


def test_a_failed_transfer_leaves_no_receive_posted(spawn) -> None:
    dec, port = spawn_with_metrics(spawn, "decode-metrics", STANDARD)
    doomed = spawn("doomed-sender-2", [STANDARD])
    with KvxferClient(dec.worker_address) as d, KvxferClient(doomed.worker_address) as s:
        expected = d.expect("cut", "kv", PageRuns.of([(0, 512)]), timeout_s=60)
        s.push("cut", "kv", PageRuns.of([(0, 512)]), peer=dec.peer_address, timeout_s=60,
               capability=expected.capability)
        # The receives are posted by the UCX thread shortly after the claim: watch the
        # gauge (not just the state) until they show, while the transfer still runs.
        deadline = time.monotonic() + 20
        posted_while_running = 0.0
        while posted_while_running == 0 and not d.transfers()[-1].state.final:
            assert time.monotonic() < deadline
            time.sleep(0.005)
            posted_while_running = posted_requests(port)
        doomed.kill()
        got = d.wait("cut", timeout_s=30)
        if got.ok:
            pytest.skip("the transfer completed before the kill landed")
        assert got.error_code == "UNAVAILABLE"
        assert posted_while_running > 0
        deadline = time.monotonic() + 5
        while posted_requests(port) > 0:
            assert time.monotonic() < deadline, f"{posted_requests(port)} receives still posted"
            time.sleep(0.05)
