"""Same-host transfers (``--local-copy``): the receiving daemon maps the sending daemon's
arena read-only and copies the pages itself; the transfer still ends only with the
sender's Commit."""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from daemon_pairs import attached_pair
from peer_calls import beats
from pool_checks import assert_moved, fill_random

from kvxfer.client import KvxferClient
from kvxfer.client.handoff import hand_off
from kvxfer.errors import IntegrityError
from kvxfer.local_copy import SIZE_CHECK_BYTES, ArenaFile, boot_id, copy_chunks, map_peer_arena
from kvxfer.memory import SHM_PREFIX, create_arena
from kvxfer.pages import Extent, PageRuns
from kvxfer.status import DataPlane, TransferState
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from kvxfer.wire.codec import descriptor_to_proto, info_from_proto

SMALL = "name=kv,preset=llama8b,num_pages=64"  # 2 MiB pages
LOCAL = ["--local-copy"]


@pytest.fixture(scope="module")
def local_pair(tmp_path_factory, dev_ca):
    """A prefill and a decode daemon on this host, both with local copy on, over mutual TLS."""
    with attached_pair(tmp_path_factory.mktemp("local"), dev_ca, SMALL, LOCAL, seed=3) as pair:
        yield pair


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("verify", [False, True])
def test_same_host_daemons_copy_without_ucx_byte_exact(local_pair, mode: str, verify: bool) -> None:
    pre, dec, p, d, src, dst = local_pair
    src_runs, dst_runs = PageRuns.of([(0, 5), (9, 11)]), PageRuns.of([(40, 3), (20, 13)])
    before = dst.raw.clone()
    done = hand_off(p, d, f"local-{mode}-{verify}", pool="kv", src=src_runs, dst=dst_runs,
                    decode_peer=dec.peer_address, prefill_peer=pre.peer_address, mode=mode,  # type: ignore[arg-type]
                    verify=verify, timeout_s=30)
    assert done.ok, (done.sent.error, done.received.error)
    assert done.sent.lanes == done.received.lanes == 0  # no UCX lane carried it: it was copied
    assert done.received.verified is verify and done.received.bytes == 16 * 2**21
    assert_moved(src, dst, src_runs, dst_runs, before)


def test_a_peer_without_local_copy_is_sent_to_over_ucx(local_pair, spawn) -> None:
    pre, dec, p, d, src, dst = local_pair
    plain = spawn("plain", [SMALL])
    with KvxferClient(plain.worker_address) as o, o.attach("kv") as odst:
        before = odst.raw.clone()
        done = hand_off(p, o, "to-plain", pool="kv", src=PageRuns.of([(1, 4)]),
                        dst=PageRuns.of([(10, 4)]), decode_peer=plain.peer_address, timeout_s=30)
        assert done.ok, (done.sent.error, done.received.error)
        assert done.sent.lanes == done.received.lanes == 1
        assert_moved(src, odst, PageRuns.of([(1, 4)]), PageRuns.of([(10, 4)]), before)


