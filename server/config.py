"""The daemon's configuration: pools, addresses, UCX and transfer settings.

Loaded from a YAML file and/or command-line flags (flags win). A pool entry is
a mapping such as::

    {name: kv, kind: mha, layer_num: 32, head_num: 8, head_dim: 128,
     v_head_dim: 128, dtype: bfloat16, page_size: 16, num_pages: 512}

Pools listed under ``pools`` get an arena (raw buffer) each; pools listed under
an entry of ``arenas`` share that arena's buffer (a hybrid model: MHA + Mamba).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from kvxfer.errors import InvalidSpecError
from kvxfer.layout import MambaSpec, MhaSpec, MlaSpec, PoolSpec

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
    "mla-small": dict(kind="mla", layer_num=4, kv_lora_rank=128, qk_rope_head_dim=32,
                      dtype="bfloat16", page_size=16, num_pages=64),
    "mamba-small": dict(kind="mamba", layer_num=4, conv_state_shapes=[[64, 4]],
                        conv_dtype="bfloat16", temporal_state_shape=[8, 16, 16],
                        temporal_dtype="float32", num_slots=16),
}

_SPEC_CLASSES = {"mha": MhaSpec, "mla": MlaSpec, "mamba": MambaSpec}


def spec_from_dict(entry: dict[str, Any], *, where: str = "pool") -> PoolSpec:
    """A pool spec from a config mapping (``kind`` plus the spec's fields)."""
    entry = dict(entry)
    if "preset" in entry:
        preset = entry.pop("preset")
        if preset not in PRESETS:
            raise InvalidSpecError(f"{where}: preset={preset!r} is unknown; expected one of {sorted(PRESETS)}")
        entry = {**PRESETS[preset], **entry}
    kind = entry.pop("kind", None)
    cls = _SPEC_CLASSES.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise InvalidSpecError(f"{where}: kind={kind!r} is unknown; expected one of {sorted(_SPEC_CLASSES)}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(entry) - names)
    if unknown:
        raise InvalidSpecError(f"{where}: unknown fields {unknown} for a {kind} pool; expected {sorted(names)}")
    missing = sorted(names - set(entry))
    if missing:
        raise InvalidSpecError(f"{where}: missing fields {missing} for a {kind} pool")
    if kind == "mamba":
        entry["conv_state_shapes"] = tuple(tuple(s) for s in entry["conv_state_shapes"])
        entry["temporal_state_shape"] = tuple(entry["temporal_state_shape"])
    return cls(**entry)


@dataclass(frozen=True)
class PoolConfig:
    """One pool to serve."""

    name: str
    spec: PoolSpec


@dataclass(frozen=True)
class ArenaConfig:
    """One raw buffer and the pools packed into it."""

    name: str
    device: str
    pools: tuple[PoolConfig, ...]


@dataclass(frozen=True)
class DaemonConfig:
    """Everything ``kvxfer serve`` needs."""

    arenas: tuple[ArenaConfig, ...]
    worker_address: str = "unix:///run/kvxfer/kvxfer.sock"
    peer_address: str = "127.0.0.1:7500"
    advertise_address: str = ""
    ucx_host: str = "127.0.0.1"
    ucx_port: int = 0
    ucx_lanes: int = 1
    ucx_error_handling: bool = True
    chunk_bytes: int = 4 << 20
    window_bytes: int = 64 << 20
    heartbeat_s: float = 1.0
    default_timeout_s: float = 30.0
    grace_s: float = 5.0
    retain_transfers: int = 1024
    shm_dir: str = "/dev/shm"
    metrics_port: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        above_zero = (lambda v: v > 0, "a number above 0")
        port = (lambda v: 0 <= v <= 65535, "a port from 0 to 65535")
        checks = {
            "ucx_lanes": above_zero, "chunk_bytes": above_zero, "window_bytes": above_zero,
            "heartbeat_s": above_zero, "default_timeout_s": above_zero,
            "retain_transfers": above_zero, "grace_s": (lambda v: v >= 0, "0 or more seconds"),
            "ucx_port": port, "metrics_port": port,
        }
        for name, (valid, expected) in checks.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not valid(value):
                raise InvalidSpecError(f"{name}={value!r}; expected {expected}")

    @property
    def pool_names(self) -> list[str]:
        """Every pool name, in config order."""
        return [p.name for a in self.arenas for p in a.pools]


def parse_pool_flag(flag: str) -> dict[str, Any]:
    """``name=PRESET`` or ``name=kv,kind=mha,layer_num=2,...`` as a pool config mapping."""
    if "," not in flag and flag.count("=") == 1:
        name, preset = flag.split("=")
        return {"name": name, "preset": preset}
    entry: dict[str, Any] = {}
    for part in flag.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise InvalidSpecError(f"--pool {flag!r}: {part!r} is not key=value")
        entry[key.strip()] = yaml.safe_load(value)
    return entry


def load_config(path: str | None = None, overrides: dict[str, Any] | None = None,
                pool_flags: list[str] | None = None, device: str | None = None) -> DaemonConfig:
    """Build the daemon config from a YAML file, flag overrides and ``--pool`` flags."""
    raw: dict[str, Any] = {}
    if path:
        text = Path(path).read_text()
        raw = yaml.safe_load(text) or {}
        if not isinstance(raw, dict):
            raise InvalidSpecError(f"config {path}: expected a mapping at the top level")
    for key, value in (overrides or {}).items():
        if value is not None:
            raw[key] = value
    pools = list(raw.pop("pools", []) or []) + [parse_pool_flag(f) for f in pool_flags or []]
    default_device = device or raw.pop("device", "cpu")
    arenas = []
    for i, pool in enumerate(pools):
        entry = dict(pool)
        name = entry.pop("name", None) or f"pool{i}"
        dev = entry.pop("device", default_device)
        arenas.append(ArenaConfig(name, dev, (PoolConfig(name, spec_from_dict(entry, where=f"pool {name!r}")),)))
    for a in raw.pop("arenas", []) or []:
        a = dict(a)
        aname = a.get("name") or f"arena{len(arenas)}"
        members = []
        for j, pool in enumerate(a.get("pools", [])):
            entry = dict(pool)
            name = entry.pop("name", None) or f"{aname}-{j}"
            members.append(PoolConfig(name, spec_from_dict(entry, where=f"pool {name!r}")))
        if not members:
            raise InvalidSpecError(f"arena {aname!r} has no pools")
        arenas.append(ArenaConfig(aname, a.get("device", default_device), tuple(members)))
    if not arenas:
        raise InvalidSpecError("no pools configured; pass --pool NAME=PRESET or a config file with 'pools:'")
    names = [p.name for a in arenas for p in a.pools]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InvalidSpecError(f"pool names must be unique; repeated: {dupes}")
    known = {f.name for f in fields(DaemonConfig)} - {"arenas", "extra"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise InvalidSpecError(f"unknown config keys {unknown}; expected some of {sorted(known)}")
    return DaemonConfig(arenas=tuple(arenas), **raw)
