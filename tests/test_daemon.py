"""The daemon as a real subprocess: pools, descriptors, attach, health, shutdown, bad input."""

from __future__ import annotations

import grp
import json
import logging
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvxfer.client import KvxferClient
from kvxfer.descriptor import PoolDescriptor
from kvxfer.errors import (
    InvalidArgumentError,
    PageOutOfRangeError,
    PoolNotFoundError,
    StaleArenaError,
    TransferExistsError,
)
from kvxfer.layout import PoolLayout
from kvxfer.layout.kinds import PRESETS, spec_from_mapping
from kvxfer.pages import PageRuns
from kvxfer.ucx_settings import LOOPBACK_ENV

HERE = Path(__file__).resolve().parent
TINY = "name=kv,preset=tiny"

HYBRID_CONFIG = """
arenas:
  - name: hybrid
    pools:
      - {name: attn, preset: tiny, num_pages: 12}
      - {name: ssm, preset: mamba-small, num_slots: 6}
pools:
  - {name: latent, preset: mla-small, num_pages: 8}
"""


def all_views(views) -> list[torch.Tensor]:
    extra = [views.temporal] if views.temporal is not None else []
    return [*views.k, *views.v, *views.latent, *views.conv, *extra]


def test_health_is_serving_and_reflection_lists_the_services(spawn, peer_channel) -> None:
    d = spawn("a", [TINY])
    with KvxferClient(d.worker_address) as kv:
        assert kv.health() == "SERVING"
    with peer_channel(d.peer_address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert "kvxfer.v1.KvxferPeer" in names and "grpc.health.v1.Health" in names


def test_health_watch_streams_through_the_interceptors(spawn) -> None:
    d = spawn("a", [TINY])
    with grpc.insecure_channel(d.worker_address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=5)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


def test_descriptor_over_grpc_rebuilds_identical_views(spawn) -> None:
    d = spawn("a", [TINY])
    expected = PoolDescriptor("kv", PoolLayout(spec_from_mapping(PRESETS["tiny"])))
    with KvxferClient(d.worker_address) as kv:
        desc, memory = kv.describe("kv")
        assert desc == expected
        assert memory.device == "cpu" and memory.kind == "shm"
        with kv.attach("kv") as pool:
            local = expected.build_views(torch.zeros(pool.raw.numel(), dtype=torch.uint8))
            for a, b in zip(all_views(pool.views), all_views(local), strict=True):
                assert (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset())


def test_what_one_worker_writes_another_attach_reads(spawn) -> None:
    d = spawn("a", [TINY])
    out = subprocess.run([sys.executable, str(HERE / "worker_write.py"), d.worker_address, "kv", "7"],
                         capture_output=True, text=True, timeout=60, check=True)
    written = json.loads(out.stdout)
    with KvxferClient(d.worker_address) as kv, kv.attach("kv") as pool:
        read = [float(v.double().sum()) for v in all_views(pool.views)]
        torch.manual_seed(7)
        expected = [torch.randn(v.shape).to(v.dtype) for v in all_views(pool.views)]
        assert all(torch.equal(v, e) for v, e in zip(all_views(pool.views), expected))
    assert read == written


def test_hybrid_arena_shares_one_buffer(spawn, tmp_path: Path) -> None:
    config = tmp_path / "hybrid.yaml"
    config.write_text(HYBRID_CONFIG)
    d = spawn("a", [], extra_args=["--config", str(config)])
    with KvxferClient(d.worker_address) as kv:
        pools = {desc.name: (desc, mem) for desc, mem in kv.pools()}
        assert set(pools) == {"attn", "ssm", "latent"}
        (attn, attn_mem), (ssm, ssm_mem) = pools["attn"], pools["ssm"]
        assert attn_mem.shm.path == ssm_mem.shm.path
        assert ssm.layout.anchor_bytes >= attn.layout.end_bytes
        subprocess.run([sys.executable, str(HERE / "worker_write.py"), d.worker_address, "ssm", "3"],
                       capture_output=True, timeout=60, check=True)
        with kv.attach("attn") as a, kv.attach("ssm") as s:
            assert all(float(v.abs().sum()) == 0 for v in all_views(a.views))
            assert s.views.temporal is not None and float(s.views.temporal.abs().sum()) > 0


def test_sigterm_exits_zero_and_leaves_no_shared_memory(spawn) -> None:
    d = spawn("a", [TINY])
    with KvxferClient(d.worker_address) as kv:
        _, memory = kv.describe("kv")
    shm = Path(memory.shm.path)
    sock = Path(d.worker_address[len("unix://"):])
    assert shm.exists()
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(shm.stat().st_mode) == 0o600
    d.process.send_signal(signal.SIGTERM)  # not d.stop(): that would also sweep the file
    assert d.process.wait(20) == 0
    assert not shm.exists() and not sock.exists()


def _a_group_to_share_with() -> grp.struct_group | None:
    """A group other than our primary one that the daemon may give its files to."""
    usable = {g.gr_gid for g in grp.getgrall()} if os.geteuid() == 0 else set(os.getgroups())
    others = sorted(usable - {os.getgid()})
    return grp.getgrgid(others[0]) if others else None


def test_a_worker_group_gets_the_socket_and_the_pools(spawn) -> None:
    """Documented in docs/explanation/security.md: with --worker-group the socket and the
    shared memory are mode 0660 and that group's, so workers under other uids in it attach."""
    group = _a_group_to_share_with()
    if group is None:
        pytest.skip("this user belongs to no group but its primary one")
    d = spawn("a", [TINY], extra_args=["--worker-group", group.gr_name])
    with KvxferClient(d.worker_address) as kv:
        _, memory = kv.describe("kv")
    for path in (Path(memory.shm.path), Path(d.worker_address[len("unix://"):])):
        st = path.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, group.gr_gid), path


