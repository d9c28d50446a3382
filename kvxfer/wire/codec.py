"""Protobuf at the edge: kvxfer's types to ``kvxfer.v1`` messages and back.

Every kvxfer type that crosses the wire (page runs, extents, descriptors and
their specs, memory handles, leases and lease uses, pool listings, transfer
status) is converted here and nowhere else, for the worker API and the peer API
alike. A worker verb's request is its scalar arguments plus these types (the
library fills it in, the worker servicer reads it); the peer protocol's own
messages are in ``kvxfer.server.peer_protocol``. Decoding validates: a descriptor
whose carried views differ from the ones its spec derives is refused
(InvalidSpecError), so a peer with another layout rule is never misread.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields
from typing import Any

from kvxfer.descriptor import PoolDescriptor
from kvxfer.errors import InvalidSpecError
from kvxfer.layout import PoolLayout, PoolSpec, ViewRole, ViewSpec
from kvxfer.layout.kinds import SPEC_CLASSES, as_shape, shape_depths, spec_class
from kvxfer.memory import CudaIpcHandle, MemoryHandle, SharedMemoryHandle
from kvxfer.offer_parts import OfferPart
from kvxfer.pages import Extent, PageRuns
from kvxfer.status import (
    DataPlane,
    LeaseInfo,
    LeaseUse,
    OfferHold,
    PeerSessionInfo,
    TransferInfo,
    TransferRole,
    TransferState,
)
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.wire.status import from_status, to_status

# -- page runs and extents ----------------------------------------------------------


def runs_to_proto(runs: PageRuns) -> list[pb.PageRun]:
    """``PageRuns`` as repeated ``PageRun`` messages."""
    return [pb.PageRun(start=r.start, count=r.count) for r in runs.runs]


def runs_from_proto(msgs: Iterable[pb.PageRun]) -> PageRuns:
    """``PageRun`` messages as validated, normalized ``PageRuns``."""
    return PageRuns.of((int(m.start), int(m.count)) for m in msgs)


def part_to_proto(part: OfferPart) -> pb.OfferPart:
    """A pull's part of its offer as its message."""
    pages = [] if part.pages is None else runs_to_proto(part.pages)
    return pb.OfferPart(index=part.index, count=part.count, pages=pages)


def part_from_proto(msg: pb.OfferPart) -> OfferPart:
    """Decode a pull's part (InvalidArgumentError for an index or count out of range)."""
    return OfferPart(msg.index, msg.count, runs_from_proto(msg.pages) if msg.pages else None)


def extents_to_proto(extents: Iterable[Extent]) -> list[pb.Extent]:
    """Byte extents as repeated ``Extent`` messages."""
    return [pb.Extent(src_offset=e.src_offset, dst_offset=e.dst_offset, nbytes=e.nbytes)
            for e in extents]


def extents_from_proto(msgs: Iterable[pb.Extent]) -> list[Extent]:
    """``Extent`` messages as byte extents."""
    return [Extent(int(m.src_offset), int(m.dst_offset), int(m.nbytes)) for m in msgs]


# -- layouts and descriptors -------------------------------------------------------------


def descriptor_to_proto(desc: PoolDescriptor) -> pb.PoolDescriptor:
    """A pool descriptor as a protobuf message."""
    return pb.PoolDescriptor(
        name=desc.name,
        spec=_spec_to_proto(desc.spec),
        anchor_bytes=desc.layout.anchor_bytes,
        page_bytes=desc.page_bytes,
        num_pages=desc.num_pages,
        page_size=desc.spec.page_size,
        views=[_view_to_proto(v) for v in desc.views],
    )


def descriptor_from_proto(msg: pb.PoolDescriptor) -> PoolDescriptor:
    """Decode and cross-check a descriptor; raises InvalidSpecError if inconsistent."""
    desc = PoolDescriptor(msg.name, PoolLayout(_spec_from_proto(msg.spec), int(msg.anchor_bytes)))
    for field, value, derived in (
        ("page_bytes", msg.page_bytes, desc.page_bytes),
        ("num_pages", msg.num_pages, desc.num_pages),
        ("page_size", msg.page_size, desc.spec.page_size),
    ):
        if value != derived:
            raise InvalidSpecError(
                f"descriptor of pool {msg.name!r} says {field}={value} but its spec gives {derived}"
            )
    carried = tuple(_view_from_proto(v) for v in msg.views)
    if carried != desc.views:
        raise InvalidSpecError(
            f"descriptor of pool {msg.name!r} carries views that differ from the ones its "
            "spec derives; expected the page-major layout of kvxfer v1"
        )
    return desc


