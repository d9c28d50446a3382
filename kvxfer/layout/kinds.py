"""Every pool kind in one registry, and the named pool shapes (presets).

A kind's one name is ``PoolKind``'s value: the config's ``kind``, the proto
``PoolSpec``'s field, the CLI's. ``SPEC_CLASSES`` maps it to its spec class, whose
fields are read from a config mapping here (``spec_from_mapping``) and converted to and
from protobuf by ``kvxfer.wire.codec``, both generically. Adding a kind is its spec
class in ``specs`` (with its ``PoolKind``), a proto message of the same name and fields
(a tuple of ints is a ``Shape``, a tuple of them a repeated ``Shape``), and one entry in
``SPEC_CLASSES``.
"""

from __future__ import annotations

import typing
from dataclasses import fields
from typing import Any

from kvxfer.errors import InvalidSpecError
from kvxfer.layout.mamba import MambaSpec
from kvxfer.layout.specs import (
    MhaHeadMajorSpec,
    MhaSpec,
    MlaSpec,
    OpaqueSpec,
    PoolSpec,
)

#: Every kind's spec class, by the kind's name.
SPEC_CLASSES: dict[str, type[PoolSpec]] = {
    cls.kind.value: cls for cls in (MhaSpec, MhaHeadMajorSpec, MlaSpec, MambaSpec, OpaqueSpec)}

#: Named pool shapes for flags and the CLI (``--pool kv=llama8b``).
PRESETS: dict[str, dict[str, Any]] = {
    # The standard workload: llama-8B-like, 2 MiB pages.
    "llama8b": dict(kind="mha", layer_num=32, head_num=8, head_dim=128, v_head_dim=128,
                    dtype="bfloat16", page_size=16, num_pages=512),
    # The same bytes per token slot with token-granular pages (128 KiB pages).
    "llama8b-ps1": dict(kind="mha", layer_num=32, head_num=8, head_dim=128, v_head_dim=128,
                        dtype="bfloat16", page_size=1, num_pages=8192),
    "tiny": dict(kind="mha", layer_num=4, head_num=2, head_dim=64, v_head_dim=64,
                 dtype="bfloat16", page_size=16, num_pages=64),
    # vLLM's CPU blocks of a tiny model: head by head, K transposed, 32-token pages.
    "tiny-head-major": dict(kind="mha_head_major", layer_num=4, head_num=2, head_dim=64,
                            dtype="bfloat16", page_size=32, num_pages=64),
    # Blocks kvxfer moves whole (4 layers of 32 KiB per page).
    "opaque-small": dict(kind="opaque", layer_num=4, layer_bytes=32768, page_size=32,
                         num_pages=64),
    "mla-small": dict(kind="mla", layer_num=4, kv_lora_rank=128, qk_rope_head_dim=32,
                      dtype="bfloat16", page_size=16, num_pages=64),
    "mamba-small": dict(kind="mamba", layer_num=4, conv_state_shapes=[[64, 4]],
                        conv_dtype="bfloat16", temporal_state_shape=[8, 16, 16],
                        temporal_dtype="float32", num_slots=16),
}


def spec_class(kind: str | None, where: str = "pool") -> type[PoolSpec]:
    """The spec class of the kind named ``kind``; InvalidSpecError naming the known ones."""
    cls = SPEC_CLASSES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise InvalidSpecError(f"{where}: kind={kind!r} is unknown; expected one of {sorted(SPEC_CLASSES)}")
    return cls


def shape_depths(cls: type[PoolSpec]) -> dict[str, int]:
    """The fields of ``cls`` that hold shapes: 1 for a tuple of ints, 2 for a tuple of them."""
    depths = {}
    for name, hint in typing.get_type_hints(cls).items():
        depth = 0
        while typing.get_origin(hint) is tuple:
            depth, hint = depth + 1, typing.get_args(hint)[0]
        if depth:
            depths[name] = depth
    return depths


def as_shape(value: Any, depth: int) -> Any:
    """``value`` (lists or tuples, ``depth`` deep) as nested tuples of ints."""
    if depth == 0:
        return int(value)
    return tuple(as_shape(v, depth - 1) for v in value)


def spec_from_mapping(entry: dict[str, Any], *, where: str = "pool") -> PoolSpec:
    """A pool spec from a config mapping (``kind`` or ``preset``, plus the spec's fields)."""
    entry = dict(entry)
    if "preset" in entry:
        preset = entry.pop("preset")
        if preset not in PRESETS:
            raise InvalidSpecError(f"{where}: preset={preset!r} is unknown; expected one of {sorted(PRESETS)}")
        entry = {**PRESETS[preset], **entry}
    kind = entry.pop("kind", None)
    cls = spec_class(kind, where)
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(entry) - names)
    if unknown:
        raise InvalidSpecError(f"{where}: unknown fields {unknown} for a {kind} pool; expected {sorted(names)}")
    missing = sorted(names - set(entry))
    if missing:
        raise InvalidSpecError(f"{where}: missing fields {missing} for a {kind} pool")
    for name, depth in shape_depths(cls).items():
        try:
            entry[name] = as_shape(entry[name], depth)
        except (TypeError, ValueError):
            raise InvalidSpecError(f"{where}: {name}={entry[name]!r} is not a shape; expected "
                                   f"{'a list of ' * (depth - 1)}a list of integers") from None
    return cls(**entry)