def test_an_unknown_worker_group_is_refused_in_one_line(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvxfer.client.cli", "serve", "--pool", TINY,
         "--worker-address", f"unix://{tmp_path}/s.sock", "--worker-group", "no-such-group-x"],
        capture_output=True, text=True, timeout=60, env={**os.environ, **LOOPBACK_ENV})
    assert out.returncode == 2
    assert "worker_group='no-such-group-x' is not a group on this machine" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr


def test_a_killed_daemons_shared_memory_is_removed_by_the_next_daemon(spawn, tmp_path: Path) -> None:
    # A directory of their own: another test's daemon starting in /dev/shm meanwhile would
    # sweep the killed daemon's file before daemon c could.
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    a = spawn("a", [TINY], shm_dir=str(shm_dir))
    with KvxferClient(a.worker_address) as kv:
        _, memory = kv.describe("kv")
    shm = Path(memory.shm.path)
    spawn("b", [TINY], shm_dir=str(shm_dir))
    assert shm.exists(), "a live daemon's arena must survive another daemon's start-up sweep"
    a.process.kill()
    a.process.wait(10)
    assert shm.exists()  # SIGKILL: the daemon had no chance to unlink it
    c = spawn("c", [TINY], shm_dir=str(shm_dir))
    assert not shm.exists()
    assert "left by a daemon that died" in c.log()


def test_a_daemon_killed_by_its_launcher_leaves_nothing_in_its_shm_dir(spawn, tmp_path: Path) -> None:
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    d = spawn("a", [TINY], shm_dir=str(shm_dir))
    with KvxferClient(d.worker_address) as kv:
        _, memory = kv.describe("kv")
    assert Path(memory.shm.path).parent == shm_dir
    d.kill()
    assert list(shm_dir.iterdir()) == []


def test_a_clients_verbs_name_its_mapping_so_a_restarted_daemon_refuses_them(spawn) -> None:
    """The library sends the epoch of its latest attach with every transfer verb: after a
    restart, an offer of pages written through the old mapping is refused (nothing of it is
    registered), and accepted once the client has attached again."""
    d = spawn("a", [TINY])
    with KvxferClient(d.worker_address) as kv:
        kv.attach("kv").detach()
        assert kv.offer("before", "kv", PageRuns.of([(0, 1)]), timeout_s=5).state.name == "WAITING"
        d.restart()
        with pytest.raises(StaleArenaError, match="restarted since"):
            kv.offer("stale", "kv", PageRuns.of([(0, 1)]), timeout_s=5)
        assert [t.transfer_id for t in kv.transfers()] == []
        kv.attach("kv").detach()
        assert kv.offer("again", "kv", PageRuns.of([(0, 1)]), timeout_s=5).state.name == "WAITING"


