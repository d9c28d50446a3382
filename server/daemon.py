"""``kvxfer serve``: wire the pools, the UCX engine and both gRPC servers, then run.

One ``serve()`` builds everything, reports SERVING once the pools are
allocated, waits for SIGTERM/SIGINT, and shuts down in order: NOT_SERVING,
refuse new transfers, let running ones finish within the grace period, stop the
servers, close UCX, release the memory (shared-memory files are unlinked).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvxfer.lanes import UcxLanes
from kvxfer.server.config import DaemonConfig
from kvxfer.server.pools import PoolRegistry
from kvxfer.server.service import PeerService, WorkerService
from kvxfer.server.transfers import TransferManager
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc

log = logging.getLogger("kvxfer.server")

WORKER_SERVICE = pb.DESCRIPTOR.services_by_name["Kvxfer"].full_name
PEER_SERVICE = pb.DESCRIPTOR.services_by_name["KvxferPeer"].full_name
SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.max_receive_message_length", 64 << 20),
]


def _unix_path(address: str) -> Path | None:
    if address.startswith("unix://"):
        return Path(address[len("unix://"):])
    if address.startswith("unix:"):
        return Path(address[len("unix:"):])
    return None


def _add_health_and_reflection(server: grpc.aio.Server, service: str) -> health.aio.HealthServicer:
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = (service, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    return servicer


async def _set_health(servicers: list[health.aio.HealthServicer], serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for servicer in servicers:
        for name in ("", WORKER_SERVICE, PEER_SERVICE):
            await servicer.set(name, status)


async def serve(config: DaemonConfig, ready_file: str | None = None) -> None:
    """Run a daemon until SIGTERM/SIGINT."""
    worker_server = grpc.aio.server(options=SERVER_OPTIONS)
    peer_server = grpc.aio.server(options=SERVER_OPTIONS)
    healths = [_add_health_and_reflection(worker_server, WORKER_SERVICE),
               _add_health_and_reflection(peer_server, PEER_SERVICE)]
    await _set_health(healths, serving=False)

    socket_path = _unix_path(config.worker_address)
    if socket_path is not None:
        socket_path.parent.mkdir(parents=True, exist_ok=True)
        socket_path.unlink(missing_ok=True)
    worker_port = worker_server.add_insecure_port(config.worker_address)
    peer_port = peer_server.add_insecure_port(config.peer_address)
    if not peer_port:
        raise OSError(f"cannot bind the peer address {config.peer_address}")
    peer_host = config.peer_address.rsplit(":", 1)[0]
    advertise = config.advertise_address or f"{peer_host}:{peer_port}"
    worker_address = config.worker_address
    if socket_path is None:
        worker_address = f"{config.worker_address.rsplit(':', 1)[0]}:{worker_port}"

    pools = PoolRegistry(config.arenas, config.shm_dir)
    engine = None
    try:
        engine = UcxLanes(config.ucx_lanes, host=config.ucx_host, port=config.ucx_port,
                          error_handling=config.ucx_error_handling)
        transfers = TransferManager(
            pools, engine, peer_address=advertise, chunk_bytes=config.chunk_bytes,
            window_bytes=config.window_bytes, heartbeat_s=config.heartbeat_s,
            default_timeout_s=config.default_timeout_s, retain=config.retain_transfers,
            error_handling=config.ucx_error_handling,
        )
        pb_grpc.add_KvxferServicer_to_server(WorkerService(pools, transfers), worker_server)
        pb_grpc.add_KvxferPeerServicer_to_server(PeerService(transfers, config.heartbeat_s),
                                                 peer_server)
        await worker_server.start()
        await peer_server.start()
        if socket_path is not None:
            os.chmod(socket_path, 0o600)
        if config.metrics_port:
            from prometheus_client import start_http_server

            start_http_server(config.metrics_port, addr="127.0.0.1")
        await _set_health(healths, serving=True)
        log.info("serving pools %s: workers at %s, peers at %s, UCX at %s ports %s",
                 config.pool_names, worker_address, advertise, engine.host, engine.ports)
        if ready_file:
            Path(ready_file).write_text(json.dumps({
                "pid": os.getpid(), "worker_address": worker_address,
                "peer_address": advertise, "ucx_port": engine.ports[0],
                "ucx_ports": engine.ports,
            }))

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("shutting down (grace %.1fs)", config.grace_s)
        await _set_health(healths, serving=False)
        await transfers.shutdown(config.grace_s)
        await asyncio.gather(worker_server.stop(config.grace_s), peer_server.stop(config.grace_s))
    finally:
        if engine is not None:
            engine.close()
        pools.close()
        if socket_path is not None:
            socket_path.unlink(missing_ok=True)
    log.info("stopped")


def run(config: DaemonConfig, ready_file: str | None = None) -> int:
    """Entry point for ``kvxfer serve``: run the daemon, return the exit code."""
    # The UCX thread busy-polls while requests are in flight, holding the GIL between
    # polls; with the default 5 ms switch interval the asyncio thread (gRPC replies,
    # Claim/Commit) waited up to 2.2 ms at p99 for it here, 0.24 ms at 0.2 ms.
    sys.setswitchinterval(0.0002)
    asyncio.run(serve(config, ready_file))
    return 0
