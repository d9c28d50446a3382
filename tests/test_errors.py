"""Errors keep their type across every boundary: the wire codec, a daemon's gRPC boundary, a
``TransferStatus``; and a daemon's own bug is INTERNAL, never blamed on the caller."""

from __future__ import annotations

import re
import time

import grpc
import pytest
from fake_transport import FakeNetwork
from grpc_health.v1 import health_pb2
from inprocess import DaemonThread

import kvxfer.errors as errors
from kvxfer.client import KvxferClient
from kvxfer.errors import ERROR_TYPES, InternalError, KvxferError
from kvxfer.pages import PageRuns
from kvxfer.server.transfers.coordinator import TransferCoordinator
from kvxfer.status import DataPlane, TransferRole, TransferState
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.wire.status import from_status, grpc_code, to_status

ALL = sorted(ERROR_TYPES.values(), key=lambda cls: cls.__name__)


def subclasses(cls: type) -> set[type]:
    return {sub for direct in cls.__subclasses__() for sub in {direct} | subclasses(direct)}


def test_every_error_type_has_a_reason_and_a_real_code() -> None:
    declared = {cls for cls in vars(errors).values()
                if isinstance(cls, type) and issubclass(cls, KvxferError) and cls is not KvxferError}
    assert declared == subclasses(KvxferError) == set(ERROR_TYPES.values())
    assert len({cls.reason for cls in ALL}) == len(ALL)
    for cls in ALL:
        assert grpc_code(cls("x")) in grpc.StatusCode


@pytest.mark.parametrize("error_type", ALL, ids=lambda cls: cls.__name__)
def test_the_wire_codec_keeps_type_and_message(error_type: type[KvxferError]) -> None:
    back = from_status(to_status(error_type("what went wrong")))
    assert type(back) is error_type and str(back) == "what went wrong"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    """An in-process daemon with real gRPC servers, and a client of its worker API."""
    thread = DaemonThread(tmp_path_factory.mktemp("errors"), "d", FakeNetwork())
    with thread as side, KvxferClient(side.bound.worker_address) as client:
        yield thread, side, client


@pytest.mark.parametrize("error_type", ALL, ids=lambda cls: cls.__name__)
def test_an_error_raised_in_the_daemon_reaches_the_client_as_itself(
        daemon, monkeypatch: pytest.MonkeyPatch, error_type: type[KvxferError]) -> None:
    _, _, client = daemon

    def fail(self: TransferCoordinator) -> list:
        raise error_type(f"{error_type.__name__} raised in the daemon")

    monkeypatch.setattr(TransferCoordinator, "all", fail)
    with pytest.raises(KvxferError) as raised:
        client.transfers()
    assert type(raised.value) is error_type
    assert str(raised.value) == f"{error_type.__name__} raised in the daemon"


@pytest.mark.parametrize("error_type", ALL, ids=lambda cls: cls.__name__)
def test_the_error_that_ended_a_transfer_reaches_the_client_as_itself(
        daemon, error_type: type[KvxferError]) -> None:
    thread, side, client = daemon
    tid = f"ended-by-{error_type.__name__}"
    client.expect(tid, "kv", PageRuns.of([(0, 1)]), timeout_s=30)

    async def end() -> None:
        side.transfers.registry.finish(side.transfers.registry.get(tid), error_type("why it ended"))

    thread.call(end())
    info = client.wait(tid, timeout_s=5)
    assert type(info.failure) is error_type and str(info.failure) == "why it ended"
    assert info.error_code == error_type.code and info.state.final


def test_a_bug_in_the_daemon_is_internal_and_the_daemon_keeps_serving(
        daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, client = daemon

    def bug(self: TransferCoordinator) -> list:
        raise ValueError("an index computed wrong")

    monkeypatch.setattr(TransferCoordinator, "all", bug)
    with pytest.raises(InternalError, match="internal error in ListTransfers: ValueError: an index"):
        client.transfers()
    monkeypatch.undo()
    assert client.health() == "SERVING" and isinstance(client.transfers(), list)


def test_roles_and_states_are_the_proto_enums() -> None:
    for enum, proto in ((TransferRole, pb.TransferRole), (TransferState, pb.TransferState),
                        (DataPlane, pb.DataPlane)):
        prefix = re.sub(r"(?<!^)([A-Z])", r"_\1", proto.DESCRIPTOR.name).upper() + "_"
        named = {name.removeprefix(prefix): value for name, value in proto.items() if value}
        assert {m.name: m.value for m in enum} == named


def test_a_handler_that_aborts_with_its_own_status_keeps_it(daemon, caplog: pytest.LogCaptureFixture) -> None:
    """The standard health service aborts with NOT_FOUND for a service it does not know: no
    kvxfer error, and no bug either."""
    _, side, client = daemon
    with grpc.insecure_channel(client.address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                    request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                    response_deserializer=health_pb2.HealthCheckResponse.FromString)
        with pytest.raises(grpc.RpcError) as raised:
            check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    # The call is counted once the daemon finished handling it, error mapping included.
    metrics = side.daemon.metrics.registry
    deadline = time.monotonic() + 5
    while not metrics.get_sample_value("kvxfer_rpcs_total", {"method": "Check", "code": "NOT_FOUND"}):
        assert time.monotonic() < deadline, "the health check was never counted"
        time.sleep(0.01)
    assert "failed unexpectedly" not in caplog.text
