"""A hybrid model through real engines, vLLM's hybrid KV cache manager on: run by
test_vllm.py under the vLLM environment; prints what it saw as JSON.

The tiny model, built with a sliding window (``tiny_model.hybrid_layers``: odd layers see
only the last ``WINDOW`` tokens), has two kinds of layers, so vLLM keeps two KV cache groups,
each with its block table, and frees a sliding-window layer's blocks before its window (its
table then names the null block). A prefill and a decode engine with KvxferConnector (which
declares ``SupportsHMA``, so the manager stays on) serve behind vllm-router. The prefill
engine first answers every prompt itself (the plain answers: no transfer in them); then the
same prompts go through the router, longer than the window, and one that extends the first
(its start a prefix-cache hit on the decode engine, so each table is loaded past it). One load fails on purpose (its
params carry another capability): with two groups, vLLM's block-level load-error path
raises, so the connector reports it per request and the decode engine computes the prompt.
The negative controls are decode engines of their own: ``careless`` copies every layer
through the first block table (the tests' seam ``KVXFER_UNGUARDED=tables``);
``unwindowed`` loads the last prompt token too (``window``), so at 143 tokens the last
token's window starts in a block vLLM nulled.

Offers outlive long queues (#32 point 9): every engine runs one request at a time
(``--max-num-seqs 1``) and an offer lives ``OFFER_S`` seconds unless kept. ``QUEUED`` prompts
are prefilled, then sent to the decode engine behind ``BLOCKERS`` long plain requests: they
wait in its queue several offer lifetimes before vLLM asks for their KV, their offers kept
alive by the connector (``offer_keeper``); ``careless`` does not keep offers
(``keep_offers_every_s: 0``), so there the same queue outlives the offers and those prompts
are computed.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from vllm_client import ask, counters, metric

from kvxfer.client.integrations.vllm.deploy import BLOCK_SIZE, Disaggregation, VllmServer
from kvxfer.client.integrations.vllm.processes import free_port
from kvxfer.client.integrations.vllm.tiny_model import build, prompt

HERE = Path(__file__).resolve().parent
#: The sliding window of the model's odd layers, in tokens: under two blocks, so a prompt
#: of several blocks leaves the sliding-window table null blocks before its window.
WINDOW = 48
#: Prompt lengths, in words (one token each): all past the window.
#: (143: the oldest token of the last one's window is the last of a block that vLLM would
#: null, had it been told the whole prompt was loaded: ``block_tables.windowed``; 161: the
#: last token starts a block, which vLLM allocates only once it computes that token.)
LENGTHS = (143, 161)
#: An offer's lifetime unless kept (the connector's ``timeout_s``), in seconds.
OFFER_S = 4.0
#: Prompts queued at once at a decode engine behind ``BLOCKERS`` plain requests of ``LONG``
#: tokens each (each 1.3 s here: the queue lasts over twice an offer's lifetime).
QUEUED, BLOCKERS, LONG = 4, 8, 900
#: vLLM's count of prompt tokens by where they came from.
SOURCE = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="%s",source="%s"}'


def taken(engine: VllmServer, model: str) -> dict[str, float]:
    """An engine's prompt tokens so far, by where they came from."""
    return {name: engine.metric(SOURCE % (model, name))
            for name in ("external_kv_transfer", "local_compute", "local_cache_hit")}


