"""The daemon's configuration: one settings model, read from a file, the environment and flags.

``DaemonConfig`` states every setting once, with its default, its bounds and
the help text ``kvxfer serve --help`` shows (pydantic-settings builds the flags
from it). A setting comes from, in order of precedence: a flag
(``--peer-address``), the environment (``KVXFER_PEER_ADDRESS``), the YAML file
given with ``--config`` (``peer_address:``), the default.

Pools come from the file (``pools:`` and ``arenas:``) and from ``--pool``
flags (``NAME=PRESET`` or ``name=N,kind=mha,...``). A pool entry is a mapping::

    {name: kv, kind: mha, layer_num: 32, head_num: 8, head_dim: 128,
     v_head_dim: 128, dtype: bfloat16, page_size: 16, num_pages: 512}

Pools listed under ``pools`` get an arena (raw buffer) each; pools listed under
an entry of ``arenas`` share that arena's buffer (a hybrid model: MHA + Mamba).
A bad value is refused at start with InvalidSpecError naming the key, the value
and what was expected.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic.config import JsonDict
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    CliSuppress,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from kvxfer.errors import InvalidSpecError, KvxferError
from kvxfer.layout import PoolSpec
from kvxfer.layout.kinds import spec_from_mapping
from kvxfer.server.dial_policy import LOOPBACK, parse_networks, parse_ports
from kvxfer.server.limits import MIN_CHUNK_BYTES, Limits

#: The config file of the load in progress (read by the file source below).
_CONFIG_FILE: ContextVar[Path | None] = ContextVar("kvxfer_config_file", default=None)


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


def _arenas(pools: list[Any], arenas: list[Any], device: str) -> tuple[ArenaConfig, ...]:
    built = []
    for i, pool in enumerate(pools):
        entry = dict(parse_pool_flag(pool) if isinstance(pool, str) else pool)
        name = entry.pop("name", None) or f"pool{i}"
        dev = entry.pop("device", device)
        built.append(ArenaConfig(name, dev, (PoolConfig(name, spec_from_mapping(entry, where=f"pool {name!r}")),)))
    for a in arenas:
        a = dict(a)
        aname = a.get("name") or f"arena{len(built)}"
        members = []
        for j, pool in enumerate(a.get("pools", [])):
            entry = dict(pool)
            name = entry.pop("name", None) or f"{aname}-{j}"
            members.append(PoolConfig(name, spec_from_mapping(entry, where=f"pool {name!r}")))
        if not members:
            raise InvalidSpecError(f"arena {aname!r} has no pools")
        built.append(ArenaConfig(aname, a.get("device", device), tuple(members)))
    if not built:
        raise InvalidSpecError("no pools configured; pass --pool NAME=PRESET or a config file with 'pools:'")
    names = [p.name for a in built for p in a.pools]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InvalidSpecError(f"pool names must be unique; repeated: {dupes}")
    return tuple(built)


def _setting(default: Any, description: str, expected: str = "", **bounds: Any) -> Any:
    """A setting's default, help text and bounds; ``expected`` words the bounds for errors."""
    extra: JsonDict | None = {"expected": expected} if expected else None
    return Field(default, description=description, json_schema_extra=extra, **bounds)


PORT = {"ge": 0, "le": 65535}
ABOVE_ZERO = "a number above 0"


