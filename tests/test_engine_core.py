"""The engine-neutral core maps every page-major kind of SGLang's reference layout: each
layer of each state of a page is one segment, the segments tile the page, and bytes an
engine copies into a segment are exactly what the reference's view of that layer and page
reads (checked against the views recorded from ``shared/reference/page_major.py``, and
against the module itself where it is checked out). No daemon: the core's copies work on
any buffer."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import pytest
import torch
from golden_layouts import GOLDEN, reference_views
from hypothesis import given
from hypothesis import strategies as st
from strategies import mamba_specs, mha_specs, mla_specs

from kvxfer.client.engine_core.page_segments import Segment, layer_spans, page_segments
from kvxfer.client.engine_core.paged_blocks import PageRows
from kvxfer.errors import IncompatibleLayoutError
from kvxfer.layout import MambaSpec, MhaSpec, MlaSpec, PoolLayout, PoolSpec, ViewRole

GOLDEN_CASES = json.loads(GOLDEN.read_text())["cases"]
RAW_BYTES = 1 << 22


def layout_of(case: dict[str, Any]) -> PoolLayout:
    fields = {k: v for k, v in case.items() if k not in ("kind", "anchor_bytes")}
    if case["kind"] == "mamba":
        fields["conv_state_shapes"] = tuple(tuple(s) for s in fields["conv_state_shapes"])
        fields["temporal_state_shape"] = tuple(fields["temporal_state_shape"])
    spec = {"mha": MhaSpec, "mla": MlaSpec, "mamba": MambaSpec}[case["kind"]](**fields)
    return PoolLayout(spec, case["anchor_bytes"])


def recorded_views(golden: dict[str, Any], raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reference's views as recorded, rebuilt over ``raw``."""
    return {v["name"]: torch.as_strided(raw.view(getattr(torch, v["dtype"])), v["shape"],
                                        v["stride"], v["storage_offset"])
            for v in golden["views"]}


def view_name(segment: Segment) -> str:
    """The name ``golden_layouts`` gives the reference's view holding ``segment``."""
    role = segment.role.value
    return "temporal" if segment.role == ViewRole.TEMPORAL else f"{role}{segment.index}"


def reads(views: dict[str, torch.Tensor], segment: Segment, page: int) -> torch.Tensor:
    """The bytes the reference's view of ``segment``'s layer reads in ``page``."""
    view = views[view_name(segment)]
    selected = view[segment.layer, page] if segment.role in (ViewRole.CONV, ViewRole.TEMPORAL) \
        else view[page]
    return selected.contiguous().view(torch.uint8).flatten()


def check_segments_are_the_references_views(layout: PoolLayout,
                                            views: dict[str, torch.Tensor],
                                            raw: torch.Tensor) -> None:
    """Write one random engine tensor per segment into every page; the reference reads each
    back from its own view; copying the pages back out gives the engine's bytes again."""
    rows = PageRows(raw, layout)
    pages = list(range(layout.num_pages))
    gen = torch.Generator().manual_seed(layout.page_bytes)
    segments = page_segments(layout)
    engine = [torch.randint(0, 256, (layout.num_pages, s.nbytes), generator=gen,
                            dtype=torch.uint8) for s in segments]
    for segment, blocks in zip(segments, engine, strict=True):
        rows.copy_out((segment.offset, segment.nbytes), blocks, pages[::-1], pages)
    for segment, blocks in zip(segments, engine, strict=True):
        for page in pages:
            expected = blocks[layout.num_pages - 1 - page]
            assert torch.equal(reads(views, segment, page), expected), (segment, page)
        back = torch.zeros_like(blocks)
        rows.copy_in((segment.offset, segment.nbytes), back, pages, pages[::-1])
        assert torch.equal(back, blocks), segment


@pytest.mark.parametrize("golden", GOLDEN_CASES,
                         ids=[f"{i}-{g['case']['kind']}" for i, g in enumerate(GOLDEN_CASES)])
def test_each_segment_is_what_the_reference_view_of_that_layer_reads(golden: dict[str, Any]) -> None:
    layout = layout_of(golden["case"])
    raw = torch.zeros(RAW_BYTES, dtype=torch.uint8)
    check_segments_are_the_references_views(layout, recorded_views(golden, raw), raw)


@pytest.mark.parametrize("golden", GOLDEN_CASES,
                         ids=[f"{i}-{g['case']['kind']}" for i, g in enumerate(GOLDEN_CASES)])
def test_the_same_against_the_reference_module_itself(golden: dict[str, Any],
                                                      reference: ModuleType) -> None:
    layout = layout_of(golden["case"])
    raw = torch.zeros(RAW_BYTES, dtype=torch.uint8)
    views = dict(reference_views(reference, golden["case"], raw))
    check_segments_are_the_references_views(layout, views, raw)


@pytest.mark.parametrize("golden", GOLDEN_CASES,
                         ids=[f"{i}-{g['case']['kind']}" for i, g in enumerate(GOLDEN_CASES)])
def test_a_layer_is_one_span_where_its_segments_are_side_by_side(golden: dict[str, Any]) -> None:
    """MHA (K then V) and MLA keep a layer together, so a vLLM-style per-layer block is one
    copy; Mamba keeps each state's layers together, and asking for layer spans says so."""
    layout = layout_of(golden["case"])
    if layout.kind.value == "mamba":
        with pytest.raises(IncompatibleLayoutError, match="copy it by segments"):
            layer_spans(layout)
        return
    spans = layer_spans(layout)
    layers = layout.spec.layer_num
    assert spans == tuple((i * layout.page_bytes // layers, layout.page_bytes // layers)
                          for i in range(layers))


@given(st.one_of(mha_specs(), mla_specs(), mamba_specs()))
def test_the_segments_of_any_page_major_spec_tile_its_page(spec: PoolSpec) -> None:
    layout = PoolLayout(spec)
    segments = page_segments(layout)  # raises unless they tile the page
    per_layer = {"mha": 2, "mla": 1}.get(layout.kind.value)
    if per_layer is None:
        assert isinstance(spec, MambaSpec)
        per_layer = len(spec.conv_state_shapes) + 1
    assert len(segments) == per_layer * spec.layer_num
    assert sorted({s.layer for s in segments}) == list(range(spec.layer_num))


def test_views_that_do_not_tile_the_page_are_refused() -> None:
    """A layout whose views leave a gap (a test double dropping layer 1's V) is refused,
    naming where."""
    layout = PoolLayout(MhaSpec(2, 1, 8, 8, "float16", 2, 3))

    class Gappy(PoolLayout):
        def view_specs(self) -> tuple[Any, ...]:
            return tuple(v for v in super().view_specs() if (v.role, v.index) != (ViewRole.V, 0))

    gappy = Gappy(layout.spec, layout.anchor_bytes)
    with pytest.raises(IncompatibleLayoutError, match=r"k\[1\] layer 1 starts at byte 64, "
                                                      r"expected 32"):
        page_segments(gappy)
