"""What the connector's halves tell each other, and what a prefill engine tells a decode engine.

Between engines, through the proxy, ``kv_transfer_params`` follows vLLM's
NixlConnector convention: the proxy sends ``{"do_remote_decode": true}`` to the
prefill engine (optionally ``"verify": true``); the prefill response carries
``{"do_remote_prefill": true, "do_remote_decode": false, "kvxfer": {...}}``
(``RemotePrefill``: which daemon, which transfer, how many tokens, the block
layout), which the proxy passes unchanged to the decode engine.

Within an engine, the scheduler half sends the worker half a ``StepPlan`` with
every step: blocks to save into leased daemon pages (prefill), transfers to
pull into newly allocated blocks (decode), and loads to drop because their
request ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvxfer.client.integrations.vllm.layout import BlockLayout


@dataclass(frozen=True)
class RemotePrefill:
    """Where a request's prefilled KV waits: a transfer offered by a prefill engine's daemon."""

    transfer_id: str
    peer: str
    num_tokens: int
    layout: BlockLayout

    def to_params(self) -> dict[str, Any]:
        """The prefill response's ``kv_transfer_params``."""
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "kvxfer": {"transfer_id": self.transfer_id, "peer": self.peer,
                           "num_tokens": self.num_tokens, "layout": self.layout.as_dict()}}

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> RemotePrefill | None:
        """The remote prefill a decode request's ``kv_transfer_params`` names, if any.

        Raises IncompatibleLayoutError if the layout it carries is not one.
        """
        if not params or not params.get("do_remote_prefill") or "kvxfer" not in params:
            return None
        ours = params["kvxfer"]
        return cls(str(ours["transfer_id"]), str(ours["peer"]), int(ours["num_tokens"]),
                   BlockLayout.from_dict(ours["layout"]))


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """True when a prefill request's ``kv_transfer_params`` ask for its KV to be handed off."""
    return bool(params and params.get("do_remote_decode"))


def rank_transfer(transfer_id: str, rank: int, tp_size: int) -> str:
    """The transfer of one tensor-parallel rank's shard (the id itself when TP is 1)."""
    return transfer_id if tp_size == 1 else f"{transfer_id}/tp{rank}"


@dataclass(frozen=True)
class Save:
    """Prefill: each rank copies these blocks, layer by layer as the forward computes them,
    into the pages leased for it (block ``i`` into ``pages[rank][i]``), then offers them as
    its rank's transfer of ``transfer_id``."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    lease_ids: tuple[str, ...]
    pages: tuple[tuple[int, ...], ...]
    verify: bool


@dataclass(frozen=True)
class Load:
    """Decode: each rank pulls its transfer of ``transfer_id`` (``num_pages`` pages) from
    ``peer``, then copies page ``first_page + i`` into ``block_ids[i]`` (earlier pages are
    a local prefix-cache hit). A load with ``refused`` set fails at once, moving nothing."""

    req_id: str
    transfer_id: str
    peer: str
    num_pages: int
    first_page: int
    block_ids: tuple[int, ...]
    refused: str = ""


@dataclass
class StepPlan:
    """One step's instructions from the scheduler half to the worker half."""

    saves: list[Save] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
