"""Pool layouts match SGLang's page-major reference byte for byte."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import mamba_specs, mha_specs, mla_specs

from kvxfer.dtypes import torch_dtype
from kvxfer.errors import InvalidSpecError
from kvxfer.layout import MambaSpec, MhaSpec, MlaSpec, PoolLayout, pack_arena


def same_view(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert a.stride() == b.stride()
    assert a.storage_offset() == b.storage_offset()
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def anchors(alignment: int) -> st.SearchStrategy[int]:
    return st.integers(0, 64).map(lambda n: n * alignment)


@given(spec=mha_specs(), data=st.data())
def test_mha_views_match_reference(reference, spec: MhaSpec, data: st.DataObject) -> None:
    anchor = data.draw(anchors(spec.alignment))
    layout = PoolLayout(spec, anchor)
    raw = torch.zeros(layout.end_bytes, dtype=torch.uint8)
    ref_k, ref_v = reference.build_page_major_mha_views(
        raw,
        layer_num=spec.layer_num,
        head_num=spec.head_num,
        head_dim=spec.head_dim,
        v_head_dim=spec.v_head_dim,
        store_dtype=torch_dtype(spec.dtype),
        page_size=spec.page_size,
        num_pages=spec.num_pages,
        anchor_bytes=anchor,
    )
    views = layout.build_views(raw)
    assert len(views.k) == len(ref_k) == spec.layer_num
    for ours, theirs in zip(views.k + views.v, ref_k + ref_v):
        same_view(ours, theirs)
    assert spec.slot_bytes == reference.mha_entry_bytes(
        layer_num=spec.layer_num,
        head_num=spec.head_num,
        head_dim=spec.head_dim,
        v_head_dim=spec.v_head_dim,
        itemsize=torch_dtype(spec.dtype).itemsize,
    )


@given(spec=mla_specs(), data=st.data())
def test_mla_views_are_mha_with_one_head_and_no_v(
    reference, spec: MlaSpec, data: st.DataObject
) -> None:
    anchor = data.draw(anchors(spec.alignment))
    layout = PoolLayout(spec, anchor)
    raw = torch.zeros(layout.end_bytes, dtype=torch.uint8)
    ref_k, _ = reference.build_page_major_mha_views(
        raw,
        layer_num=spec.layer_num,
        head_num=1,
        head_dim=spec.latent_dim,
        v_head_dim=0,
        store_dtype=torch_dtype(spec.dtype),
        page_size=spec.page_size,
        num_pages=spec.num_pages,
        anchor_bytes=anchor,
    )
    views = layout.build_views(raw)
    assert views.v == ()
    for ours, theirs in zip(views.latent, ref_k, strict=True):
        same_view(ours, theirs)


@given(spec=mamba_specs(), data=st.data())
def test_mamba_views_match_reference(reference, spec: MambaSpec, data: st.DataObject) -> None:
    anchor = data.draw(anchors(spec.alignment))
    layout = PoolLayout(spec, anchor)
    raw = torch.zeros(layout.end_bytes, dtype=torch.uint8)
    ref_conv, ref_temporal = reference.build_page_major_mamba_views(
        raw,
        layer_num=spec.layer_num,
        conv_state_shapes=spec.conv_state_shapes,
        conv_dtype=torch_dtype(spec.conv_dtype),
        temporal_state_shape=spec.temporal_state_shape,
        temporal_dtype=torch_dtype(spec.temporal_dtype),
        max_slots=spec.num_slots,
        anchor_bytes=anchor,
    )
    views = layout.build_views(raw)
    for ours, theirs in zip(views.conv, ref_conv, strict=True):
        same_view(ours, theirs)
    assert views.temporal is not None
    same_view(views.temporal, ref_temporal)
    assert spec.page_size == 1


@given(spec=mha_specs())
def test_a_page_is_one_contiguous_block(spec: MhaSpec) -> None:
    """Writing one page through the views touches exactly that page's bytes."""
    layout = PoolLayout(spec)
    raw = torch.zeros(layout.end_bytes, dtype=torch.uint8)
    views = layout.build_views(raw)
    page = spec.num_pages - 1
    for k, v in zip(views.k, views.v):
        k[page].view(torch.uint8).fill_(0xAB)
        v[page].view(torch.uint8).fill_(0xCD)
    touched = (raw != 0).nonzero().flatten()
    assert touched.min() >= layout.page_offset(page)
    assert touched.max() < layout.page_offset(page) + spec.page_bytes
    assert touched.numel() == spec.page_bytes


def test_standard_workload_sizes() -> None:
    spec = MhaSpec(32, 8, 128, 128, "bfloat16", page_size=16, num_pages=512)
    assert spec.slot_bytes == 128 * 1024
    assert spec.page_bytes == 2 * 1024 * 1024
    assert spec.total_bytes == 1024 * 1024 * 1024


def test_hybrid_arena_places_pools_without_overlap() -> None:
    mha = MhaSpec(2, 2, 8, 8, "bfloat16", 4, 10)
    mamba = MambaSpec(2, ((3, 8),), "float32", (4, 8), "float32", 5)
    (a, b), size = pack_arena([mha, mamba])
    assert a.anchor_bytes == 0
    assert b.anchor_bytes >= a.end_bytes and b.anchor_bytes % 4096 == 0
    assert size == b.end_bytes
    raw = torch.zeros(size, dtype=torch.uint8)
    va, vb = a.build_views(raw), b.build_views(raw)
    for k in va.k:
        k.fill_(1.0)
    assert vb.temporal is not None and vb.temporal.abs().sum() == 0


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: MhaSpec(0, 8, 128, 128, "bfloat16", 16, 4), "layer_num=0"),
        (lambda: MhaSpec(2, -1, 128, 128, "bfloat16", 16, 4), "head_num=-1"),
        (lambda: MhaSpec(2, 8, 128, 128, "bfloat13", 16, 4), "dtype='bfloat13'"),
        (lambda: MhaSpec(2, 8, 128, 128, "bfloat16", 16, 0), "num_pages=0"),
        (lambda: MlaSpec(2, 0, 64, "bfloat16", 1, 4), "kv_lora_rank=0"),
        (lambda: MambaSpec(2, (), "float32", (4,), "float32", 3), "conv_state_shapes"),
        (lambda: MambaSpec(1, ((3,),), "bfloat16", (1,), "float32", 3), "misaligned"),
        (lambda: PoolLayout(MhaSpec(2, 8, 128, 128, "bfloat16", 16, 4), 3), "anchor_bytes=3"),
    ],
)
def test_bad_specs_raise_naming_the_field(make, field: str) -> None:
    with pytest.raises(InvalidSpecError, match=field.replace("(", r"\(").replace("[", r"\[")):
        make()


def test_a_pool_that_does_not_fit_its_buffer_is_refused() -> None:
    layout = PoolLayout(MhaSpec(2, 2, 8, 8, "bfloat16", 4, 10), 4096)
    with pytest.raises(InvalidSpecError, match="buffer has"):
        layout.build_views(torch.zeros(layout.end_bytes - 1, dtype=torch.uint8))
