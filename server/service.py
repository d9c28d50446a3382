"""The gRPC servicers: thin translations between messages and the pool/transfer logic."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from kvxfer.errors import KvxferError
from kvxfer.server.errors import grpc_code, rpc
from kvxfer.server.pools import Pool, PoolRegistry
from kvxfer.server.transfers import TransferManager
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from kvxfer.wire import extents_to_proto, runs_from_proto

Ctx = grpc.aio.ServicerContext

def _pool_info(pool: Pool) -> pb.PoolInfo:
    return pb.PoolInfo(descriptor=pool.descriptor.to_proto(), memory=pool.arena.handle)


class WorkerService(pb_grpc.KvxferServicer):
    """The API inference workers on this node call (see protos/kvxfer/v1/kvxfer.proto)."""

    def __init__(self, pools: PoolRegistry, transfers: TransferManager) -> None:
        self._pools = pools
        self._transfers = transfers

    @rpc
    async def ListPools(self, request: pb.ListPoolsRequest, context: Ctx) -> pb.ListPoolsResponse:
        return pb.ListPoolsResponse(pools=[_pool_info(p) for p in self._pools.all()])

    @rpc
    async def DescribePool(self, request: pb.DescribePoolRequest, context: Ctx) -> pb.PoolInfo:
        return _pool_info(self._pools.get(request.pool))

    @rpc
    async def DescribePages(self, request: pb.DescribePagesRequest, context: Ctx) -> pb.DescribePagesResponse:
        pool = self._pools.get(request.pool)
        extents = pool.extents(runs_from_proto(request.runs))
        return pb.DescribePagesResponse(page_bytes=pool.descriptor.page_bytes,
                                        extents=extents_to_proto(extents))

    @rpc
    async def Expect(self, request: pb.ExpectRequest, context: Ctx) -> pb.TransferStatus:
        t = await self._transfers.expect(request.transfer_id, request.pool,
                                         runs_from_proto(request.dst_runs), request.timeout_s)
        return t.status()

    @rpc
    async def Push(self, request: pb.PushRequest, context: Ctx) -> pb.TransferStatus:
        t = await self._transfers.push(request.transfer_id, request.pool,
                                       runs_from_proto(request.src_runs), request.peer,
                                       request.timeout_s, request.verify)
        return t.status()

    @rpc
    async def Offer(self, request: pb.OfferRequest, context: Ctx) -> pb.TransferStatus:
        t = await self._transfers.offer(request.transfer_id, request.pool,
                                        runs_from_proto(request.src_runs), request.timeout_s,
                                        request.verify)
        return t.status()

    @rpc
    async def Pull(self, request: pb.PullRequest, context: Ctx) -> pb.TransferStatus:
        t = await self._transfers.pull(request.transfer_id, request.peer, request.pool,
                                       runs_from_proto(request.dst_runs), request.timeout_s)
        return t.status()

    @rpc
    async def Wait(self, request: pb.WaitRequest, context: Ctx) -> pb.TransferStatus:
        t = await self._transfers.wait(request.transfer_id, request.timeout_s)
        return t.status()

    @rpc
    async def Abort(self, request: pb.AbortRequest, context: Ctx) -> pb.TransferStatus:
        t = await self._transfers.abort(request.transfer_id, request.reason)
        return t.status()

    @rpc
    async def ListTransfers(self, request: pb.ListTransfersRequest, context: Ctx) -> pb.ListTransfersResponse:
        return pb.ListTransfersResponse(transfers=[t.status() for t in self._transfers.all()])


class PeerService(pb_grpc.KvxferPeerServicer):
    """The API other kvxfer daemons call: sessions, liveness, and the transfer rendezvous."""

    def __init__(self, transfers: TransferManager, heartbeat_s: float) -> None:
        self._transfers = transfers
        self._heartbeat_s = heartbeat_s

    @rpc
    async def Handshake(self, request: pb.HandshakeRequest, context: Ctx) -> pb.HandshakeResponse:
        return self._transfers.handshake(request)

    async def Watch(self, request: pb.WatchRequest, context: Ctx) -> AsyncIterator[pb.Heartbeat]:
        try:
            self._transfers.inbound_session_watched(request.session_id)
        except KvxferError as exc:
            await context.abort(grpc_code(exc), str(exc))
        try:
            while True:
                yield pb.Heartbeat(unix_time=time.time())
                await asyncio.sleep(self._heartbeat_s)
        finally:
            self._transfers.inbound_session_ended(request.session_id)

    @rpc
    async def Claim(self, request: pb.ClaimRequest, context: Ctx) -> pb.ClaimResponse:
        return await self._transfers.claim(request)

    @rpc
    async def Commit(self, request: pb.CommitRequest, context: Ctx) -> pb.TransferStatus:
        return await self._transfers.commit(request)

    @rpc
    async def RequestPush(self, request: pb.RequestPushRequest, context: Ctx) -> pb.RequestPushResponse:
        await self._transfers.request_push(request)
        return pb.RequestPushResponse()

    @rpc
    async def AbortTransfer(self, request: pb.AbortTransferRequest, context: Ctx) -> pb.AbortTransferResponse:
        self._transfers.abort_from_peer(request)
        return pb.AbortTransferResponse()