def _spec_to_proto(spec: PoolSpec) -> pb.PoolSpec:
    """Any kind's spec as its message (same name, same fields; shapes as ``Shape``)."""
    depths = shape_depths(type(spec))
    values = {f.name: _shape_to_proto(getattr(spec, f.name), depths[f.name]) if f.name in depths
              else getattr(spec, f.name) for f in fields(spec)}
    return pb.PoolSpec(**{spec.kind.value: getattr(pb, type(spec).__name__)(**values)})


def _shape_to_proto(value: Any, depth: int) -> Any:
    return pb.Shape(dims=value) if depth == 1 else [_shape_to_proto(v, depth - 1) for v in value]


def _spec_from_proto(msg: pb.PoolSpec) -> PoolSpec:
    """Any kind's message as its spec (the registry in ``kvxfer.layout.kinds``)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidSpecError(f"pool spec has no kind; expected one of {sorted(SPEC_CLASSES)}")
    cls = spec_class(kind, "pool spec")
    inner = getattr(msg, kind)
    depths = shape_depths(cls)
    return cls(**{f.name: _shape_from_proto(getattr(inner, f.name), depths[f.name]) if f.name in depths
                  else getattr(inner, f.name) for f in fields(cls)})


def _shape_from_proto(value: Any, depth: int) -> Any:
    return as_shape(value.dims, 1) if depth == 1 else tuple(_shape_from_proto(v, depth - 1) for v in value)


def _view_to_proto(view: ViewSpec) -> pb.ViewSpec:
    return pb.ViewSpec(role=view.role.value, index=view.index, dtype=view.dtype, shape=view.shape,
                       stride=view.stride, offset_bytes=view.offset_bytes)


def _view_from_proto(msg: pb.ViewSpec) -> ViewSpec:
    try:
        role = ViewRole(msg.role)
    except ValueError:
        raise InvalidSpecError(
            f"view role {msg.role!r} is unknown; expected one of {[r.value for r in ViewRole]}"
        ) from None
    return ViewSpec(role=role, index=msg.index, dtype=msg.dtype,
                    shape=tuple(int(d) for d in msg.shape),
                    stride=tuple(int(s) for s in msg.stride),
                    offset_bytes=int(msg.offset_bytes))


# -- memory handles ----------------------------------------------------------------------


def memory_to_proto(handle: MemoryHandle) -> pb.MemoryHandle:
    """An arena's attach handle as a protobuf message."""
    msg = pb.MemoryHandle(arena=handle.arena, device=handle.device, size_bytes=handle.size_bytes,
                          epoch=handle.epoch)
    if handle.shm is not None:
        msg.shm.path = handle.shm.path
    if handle.cuda is not None:
        c = handle.cuda
        msg.cuda.CopyFrom(pb.CudaIpc(
            device=c.device, storage_handle=c.storage_handle,
            storage_offset_bytes=c.storage_offset_bytes, ref_counter_handle=c.ref_counter_handle,
            ref_counter_offset=c.ref_counter_offset, event_handle=c.event_handle,
            event_sync_required=c.event_sync_required,
        ))
    return msg


def memory_from_proto(msg: pb.MemoryHandle) -> MemoryHandle:
    """An attach handle from its protobuf message."""
    shm = cuda = None
    kind = msg.WhichOneof("kind")
    if kind == "shm":
        shm = SharedMemoryHandle(msg.shm.path)
    elif kind == "cuda":
        c = msg.cuda
        cuda = CudaIpcHandle(c.device, c.storage_handle, c.storage_offset_bytes,
                             c.ref_counter_handle, c.ref_counter_offset, c.event_handle,
                             c.event_sync_required)
    return MemoryHandle(msg.arena, msg.device, msg.size_bytes, shm=shm, cuda=cuda,
                        epoch=msg.epoch)


# -- page leases --------------------------------------------------------------------------


