"""Where each layer of each state sits inside a page, from a pool's own view specs.

A page of a page-major pool is a row of ``page_bytes`` bytes. Each view of the pool
(MHA's K and V of a layer, MLA's latent of a layer, each Mamba conv state and the
temporal state, all layers) addresses, within one page, one contiguous run of bytes
per layer: a ``Segment``. ``page_segments`` derives them from the descriptor's views
(the same specs the golden tests hold to SGLang's reference), so an engine moves its
blocks as byte copies of segments, whatever the kind: ``layer_spans`` merges each layer's
views when they lie side by side (MHA's K then V, MLA's latent) or interleave (a
head-major page's K and V, head by head), which is how vLLM's per-layer blocks map onto
pages; Mamba keeps each state's layers together, so its layers are not contiguous, and
an engine copies it segment by segment instead.
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


@dataclass(frozen=True)
class _Run:
    """One layer of one view within a page: the ``extent`` bytes from ``offset`` it reaches,
    ``nbytes`` of which it holds (fewer when it interleaves with another view)."""

    view: ViewSpec
    layer: int
    offset: int
    extent: int
    nbytes: int
    contiguous: bool


def _runs_of(view: ViewSpec, layout: PoolLayout) -> list[_Run]:
    """The runs of one view: its page dimension is the first of its first two that steps a
    whole page; the dimension before it, if any, is its layers (else the view is one layer,
    its index); the dimensions after it address one page's bytes of the layer."""
    size = itemsize(view.dtype)
    page_elems = layout.page_bytes // size
    page_dims = [d for d, (n, s) in enumerate(zip(view.shape[:2], view.stride[:2]))
                 if n == layout.num_pages and s == page_elems]
    if not page_dims:
        raise IncompatibleLayoutError(f"view {view.role.value}[{view.index}] {view.shape} "
                                      "has no page dimension kvxfer can split into segments")
    page_dim = page_dims[0]
    inner_shape, inner_stride = view.shape[page_dim + 1:], view.stride[page_dim + 1:]
    nbytes = math.prod(inner_shape) * size
    extent = (sum((n - 1) * s for n, s in zip(inner_shape, inner_stride)) + 1) * size
    contiguous = _contiguous(inner_shape, inner_stride)
    start = view.offset_bytes - layout.anchor_bytes
    if page_dim == 0:
        return [_Run(view, view.index, start, extent, nbytes, contiguous)]
    return [_Run(view, layer, start + layer * view.stride[0] * size, extent, nbytes, contiguous)
            for layer in range(view.shape[0])]


def _all_runs(layout: PoolLayout) -> list[_Run]:
    return sorted((r for view in layout.view_specs() for r in _runs_of(view, layout)),
                  key=lambda r: r.offset)


def page_segments(layout: PoolLayout) -> tuple[Segment, ...]:
    """Every segment of a page of ``layout``, in page order; IncompatibleLayoutError unless
    each view's layer is one contiguous run (not so in a head-major page, whose K and V
    interleave head by head: copy it by ``layer_spans``) and they tile the page exactly
    (no gap, no overlap)."""
    at = 0
    segments = []
    for r in _all_runs(layout):
        if not r.contiguous:
            raise IncompatibleLayoutError(f"view {r.view.role.value}[{r.view.index}]: a layer of "
                                          f"a page is not contiguous (shape {r.view.shape}, "
                                          f"strides {r.view.stride})")
        if r.offset != at:
            raise IncompatibleLayoutError(f"the segments of a {layout.kind.value} page do not tile "
                                          f"it: {r.view.role.value}[{r.view.index}] layer {r.layer} "
                                          f"starts at byte {r.offset}, expected {at}")
        segments.append(Segment(r.view.role, r.view.index, r.layer, r.offset, r.nbytes))
        at += r.nbytes
    if at != layout.page_bytes:
        raise IncompatibleLayoutError(f"the segments of a {layout.kind.value} page cover {at} of "
                                      f"its {layout.page_bytes} bytes")
    return tuple(segments)


def layer_spans(layout: PoolLayout) -> tuple[tuple[int, int], ...]:
    """Per layer, the ``(offset, nbytes)`` of a page holding all of that layer's views (side
    by side, as MHA's K then V and MLA's latent, or interleaved, as a head-major page's);
    IncompatibleLayoutError unless the layers' spans tile the page in layer order, each
    exactly filled by its views (not Mamba's, which keeps each state's layers together)."""
    spans: list[tuple[int, int, int]] = []  # (offset, end, bytes held)
    for r in _all_runs(layout):
        end = r.offset + r.extent
        if r.layer == len(spans) - 1 and r.offset <= spans[-1][1]:
            first, last, held = spans[-1]
            spans[-1] = (first, max(last, end), held + r.nbytes)
        elif r.layer == len(spans) and (not spans or spans[-1][1] == r.offset):
            spans.append((r.offset, end, r.nbytes))
        else:
            raise IncompatibleLayoutError(
                f"a {layout.kind.value} page does not keep each layer together "
                f"({r.view.role.value}[{r.view.index}] of layer {r.layer} follows layer "
                f"{len(spans) - 1}): copy it by segments")
    for layer, (first, last, held) in enumerate(spans):
        if held != last - first:
            raise IncompatibleLayoutError(f"layer {layer} of a {layout.kind.value} page spans "
                                          f"{last - first} bytes but its views hold {held}")
    if not spans or spans[0][0] != 0 or spans[-1][1] != layout.page_bytes:
        raise IncompatibleLayoutError(f"the layers of a {layout.kind.value} page do not cover "
                                      f"its {layout.page_bytes} bytes")
    return tuple((first, last - first) for first, last, _ in spans)
