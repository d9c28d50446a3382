"""Views: strided tensors over a pool's raw bytes, described by ``ViewSpec``.

A ``ViewSpec`` (dtype, shape, element strides, byte offset) is all
``torch.as_strided`` needs, and it is what a descriptor carries, so any process
that maps the same bytes rebuilds identical views.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from kvxfer.dtypes import itemsize, torch_dtype
from kvxfer.errors import InvalidSpecError


class ViewRole(enum.Enum):
    """What one view of a pool shows."""

    K = "k"
    V = "v"
    LATENT = "latent"
    CONV = "conv"
    TEMPORAL = "temporal"
    BYTES = "bytes"


@dataclass(frozen=True)
class ViewSpec:
    """One strided tensor view over a raw byte buffer: what ``torch.as_strided`` needs."""

    role: ViewRole
    index: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset_bytes: int

    def __post_init__(self) -> None:
        size = itemsize(self.dtype)
        if self.offset_bytes % size:
            raise InvalidSpecError(
                f"view {self.role.value}[{self.index}] offset_bytes={self.offset_bytes} is not a "
                f"multiple of its {self.dtype} itemsize {size}"
            )
        if len(self.shape) != len(self.stride):
            raise InvalidSpecError(
                f"view {self.role.value}[{self.index}] has shape {self.shape} but strides "
                f"{self.stride}; expected one stride per dimension"
            )

    @property
    def end_bytes(self) -> int:
        """One past the last byte this view can touch."""
        size = itemsize(self.dtype)
        last = sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        return self.offset_bytes + (last + 1) * size

    def build(self, raw: torch.Tensor) -> torch.Tensor:
        """The view over ``raw`` (a 1-D uint8 tensor, which may itself start inside a larger
        storage), sharing its memory; ``offset_bytes`` counts from ``raw``'s first byte."""
        typed = raw.view(torch_dtype(self.dtype))
        return torch.as_strided(
            typed,
            size=self.shape,
            stride=self.stride,
            storage_offset=typed.storage_offset() + self.offset_bytes // itemsize(self.dtype),
        )


@dataclass(frozen=True)
class PoolViews:
    """The tensors an engine reads and writes; which fields are filled depends on the kind.

    MHA: ``k[layer]``, ``v[layer]`` of shape (num_pages, page_size, heads, dim).
    MLA: ``latent[layer]`` of shape (num_pages, page_size, 1, latent_dim).
    Mamba: ``conv[i]`` and ``temporal`` of shape (layers, slots, *inner).
    Opaque: ``layer_bytes[layer]`` of shape (num_pages, layer_bytes), uint8.
    """

    k: tuple[torch.Tensor, ...] = ()
    v: tuple[torch.Tensor, ...] = ()
    latent: tuple[torch.Tensor, ...] = ()
    conv: tuple[torch.Tensor, ...] = ()
    temporal: torch.Tensor | None = None
    layer_bytes: tuple[torch.Tensor, ...] = ()


def build_views(raw: torch.Tensor, views: tuple[ViewSpec, ...]) -> PoolViews:
    """Build every view of ``views`` over ``raw``; raises InvalidSpecError if one does not fit."""
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise InvalidSpecError(
            f"raw buffer must be a 1-D uint8 tensor, got dtype={raw.dtype} dim={raw.dim()}"
        )
    by_role: dict[ViewRole, list[torch.Tensor]] = {role: [] for role in ViewRole}
    for spec in views:
        if spec.end_bytes > raw.numel():
            raise InvalidSpecError(
                f"view {spec.role.value}[{spec.index}] reaches byte {spec.end_bytes} but the "
                f"buffer has {raw.numel()} bytes"
            )
        by_role[spec.role].append(spec.build(raw))
    temporal = by_role[ViewRole.TEMPORAL]
    return PoolViews(
        k=tuple(by_role[ViewRole.K]),
        v=tuple(by_role[ViewRole.V]),
        latent=tuple(by_role[ViewRole.LATENT]),
        conv=tuple(by_role[ViewRole.CONV]),
        temporal=temporal[0] if temporal else None,
        layer_bytes=tuple(by_role[ViewRole.BYTES]),
    )