def lease_to_proto(lease: LeaseInfo) -> pb.Lease:
    """A page lease as its message."""
    return pb.Lease(lease_id=lease.lease_id, pool=lease.pool, runs=runs_to_proto(lease.runs),
                    expires_in_s=lease.expires_in_s, holder=lease.holder,
                    arena_epoch=lease.arena_epoch, capability=lease.capability)


def lease_from_proto(msg: pb.Lease) -> LeaseInfo:
    """A lease from its message."""
    return LeaseInfo(msg.lease_id, msg.pool, runs_from_proto(msg.runs), msg.expires_in_s,
                     msg.holder, msg.arena_epoch, msg.capability)


def lease_use_to_proto(use: LeaseUse) -> pb.LeaseUse:
    """What a verb says about its pages' lease and mapping, as its message."""
    return pb.LeaseUse(lease_id=use.lease_id, release_lease=use.release_lease,
                       arena_epoch=use.arena_epoch)


def lease_use_from_proto(msg: pb.LeaseUse) -> LeaseUse:
    """Decode a verb's ``LeaseUse``."""
    return LeaseUse(msg.lease_id, msg.release_lease, msg.arena_epoch)


def holds_to_proto(holds: Iterable[OfferHold]) -> list[pb.OfferHold]:
    """Offers kept or dropped, as their messages."""
    return [pb.OfferHold(transfer_id=h.transfer_id, capability=h.capability) for h in holds]


def holds_from_proto(msgs: Iterable[pb.OfferHold]) -> list[OfferHold]:
    """Decode offers kept or dropped (their ids and capabilities are checked where used)."""
    return [OfferHold(m.transfer_id, m.capability) for m in msgs]


# -- pools -------------------------------------------------------------------------------


def pool_info_to_proto(descriptor: PoolDescriptor, memory: MemoryHandle, leased_pages: int) -> pb.PoolInfo:
    """A pool as the daemon lists it: its descriptor, its memory handle, its leased pages."""
    return pb.PoolInfo(descriptor=descriptor_to_proto(descriptor), memory=memory_to_proto(memory),
                       leased_pages=leased_pages)


def pool_info_from_proto(msg: pb.PoolInfo) -> tuple[PoolDescriptor, MemoryHandle, int]:
    """Decode a listed pool: descriptor, memory handle, leased pages."""
    return descriptor_from_proto(msg.descriptor), memory_from_proto(msg.memory), msg.leased_pages


# -- transfer status ---------------------------------------------------------------------


def info_to_proto(info: TransferInfo) -> pb.TransferStatus:
    """One side's transfer status as a ``TransferStatus`` message."""
    msg = pb.TransferStatus(
        transfer_id=info.transfer_id, role=info.role.value, state=info.state.value,
        pool=info.pool, peer=info.peer, pages=info.pages, bytes=info.bytes,
        bytes_done=info.bytes_done, extents=info.extents, seconds=info.seconds,
        verified=info.verified, created_unix=info.created_unix, data_seconds=info.data_seconds,
        lanes=info.lanes, timeout_s=info.timeout_s,
    )
    if info.failure is not None:
        msg.error.CopyFrom(to_status(info.failure))
    return msg


def info_from_proto(msg: pb.TransferStatus) -> TransferInfo:
    """Decode a ``TransferStatus`` message (the failure comes back as its own type)."""
    return TransferInfo(
        transfer_id=msg.transfer_id, role=TransferRole(msg.role), state=TransferState(msg.state),
        pool=msg.pool, peer=msg.peer, pages=msg.pages, bytes=msg.bytes, bytes_done=msg.bytes_done,
        extents=msg.extents, seconds=msg.seconds,
        failure=from_status(msg.error) if msg.HasField("error") else None,
        verified=msg.verified, created_unix=msg.created_unix, data_seconds=msg.data_seconds,
        lanes=msg.lanes, timeout_s=msg.timeout_s, capability=msg.capability,
    )


def peer_session_to_proto(info: PeerSessionInfo) -> pb.PeerSession:
    return pb.PeerSession(peer_address=info.peer_address, outbound=info.outbound,
                          session_id=info.session_id, data_plane=info.data_plane.value,
                          lanes=info.lanes, identity=info.identity)


def peer_session_from_proto(msg: pb.PeerSession) -> PeerSessionInfo:
    return PeerSessionInfo(msg.peer_address, msg.outbound, msg.session_id, DataPlane(msg.data_plane),
                           msg.lanes, msg.identity)