def test_status_shows_each_sessions_data_plane(local_pair, spawn) -> None:
    """The prefill daemon sends to a same-host peer with local copy on (copied) and to one
    without (UCX): ``ListPeers`` and ``kvxfer status`` name each session's data plane on
    both sides."""
    pre, dec, p, d, src, dst = local_pair
    plain = spawn("plain-status", [SMALL])
    with KvxferClient(plain.worker_address) as o:
        for client, daemon, tid in ((d, dec, "status-local"), (o, plain, "status-ucx")):
            done = hand_off(p, client, tid, pool="kv", src=PageRuns.of([(1, 2)]),
                            dst=PageRuns.of([(30, 2)]), decode_peer=daemon.peer_address, timeout_s=30)
            assert done.ok, (done.sent.error, done.received.error)
        outbound = {(s.peer_address, s.data_plane, s.lanes) for s in p.peers() if s.outbound}
        assert outbound == {(dec.peer_address, DataPlane.LOCAL_COPY, 0),
                            (plain.peer_address, DataPlane.UCX_TAGGED, 1)}
        [copied] = d.peers()
        [sent] = o.peers()
        assert (copied.outbound, copied.data_plane, copied.identity) == (False, DataPlane.LOCAL_COPY, "prefill")
        assert (sent.outbound, sent.data_plane, sent.lanes) == (False, DataPlane.UCX_TAGGED, 1)
        assert copied.peer_address == sent.peer_address == pre.peer_address
    out = subprocess.run([sys.executable, "-m", "kvxfer.client.cli", "status", "--address",
                          pre.worker_address, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["peer_address"] == pre.peer_address and len(status["epoch"]) == 32
    assert {(row["peer"], row["direction"], row["data_plane"]) for row in status["peers"]} == {
        (dec.peer_address, "outbound", "local-copy"), (plain.peer_address, "outbound", "ucx-tagged")}


def _open_files(pid: int | str) -> dict[str, int]:
    """The files process ``pid`` has open, with one descriptor of each."""
    files = {}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            files[os.readlink(fd)] = int(fd.name)
    return files


def _peer_arenas_open(pid: int, own: str) -> list[str]:
    """The kvxfer arena files in ``own``'s directory (other than ``own``) that process ``pid``
    has open or mapped: the peer arenas it holds."""
    prefix = os.path.join(os.path.dirname(own), SHM_PREFIX)
    held = set(_open_files(pid))
    held |= {line.split(None, 5)[5] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
             if len(line.split(None, 5)) == 6}
    return sorted(f for f in held if f.startswith(prefix) and own not in f)


def test_a_senders_pool_is_unmapped_and_closed_when_its_session_ends(spawn) -> None:
    """The receiver maps each sender's pool for the session only: once the sender is gone
    (stopped or killed) nothing keeps its unlinked file, and its memory, alive."""
    dec = spawn("unmap-d", [SMALL], extra_args=[*LOCAL, "--heartbeat-s", "0.5"])
    with KvxferClient(dec.worker_address) as d:
        own = d.describe("kv")[1].shm.path
        for how in ("stopped", "killed"):
            pre = spawn(f"unmap-{how[0]}", [SMALL], extra_args=[*LOCAL, "--heartbeat-s", "0.5"])
            with KvxferClient(pre.worker_address) as p:
                done = hand_off(p, d, f"unmap-{how}", pool="kv", src=PageRuns.of([(0, 2)]),
                                dst=PageRuns.of([(0, 2)]), decode_peer=dec.peer_address)
                assert done.ok and done.received.lanes == 0
                assert len(_peer_arenas_open(dec.pid, own)) == 1
            pre.stop() if how == "stopped" else pre.kill()
            deadline = time.monotonic() + 10  # the session ends within the liveness limit
            while _peer_arenas_open(dec.pid, own) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _peer_arenas_open(dec.pid, own) == [], how


class _FileSender:
    """A hand-driven sender whose "arena" is a file this test wrote: it describes the file
    in its handshake, claims, and commits only when told to."""

    def __init__(self, dec, channel, descriptor: pb.PoolDescriptor, path: Path) -> None:
        self.stub = pb_grpc.KvxferPeerStub(channel)
        self.descriptor = descriptor
        self.session = "local-file-sender"
        info = path.stat()
        self._stop = threading.Event()
        hello = self.stub.Handshake(pb.HandshakeRequest(protocol_version=1,
            session_id=self.session, ucx_host="127.0.0.1", ucx_ports=[1], ucx_error_handling=True,
            pools=[descriptor], peer_address="127.0.0.1:1",
            arena_files=[pb.ArenaFile(pool="kv", path=str(path), size_bytes=info.st_size,
                                      boot_id=boot_id(), device=info.st_dev,
                                      inode=info.st_ino)]), timeout=10)
        assert hello.reads_locally
        self._watch = self.stub.Watch(beats(self.session, self._stop))

    def claim(self, tid: str, runs: PageRuns, capability: str) -> pb.ClaimResponse:
        return self.stub.Claim(pb.ClaimRequest(
            transfer_id=tid, session_id=self.session, src_pool="kv",
            src_runs=[pb.PageRun(start=s, count=c) for s, c in runs.pairs()],
            capability=capability), timeout=10)

    def commit(self, tid: str) -> pb.TransferStatus:
        return self.stub.Commit(pb.CommitRequest(transfer_id=tid, session_id=self.session),
                                timeout=10)

    def close(self) -> None:
        self._stop.set()
        self._watch.cancel()


def test_the_receiver_ends_only_with_the_senders_commit(spawn, peer_channel, tmp_path) -> None:
    """The copy is done when the claim is answered, but the transfer is not: only the
    sender knows its pages were still its transfer's all along, and says so by committing.
    Without the commit the transfer runs into its deadline, never DONE."""
    dec = spawn("decode-local", [SMALL], extra_args=LOCAL)
    with KvxferClient(dec.worker_address) as d, d.attach("kv") as dst:
        descriptor, memory = d.describe("kv")
        path = Path("/dev/shm") / f"test-file-sender-{os.getpid()}"  # not kvxfer-*: daemons sweep those
        noise = np.random.default_rng(7).integers(0, 256, memory.size_bytes, dtype=np.uint8)
        path.write_bytes(noise.tobytes())
        sender = _FileSender(dec, peer_channel(dec.peer_address), descriptor_to_proto(descriptor),
                             path)
        try:
            page = descriptor.page_bytes
            anchor = descriptor.layout.anchor_bytes
            expected = d.expect("committed", "kv", PageRuns.of([(30, 2)]), timeout_s=20)
            assert sender.claim("committed", PageRuns.of([(5, 2)]), expected.capability).copied
            time.sleep(0.3)
            assert d.transfers()[-1].state == TransferState.TRANSFERRING
            got = dst.raw[anchor + 30 * page: anchor + 32 * page]
            assert torch.equal(got, torch.from_numpy(noise[anchor + 5 * page: anchor + 7 * page]))
            assert info_from_proto(sender.commit("committed")).state == TransferState.DONE
            assert d.wait("committed", timeout_s=5).ok

            expected = d.expect("uncommitted", "kv", PageRuns.of([(40, 1)]), timeout_s=1.5)
            assert sender.claim("uncommitted", PageRuns.of([(1, 1)]), expected.capability).copied
            assert d.wait("uncommitted", timeout_s=10).state == TransferState.DEADLINE_EXCEEDED
        finally:
            sender.close()
            path.unlink()


def _open_read_only(path: Path) -> bool:
    """Whether this process has ``path`` open, and only for reading."""
    fd = _open_files("self").get(str(path))
    return fd is not None and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY


def test_only_the_file_the_peer_described_is_mapped_and_only_for_reading(tmp_path) -> None:
    path = tmp_path / "arena"
    path.write_bytes(bytes(range(256)) * 64)
    info = path.stat()
    real = ArenaFile(str(path), info.st_size, boot_id(), info.st_dev, info.st_ino)
    arena = map_peer_arena(real)
    assert arena is not None and _open_read_only(path)
    assert bytes(arena.bytes[254:258]) == b"\xfe\xff\x00\x01"
    with pytest.raises(ValueError, match="read-only"):
        arena.bytes[0] = 1
    del arena  # nothing refers to it: its file is closed
    assert not _open_read_only(path)
    other = tmp_path / "other"
    other.write_bytes(path.read_bytes())
    link = tmp_path / "link"
    link.symlink_to(path)
    for wrong in (ArenaFile(str(other), info.st_size, boot_id(), info.st_dev, info.st_ino),
                  ArenaFile(str(path), info.st_size, "another-host", info.st_dev, info.st_ino),
                  ArenaFile(str(path), info.st_size, "", info.st_dev, info.st_ino),
                  ArenaFile(str(path), info.st_size + mmap.PAGESIZE, boot_id(), info.st_dev,
                            info.st_ino),
                  ArenaFile(str(link), info.st_size, boot_id(), info.st_dev, info.st_ino),
                  ArenaFile(str(tmp_path / "missing"), info.st_size, boot_id(), info.st_dev,
                            info.st_ino)):
        assert map_peer_arena(wrong) is None, wrong
    assert not _open_read_only(path) and not _open_read_only(other)


def test_a_file_shortened_during_a_copy_is_not_read_past_its_end(tmp_path) -> None:
    """Reading a mapping past its file's end would kill the process (SIGBUS): a copy checks
    the size again every SIZE_CHECK_BYTES, and its error names the file and both sizes.
    The file is cut to half between the copy's first and second chunk (from ``stop``)."""
    size = 4 * SIZE_CHECK_BYTES
    path = tmp_path / "arena"
    path.write_bytes(b"\x07" * size)
    info = path.stat()
    src = map_peer_arena(ArenaFile(str(path), size, boot_id(), info.st_dev, info.st_ino))
    assert src is not None
    dst = create_arena("short-dst", size, "cpu")
    try:
        chunks = [Extent(i * SIZE_CHECK_BYTES, i * SIZE_CHECK_BYTES, SIZE_CHECK_BYTES)
                  for i in range(4)]
        checks = []

        def cut_after_the_first_chunk() -> bool:
            checks.append(1)
            if len(checks) == 2:
                os.truncate(path, size // 2 - 1)  # chunk 2 now reaches past the end
            return False

        with pytest.raises(IntegrityError, match=rf"arena is {size // 2 - 1} bytes now, "
                                                 rf"shorter than the {size}"):
            copy_chunks(src, dst, chunks, cut_after_the_first_chunk)
        assert len(checks) == 2 and (dst.raw[:SIZE_CHECK_BYTES] == 7).all()
        assert (dst.raw[SIZE_CHECK_BYTES:] == 0).all()  # nothing after the check was copied
    finally:
        dst.close()


def test_a_senders_file_shortened_mid_session_fails_the_transfer_not_the_receiver(
        spawn, peer_channel) -> None:
    """Someone shortens a sending daemon's pool file after the handshake: the receiver's copy
    fails the transfer with DATA_LOSS and the receiver keeps serving (reading its mapping
    past the new end would have killed it with SIGBUS)."""
    dec = spawn("decode-short", [SMALL], extra_args=LOCAL)
    with KvxferClient(dec.worker_address) as d:
        descriptor, memory = d.describe("kv")
        path = Path("/dev/shm") / f"test-short-sender-{os.getpid()}"  # not kvxfer-*: daemons sweep those
        path.write_bytes(b"\x01" * memory.size_bytes)
        sender = _FileSender(dec, peer_channel(dec.peer_address), descriptor_to_proto(descriptor),
                             path)
        try:
            os.truncate(path, memory.size_bytes // 2)
            expected = d.expect("shortened", "kv", PageRuns.of([(60, 2)]), timeout_s=20)
            with pytest.raises(grpc.RpcError) as refused:  # past the new end
                sender.claim("shortened", PageRuns.of([(62, 2)]), expected.capability)
            assert refused.value.code() == grpc.StatusCode.DATA_LOSS
            assert str(path) in str(refused.value.details()), refused.value.details()
            got = d.wait("shortened", timeout_s=5)
            assert got.state == TransferState.FAILED and str(path) in got.error, got
            assert dec.process.poll() is None and d.health() == "SERVING"
        finally:
            sender.close()
            path.unlink()


BIG = "name=kv,preset=llama8b,num_pages=600"  # 1.2 GiB: a 1 GiB copy takes ~70 ms here
BIG_RUNS = PageRuns.of([(0, 512)])


def _when_copying(d: KvxferClient, tid: str) -> None:
    """Return once the receiver of ``tid`` is copying (TRANSFERRING), within 10 s."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if any(t.transfer_id == tid and t.state == TransferState.TRANSFERRING
               for t in d.transfers()):
            return
    raise AssertionError(f"{tid} never started copying")


@pytest.mark.slow  # three daemons with 1.2 GiB pools: ~10 s each
@pytest.mark.parametrize("fault", ["sender killed", "sender aborted", "receiver aborted"])
def test_a_copy_cut_short_never_ends_done_and_the_receiver_keeps_serving(spawn, fault: str) -> None:
    pre = spawn("bp", [BIG], extra_args=LOCAL)
    dec = spawn("bd", [BIG], extra_args=LOCAL)
    with KvxferClient(pre.worker_address) as p, KvxferClient(dec.worker_address) as d:
        assert hand_off(p, d, "warm-up", pool="kv", src=PageRuns.of([(0, 1)]),
                        dst=PageRuns.of([(0, 1)]), decode_peer=dec.peer_address).ok
        expected = d.expect("cut", "kv", BIG_RUNS, timeout_s=20)
        p.push("cut", "kv", BIG_RUNS, peer=dec.peer_address, timeout_s=20, capability=expected.capability)
        _when_copying(d, "cut")
        start = time.monotonic()
        if fault == "sender killed":
            pre.kill()
        elif fault == "sender aborted":
            p.abort("cut", "prefill gave up")
        else:
            d.abort("cut", "decode gave up")
        got = d.wait("cut", timeout_s=10)
        assert got.state != TransferState.DONE, got
        assert time.monotonic() - start < 5
        if fault == "sender killed":  # its pool is unmapped here, the failed copy included
            own = d.describe("kv")[1].shm.path
            deadline = time.monotonic() + 10
            while _peer_arenas_open(dec.pid, own) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _peer_arenas_open(dec.pid, own) == []
        else:
            assert got.state == TransferState.ABORTED and "gave up" in got.error
            assert p.wait("cut", timeout_s=5).state in (TransferState.ABORTED,
                                                        TransferState.FAILED)
        assert d.health() == "SERVING"
        other = spawn("bo", [SMALL], extra_args=LOCAL)  # same layout, fewer pages
        with KvxferClient(other.worker_address) as o, o.attach("kv") as osrc, \
                d.attach("kv") as dst:
            fill_random(osrc, 9)
            before = dst.raw.clone()
            done = hand_off(o, d, "after", pool="kv", src=PageRuns.of([(3, 4)]),
                            dst=PageRuns.of([(100, 4)]), decode_peer=dec.peer_address)
            assert done.ok and done.received.lanes == 0, (done.sent.error, done.received.error)
            assert_moved(osrc, dst, PageRuns.of([(3, 4)]), PageRuns.of([(100, 4)]), before)
