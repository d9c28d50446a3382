"""Pool descriptors: what another process needs to rebuild identical views of a pool.

A ``PoolDescriptor`` is a named ``PoolLayout`` plus the list of its views
(dtype, shape, element strides, byte offset). It round-trips losslessly through
the ``kvxfer.v1.PoolDescriptor`` protobuf message. On decode the views carried
on the wire are checked against the ones the spec derives, so a descriptor from
a peer with a different layout rule is refused instead of silently misread.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from kvxfer.errors import IncompatibleLayoutError, InvalidSpecError
from kvxfer.layout import (
    MambaSpec,
    MhaSpec,
    MlaSpec,
    PoolKind,
    PoolLayout,
    PoolSpec,
    PoolViews,
    ViewRole,
    ViewSpec,
    build_views,
)
from kvxfer.v1 import kvxfer_pb2 as pb


@dataclass(frozen=True)
class PoolDescriptor:
    """A named pool: its layout in a raw buffer and the views built over it."""

    name: str
    layout: PoolLayout

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidSpecError("pool name is empty; expected a non-empty name")

    @property
    def kind(self) -> PoolKind:
        """What the pool stores."""
        return self.layout.kind

    @property
    def spec(self) -> PoolSpec:
        """The pool's spec (shapes, dtypes, page_size, num_pages)."""
        return self.layout.spec

    @property
    def page_bytes(self) -> int:
        """Bytes of one page."""
        return self.layout.page_bytes

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        return self.layout.num_pages

    @property
    def views(self) -> tuple[ViewSpec, ...]:
        """Every view of the pool, with absolute byte offsets."""
        return self.layout.view_specs()

    def build_views(self, raw: torch.Tensor) -> PoolViews:
        """Per-layer views over ``raw``, the buffer the pool lives in."""
        self.layout.check_fits(raw.numel())
        return build_views(raw, self.views)

    def to_proto(self) -> pb.PoolDescriptor:
        """The descriptor as a protobuf message."""
        return pb.PoolDescriptor(
            name=self.name,
            spec=_spec_to_proto(self.spec),
            anchor_bytes=self.layout.anchor_bytes,
            page_bytes=self.page_bytes,
            num_pages=self.num_pages,
            page_size=self.spec.page_size,
            views=[_view_to_proto(v) for v in self.views],
        )

    @classmethod
    def from_proto(cls, msg: pb.PoolDescriptor) -> PoolDescriptor:
        """Decode and cross-check a descriptor; raises InvalidSpecError if inconsistent."""
        desc = cls(msg.name, PoolLayout(_spec_from_proto(msg.spec), int(msg.anchor_bytes)))
        for field, value in (
            ("page_bytes", msg.page_bytes),
            ("num_pages", msg.num_pages),
            ("page_size", msg.page_size),
        ):
            derived = getattr(desc.spec, field) if field != "page_bytes" else desc.page_bytes
            if value != derived:
                raise InvalidSpecError(
                    f"descriptor of pool {msg.name!r} says {field}={value} but its spec gives "
                    f"{derived}"
                )
        carried = tuple(_view_from_proto(v) for v in msg.views)
        if carried != desc.views:
            raise InvalidSpecError(
                f"descriptor of pool {msg.name!r} carries views that differ from the ones its "
                "spec derives; expected the page-major layout of kvxfer v1"
            )
        return desc


def check_compatible(src: PoolDescriptor, dst: PoolDescriptor) -> None:
    """Raise IncompatibleLayoutError unless pages of ``src`` can be copied into ``dst`` as is.

    Two pools are compatible when every spec field but the page count matches
    (so their pages hold the same tensors at the same offsets). The message
    names the first field that differs.
    """
    if src.kind != dst.kind:
        raise IncompatibleLayoutError(
            f"pool kinds differ: source {src.name!r} is {src.kind.value}, destination "
            f"{dst.name!r} is {dst.kind.value}"
        )
    skip = {"num_pages", "num_slots"}
    for field in fields(src.spec):
        if field.name in skip:
            continue
        a, b = getattr(src.spec, field.name), getattr(dst.spec, field.name)
        if a != b:
            raise IncompatibleLayoutError(
                f"{field.name} differs: source pool {src.name!r} has {a}, destination pool "
                f"{dst.name!r} has {b}"
            )
    if src.page_bytes != dst.page_bytes:
        raise IncompatibleLayoutError(
            f"page_bytes differs: source {src.page_bytes}, destination {dst.page_bytes}"
        )


def _spec_to_proto(spec: PoolSpec) -> pb.PoolSpec:
    if isinstance(spec, MhaSpec):
        return pb.PoolSpec(
            mha=pb.MhaSpec(
                layer_num=spec.layer_num,
                head_num=spec.head_num,
                head_dim=spec.head_dim,
                v_head_dim=spec.v_head_dim,
                dtype=spec.dtype,
                page_size=spec.page_size,
                num_pages=spec.num_pages,
            )
        )
    if isinstance(spec, MlaSpec):
        return pb.PoolSpec(
            mla=pb.MlaSpec(
                layer_num=spec.layer_num,
                kv_lora_rank=spec.kv_lora_rank,
                qk_rope_head_dim=spec.qk_rope_head_dim,
                dtype=spec.dtype,
                page_size=spec.page_size,
                num_pages=spec.num_pages,
            )
        )
    return pb.PoolSpec(
        mamba=pb.MambaSpec(
            layer_num=spec.layer_num,
            conv_state_shapes=[pb.Shape(dims=s) for s in spec.conv_state_shapes],
            conv_dtype=spec.conv_dtype,
            temporal_state_shape=pb.Shape(dims=spec.temporal_state_shape),
            temporal_dtype=spec.temporal_dtype,
            num_slots=spec.num_slots,
        )
    )


def _spec_from_proto(msg: pb.PoolSpec) -> PoolSpec:
    kind = msg.WhichOneof("kind")
    if kind == "mha":
        m = msg.mha
        return MhaSpec(
            m.layer_num, m.head_num, m.head_dim, m.v_head_dim, m.dtype, m.page_size, m.num_pages
        )
    if kind == "mla":
        a = msg.mla
        return MlaSpec(
            a.layer_num, a.kv_lora_rank, a.qk_rope_head_dim, a.dtype, a.page_size, a.num_pages
        )
    if kind == "mamba":
        s = msg.mamba
        return MambaSpec(
            s.layer_num,
            tuple(tuple(int(d) for d in shape.dims) for shape in s.conv_state_shapes),
            s.conv_dtype,
            tuple(int(d) for d in s.temporal_state_shape.dims),
            s.temporal_dtype,
            s.num_slots,
        )
    raise InvalidSpecError("pool spec has no kind; expected one of mha, mla, mamba")


def _view_to_proto(view: ViewSpec) -> pb.ViewSpec:
    return pb.ViewSpec(
        role=view.role.value,
        index=view.index,
        dtype=view.dtype,
        shape=view.shape,
        stride=view.stride,
        offset_bytes=view.offset_bytes,
    )


def _view_from_proto(msg: pb.ViewSpec) -> ViewSpec:
    try:
        role = ViewRole(msg.role)
    except ValueError:
        raise InvalidSpecError(
            f"view role {msg.role!r} is unknown; expected one of {[r.value for r in ViewRole]}"
        ) from None
    return ViewSpec(
        role=role,
        index=msg.index,
        dtype=msg.dtype,
        shape=tuple(int(d) for d in msg.shape),
        stride=tuple(int(s) for s in msg.stride),
        offset_bytes=int(msg.offset_bytes),
    )
