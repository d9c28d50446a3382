"""What the connector's halves tell each other, and what a prefill engine tells a decode engine.

Between engines, through the proxy or router, ``kv_transfer_params`` follows vLLM's
NixlConnector convention, in kvxfer's params **v4** (``docs/trust.md``): the router
sends ``{"do_remote_decode": true}`` to the prefill engine (optionally
``"verify": true``); the prefill response carries ``{"do_remote_prefill": true,
"do_remote_decode": false, "kvxfer": {"version": 4, ...}}`` (``KvxferParamsV4``:
which daemon, which transfer, the page layout of the bytes, the model's identity),
which the router passes unchanged to the decode engine. Compatibility is decided by
bytes and model: the layouts must agree field by field and the model fingerprints
must be equal; the model's name and the vLLM version travel only to be logged. The
engines' tensor-parallel sizes may differ (``engine_core.head_split``).
Params are client input: ``parse_remote_prefill`` validates them strictly into typed
records or a ``Refusal`` naming the reason, never raises, and nothing in them says how
many tokens to load (the decode engine counts its own prompt).

Within an engine, the scheduler half sends the worker half a ``StepPlan`` with
every step: blocks to save into leased daemon pages (prefill), transfers to
pull into newly allocated blocks (decode), and loads to drop because their
request ended.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvxfer.client.integrations.vllm.layout import BlockLayout, PageLayout
from kvxfer.client.integrations.vllm.model_identity import FINGERPRINT_CHARS, ModelIdentity
from kvxfer.errors import InvalidSpecError
from kvxfer.status import OfferHold

#: The version of ``kv_transfer_params["kvxfer"]`` this connector writes and reads (v1
#: compared model paths and vLLM versions; v2 compared the bytes and the model's
#: fingerprint, block by block; v3 compared pages, so engines of other block sizes load; v4
#: pages of a number of the model's KV heads, so engines of other TP sizes load).
PARAMS_VERSION: Final = 4
#: A transfer id: printable ASCII without spaces or ``#`` (reserved for the parts of offers),
#: short enough for the daemon's limit (256) with a rank's and a part's suffixes.
TRANSFER_ID_PATTERN = r'^[!-"$-~]{1,240}$'
#: A daemon's peer address: ``host:port`` with a DNS name, IPv4 or bracketed IPv6 host.
PEER_PATTERN = r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):[0-9]{1,5}$"
#: An offer's capability: 128 random bits in hex (``kvxfer.server.leases``).
CAPABILITY_PATTERN = r"^[0-9a-f]{32}$"

#: Why a request's params were not followed (the keys of ``SchedulerSide.refusals``):
#: ``layout``, another page layout of the bytes; ``model``, another model (fingerprint);
#: ``unsupported``, a request whose KV the connector cannot bind to its prompt.
RefusalReason = Literal["malformed", "version", "layout", "model", "unsupported"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class LayoutV4(_Strict):
    """``PageLayout`` as params carry it: every field, exact types."""

    dtype: str = Field(max_length=64)
    page_size: int = Field(gt=0, le=1 << 20)
    num_layers: int = Field(gt=0, le=1 << 16)
    page_heads: int = Field(gt=0, le=1 << 16)
    model_kv_heads: int = Field(gt=0, le=1 << 16)
    head_size: int = Field(gt=0, le=1 << 16)
    tp_size: int = Field(gt=0, le=1 << 10)
    block_format: str = Field(max_length=256)


class ModelV4(_Strict):
    """``ModelIdentity`` as params carry it."""

    fingerprint: str = Field(pattern=rf"^[0-9a-f]{{{FINGERPRINT_CHARS}}}$")
    name: str = Field(max_length=4096)
    vllm_version: str = Field(max_length=256)


class KvxferParamsV4(_Strict):
    """``kv_transfer_params["kvxfer"]``, version 4."""

    version: Literal[4]
    transfer_id: str = Field(pattern=TRANSFER_ID_PATTERN)
    peer: str = Field(pattern=PEER_PATTERN)
    capabilities: list[Annotated[str, Field(pattern=CAPABILITY_PATTERN)]] = Field(
        min_length=1, max_length=1 << 16, repr=False)
    layout: LayoutV4
    model: ModelV4


@dataclass(frozen=True)
class RemotePrefill:
    """Where a request's prefilled KV waits: a transfer offered by a prefill engine's daemon,
    one per tensor-parallel rank, each pulled with its rank's capability."""

    transfer_id: str
    peer: str
    capabilities: tuple[str, ...] = field(repr=False)
    layout: PageLayout
    model: ModelIdentity

    def holds(self, ranks: Collection[int] | None = None) -> list[OfferHold]:
        """Its offers, one per prefill rank (of ``ranks``; None: all), with their
        capabilities (to keep or drop them)."""
        return [OfferHold(rank_transfer(self.transfer_id, rank, len(self.capabilities)), cap)
                for rank, cap in enumerate(self.capabilities) if ranks is None or rank in ranks]

    def to_params(self) -> dict[str, Any]:
        """The prefill response's ``kv_transfer_params``."""
        ours = KvxferParamsV4(version=PARAMS_VERSION, transfer_id=self.transfer_id,
                              peer=self.peer, capabilities=list(self.capabilities),
                              layout=LayoutV4(**self.layout.as_dict()),
                              model=ModelV4(**dataclasses.asdict(self.model)))
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "kvxfer": ours.model_dump()}


@dataclass(frozen=True)
class Refusal:
    """Params that ask for a remote prefill this connector will not load, and why."""

    reason: RefusalReason
    detail: str


