"""The worker-side client: talk to the local daemon, attach to its pools, drive transfers.

::

    from kvxfer.client import KvxferClient
    from kvxfer.pages import PageRuns

    with KvxferClient("unix:///run/kvxfer/kvxfer.sock") as kv:
        with kv.attach("kv") as pool:          # zero-copy views of the daemon's memory
            pool.views.k[0][3].fill_(1.0)      # layer 0, page 3
        kv.push("req-1", "kv", PageRuns.of([(3, 1)]), peer="decode-host:7500")
        status = kv.wait("req-1", timeout_s=10)
        assert status.ok, status.error

Errors from the daemon arrive as typed ``kvxfer.errors`` exceptions.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2

from kvxfer.client.health_probe import health_check
from kvxfer.descriptor import PoolDescriptor
from kvxfer.layout import PoolViews
from kvxfer.memory import Mapping, MemoryHandle, attach
from kvxfer.offer_parts import WHOLE_OFFER, OfferPart
from kvxfer.pages import Extent, PageRuns
from kvxfer.propagation import WORKER_NAME_KEY, outgoing_metadata
from kvxfer.status import (
    Completions,
    LeaseInfo,
    LeaseUse,
    OfferHold,
    PeerSessionInfo,
    TransferInfo,
)
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.v1 import kvxfer_pb2_grpc as pb_grpc
from kvxfer.wire.codec import (
    extents_from_proto,
    holds_to_proto,
    info_from_proto,
    lease_from_proto,
    lease_use_to_proto,
    part_to_proto,
    peer_session_from_proto,
    pool_info_from_proto,
    runs_to_proto,
)
from kvxfer.wire.status import from_rpc_error

T = TypeVar("T")


class AttachedPool:
    """A pool of the daemon mapped into this process, with its per-layer views.

    ``epoch`` is the memory epoch of the mapping: pass it as ``arena_epoch`` with the
    transfer verbs whose pages were written (or will be read) through it, and a daemon
    that restarted since refuses them (StaleArenaError) instead of moving other memory."""

    __slots__ = ("descriptor", "memory", "views", "_mapping")

    def __init__(self, descriptor: PoolDescriptor, memory: MemoryHandle) -> None:
        self.descriptor = descriptor
        self.memory = memory
        self._mapping: Mapping | None = attach(memory)
        self.views: PoolViews = descriptor.build_views(self._mapping.raw)

    @property
    def raw(self) -> Any:
        """The whole arena buffer as a uint8 tensor (shared with the daemon)."""
        if self._mapping is None:
            raise RuntimeError("pool is detached")
        return self._mapping.raw

    @property
    def epoch(self) -> str:
        """The memory epoch of the daemon whose arena this maps."""
        return self.memory.epoch

    def page_bytes_view(self, page: int) -> Any:
        """One page as a uint8 tensor over the shared memory."""
        start = self.descriptor.layout.page_offset(page)
        return self.raw[start : start + self.descriptor.page_bytes]

    def detach(self) -> None:
        """Drop the views and unmap the memory."""
        self.views = PoolViews()
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None

    def __enter__(self) -> AttachedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def __repr__(self) -> str:
        state = "attached" if self._mapping is not None else "detached"
        return (f"AttachedPool({self.descriptor.name!r}, {self.descriptor.kind.value}, "
                f"{self.descriptor.num_pages} pages x {self.descriptor.page_bytes} B, {state})")


#: A restarted daemon (the sidecar outlives the engine, and the other way round) is reached
#: again within 0.1-1 s: a channel of its own (gRPC shares connections per target and
#: process, and a shared one still backing off refuses a new client at once) and short
#: reconnect backoff (gRPC's default grows to 120 s). Not ``min_reconnect_backoff_ms``: gRPC
#: also gives each connection attempt only that long, so a daemon slower than 0.1 s to
#: answer a new connection (a loaded machine) would be UNAVAILABLE at once.
CHANNEL_OPTIONS = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


#: The daemon's default transfer deadline (``--default-timeout-s``): how long a verb called with
#: ``wait`` and no ``timeout_s`` may take before the client gives up on the answer.
DEFAULT_DEADLINE_S = 30.0


class KvxferClient:
    """A synchronous client of one daemon's worker API (``unix://...`` or ``host:port``).

    Every call carries the caller's current OpenTelemetry trace context, so a transfer's
    spans on both daemons join the engine's trace of the request.

    A transfer verb's ``arena_epoch`` defaults to the memory epoch of this client's latest
    ``attach`` of the verb's pool: pages written or read through that mapping are refused
    (StaleArenaError) once the daemon has restarted, until the client attaches again. A
    client that never attached the pool sends none unless told (the daemon then cannot
    check it).
    """

    def __init__(self, address: str, *, timeout_s: float = 10.0, name: str = "") -> None:
        self.address = address
        self.timeout_s = timeout_s
        #: How the daemon's audit lines name this caller (self-declared: workers share a
        #: node with their daemon and are trusted), sent with every call.
        self.name = f"{name} (pid {os.getpid()})" if name else f"pid {os.getpid()}"
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.KvxferStub(self._channel)
        self._health_check = health_check(self._channel)
        self._mapped_epochs: dict[str, str] = {}

    def _call(self, method: Callable[..., T], request: Any, timeout: float | None = None) -> T:
        try:
            return method(request, timeout=timeout or self.timeout_s,
                          metadata=(*outgoing_metadata(), (WORKER_NAME_KEY, self.name)))
        except grpc.RpcError as exc:
            assert isinstance(exc, grpc.Call)  # what grpc raises for a failed call is both
            raise from_rpc_error(exc) from None

    # -- pools --------------------------------------------------------------------

    def pools(self) -> list[tuple[PoolDescriptor, MemoryHandle]]:
        """Every pool the daemon serves, with the handle to attach to its memory."""
        reply = self._call(self._stub.ListPools, pb.ListPoolsRequest())
        return [pool_info_from_proto(p)[:2] for p in reply.pools]

    def describe(self, pool: str) -> tuple[PoolDescriptor, MemoryHandle]:
        """One pool's descriptor and memory handle."""
        reply = self._call(self._stub.DescribePool, pb.DescribePoolRequest(pool=pool))
        descriptor, memory, _ = pool_info_from_proto(reply)
        return descriptor, memory

    def describe_pages(self, pool: str, runs: PageRuns) -> list[Extent]:
        """The byte extents (offsets in the arena) of ``runs``."""
        reply = self._call(self._stub.DescribePages,
                           pb.DescribePagesRequest(pool=pool, runs=runs_to_proto(runs)))
        return extents_from_proto(reply.extents)

    def attach(self, pool: str) -> AttachedPool:
        """Map ``pool``'s memory and build its views (same node only)."""
        descriptor, memory = self.describe(pool)
        attached = AttachedPool(descriptor, memory)
        self._mapped_epochs[pool] = attached.epoch
        return attached

    def _lease(self, pool: str, lease_id: str, release_lease: bool, arena_epoch: str) -> pb.LeaseUse:
        epoch = arena_epoch or self._mapped_epochs.get(pool, "")
        return lease_use_to_proto(LeaseUse(lease_id, release_lease, epoch))

    def reachable(self, timeout_s: float) -> bool:
        """Whether the channel to the daemon is connected, or connects within ``timeout_s``
        (after a restart of the daemon, once its reconnect backoff has passed)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            return False
        return True

    def health(self, service: str = "") -> str:
        """The daemon's health status name (SERVING, NOT_SERVING, ...)."""
        reply = self._call(self._health_check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    # -- transfers --------------------------------------------------------------------

    def _verb(self, method: Callable[..., pb.TransferStatus], request: Any, timeout_s: float,
              wait: bool) -> TransferInfo:
        """Call a transfer verb. Without ``wait`` the answer is the registered transfer's
        status; with it, its final status (one round trip instead of verb + ``wait``), the
        call bounded by the transfer's deadline (``DEFAULT_DEADLINE_S`` when 0) + 5 s."""
        timeout = (timeout_s or DEFAULT_DEADLINE_S) + 5 if wait else None
        return info_from_proto(self._call(method, request, timeout))

    def expect(self, transfer_id: str, pool: str, dst_runs: PageRuns,
               timeout_s: float = 0.0, *, lease_id: str = "",
               release_lease: bool = False, peer_identity: str = "",
               arena_epoch: str = "", wait: bool = False) -> TransferInfo:
        """Register destination pages for ``transfer_id`` (decode side). With ``lease_id``
        the pages must be the lease's, and ``release_lease`` ends the lease with the transfer;
        with ``peer_identity`` only the peer with that certificate name may fill them. With
        ``wait`` the answer comes when the transfer is final (see ``_verb``).

        The answer's ``capability`` is what the push must present: hand it to the prefill
        side as a secret. A push without it is refused, and cannot fill these pages."""
        req = pb.ExpectRequest(transfer_id=transfer_id, pool=pool,
                               dst_runs=runs_to_proto(dst_runs), timeout_s=timeout_s,
                               lease=self._lease(pool, lease_id, release_lease, arena_epoch),
                               peer_identity=peer_identity,
                               wait=wait)
        return self._verb(self._stub.Expect, req, timeout_s, wait)

    def push(self, transfer_id: str, pool: str, src_runs: PageRuns, peer: str,
             timeout_s: float = 0.0, verify: bool = False, *, lease_id: str = "",
             release_lease: bool = False, arena_epoch: str = "", capability: str = "",
             wait: bool = False) -> TransferInfo:
        """Send ``src_runs`` to the decode daemon at ``peer`` (prefill side), presenting the
        ``capability`` its expect's answer told (a wrong one, or no such expect, fails the
        transfer with NOT_FOUND); with ``wait``, answer when the transfer is final."""
        req = pb.PushRequest(transfer_id=transfer_id, pool=pool, src_runs=runs_to_proto(src_runs),
                             peer=peer, timeout_s=timeout_s, verify=verify,
                             lease=self._lease(pool, lease_id, release_lease, arena_epoch),
                             capability=capability, wait=wait)
        return self._verb(self._stub.Push, req, timeout_s, wait)

    def offer(self, transfer_id: str, pool: str, src_runs: PageRuns, timeout_s: float = 0.0,
              verify: bool = False, *, lease_id: str = "",
              release_lease: bool = False, peer_identity: str = "",
              arena_epoch: str = "", prompt_digest: bytes = b"",
              wait: bool = False) -> TransferInfo:
        """Make ``src_runs`` available for a peer's pull (prefill side); with
        ``peer_identity``, for that peer's only; with ``wait``, answer when it is final.

        The answer's ``capability`` (the lease's, when one is named) is what the pull must
        present, once; hand it to the puller as a secret. ``prompt_digest`` (what the KV was
        computed from) must equal the pull's."""
        req = pb.OfferRequest(transfer_id=transfer_id, pool=pool, src_runs=runs_to_proto(src_runs),
                              timeout_s=timeout_s, verify=verify,
                              lease=self._lease(pool, lease_id, release_lease, arena_epoch),
                              peer_identity=peer_identity, wait=wait, prompt_digest=prompt_digest)
        return self._verb(self._stub.Offer, req, timeout_s, wait)

    def pull(self, transfer_id: str, peer: str, pool: str, dst_runs: PageRuns,
             timeout_s: float = 0.0, *, lease_id: str = "",
             release_lease: bool = False, peer_identity: str = "",
             arena_epoch: str = "", capability: str = "", prompt_digest: bytes = b"",
             skip_pages: int = 0, part: OfferPart = WHOLE_OFFER,
             wait: bool = False) -> TransferInfo:
        """Fetch ``transfer_id`` offered by the prefill daemon at ``peer`` (decode side),
        presenting the offer's ``capability`` and ``prompt_digest`` (a wrong or spent
        capability, or no such offer, fails the transfer with NOT_FOUND; another digest with
        PromptMismatchError); with ``peer_identity`` (that daemon's certificate name) no
        other peer may fill it; with ``wait``, answer when it is final. The offer's first
        ``skip_pages`` pages are not moved (the caller holds their KV): ``dst_runs`` receive
        the rest; with a ``part``, its pages of the offer (``kvxfer.offer_parts``: shared by
        several pullers, the pull is the transfer ``part_id(transfer_id, part.index)``)."""
        req = pb.PullRequest(transfer_id=transfer_id, peer=peer, pool=pool,
                             dst_runs=runs_to_proto(dst_runs), timeout_s=timeout_s,
                             lease=self._lease(pool, lease_id, release_lease, arena_epoch),
                             peer_identity=peer_identity, wait=wait, capability=capability,
                             prompt_digest=prompt_digest, skip_pages=skip_pages,
                             part=part_to_proto(part))
        return self._verb(self._stub.Pull, req, timeout_s, wait)

    def lease_and_pull(self, transfer_id: str, peer: str, pool: str, pages: int,
                       timeout_s: float = 0.0, *, lease_s: float = 0.0, holder: str = "",
                       peer_identity: str = "", arena_epoch: str = "", capability: str = "",
                       prompt_digest: bytes = b"", skip_pages: int = 0,
                       part: OfferPart = WHOLE_OFFER) -> tuple[LeaseInfo, TransferInfo]:
        """Lease ``pages`` pages of ``pool`` and ``pull`` into them (the offer's pages from
        ``skip_pages`` on, or ``part``'s: as many as ``pages``), in one round trip: the
        new lease (release it once its pages are read) and the pull's status. A refused
        pull raises as ``pull`` does, and leaves no lease."""
        req = pb.LeasePullRequest(
            lease=pb.AllocateRequest(pool=pool, pages=pages, lease_s=lease_s, holder=holder),
            pull=pb.PullRequest(transfer_id=transfer_id, peer=peer, timeout_s=timeout_s,
                                lease=self._lease(pool, "", False, arena_epoch),
                                peer_identity=peer_identity, capability=capability,
                                prompt_digest=prompt_digest, skip_pages=skip_pages,
                                part=part_to_proto(part)))
        reply = self._call(self._stub.LeasePull, req)
        return lease_from_proto(reply.lease), info_from_proto(reply.transfer)

    def wait(self, transfer_id: str, timeout_s: float = 30.0) -> TransferInfo:
        """Block until ``transfer_id`` is final; its state says how it ended."""
        req = pb.WaitRequest(transfer_id=transfer_id, timeout_s=timeout_s)
        return info_from_proto(self._call(self._stub.Wait, req, timeout=timeout_s + 5))

    def abort(self, transfer_id: str, reason: str = "") -> TransferInfo:
        """End ``transfer_id`` on both sides."""
        req = pb.AbortRequest(transfer_id=transfer_id, reason=reason)
        return info_from_proto(self._call(self._stub.Abort, req))

    def transfers(self) -> list[TransferInfo]:
        """In-flight and recent transfers, oldest first."""
        reply = self._call(self._stub.ListTransfers, pb.ListTransfersRequest())
        return [info_from_proto(t) for t in reply.transfers]

    def completions(self, after: int = 0, timeout_s: float = 0.0) -> Completions:
        """Every transfer that ended after cursor ``after`` (0: the oldest the daemon keeps),
        waiting up to ``timeout_s`` for one; pass the returned cursor next time."""
        reply = self._call(self._stub.Completions,
                           pb.CompletionsRequest(after=after, timeout_s=timeout_s),
                           timeout=timeout_s + self.timeout_s)
        return Completions([info_from_proto(t) for t in reply.transfers], reply.cursor,
                           reply.missed, reply.epoch)

    # -- page leases ----------------------------------------------------------------------

    def keep_offers(self, peer: str, offers: Sequence[OfferHold],
                    keep_s: float = 0.0) -> list[float]:
        """Keep the offers of the prefill daemon at ``peer`` waiting ``keep_s`` seconds more
        (0: the daemon's default deadline) for pulls from here; the seconds each now waits
        (0: not kept: pulled, ended, or not open to this daemon)."""
        reply = self._call(self._stub.KeepOffers, pb.KeepOffersRequest(
            peer=peer, offers=holds_to_proto(offers), keep_s=keep_s))
        return list(reply.remaining_s)

    def drop_offers(self, peer: str, offers: Sequence[OfferHold], reason: str = "") -> int:
        """End offers of the prefill daemon at ``peer`` that nothing here will pull (their
        pages are free there at once); how many ended."""
        reply = self._call(self._stub.DropOffers, pb.DropOffersRequest(
            peer=peer, offers=holds_to_proto(offers), reason=reason))
        return reply.dropped

    def allocate(self, pool: str, pages: int, lease_s: float = 0.0, holder: str = "") -> LeaseInfo:
        """Lease ``pages`` free pages of ``pool`` (for ``lease_s`` seconds; 0: the daemon's
        default); PoolExhaustedError if too few are free."""
        req = pb.AllocateRequest(pool=pool, pages=pages, lease_s=lease_s, holder=holder)
        return lease_from_proto(self._call(self._stub.Allocate, req))

    def release(self, lease_id: str) -> None:
        """End a lease now (its pages are free again; transfers still using it fail)."""
        self._call(self._stub.Release, pb.ReleaseRequest(lease_id=lease_id))

    def renew(self, lease_id: str, lease_s: float = 0.0) -> LeaseInfo:
        """Push a lease's expiry ``lease_s`` seconds from now (0: the daemon's default)."""
        return lease_from_proto(self._call(self._stub.Renew,
                                           pb.RenewRequest(lease_id=lease_id, lease_s=lease_s)))

    def leases(self) -> list[LeaseInfo]:
        """Every live lease, oldest first."""
        reply = self._call(self._stub.ListLeases, pb.ListLeasesRequest())
        return [lease_from_proto(lease) for lease in reply.leases]

    def leased_pages(self) -> dict[str, int]:
        """Pages under a lease, by pool."""
        reply = self._call(self._stub.ListPools, pb.ListPoolsRequest())
        return {d.name: leased for d, _, leased in map(pool_info_from_proto, reply.pools)}

    def info(self) -> dict[str, str]:
        """The daemon's version, peer address and memory epoch."""
        reply = self._call(self._stub.Info, pb.DaemonInfoRequest())
        return {"version": reply.version, "peer_address": reply.peer_address, "epoch": reply.epoch}

    def peer_address(self) -> str:
        """Where this daemon serves its peers (what a decode daemon's ``pull`` names)."""
        return self.info()["peer_address"]

    def epoch(self) -> str:
        """The daemon's memory epoch: it changes when the daemon restarts (see ``AttachedPool``)."""
        return self.info()["epoch"]

    def peers(self) -> list[PeerSessionInfo]:
        """The daemon's open sessions with peer daemons, and the data plane each one uses."""
        reply = self._call(self._stub.ListPeers, pb.ListPeersRequest())
        return [peer_session_from_proto(p) for p in reply.peers]

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> KvxferClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