def prefilled(engine: VllmServer, model: str, text: str, case: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` ``engine`` answers for ``text``."""
    with engine.client() as http:
        reply = http.post("/v1/completions", headers={"X-Request-Id": case}, json={
            "model": model, "prompt": text, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}})
        reply.raise_for_status()
        params: dict[str, Any] = reply.json()["kv_transfer_params"]
        return params


def queue(engine: VllmServer, model: str, params: list[dict[str, Any]], prompts: list[str],
          case: str) -> list[float]:
    """``BLOCKERS`` plain requests of ``LONG`` tokens to ``engine``, then, once they are queued,
    each prompt with its params, all at once: the seconds each of those took."""
    def one(i: int, text: str, hints: dict[str, Any] | None, tokens: int) -> float:
        start = time.monotonic()
        with engine.client() as http:
            reply = http.post("/v1/completions", headers={"X-Request-Id": f"{case}-{i}"}, json={
                "model": model, "prompt": text, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True, **({"kv_transfer_params": hints} if hints else {})})
            reply.raise_for_status()
            return time.monotonic() - start
    with ThreadPoolExecutor(BLOCKERS + len(prompts)) as pool:
        blockers = [pool.submit(one, -1 - i, prompt(seed=500 + i, words=16), None, LONG)
                    for i in range(BLOCKERS)]
        time.sleep(0.5)  # the blockers arrive first
        queued = [pool.submit(one, i, text, hints, 4)
                  for i, (text, hints) in enumerate(zip(prompts, params, strict=True))]
        for blocker in blockers:
            blocker.result()
        return [future.result() for future in queued]


def queue_phase(d: Disaggregation, engine: VllmServer, daemon_port: int | None, model: str,
                case: str) -> dict[str, Any]:
    """``QUEUED`` prompts prefilled, then queued at ``engine`` behind the blockers: the
    seconds each took, where their prompt tokens came from, and the KeepOffers calls its
    daemon answered."""
    assert d.prefill is not None
    prompts = [prompt(seed=400 + i + (100 if case == "careless" else 0), words=64)
               for i in range(QUEUED)]
    params = [prefilled(d.prefill, model, text, f"{case}-queue-prefill-{i}")
              for i, text in enumerate(prompts)]
    keeps = 'kvxfer_rpcs_total{code="OK",method="KeepOffers"}'
    before, keeps_before = taken(engine, model), metric(daemon_port, keeps)
    seconds = queue(engine, model, params, prompts, f"{case}-queue")
    after = taken(engine, model)
    moved = {k: after[k] - before[k] for k in after}
    moved["local_compute"] -= BLOCKERS * 16  # the blockers' prompts
    return {"seconds": seconds, "moved": moved,
            "keeps": metric(daemon_port, keeps) - keeps_before, "prompt_tokens": QUEUED * 64}


def healthy(engine: VllmServer) -> bool:
    with engine.client(timeout_s=10) as http:
        return http.get("/health").status_code == 200


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    workdir = Path(parser.parse_args().workdir)
    model = str(build(str(workdir / "model"), layers=4, sliding_window=WINDOW))
    prompts = [prompt(seed=300 + i, words=n) for i, n in enumerate(LENGTHS)]
    out: dict[str, Any] = {"model": model, "window": WINDOW, "lengths": LENGTHS,
                           "offer_s": OFFER_S}
    careless_env = {"PYTHONPATH": str(HERE / "unguarded_engine"), "KVXFER_UNGUARDED": "tables"}
    with Disaggregation(model, workdir, num_pages=256, ports=(free_port(), free_port(),
                                                              free_port()),
                        router=True, more_engines=("careless", "unwindowed"),
                        engine_args=["--max-num-seqs", "1"],
                        connector={"timeout_s": OFFER_S}) as d:
        assert d.prefill is not None and d.decode is not None
        extended = f"{prompts[0]} {prompt(seed=310, words=60)}"  # hits the decode's cache
        forged = prompt(seed=320, words=150)  # in no cache of the decode engine
        with d.prefill.client() as http:
            out["plain"] = [ask(http, model, text, f"plain-{i}") for i, text in enumerate(prompts)]
            out["plain_extended"] = ask(http, model, extended, "plain-extended")
            out["plain_forged"] = ask(http, model, forged, "plain-forged")
        before = counters(d, model)
        with d.client() as http:
            out["routed"] = [ask(http, model, text, f"routed-{i}") for i, text in enumerate(prompts)]
        after = counters(d, model)
        out["routed_moved"] = {k: after[k] - before[k] for k in after}
        with d.client() as http:
            out["routed_extended"] = ask(http, model, extended, "routed-extended")
        extended_after = counters(d, model)
        out["extended_moved"] = {k: extended_after[k] - after[k] for k in after}

        params = prefilled(d.prefill, model, forged, "forged-prefill")
        params["kvxfer"]["capabilities"] = ["0" * 32] * len(params["kvxfer"]["capabilities"])
        with d.decode.client() as http:
            before = taken(d.decode, model)
            try:
                out["forged"] = ask(http, model, forged, "forged", params)
            except RuntimeError as exc:
                out["forged"] = {"error": str(exc)[:500]}
            after = taken(d.decode, model)
        out["forged_moved"] = {k: after[k] - before[k] for k in after}
        out["decode_healthy"] = healthy(d.decode)
        out["logs"] = {name: {"two_groups": "kv cache group sizes (32, 32)" in engine.log(),
                              "hma_off": "Turning off hybrid kv cache manager" in engine.log()}
                       for name, engine in (("prefill", d.prefill), ("decode", d.decode))}

        assert d.decode_daemon is not None
        out["queue"] = queue_phase(d, d.decode, d.decode_daemon.metrics_port, model, "decode")

        careless_daemon, careless = d.add_engine(
            "careless", block_size=BLOCK_SIZE, page_size=BLOCK_SIZE, role="kv_consumer",
            env=careless_env, connector={"keep_offers_every_s": 0})
        params = prefilled(d.prefill, model, prompts[1], "careless-prefill")
        with careless.client() as http:
            out["careless"] = ask(http, model, prompts[1], "careless", params)
        out["careless_moved"] = taken(careless, model)
        out["careless_queue"] = queue_phase(d, careless, careless_daemon.metrics_port, model,
                                            "careless")
        careless.stop()  # the cores, for the next

        _, unwindowed = d.add_engine(
            "unwindowed", block_size=BLOCK_SIZE, page_size=BLOCK_SIZE, role="kv_consumer",
            env={**careless_env, "KVXFER_UNGUARDED": "window"})
        params = prefilled(d.prefill, model, prompts[0], "unwindowed-prefill")
        with unwindowed.client() as http:
            out["unwindowed"] = ask(http, model, prompts[0], "unwindowed", params)
        out["unwindowed_moved"] = taken(unwindowed, model)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
