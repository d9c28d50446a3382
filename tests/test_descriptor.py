"""Descriptors carry everything needed to rebuild identical views, losslessly over protobuf."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from hypothesis import given
from strategies import any_spec, mha_specs

from kvxfer.descriptor import PoolDescriptor, check_compatible
from kvxfer.errors import IncompatibleLayoutError, InvalidSpecError
from kvxfer.layout import MhaSpec, MlaSpec, PoolKind, PoolLayout, PoolViews
from kvxfer.layout.kinds import PRESETS, SPEC_CLASSES, spec_from_mapping
from kvxfer.v1 import kvxfer_pb2 as pb
from kvxfer.wire.codec import descriptor_from_proto, descriptor_to_proto


def all_views(views: PoolViews) -> list[torch.Tensor]:
    extra = [views.temporal] if views.temporal is not None else []
    return [*views.k, *views.v, *views.latent, *views.conv, *extra]


def round_trip(desc: PoolDescriptor) -> PoolDescriptor:
    wire = descriptor_to_proto(desc).SerializeToString()
    return descriptor_from_proto(pb.PoolDescriptor.FromString(wire))


@given(spec=any_spec)
def test_descriptor_round_trips_through_protobuf(spec) -> None:
    desc = PoolDescriptor("pool", PoolLayout(spec, 4096))
    assert round_trip(desc) == desc


@given(spec=any_spec)
def test_views_rebuilt_from_a_descriptor_see_what_the_owner_wrote(spec) -> None:
    desc = PoolDescriptor("pool", PoolLayout(spec, 4096))
    owner_raw = torch.zeros(desc.layout.end_bytes, dtype=torch.uint8)
    owner = desc.build_views(owner_raw)
    generator = torch.Generator().manual_seed(0)
    for view in all_views(owner):
        view.view(torch.uint8).copy_(
            torch.randint(0, 256, view.view(torch.uint8).shape, generator=generator, dtype=torch.uint8)
        )
    # Another process would map the same bytes; a second tensor over the same storage stands in.
    shared = torch.frombuffer(owner_raw.numpy(), dtype=torch.uint8)
    rebuilt = round_trip(desc).build_views(shared)
    for a, b in zip(all_views(owner), all_views(rebuilt), strict=True):
        assert a.shape == b.shape and a.stride() == b.stride()
        assert a.storage_offset() == b.storage_offset()
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_descriptor_with_tampered_views_is_refused() -> None:
    desc = PoolDescriptor("pool", PoolLayout(MhaSpec(2, 2, 8, 8, "bfloat16", 4, 3)))
    msg = descriptor_to_proto(desc)
    msg.views[1].offset_bytes += 2
    with pytest.raises(InvalidSpecError, match="views that differ"):
        descriptor_from_proto(msg)


def test_descriptor_with_wrong_page_bytes_is_refused() -> None:
    msg = descriptor_to_proto(PoolDescriptor("pool", PoolLayout(MhaSpec(2, 2, 8, 8, "bfloat16", 4, 3))))
    msg.page_bytes += 1
    with pytest.raises(InvalidSpecError, match="page_bytes"):
        descriptor_from_proto(msg)


@given(spec=mha_specs())
def test_pools_that_differ_only_in_page_count_are_compatible(spec: MhaSpec) -> None:
    other = MhaSpec(**{**spec.__dict__, "num_pages": spec.num_pages + 7})
    check_compatible(PoolDescriptor("a", PoolLayout(spec)), PoolDescriptor("b", PoolLayout(other)))


@pytest.mark.parametrize(
    ("change", "field"),
    [({"head_num": 4}, "head_num"), ({"dtype": "float16"}, "dtype"), ({"layer_num": 3}, "layer_num")],
)
def test_incompatible_layouts_name_the_difference(change: dict, field: str) -> None:
    base = MhaSpec(2, 2, 8, 8, "bfloat16", 4, 3)
    other = MhaSpec(**{**base.__dict__, **change})
    with pytest.raises(IncompatibleLayoutError, match=field):
        check_compatible(PoolDescriptor("a", PoolLayout(base)), PoolDescriptor("b", PoolLayout(other)))


def test_different_kinds_are_incompatible() -> None:
    mha = PoolDescriptor("a", PoolLayout(MhaSpec(2, 1, 8, 8, "bfloat16", 4, 3)))
    mla = PoolDescriptor("b", PoolLayout(MlaSpec(2, 16, 0, "bfloat16", 4, 3)))
    with pytest.raises(IncompatibleLayoutError, match="kinds differ"):
        check_compatible(mha, mla)


def test_every_kind_is_one_registry_entry_with_a_proto_message_of_its_fields() -> None:
    """The registry, PoolKind and the proto's PoolSpec name the same kinds, and each kind's
    message has exactly its spec's fields (what the generic codec relies on)."""
    oneof = pb.PoolSpec.DESCRIPTOR.oneofs_by_name["kind"]
    assert set(SPEC_CLASSES) == {k.value for k in PoolKind} == {f.name for f in oneof.fields}
    for name, cls in SPEC_CLASSES.items():
        message = pb.PoolSpec.DESCRIPTOR.fields_by_name[name].message_type
        assert message.name == cls.__name__
        assert [f.name for f in message.fields] == [f.name for f in fields(cls)], name
        preset = next(p for p in PRESETS.values() if p["kind"] == name)
        assert type(spec_from_mapping(preset)) is cls
