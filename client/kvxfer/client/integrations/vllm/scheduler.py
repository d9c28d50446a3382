"""The connector's scheduler half: which requests hand off KV, which load it, and when.

Prefill (a request whose ``kv_transfer_params`` say ``do_remote_decode``): in
the step in which its prompt finishes, the scheduler leases pages for all its
prompt tokens from the local daemon (pages of ``page_size`` tokens: a block is one page
or several), one lease per tensor-parallel rank (each
rank holds a shard of the KV heads), and tells the workers to save the blocks
there (``Save``). The lease is taken here, not in the worker, because
``request_finished`` (the same step) must already know whether the KV will be
there: if the lease failed, the response carries no remote prefill and the
decode engine computes the prompt itself. vLLM frees the request's blocks at
once: the daemon holds the KV from then on.

Decode (``do_remote_prefill`` with kvxfer params): the prompt's tokens beyond a
local prefix-cache hit are an asynchronous external hit; once vLLM has
allocated blocks for them, the worker pulls the transfer's pages past the local
hit (only those cross the wire) into leased pages of its own daemon and copies
them into those blocks (``Load``). How many tokens is
the engine's own prompt length, never a number from params. Params that are
malformed, of another version, block layout or model are refused before
any block is allocated: the request is computed here like an ordinary prompt,
and ``refusals`` counts it by reason (the log names each). A load that fails
later is reported failed (``kv_load_failure_policy`` decides: recompute or
fail). A request that ends while its load is pending is cancelled in the next
plan; its load is reported finished so vLLM frees its blocks. While a request waits in
the queue its offers are kept alive, and a request that will never pull them (it ended
first, or loads nothing) drops them (``offer_keeper``).

Every entry point vLLM calls is wrapped by the connector (``connector.py``): no
exception from here reaches vLLM's scheduler loop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from kvxfer.client.engine_core.head_split import pulled_ranks
from kvxfer.client.integrations.vllm.block_tables import NULL_BLOCK
from kvxfer.client.integrations.vllm.digest import engine_binding, prompt_digest
from kvxfer.client.integrations.vllm.layout import BlockLayout
from kvxfer.client.integrations.vllm.model_identity import ModelIdentity
from kvxfer.client.integrations.vllm.offer_keeper import OfferKeeper
from kvxfer.client.integrations.vllm.protocol import (
    Load,
    Refusal,
    RemotePrefill,
    Save,
    StepPlan,
    parse_remote_prefill,
    wants_remote_decode,
    wants_verify,
)
from kvxfer.client.integrations.vllm.settings import ConnectorSettings
from kvxfer.client.integrations.vllm.stats import IntervalStats
from kvxfer.client.library import KvxferClient
from kvxfer.errors import KvxferError
from kvxfer.status import LeaseInfo

log = logging.getLogger("kvxfer.integrations.vllm")

#: vLLM's statuses of a request that ended normally (anything else was aborted).
FINISHED_NORMALLY = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


#: The longest name ``transfer_name`` gives (a transfer id is an engine id, ``/``, a name,
#: and the daemons' suffixes, within ``protocol.TRANSFER_ID_PATTERN``).
MAX_NAME_CHARS = 100


def transfer_name(name: str) -> str:
    """An engine's or request's id as part of a transfer id: ``#`` (which the daemons reserve
    for the parts of offers) and ``%`` escaped, so that two ids stay two names; a longer
    one than ``MAX_NAME_CHARS`` by its SHA-256 (hex, 64 characters)."""
    escaped = name.replace("%", "%25").replace("#", "%23")
    if len(escaped) <= MAX_NAME_CHARS:
        return escaped
    return "sha256-" + hashlib.sha256(name.encode()).hexdigest()


class SchedulerSide:
    """Plans saves (prefill) and loads (decode) step by step."""

    def __init__(self, settings: ConnectorSettings, layout: BlockLayout, model: ModelIdentity,
                 engine_id: str, *, producer: bool, consumer: bool, client: KvxferClient | None,
                 interval: IntervalStats | None = None, keeper: OfferKeeper | None = None,
                 computes_last_token: bool = False) -> None:
        self._settings = settings
        #: A load leaves the prompt's last token to the engine (``block_tables.windowed``).
        self._held_back = 1 if computes_last_token else 0
        self._model = model
        #: What binds this engine's prompt digests to its model and layout.
        self._engine = engine_binding(layout.page.bytes_dict(), model.fingerprint)
        #: This interval's figures for vLLM's metrics (``metrics``), shared with the connector.
        self.interval = interval or IntervalStats()
        self._layout = layout
        self._engine_id = engine_id
        self._producer, self._consumer = producer, consumer
        self._client = client
        #: Keeps the offers of queued decode requests alive (None: not a consumer, or off).
        self._keeper = keeper
        self._peer = client.peer_address() if client is not None and producer else ""
        self._to_save: dict[str, Any] = {}       # req id -> vLLM Request
        self._saved: dict[str, Save] = {}
        self._local_computed: dict[str, int] = {}
        self._new_loads: list[Load] = []
        self._loading: set[str] = set()
        self._cancels: list[str] = []
        #: req id -> the load it was promised, and the digest of its prompt
        self._remote: dict[str, tuple[RemotePrefill, bytes]] = {}
        #: Requests whose params were not followed, by reason (see ``protocol.Refusal``).
        self.refusals: Counter[str] = Counter()

    # -- decode --------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """A request arrived: if it will load a remote prefill, keep its offers alive while
        it waits in the queue (params refused here are refused and counted when it is
        scheduled)."""
        if not self._consumer or self._keeper is None:
            return
        remote = parse_remote_prefill(request.kv_transfer_params, self._layout, self._model)
        if isinstance(remote, RemotePrefill):
            pulled = pulled_ranks(remote.layout.split, self._layout.page.split)
            self._keeper.want(request.request_id, remote.peer, remote.holds(pulled))
            unpulled = set(range(remote.layout.tp_size)) - pulled
            if unpulled:
                self._keeper.drop_now(remote.peer, remote.holds(unpulled),
                                      f"decode request {request.request_id}: no rank here "
                                      "pulls those KV heads (other ranks hold them too)")

    def _drop_offers(self, request: Any, why: str) -> None:
        """``request`` will not pull its offers: they end at the prefill daemon now."""
        if self._keeper is not None:
            self._keeper.drop(request.request_id, why)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """The prompt tokens a remote prefill holds beyond the local hit: loaded asynchronously.

        Counted from the engine's own prompt, but its last token where the engine computes it
        (``computes_last_token``); refused params load nothing (counted)."""
        if not self._consumer:
            return 0, False
        remote = parse_remote_prefill(request.kv_transfer_params, self._layout, self._model)
        if isinstance(remote, Refusal):
            self._refuse(request, remote)
            return 0, False
        if remote is None:
            return 0, False
        digest = prompt_digest(request, self._engine)
        if digest is None:
            self._refuse(request, Refusal("unsupported", "a prompt given as embeddings: its KV "
                                                         "cannot be bound to it"))
            self._drop_offers(request, "a prompt given as embeddings loads nothing")
            return 0, False
        count = int(request.num_prompt_tokens) - self._held_back - num_computed_tokens
        if count <= 0:
            self._drop_offers(request, "its whole prompt was cached here")
            return 0, False
        self._local_computed[request.request_id] = num_computed_tokens
        self._remote[request.request_id] = (remote, digest)
        return count, True

    def forget(self, request: Any) -> tuple[int, bool]:
        """Load nothing for ``request`` (after a failure): it is computed here."""
        self._drop_offers(request, "its load could not be planned; computed here")
        self._remote.pop(request.request_id, None)
        self._local_computed.pop(request.request_id, None)
        return 0, False

    def fail_load(self, request: Any, block_tables: Sequence[Sequence[int]],
                  num_external_tokens: int, why: str) -> None:
        """Plan a load of ``request`` that fails at once (after a failure): vLLM is told it
        failed and computes the prompt, instead of waiting for it forever."""
        self.forget(request)
        if num_external_tokens > 0:
            self._new_loads.append(Load(request.request_id, "", "", 0, 0,
                                        tuple(map(tuple, block_tables)), refused=why))
            self._loading.add(request.request_id)

    def failed_plan(self, why: str) -> StepPlan:
        """This step's plan when building it failed: its loads fail at once (vLLM computes
        their blocks), its saves are dropped (the decode engines compute those prompts)."""
        plan = StepPlan(loads=[dataclasses.replace(load, refused=load.refused or why)
                               for load in self._new_loads],
                        cancels=self._cancels)
        self._new_loads, self._cancels = [], []
        return plan

    def _refuse(self, request: Any, refusal: Refusal) -> None:
        self.refusals[refusal.reason] += 1
        self.interval.count("refused_params", refusal.reason)
        request.kv_transfer_params["do_remote_prefill"] = False  # refused once, not every step
        log.warning("request %s: not loading its KV (params %s: %s); computing its prompt here",
                    request.request_id, refusal.reason, refusal.detail)

    def update_state_after_alloc(self, request: Any, block_tables: Sequence[Sequence[int]],
                                 num_external_tokens: int) -> None:
        """Blocks are allocated (``block_tables``: one per KV cache group): plan the save
        (prefill) or the load (decode) of ``request``."""
        params = request.kv_transfer_params
        if self._producer and wants_remote_decode(params):
            self._to_save[request.request_id] = request
            return
        promised = self._remote.pop(request.request_id, None)
        if promised is None:
            return
        remote, digest = promised
        params["do_remote_prefill"] = False  # one transfer per request, however often we are called
        local = self._local_computed.pop(request.request_id, 0)
        if num_external_tokens <= 0:
            self._drop_offers(request, "vLLM loads none of its tokens")
            return
        if self._keeper is not None:
            self._keeper.stop(request.request_id)  # its pull takes the offers now
        layout = self._layout  # the local hit is whole blocks, so whole pages too
        num_pages = math.ceil(int(request.num_prompt_tokens) / layout.page_size)
        num_blocks = math.ceil(int(request.num_prompt_tokens) / layout.block_size)
        first_block = local // layout.block_size
        tables = tuple(self._loaded_blocks(table[first_block:num_blocks],
                                           num_blocks - first_block) for table in block_tables)
        self._new_loads.append(Load(request.request_id, remote.transfer_id, remote.peer,
                                    num_pages, first_block * layout.token_pages_per_block,
                                    tables, remote.layout.tp_size,
                                    capabilities=remote.capabilities, prompt_digest=digest,
                                    planned_unix=time.time()))
        self._loading.add(request.request_id)

    def _loaded_blocks(self, blocks: Sequence[int], count: int) -> tuple[int, ...]:
        """``blocks``, the ``count`` blocks a load fills; where the engine computes the
        prompt's last token and it starts a block (``computes_last_token``), vLLM has not
        allocated that block yet: its page goes nowhere (``NULL_BLOCK``)."""
        missing = count - len(blocks)
        if 0 < missing <= self._held_back:
            return (*blocks, *(NULL_BLOCK,) * missing)
        return tuple(blocks)

    def finished_loading(self, req_ids: set[str]) -> None:
        """The worker reported these loads finished (or failed)."""
        self._loading -= req_ids

    # -- every step ------------------------------------------------------------------------

    def build_plan(self, scheduled: dict[str, tuple[int, int]],
                   block_tables_of: Callable[[str], Sequence[Sequence[int]]]) -> StepPlan:
        """This step's plan; ``scheduled`` gives each scheduled request's (computed tokens,
        tokens scheduled now), ``block_tables_of`` a request's blocks (per KV cache group).
        The loads leave ``_new_loads`` only with the finished plan: if anything here raised,
        ``failed_plan`` still fails them."""
        plan = StepPlan(idle=not scheduled)
        for req_id, request in list(self._to_save.items()):
            if req_id not in scheduled:
                continue
            computed, now = scheduled[req_id]
            num_tokens = request.num_prompt_tokens
            if computed + now < num_tokens:
                continue  # its prompt finishes in a later step (chunked prefill)
            del self._to_save[req_id]
            try:
                save = self._lease(request, block_tables_of(req_id))
            except Exception:  # noqa: BLE001 - the failure contract: the decode side recomputes
                log.exception("request %s: could not plan its save; its decode engine will "
                              "compute the prompt", req_id)
                save = None
            if save is not None:
                self._saved[req_id] = save  # its capabilities go into the response's params,
                plan.saves.append(dataclasses.replace(save, capabilities=()))  # not to workers
        plan.loads, plan.cancels = self._new_loads, self._cancels
        self._new_loads, self._cancels = [], []
        return plan

    def _lease(self, request: Any, block_tables: Sequence[Sequence[int]]) -> Save | None:
        assert self._client is not None
        digest = prompt_digest(request, self._engine)
        if digest is None:
            log.warning("request %s keeps its KV to itself: a prompt given as embeddings cannot "
                        "be bound to its KV; the decode engine will compute it", request.request_id)
            return None
        num_pages = (math.ceil(request.num_prompt_tokens / self._layout.page_size)
                     * self._layout.groups)
        num_blocks = math.ceil(request.num_prompt_tokens / self._layout.block_size)
        transfer_id = f"{transfer_name(self._engine_id)}/{transfer_name(request.request_id)}"
        leases: list[LeaseInfo] = []
        try:
            for rank in range(self._layout.tp_size):
                leases.append(self._client.allocate(
                    self._settings.pool, num_pages, self._settings.lease_s,
                    holder=f"vllm {self._engine_id} tp{rank}"))
        except KvxferError as exc:
            log.warning("request %s keeps its KV to itself: no daemon pages for it (%s: %s); "
                        "the decode engine will compute its prompt", request.request_id,
                        type(exc).__name__, exc)
            for lease in leases:
                try:
                    self._client.release(lease.lease_id)
                except KvxferError:
                    pass  # the daemon frees it when it expires (lease_s)
            return None
        verify = self._settings.verify or wants_verify(request.kv_transfer_params)
        return Save(request.request_id, transfer_id,
                    tuple(tuple(table[:num_blocks]) for table in block_tables),
                    tuple(lease.lease_id for lease in leases),
                    tuple(tuple(lease.runs.pages()) for lease in leases), verify, digest,
                    leases[0].arena_epoch, tuple(lease.capability for lease in leases))

    def request_finished(self, request: Any) -> dict[str, Any] | None:
        """The request ended: the ``kv_transfer_params`` of its response (vLLM frees its
        blocks at once either way)."""
        req_id = request.request_id
        self._drop_offers(request, "it ended before its KV was loaded")
        self._to_save.pop(req_id, None)
        self._remote.pop(req_id, None)
        self._local_computed.pop(req_id, None)
        if req_id in self._loading:
            self._loading.discard(req_id)
            self._cancels.append(req_id)
        save = self._saved.pop(req_id, None)
        if save is None or request.status.name not in FINISHED_NORMALLY:
            return None
        return RemotePrefill(save.transfer_id, self._peer, save.capabilities,
                             self._layout.page, self._model).to_params()
