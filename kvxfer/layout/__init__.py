"""Page-major pool layouts: specs, views, and where pools sit in their arena.

- ``specs``: what a pool stores (MHA, head-major MHA, MLA, Mamba) and the bytes it takes;
- ``views``: strided tensors over raw bytes (``ViewSpec``, ``PoolViews``);
- ``pool_layout``: a spec placed at an anchor (``PoolLayout``), and ``pack_arena``.
"""

from kvxfer.layout.pool_layout import PoolLayout, pack_arena
from kvxfer.layout.specs import (
    MambaSpec,
    MhaHeadMajorSpec,
    MhaSpec,
    MlaSpec,
    PoolKind,
    PoolSpec,
)
from kvxfer.layout.views import PoolViews, ViewRole, ViewSpec, build_views

__all__ = [
    "MambaSpec", "MhaHeadMajorSpec", "MhaSpec", "MlaSpec", "PoolKind", "PoolLayout", "PoolSpec", "PoolViews",
    "ViewRole", "ViewSpec", "build_views", "pack_arena",
]