def test_sigint_also_shuts_down_cleanly(spawn) -> None:
    d = spawn("a", [TINY])
    d.process.send_signal(signal.SIGINT)
    assert d.process.wait(20) == 0


def test_bad_requests_get_clear_codes_and_the_daemon_keeps_serving(spawn) -> None:
    d = spawn("a", [TINY])
    with KvxferClient(d.worker_address) as kv:
        with pytest.raises(PoolNotFoundError, match=r"no pool named 'nope'.*\['kv'\]"):
            kv.describe("nope")
        with pytest.raises(PageOutOfRangeError, match="pages 0..63"):
            kv.describe_pages("kv", PageRuns.of([(60, 8)]))
        with pytest.raises(InvalidArgumentError, match="overlap"):
            kv.expect("t1", "kv", PageRuns.of([(0, 4), (2, 1)]))
        kv.expect("t2", "kv", PageRuns.of([(0, 1)]), timeout_s=30)
        with pytest.raises(TransferExistsError, match="already WAITING"):
            kv.expect("t2", "kv", PageRuns.of([(1, 1)]))
        raw = grpc.insecure_channel(d.worker_address)
        from kvxfer.v1 import kvxfer_pb2 as pb
        from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc

        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.KvxferStub(raw).DescribePages(pb.DescribePagesRequest(pool="kv"), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "empty" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.KvxferStub(raw).Expect(pb.ExpectRequest(transfer_id="", pool="kv",
                                           dst_runs=[pb.PageRun(start=0, count=1)]), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        raw.close()
        assert kv.health() == "SERVING"
        assert [e.nbytes for e in kv.describe_pages("kv", PageRuns.of([(0, 2), (5, 1)]))] == [
            2 * kv.describe("kv")[0].page_bytes, kv.describe("kv")[0].page_bytes]


def test_a_bad_config_fails_fast_with_a_clear_message(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvxfer.client.cli", "serve", "--pool", "name=kv,kind=mha,layer_num=0",
         "--worker-address", f"unix://{tmp_path}/s.sock", "--peer-address", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60, env={**os.environ, **LOOPBACK_ENV},
    )
    assert out.returncode == 2
    assert "missing fields" in out.stdout + out.stderr


def test_grpcs_error_for_an_answer_to_a_caller_that_left_becomes_one_info_line() -> None:
    """A handler that answers just after its caller's deadline makes gRPC core log an
    ERROR with a traceback (seen in the fuzz run); the daemon says it in one INFO line."""
    from kvxfer.server.daemon import _LATE_ANSWERS

    try:
        raise RuntimeError("Failed execute_batch")
    except RuntimeError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, "server.pyx", 1,
                               "ExecuteBatchError raised in core by servicer method [%s]",
                               ("/kvxfer.v1.KvxferPeer/Claim",), exc_info)
    assert _LATE_ANSWERS.filter(record)
    assert (record.levelname, record.exc_info) == ("INFO", None)
    assert record.getMessage() == "answer dropped: the caller of /kvxfer.v1.KvxferPeer/Claim went away"
    other = logging.LogRecord("grpc._cython.cygrpc", logging.ERROR, "x", 1, "something else", (), None)
    assert _LATE_ANSWERS.filter(other) and other.levelname == "ERROR"


def test_the_ready_file_appears_whole(tmp_path: Path) -> None:
    """A launcher polls for the ready file and reads it once it exists (CI once read it
    empty, mid-write): it is written beside and renamed over, never written in place."""
    from kvxfer.server.daemon import write_whole

    ready = tmp_path / "d.ready.json"
    ready.write_text("old")
    with open(ready) as reader_of_the_old_file:
        write_whole(ready, '{"worker_address": "unix:///x"}')
        assert reader_of_the_old_file.read() == "old"  # the old file was replaced, not rewritten
    assert json.loads(ready.read_text()) == {"worker_address": "unix:///x"}
    assert [p.name for p in tmp_path.iterdir()] == ["d.ready.json"]
