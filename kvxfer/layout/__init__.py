"""Page-major pool layouts: specs, views, and where pools sit in their arena.

- ``specs``: what a pool stores (MHA, head-major MHA, MLA, opaque bytes; ``mamba``: Mamba
  state) and the bytes it takes, from ``fields``' checks;
- ``views``: strided tensors over raw bytes (``ViewSpec``, ``PoolViews``);
- ``pool_layout``: a spec placed at an anchor (``PoolLayout``), and ``pack_arena``.
"""

from kvxfer.layout.fields import PoolKind
from kvxfer.layout.mamba import MambaSpec
from kvxfer.layout.pool_layout import PoolLayout, pack_arena
from kvxfer.layout.specs import (
    MhaHeadMajorSpec,
    MhaSpec,
    MlaSpec,
    OpaqueSpec,
    PoolSpec,
)
from kvxfer.layout.views import PoolViews, ViewRole, ViewSpec, build_views

__all__ = [
    "MambaSpec", "MhaHeadMajorSpec", "MhaSpec", "MlaSpec", "OpaqueSpec", "PoolKind", "PoolLayout",
    "PoolSpec", "PoolViews", "ViewRole", "ViewSpec", "build_views", "pack_arena",
]
