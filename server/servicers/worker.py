"""The worker API (``kvxfer.v1.Kvxfer``): pools, descriptors, attach handles, transfer verbs."""

from __future__ import annotations

from typing import Any

import grpc

from kvxfer.server.pools import Pool, PoolRegistry
from kvxfer.server.transfers.coordinator import TransferCoordinator
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from kvxfer.wire.codec import (
    descriptor_to_proto,
    extents_to_proto,
    info_to_proto,
    memory_to_proto,
    runs_from_proto,
)

Context = grpc.aio.ServicerContext[Any, Any]


def _pool_info(pool: Pool) -> pb.PoolInfo:
    return pb.PoolInfo(descriptor=descriptor_to_proto(pool.descriptor),
                       memory=memory_to_proto(pool.arena.handle))


class WorkerService(pb_grpc.KvxferServicer):
    """The API inference workers on this node call (see protos/kvxfer/v1/kvxfer.proto)."""

    def __init__(self, pools: PoolRegistry, transfers: TransferCoordinator) -> None:
        self._pools = pools
        self._transfers = transfers

    async def ListPools(self, request: pb.ListPoolsRequest, context: Context) -> pb.ListPoolsResponse:
        return pb.ListPoolsResponse(pools=[_pool_info(p) for p in self._pools.all()])

    async def DescribePool(self, request: pb.DescribePoolRequest, context: Context) -> pb.PoolInfo:
        return _pool_info(self._pools.get(request.pool))

    async def DescribePages(self, request: pb.DescribePagesRequest,
                            context: Context) -> pb.DescribePagesResponse:
        pool = self._pools.get(request.pool)
        extents = pool.extents(runs_from_proto(request.runs))
        return pb.DescribePagesResponse(page_bytes=pool.descriptor.page_bytes,
                                        extents=extents_to_proto(extents))

    async def Expect(self, request: pb.ExpectRequest, context: Context) -> pb.TransferStatus:
        t = self._transfers.expect(request.transfer_id, request.pool,
                                   runs_from_proto(request.dst_runs), request.timeout_s)
        return info_to_proto(t.info())

    async def Push(self, request: pb.PushRequest, context: Context) -> pb.TransferStatus:
        t = self._transfers.push(request.transfer_id, request.pool,
                                 runs_from_proto(request.src_runs), request.peer,
                                 request.timeout_s, request.verify)
        return info_to_proto(t.info())

    async def Offer(self, request: pb.OfferRequest, context: Context) -> pb.TransferStatus:
        t = self._transfers.offer(request.transfer_id, request.pool,
                                  runs_from_proto(request.src_runs), request.timeout_s,
                                  request.verify)
        return info_to_proto(t.info())

    async def Pull(self, request: pb.PullRequest, context: Context) -> pb.TransferStatus:
        t = self._transfers.pull(request.transfer_id, request.peer, request.pool,
                                 runs_from_proto(request.dst_runs), request.timeout_s)
        return info_to_proto(t.info())

    async def Wait(self, request: pb.WaitRequest, context: Context) -> pb.TransferStatus:
        t = await self._transfers.wait(request.transfer_id, request.timeout_s)
        return info_to_proto(t.info())

    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.TransferStatus:
        t = self._transfers.abort(request.transfer_id, request.reason)
        return info_to_proto(t.info())

    async def ListTransfers(self, request: pb.ListTransfersRequest,
                            context: Context) -> pb.ListTransfersResponse:
        return pb.ListTransfersResponse(transfers=[info_to_proto(i) for i in self._transfers.all()])