class DaemonConfig(BaseSettings):
    """Everything ``kvxfer serve`` needs (see the module docstring for where values come from)."""

    model_config = SettingsConfigDict(
        env_prefix="KVXFER_", extra="forbid", frozen=True, arbitrary_types_allowed=True,
        cli_kebab_case=True, cli_implicit_flags=True, cli_hide_none_type=True)

    arenas: CliSuppress[tuple[ArenaConfig, ...]] = ()
    device: str = _setting("cpu", "device of pools that name none: cpu or cuda:N")
    worker_address: str = _setting(
        "unix:///run/kvxfer/kvxfer.sock", "address for workers on this node: unix:///PATH or host:port")
    peer_address: str = _setting("127.0.0.1:7500",
                                 "host:port for peer daemons (port 0 picks a free one)")
    advertise_address: str = _setting(
        "", "host:port peers should use to reach us, when binding 0.0.0.0 (empty: the bound one)")
    peer_tls_cert: str = _setting(
        "", "PEM certificate this daemon presents to peers (with --peer-tls-key and "
            "--peer-tls-ca: mutual TLS on the peer API; kvxfer certs makes them)")
    peer_tls_key: str = _setting("", "PEM private key of --peer-tls-cert")
    peer_tls_ca: str = _setting(
        "", "PEM CA certificates; a peer's certificate must be signed by one of them")
    peer_allow: list[str] = _setting(
        [], "with TLS, the only peer identities (certificate common or DNS names) admitted, "
            "and the only ones a dialled peer's certificate may name; repeatable (empty: any "
            "certificate the CA signed)")
    dial_allow: list[str] = _setting(
        list(LOOPBACK), "the only networks (CIDRs or addresses) this daemon dials as peers; a "
        "pull names its peer, so the address is client input; repeatable (default: loopback "
        "only; a name must resolve to allowed addresses only)")
    dial_ports: list[str] = _setting(
        [], "the only ports this daemon dials peers at (a port, or a range LOW-HIGH), so that "
        "a pull cannot aim it at another service of an allowed host; repeatable (default: any "
        "port; set it to your daemons' peer port)")
    insecure_peer: bool = _setting(
        False, "serve the peer API in plaintext on an address other machines can reach "
               "(without it, a plaintext peer API binds only to loopback)")
    ucx_host: str = _setting("127.0.0.1", "address peers reach the UCX listeners at")
    ucx_port: int = _setting(0, "UCX listener port of data lane 0; lane i listens on PORT+i "
                                "(0: any free ports)", "a port from 0 to 65535", **PORT)
    ucx_lanes: int = _setting(
        1, "UCX workers, each with its own thread, that move one transfer's chunks side by side "
           "(peers use the smaller count of the two). Over shared memory (cma: UCX error "
           "handling off) each lane copies on its own core; over tcp on 2 cores a second lane "
           "made transfers slower", ABOVE_ZERO, gt=0)
    ucx_error_handling: bool = _setting(
        True, "UCX peer error handling (every daemon must agree). Off lets UCX copy over shared "
              "memory (cma) between daemons on one node, 1.2-1.7x faster in our loopback runs, "
              "but a peer that dies mid-transfer over cma can abort this daemon: only turn it "
              "off where no peer can die uncleanly")
    local_copy: bool = _setting(
        False, "same-host transfers without the network: a receiving daemon that can open a "
               "sending daemon's pool files (same host, same shm directory, same user or "
               "worker group) maps them read-only and copies the pages itself, several times "
               "faster than UCX over loopback and safe against a dying peer. Both daemons must "
               "turn it on (the sender lets its pools be read, the receiver reads); peers it "
               "cannot read still use UCX")
    chunk_bytes: int = _setting(4 << 20, "largest UCX message in bytes", "at least 4096",
                                ge=MIN_CHUNK_BYTES)
    window_bytes: int = _setting(
        64 << 20, "bytes in flight per peer (split over its lanes), shared by its transfers in "
                  "turn; smaller lets a small transfer pass large ones sooner, at some bandwidth",
        ABOVE_ZERO, gt=0)
    heartbeat_s: float = _setting(
        1.0, "seconds between a session's heartbeats; a peer silent for 3 heartbeats + 1 s is lost",
        ABOVE_ZERO, gt=0)
    default_timeout_s: float = _setting(30.0, "deadline of a transfer registered without one",
                                        ABOVE_ZERO, gt=0)
    max_offer_s: float = _setting(
        600.0, "the longest an offer can be kept waiting for its pull by the decode daemon "
               "that wants it (KeepOffers: its engine's request is still queued); past it the "
               "offer ends and its pages are free", "a number above 0, at most 3600",
        gt=0, le=3600)
    grace_s: float = _setting(5.0, "seconds running transfers get to finish at shutdown",
                              "0 or more seconds", ge=0)
    lease_s: float = _setting(60.0, "how long a page lease lasts when its holder names no "
                                    "duration (it can renew or release it sooner)", ABOVE_ZERO, gt=0)
    retain_transfers: int = _setting(
        1024, "finished transfers remembered for wait and transfers", ABOVE_ZERO, gt=0)
    max_sessions_per_peer: int = _setting(
        8, "sessions one peer identity may hold open to this daemon (a peer needs one; a "
           "restarted peer briefly two)", ABOVE_ZERO, gt=0)
    max_active_transfers: int = _setting(
        16384, "transfers registered here and not yet ended", ABOVE_ZERO, gt=0)
    max_message_bytes: int = _setting(
        4 << 20, "largest gRPC message either server accepts, in bytes", "at least 64 KiB",
        ge=64 << 10)
    worker_group: str = _setting(
        "", "a group whose members may use the worker socket and map the pools (both become "
            "mode 0660 and that group; the daemon must belong to it). Empty: owner only, 0600")
    shm_dir: str = _setting(
        "/dev/shm", "where CPU pools' shared memory lives; a hugetlbfs mount or a tmpfs mounted "
                    "with huge=always gives them 2 MiB pages, which copy faster over cma (docs/how-to/tuning.md)")
    otlp_endpoint: str = _setting(
        "", "an OpenTelemetry collector (OTLP over gRPC) to export transfer spans to: "
            "http://HOST:PORT (plaintext, e.g. a collector in the pod) or https://HOST:PORT "
            "(TLS) (empty: tracing off)",
        "empty, http://HOST:PORT or https://HOST:PORT", pattern=r"^(https?://[^/\s]+/?)?$")
    metrics_port: int | None = _setting(
        None, "serve Prometheus metrics on METRICS_HOST:PORT (0: any free port; unset: off)",
        "a port from 0 to 65535", **PORT)
    metrics_host: str = _setting(
        "127.0.0.1", "address the metrics port binds (0.0.0.0 in a Kubernetes pod, so that "
                     "Prometheus can scrape it; the metrics carry no secrets)")

    @field_validator("dial_allow")
    @classmethod
    def _networks(cls, values: list[str]) -> list[str]:
        parse_networks(values)
        return values

    @field_validator("dial_ports", mode="before")
    @classmethod
    def _port_numbers(cls, values: Any) -> Any:
        """Ports written as numbers (YAML ``[7500]``) are ports too."""
        return [str(v) if isinstance(v, int) else v for v in values] if isinstance(values, list) else values

    @field_validator("dial_ports")
    @classmethod
    def _ports(cls, values: list[str]) -> list[str]:
        parse_ports(values)
        return values

    @model_validator(mode="before")
    @classmethod
    def _build_arenas(cls, raw: Any) -> Any:
        """Turn the file's ``pools``/``arenas`` and the ``--pool`` flags into arenas."""
        if not isinstance(raw, dict):
            raise InvalidSpecError("the config must be a mapping of settings")
        raw = dict(raw)
        pools = list(raw.pop("pools", None) or []) + list(raw.pop("pool_flags", None) or [])
        arenas = list(raw.get("arenas") or [])
        if pools or not arenas or not all(isinstance(a, ArenaConfig) for a in arenas):
            raw["arenas"] = _arenas(pools, arenas, str(raw.get("device", "cpu")))
        return raw

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags (put in front by the CLI source), values given in code, KVXFER_* environment
        variables, then the config file."""
        return (init_settings, env_settings,
                YamlConfigSettingsSource(settings_cls, yaml_file=_CONFIG_FILE.get()))

    @property
    def limits(self) -> Limits:
        """The per-daemon bounds against exhaustion."""
        return Limits(self.max_sessions_per_peer,
                      self.max_active_transfers, self.max_message_bytes)

    @property
    def pool_names(self) -> list[str]:
        """Every pool name, in config order."""
        return [p.name for a in self.arenas for p in a.pools]


def load_config(path: str | None = None, overrides: dict[str, Any] | None = None,
                pool_flags: list[str] | None = None, *,
                cli: CliSettingsSource[DaemonConfig] | None = None) -> DaemonConfig:
    """The daemon config: ``cli`` flags over ``overrides`` over the environment over the
    YAML file at ``path`` over defaults, plus ``pool_flags`` (``--pool``) after the file's pools.

    Raises InvalidSpecError naming the first bad key, its value and what was expected.
    """
    values = {k: v for k, v in (overrides or {}).items() if v is not None}
    if pool_flags:
        values["pool_flags"] = pool_flags
    if path is not None:
        _check_file(Path(path))
    token = _CONFIG_FILE.set(Path(path) if path else None)
    try:
        return DaemonConfig(_cli_settings_source=cli, **values)
    except ValidationError as exc:
        raise _explain(exc) from None
    finally:
        _CONFIG_FILE.reset(token)


def _check_file(path: Path) -> None:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidSpecError(f"config {path}: cannot read it: {exc}") from None
    if raw is not None and not isinstance(raw, dict):
        raise InvalidSpecError(f"config {path}: expected a mapping at the top level")


def _explain(exc: ValidationError) -> KvxferError:
    """The first problem of a failed validation, as a kvxfer error naming key, value, bound."""
    error = exc.errors()[0]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, KvxferError):
        return cause
    key = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        known = sorted(set(DaemonConfig.model_fields) - {"arenas"} | {"pools"})
        unknown = sorted(str(e["loc"][0]) for e in exc.errors() if e["type"] == "extra_forbidden")
        return InvalidSpecError(f"unknown config keys {unknown}; expected some of {known}")
    field = DaemonConfig.model_fields.get(str(error["loc"][0]))
    extra = field.json_schema_extra if field is not None else None
    expected = extra.get("expected") if isinstance(extra, dict) else None
    return InvalidSpecError(f"{key}={error.get('input')!r}; expected {expected or error['msg']}")
