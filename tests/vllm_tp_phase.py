"""The mixed tensor-parallel phase of ``vllm_scenario.py --tp 2``: engines of other TP sizes.

An engine of one rank (``narrow``, ``kv_both``, block 32) joins the TP 2 pair. Its daemon's
pages hold one KV head, as the pair's do (the tiny model's two KV heads over two ranks), so
it loads what the pair's prefill engine computed on two ranks (TP 2 -> 1): its one rank
pulls both ranks' transfers and copies each among its heads. The pair's decode engine then
loads what the narrow engine computed (TP 1 -> 2): each of its ranks pulls its own part of
the one transfer. Each answer is recorded with the plain answers of both engines (asked
with a ``cache_salt``, so they neither hit nor fill the prefix cache), the tokens each
engine took from a transfer and the transfers each daemon saw.

Then one decode rank's part fails while the other's waits (TP 1 -> 2, ``SPLIT_FAIL``): the
pair's decode daemon (``corrupting_daemon.py``) flips a byte of part 1, checksummed, so it
fails, and never asks for part 0; the failing rank must abort part 0 (its sibling's), and the
request fail (the pair's policy is ``fail``) without waiting for part 0's deadline.
"""

from __future__ import annotations

from typing import Any

from vllm_client import ask
from vllm_trust_phase import PROMPTS, Phase

from kvxfer.client import KvxferClient
from kvxfer.client.integrations.vllm.deploy import Disaggregation, VllmServer

#: The narrow engine's pages: one KV head (the pair's rank holds one of the model's two).
PAGE_HEADS = 1
#: vLLM's count of prompt tokens by where they came from.
SOURCE = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="%s",source="%s"}'
#: The prompts loaded TP 2 -> 1, and TP 1 -> 2.
NARROWED, WIDENED = ("K0", "K1", "K2"), ("K3", "K4")
#: The prefill request id whose transfer's part 1 the pair's decode daemon corrupts and whose
#: part 0 it stalls (``corrupting_daemon``: "corrupt" and ``STALL``).
SPLIT_FAIL = "stall-rank0-corrupt-widen"


def failed_part(phase: Phase, narrow: VllmServer) -> dict[str, Any]:
    """``K5`` computed by the narrow engine with checksums (``SPLIT_FAIL``), loaded by the
    pair's decode engine: its answer (an error, by policy)."""
    with narrow.client() as http:
        reply = http.post("/v1/completions", headers={"X-Request-Id": SPLIT_FAIL}, json={
            "model": phase.model, "prompt": PROMPTS["K5"], "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True, "verify": True}})
        reply.raise_for_status()
        params: dict[str, Any] = reply.json()["kv_transfer_params"]
    phase.capabilities.extend(params["kvxfer"]["capabilities"])
    return phase.direct("K5", params, "widen-fail")


def run(d: Disaggregation, model: str) -> dict[str, Any]:
    """Every case, in order; what each answered and moved."""
    assert d.decode is not None
    daemon, narrow = d.add_engine("narrow", block_size=32, page_size=32, tp=1,
                                  page_heads=PAGE_HEADS)
    phase = Phase(d, model)

    def taken(engine: VllmServer) -> float:
        return engine.metric(SOURCE % (model, "external_kv_transfer"))

    def plain(engine: VllmServer, name: str) -> dict[str, Any]:
        with engine.client() as http:
            return ask(http, model, PROMPTS[name], f"plain-{engine.name}-{name}", top=1,
                       salt="plain")

    out: dict[str, Any] = {"narrowed": {}, "plain_narrow": {}, "plain_pair": {}}
    for name in NARROWED:
        params = phase.prefilled(name, f"to-narrow-{name}")
        before = taken(narrow)
        out["narrowed"][name] = phase.direct(name, params, f"to-narrow-{name}", engine=narrow)
        out["narrowed"][name]["loaded"] = taken(narrow) - before
    with KvxferClient(daemon.worker_address) as client:
        out["narrow_transfers"] = {i.transfer_id: [i.role.name, i.state.name, i.pages]
                                   for i in client.transfers()}
    out["widened"] = {}
    for name in WIDENED:
        params = phase.prefilled(name, f"from-narrow-{name}", engine=narrow)
        before = taken(d.decode)
        out["widened"][name] = phase.direct(name, params, f"from-narrow-{name}")
        out["widened"][name]["loaded"] = taken(d.decode) - before
    assert d.decode_daemon is not None
    with KvxferClient(d.decode_daemon.worker_address) as client:
        out["pair_transfers"] = {i.transfer_id: [i.role.name, i.state.name, i.pages]
                                 for i in client.transfers() if "from-narrow" in i.transfer_id}
    out["widened_fail"] = failed_part(phase, narrow)
    with KvxferClient(d.decode_daemon.worker_address) as client:
        out["widened_fail_transfers"] = {i.transfer_id.rsplit("#", 1)[-1]: [i.state.name, i.error]
                                         for i in client.transfers() if SPLIT_FAIL in i.transfer_id}
    for name in (*NARROWED, *WIDENED):
        out["plain_narrow"][name] = plain(narrow, name)
        out["plain_pair"][name] = plain(d.decode, name)
    narrow.stop()  # the phases after it need the cores
    return out
