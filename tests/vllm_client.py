"""Requests to the vLLM engines and proxy of the scenarios, and the counters they read."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvxfer.client.integrations.vllm.deploy import Disaggregation

#: Tokens generated per request.
NEW_TOKENS = 12


def ask(http: Any, model: str, text: str, request_id: str, hints: dict[str, Any] | None = None,
        stream: bool = False, top: int = 1, salt: str | None = None) -> dict[str, Any]:
    """One completion: its text, tokens, their logprobs and (``top`` > 1) the top-``top``
    logprobs of each step; RuntimeError with the body on an HTTP error. ``salt``: a
    ``cache_salt`` (the prompt neither hits nor fills the prefix cache of other requests)."""
    body: dict[str, Any] = {"model": model, "prompt": text, "max_tokens": NEW_TOKENS,
                            "temperature": 0, "logprobs": top, "stream": stream}
    if salt is not None:
        body["cache_salt"] = salt
    if hints:
        body["kv_transfer_params"] = hints
    headers = {"X-Request-Id": request_id}
    if stream:
        pieces = []
        with http.stream("POST", "/v1/completions", json=body, headers=headers) as reply:
            reply.raise_for_status()
            for line in reply.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
        return {"text": "".join(pieces)}
    reply = http.post("/v1/completions", json=body, headers=headers)
    if reply.status_code != 200:
        raise RuntimeError(f"{request_id}: HTTP {reply.status_code}: {reply.text[:2000]}")
    answer = reply.json()
    choice = answer["choices"][0]
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"],
            "logprobs": choice["logprobs"]["token_logprobs"],
            "top_logprobs": choice["logprobs"]["top_logprobs"] if top > 1 else None,
            "prompt_tokens": answer["usage"]["prompt_tokens"]}


def ask_all(make_client: Any, model: str, prompts: list[str], prefix: str,
            hints: dict[str, Any] | None = None, top: int = 1) -> list[dict[str, Any]]:
    """Every prompt at once, one connection each."""
    def one(i: int) -> dict[str, Any]:
        with make_client() as http:
            return ask(http, model, prompts[i], f"{prefix}-{i}", hints, top=top)
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def counters(d: Disaggregation, model: str) -> dict[str, float]:
    assert d.decode is not None and d.prefill is not None
    assert d.decode_daemon is not None and d.prefill_daemon is not None
    source = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="%s",source="%s"}'
    out = {name: d.decode.metric(source % (model, name))
           for name in ("external_kv_transfer", "local_compute", "local_cache_hit")}
    out["prefill_local_compute"] = d.prefill.metric(source % (model, "local_compute"))
    for state in ("done", "failed"):
        out[f"decode_daemon_{state}"] = metric(d.decode_daemon.metrics_port,
                                               f'kvxfer_transfers_total{{role="receiver",state="{state}"}}')
    out["prefill_daemon_done"] = metric(d.prefill_daemon.metrics_port,
                                        'kvxfer_transfers_total{role="sender",state="done"}')
    return out


def metric(port: int | None, sample: str) -> float:
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == sample:
            return float(value)
    return 0.0
