"""Drive real vLLM servers through kvxfer and report what they answered (run by test_vllm.py).

usage: .venv-vllm/bin/python tests/vllm_scenario.py WORKDIR [--tp N] [--no-controls]

Runs under the vLLM environment: builds the tiny model, starts a single-engine
baseline beside a disaggregated deployment (two kvxfer daemons, a prefill and
a decode engine with KvxferConnector, the proxy), sends the same prompts to
both, concurrently, and prints one JSON object: every answer's tokens and
logprobs, the engines' and daemons' counters after each phase, and the
connector's per-transfer records. The decode daemon corrupts every transfer
whose id contains "corrupt" (its test-only fault hook); requests of the
negative controls are named so (X-Request-Id). ``--tp 2`` runs every engine with
two tensor-parallel ranks; ``--no-controls`` leaves the negative controls out.
test_vllm.py asserts on the output.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvxfer.client.integrations.vllm.deploy import Disaggregation, VllmServer
from kvxfer.client.integrations.vllm.tiny_model import build, prompt

#: Prompt lengths in tokens (blocks are 32 tokens): from under one block to seven.
LENGTHS = [5, 17, 31, 32, 33, 70, 130, 200]
NEW_TOKENS = 12


def ask(http: Any, model: str, text: str, request_id: str, hints: dict[str, Any] | None = None,
        stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": text, "max_tokens": NEW_TOKENS,
                            "temperature": 0, "logprobs": 1, "stream": stream}
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
            "prompt_tokens": answer["usage"]["prompt_tokens"]}


def ask_all(make_client: Any, model: str, prompts: list[str], prefix: str,
            hints: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every prompt at once, one connection each."""
    def one(i: int) -> dict[str, Any]:
        with make_client() as http:
            return ask(http, model, prompts[i], f"{prefix}-{i}", hints)
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--no-controls", dest="controls", action="store_false")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    model = str(build(str(workdir / "model")))
    sets = {"A": [prompt(seed=i, words=n) for i, n in enumerate(LENGTHS)],
            "B": [prompt(seed=100 + i, words=n) for i, n in enumerate(LENGTHS[4:])],
            "C": [prompt(seed=200 + i, words=n) for i, n in enumerate(LENGTHS[4:])]}
    if not args.controls:
        del sets["B"], sets["C"]
    out: dict[str, Any] = {"model": model, "lengths": LENGTHS, "tp": args.tp}
    baseline = VllmServer("baseline", model, workdir, tp=args.tp).spawn()
    try:
        with Disaggregation(model, workdir, num_pages=512, tp=args.tp,
                            decode_daemon_env={"KVXFER_FAULT_CORRUPT_RECEIVED": "corrupt"}) as d:
            baseline.wait_ready()
            out["baseline"] = {name: ask_all(baseline.client, model, prompts, f"base-{name}")
                               for name, prompts in sets.items()}
            baseline.stop()
            out["before"] = counters(d, model)
            out["disaggregated"] = ask_all(d.client, model, sets["A"], "pd")
            out["after_disaggregated"] = counters(d, model)
            with d.client() as http:
                out["streamed"] = ask(http, model, sets["A"][5], "pd-stream", stream=True)
            if args.controls:
                out["corrupted"] = ask_all(d.client, model, sets["B"], "corrupt-plain")
                out["after_corrupted"] = counters(d, model)
                out["corrupted_verified"] = ask_all(d.client, model, sets["C"], "corrupt-checked",
                                                    {"verify": True})
                out["after_corrupted_verified"] = counters(d, model)
            assert d.prefill_daemon is not None and d.decode_daemon is not None
            from kvxfer.client import KvxferClient

            with KvxferClient(d.prefill_daemon.worker_address) as p, \
                    KvxferClient(d.decode_daemon.worker_address) as q:
                out["leased_pages_at_end"] = {"prefill": p.leased_pages(), "decode": q.leased_pages()}
            for side in ("prefill", "decode"):
                path = workdir / f"{side}-stats.jsonl"
                records = path.read_text().splitlines() if path.exists() else []
                out[f"{side}_stats"] = [json.loads(line) for line in records]
    finally:
        baseline.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
