"""Where each layer of each state sits inside a page, from a pool's own view specs.

A page of a page-major pool is a row of ``page_bytes`` bytes. Each view of the pool
(MHA's K and V of a layer, MLA's latent of a layer, each Mamba conv state and the
temporal state, all layers) addresses, within one page, one contiguous run of bytes
per layer: a ``Segment``. ``page_segments`` derives them from the descriptor's views
(the same specs the golden tests hold to SGLang's reference), so an engine moves its
blocks as byte copies of segments, whatever the kind: ``layer_spans`` merges each layer's
segments when they lie side by side (MHA's K then V, MLA's latent), which is how vLLM's
per-layer blocks map onto pages; Mamba keeps each state's layers together, so its
layers are not contiguous, and an engine copies it segment by segment instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvxfer.dtypes import itemsize
from kvxfer.errors import IncompatibleLayoutError
from kvxfer.layout import PoolLayout, ViewRole, ViewSpec


@dataclass(frozen=True)
class Segment:
    """One layer of one view within a page: ``nbytes`` bytes from ``offset`` of the page."""

    role: ViewRole
    index: int
    layer: int
    offset: int
    nbytes: int


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def _segments_of(view: ViewSpec, layout: PoolLayout) -> list[Segment]:
    """The segments of one view: its page dimension is the first of its first two that
    steps a whole page; the dimension before it, if any, is its layers (else the view is
    one layer, its index); the dimensions after it must be contiguous: one segment."""
    size = itemsize(view.dtype)
    page_elems = layout.page_bytes // size
    page_dims = [d for d, (n, s) in enumerate(zip(view.shape[:2], view.stride[:2]))
                 if n == layout.num_pages and s == page_elems]
    if not page_dims:
        raise IncompatibleLayoutError(f"view {view.role.value}[{view.index}] {view.shape} "
                                      "has no page dimension kvxfer can split into segments")
    page_dim = page_dims[0]
    inner_shape, inner_stride = view.shape[page_dim + 1:], view.stride[page_dim + 1:]
    if not _contiguous(inner_shape, inner_stride):
        raise IncompatibleLayoutError(f"view {view.role.value}[{view.index}]: a layer of a page "
                                      f"is not contiguous (shape {view.shape}, strides "
                                      f"{view.stride})")
    nbytes = math.prod(inner_shape) * size
    start = view.offset_bytes - layout.anchor_bytes
    if page_dim == 0:
        return [Segment(view.role, view.index, view.index, start, nbytes)]
    return [Segment(view.role, view.index, layer, start + layer * view.stride[0] * size, nbytes)
            for layer in range(view.shape[0])]


def page_segments(layout: PoolLayout) -> tuple[Segment, ...]:
    """Every segment of a page of ``layout``, in page order; IncompatibleLayoutError unless
    they tile the page exactly (no gap, no overlap)."""
    segments = sorted((s for view in layout.view_specs() for s in _segments_of(view, layout)),
                      key=lambda s: s.offset)
    at = 0
    for s in segments:
        if s.offset != at:
            raise IncompatibleLayoutError(f"the segments of a {layout.kind.value} page do not tile "
                                          f"it: {s.role.value}[{s.index}] layer {s.layer} starts "
                                          f"at byte {s.offset}, expected {at}")
        at += s.nbytes
    if at != layout.page_bytes:
        raise IncompatibleLayoutError(f"the segments of a {layout.kind.value} page cover {at} of "
                                      f"its {layout.page_bytes} bytes")
    return tuple(segments)


def layer_spans(layout: PoolLayout) -> tuple[tuple[int, int], ...]:
    """Per layer, the ``(offset, nbytes)`` of a page holding all of that layer's segments;
    IncompatibleLayoutError when a layer's segments are not side by side (Mamba)."""
    spans: list[tuple[int, int]] = []
    for s in page_segments(layout):
        if s.layer == len(spans) - 1 and sum(spans[-1]) == s.offset:
            spans[-1] = (spans[-1][0], spans[-1][1] + s.nbytes)
        elif s.layer == len(spans):
            spans.append((s.offset, s.nbytes))
        else:
            raise IncompatibleLayoutError(
                f"a {layout.kind.value} page does not keep each layer together ({s.role.value}"
                f"[{s.index}] of layer {s.layer} follows layer {len(spans) - 1}): copy it by "
                "segments")
    return tuple(spans)
