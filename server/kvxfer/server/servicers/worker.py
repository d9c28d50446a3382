"""The worker API (``kvxfer.v1.Kvxfer``): pools, descriptors, attach handles, page leases,
transfer verbs and completions. An abort leaves an audit line (``kvxfer.server.audit``)."""

from __future__ import annotations

from typing import Any

import grpc

from kvxfer.errors import InvalidArgumentError
from kvxfer.propagation import WORKER_NAME_KEY
from kvxfer.server.audit import audited
from kvxfer.server.leases import Lease, PageLeases
from kvxfer.server.pools import Pool, PoolRegistry
from kvxfer.server.sessions import Sessions
from kvxfer.server.transfers.coordinator import TransferCoordinator
from kvxfer.server.transfers.record import Transfer
from kvxfer.status import LeaseInfo
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from kvxfer.version import __version__
from kvxfer.wire.codec import (
    extents_to_proto,
    holds_from_proto,
    info_to_proto,
    lease_to_proto,
    lease_use_from_proto,
    part_from_proto,
    peer_session_to_proto,
    pool_info_to_proto,
    runs_from_proto,
)

Context = grpc.aio.ServicerContext[Any, Any]


class WorkerService(pb_grpc.KvxferServicer):
    """The API inference workers on this node call (see protos/kvxfer/v1/kvxfer.proto)."""

    def __init__(self, pools: PoolRegistry, transfers: TransferCoordinator,
                 sessions: Sessions) -> None:
        self._pools = pools
        self._transfers = transfers
        self._sessions = sessions
        self._leases: PageLeases = transfers.leases

    def _lease_to_proto(self, lease: Lease, *, granted: bool = False) -> pb.Lease:
        """A lease as its message; its capability only when ``granted`` (Allocate's answer)."""
        return lease_to_proto(LeaseInfo(lease.id, lease.pool, lease.runs, lease.expires_in(),
                                        lease.holder, self._pools.epoch,
                                        lease.capability if granted else ""))

    def _pool_info(self, pool: Pool) -> pb.PoolInfo:
        return pool_info_to_proto(pool.descriptor, pool.arena.handle,
                                  self._leases.leased_pages(pool.name))

    async def _answer(self, t: Transfer, wait: bool) -> pb.TransferStatus:
        """A verb's answer: the status now, or with ``wait`` the final one (no Wait round trip)."""
        if wait:
            await self._transfers.until_final(t)
        return info_to_proto(t.info())

    async def Info(self, request: pb.DaemonInfoRequest, context: Context) -> pb.DaemonInfo:
        return pb.DaemonInfo(version=__version__, peer_address=self._transfers.peer_address,
                             epoch=self._pools.epoch)

    async def ListPools(self, request: pb.ListPoolsRequest, context: Context) -> pb.ListPoolsResponse:
        return pb.ListPoolsResponse(pools=[self._pool_info(p) for p in self._pools.all()])

    async def DescribePool(self, request: pb.DescribePoolRequest, context: Context) -> pb.PoolInfo:
        return self._pool_info(self._pools.get(request.pool))

    async def DescribePages(self, request: pb.DescribePagesRequest,
                            context: Context) -> pb.DescribePagesResponse:
        pool = self._pools.get(request.pool)
        extents = pool.extents(runs_from_proto(request.runs))
        return pb.DescribePagesResponse(page_bytes=pool.descriptor.page_bytes,
                                        extents=extents_to_proto(extents))

    async def Expect(self, request: pb.ExpectRequest, context: Context) -> pb.TransferStatus:
        t = self._transfers.expect(request.transfer_id, request.pool,
                                   runs_from_proto(request.dst_runs), request.timeout_s,
                                   lease_use_from_proto(request.lease), request.peer_identity)
        answer = await self._answer(t, request.wait)
        answer.capability = t.capability
        return answer

    async def Push(self, request: pb.PushRequest, context: Context) -> pb.TransferStatus:
        t = self._transfers.push(request.transfer_id, request.pool,
                                 runs_from_proto(request.src_runs), request.peer,
                                 request.timeout_s, request.verify, lease_use_from_proto(request.lease),
                                 request.capability)
        return await self._answer(t, request.wait)

    async def Offer(self, request: pb.OfferRequest, context: Context) -> pb.TransferStatus:
        t = self._transfers.offer(request.transfer_id, request.pool,
                                  runs_from_proto(request.src_runs), request.timeout_s,
                                  request.verify, lease_use_from_proto(request.lease), request.peer_identity,
                                  request.prompt_digest)
        answer = await self._answer(t, request.wait)
        answer.capability = t.capability
        return answer

    async def Pull(self, request: pb.PullRequest, context: Context) -> pb.TransferStatus:
        t = self._transfers.pull(request.transfer_id, request.peer, request.pool,
                                 runs_from_proto(request.dst_runs), request.timeout_s,
                                 lease_use_from_proto(request.lease), request.peer_identity,
                                 request.capability, request.prompt_digest, request.skip_pages,
                                 part_from_proto(request.part))
        return await self._answer(t, request.wait)

    async def LeasePull(self, request: pb.LeasePullRequest,
                        context: Context) -> pb.LeasePullResponse:
        want, pull = request.lease, request.pull
        if (pull.pool not in ("", want.pool) or pull.dst_runs or pull.lease.lease_id
                or pull.lease.release_lease or pull.wait):
            raise InvalidArgumentError(
                "a LeasePull pulls into the pages it leases and answers at once: pull.pool "
                f"must be empty or the lease's ({want.pool!r}; it is {pull.pool!r}), "
                "pull.dst_runs, pull.lease.lease_id, pull.lease.release_lease and pull.wait "
                f"unset (they are {len(pull.dst_runs)} runs, {pull.lease.lease_id!r}, "
                f"{pull.lease.release_lease}, {pull.wait}); call Wait for the end, Release "
                "after reading the pages")
        lease, t = self._transfers.lease_and_pull(
            want.pool, want.pages, want.lease_s, want.holder, pull.transfer_id, pull.peer,
            pull.timeout_s, pull.lease.arena_epoch, pull.peer_identity, pull.capability,
            pull.prompt_digest, pull.skip_pages, part_from_proto(pull.part))
        return pb.LeasePullResponse(lease=self._lease_to_proto(lease),
                                    transfer=info_to_proto(t.info()))

    async def Wait(self, request: pb.WaitRequest, context: Context) -> pb.TransferStatus:
        t = await self._transfers.wait(request.transfer_id, request.timeout_s)
        return info_to_proto(t.info())

    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.TransferStatus:
        declared = dict(context.invocation_metadata() or ()).get(WORKER_NAME_KEY, "")
        with audited(f"worker={str(declared)[:80]!r} at={context.peer()!r}", "abort",
                     request.transfer_id):
            t = self._transfers.abort(request.transfer_id, request.reason)
        return info_to_proto(t.info())

    async def ListTransfers(self, request: pb.ListTransfersRequest,
                            context: Context) -> pb.ListTransfersResponse:
        return pb.ListTransfersResponse(transfers=[info_to_proto(i) for i in self._transfers.all()])

    async def Completions(self, request: pb.CompletionsRequest,
                          context: Context) -> pb.CompletionsResponse:
        ended, cursor, missed = await self._transfers.completions(request.after, request.timeout_s)
        return pb.CompletionsResponse(transfers=[info_to_proto(i) for i in ended], cursor=cursor,
                                      missed=missed, epoch=self._pools.epoch)

    async def Allocate(self, request: pb.AllocateRequest, context: Context) -> pb.Lease:
        lease = self._leases.allocate(request.pool, request.pages, request.lease_s, request.holder)
        return self._lease_to_proto(lease, granted=True)

    async def Release(self, request: pb.ReleaseRequest, context: Context) -> pb.ReleaseResponse:
        self._leases.release(request.lease_id)
        return pb.ReleaseResponse()

    async def Renew(self, request: pb.RenewRequest, context: Context) -> pb.Lease:
        return self._lease_to_proto(self._leases.renew(request.lease_id, request.lease_s))

    async def ListLeases(self, request: pb.ListLeasesRequest,
                         context: Context) -> pb.ListLeasesResponse:
        return pb.ListLeasesResponse(leases=[self._lease_to_proto(lease) for lease in self._leases.all()])

    async def ListPeers(self, request: pb.ListPeersRequest, context: Context) -> pb.ListPeersResponse:
        return pb.ListPeersResponse(peers=[peer_session_to_proto(p) for p in self._sessions.describe()])

    async def KeepOffers(self, request: pb.KeepOffersRequest,
                         context: Context) -> pb.KeepOffersResponse:
        remaining = await self._transfers.offers.keep_at(
            request.peer, holds_from_proto(request.offers), request.keep_s)
        return pb.KeepOffersResponse(remaining_s=remaining)

    async def DropOffers(self, request: pb.DropOffersRequest,
                         context: Context) -> pb.DropOffersResponse:
        holds = holds_from_proto(request.offers)
        declared = dict(context.invocation_metadata() or ()).get(WORKER_NAME_KEY, "")
        with audited(f"worker={str(declared)[:80]!r} at={context.peer()!r}", "drop-offers",
                     ",".join(h.transfer_id for h in holds)):
            dropped = await self._transfers.offers.drop_at(request.peer, holds, request.reason)
        return pb.DropOffersResponse(dropped=dropped)