def parse_remote_prefill(params: Any, ours: BlockLayout,
                         our_model: ModelIdentity) -> RemotePrefill | Refusal | None:
    """What a decode request's ``kv_transfer_params`` ask for: None when no remote prefill
    (``do_remote_prefill`` absent or false), a ``RemotePrefill`` to load, or a ``Refusal``
    (malformed, another version, another page layout than ``ours``'s, another model than
    ``our_model``). Never raises."""
    asked = params.get("do_remote_prefill") if isinstance(params, dict) else None
    if asked is None or asked is False:
        return None
    if asked is not True:
        return Refusal("malformed", f"do_remote_prefill is {_short(asked)}, expected true or false")
    if params.get("do_remote_decode") is True:
        return Refusal("malformed", "do_remote_prefill and do_remote_decode are both true; a "
                                    "request is either prefilled elsewhere or handed off")
    raw = params.get("kvxfer")
    if not isinstance(raw, dict):
        return Refusal("malformed", f"kvxfer is {_short(raw)}, expected an object of params "
                                    f"v{PARAMS_VERSION} (was the prefill engine's connector kvxfer?)")
    version = raw.get("version")
    if version != PARAMS_VERSION or type(version) is not int:
        return Refusal("version", f"params version {_short(version)}; this connector reads "
                                  f"version {PARAMS_VERSION}")
    try:
        parsed = KvxferParamsV4.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "kvxfer"
        return Refusal("malformed", f"kvxfer.{where}: {error['msg']}")
    try:
        theirs = PageLayout(**parsed.layout.model_dump())
        theirs.split  # noqa: B018 - validates how their heads split over their ranks
    except InvalidSpecError as exc:
        return Refusal("malformed", f"kvxfer.layout: {exc}")
    if len(parsed.capabilities) != theirs.tp_size:
        return Refusal("malformed", f"kvxfer.capabilities has {len(parsed.capabilities)} "
                                    f"entries; expected one per rank ({theirs.tp_size})")
    differences = ours.differences(theirs)
    if differences:
        return Refusal("layout", "the prefill engine's page layout differs from ours: "
                                 + "; ".join(differences))
    theirs_model = ModelIdentity(**parsed.model.model_dump())
    if theirs_model.fingerprint != our_model.fingerprint:
        return Refusal("model", f"the prefill engine ran another model: fingerprint "
                                f"{theirs_model.fingerprint} ({theirs_model.name!r}), ours "
                                f"{our_model.fingerprint} ({our_model.name!r})")
    return RemotePrefill(parsed.transfer_id, parsed.peer, tuple(parsed.capabilities), theirs,
                         theirs_model)


def wants_remote_decode(params: Any) -> bool:
    """True when a prefill request's ``kv_transfer_params`` ask for its KV to be handed off
    (``do_remote_decode`` exactly true)."""
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def wants_verify(params: Any) -> bool:
    """True when a prefill request asks for checksums (``verify`` exactly true)."""
    return isinstance(params, dict) and params.get("verify") is True


def _short(value: Any) -> str:
    """A value for an error message: its type and at most 40 characters of it."""
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def rank_transfer(transfer_id: str, rank: int, tp_size: int) -> str:
    """The transfer of one tensor-parallel rank's shard (the id itself when TP is 1)."""
    return transfer_id if tp_size == 1 else f"{transfer_id}/tp{rank}"


@dataclass(frozen=True)
class Save:
    """Prefill: each rank copies the request's blocks, layer by layer as the forward computes
    them, each layer's from its KV cache group's block table (``block_tables``, one per group:
    ``block_tables.py``), into the pages leased for it (page ``t * g + j`` of ``pages[rank]``
    holds head group ``j`` of part ``t % n`` of block ``t // n``, ``n`` the token pages per
    block and ``g`` the groups: ``engine_core.head_split``), then offers them as
    its rank's transfer of ``transfer_id``, recording ``prompt_digest`` with it.
    ``arena_epoch`` is the daemon memory epoch the leases were granted in: a worker whose
    mapping is older re-attaches before writing. ``capabilities`` (per rank, the leases')
    go into the response's params; the scheduler half keeps them, and the plan it sends to
    the workers carries none."""

    req_id: str
    transfer_id: str
    block_tables: tuple[tuple[int, ...], ...]
    lease_ids: tuple[str, ...]
    pages: tuple[tuple[int, ...], ...]
    verify: bool
    prompt_digest: bytes
    arena_epoch: str = ""
    capabilities: tuple[str, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class Load:
    """Decode: each rank pulls, from each of the ``prefill_tp`` prefill ranks' transfers of
    ``transfer_id`` that holds some of its KV heads (``engine_core.head_split``), the pages of
    token pages ``first_page`` to ``num_pages`` (earlier ones are a local prefix-cache hit:
    they do not cross the wire) from ``peer``, with that rank's capability and the request's
    ``prompt_digest``, then copies token page ``t`` into part ``t % n`` of block
    ``table[t // n - first_page // n]`` (``n`` the token pages per block; ``first_page`` is a
    multiple) of each layer's KV cache group's table in ``block_tables``, each head group among
    its heads. A load with ``refused`` set fails at
    once, moving nothing. ``planned_unix``: when the scheduler planned it (where its timeline
    in the stats starts)."""

    req_id: str
    transfer_id: str
    peer: str
    num_pages: int
    first_page: int
    block_tables: tuple[tuple[int, ...], ...]
    prefill_tp: int = 1
    refused: str = ""
    capabilities: tuple[str, ...] = field(default=(), repr=False)
    prompt_digest: bytes = b""
    planned_unix: float = 0.0

    @property
    def pulled_pages(self) -> int:
        """The token pages that cross the wire."""
        return self.num_pages - self.first_page


@dataclass
class StepPlan:
    """One step's instructions from the scheduler half to the worker half."""

    saves: list[Save] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    #: The step computes no token: the worker may wait a little for its loads' endings.
    idle: bool = False
