"""Disaggregated vLLM through kvxfer against one vLLM engine, the same prompts, in one run.

usage: .venv-vllm/bin/python benchmarks/vllm_disagg.py [--rounds 3] [--burst 8] [--json]

Starts a single-engine baseline and a disaggregated deployment (two kvxfer
daemons, a prefill and a decode engine with KvxferConnector, the proxy) side by
side, then in each round sends every prompt, streamed, one at a time, to the
baseline and to the proxy in turn (the order alternates round by round, since
these machines are noisy). Prints, per prompt length: time to first token and
total latency of both (medians over rounds) and their ratio; and per
disaggregated request, from the connector's records: the transfer time as the
decode engine saw it, the daemon's own transfer time, the copy-out (prefill
blocks to daemon pages) and copy-in (daemon pages to decode blocks) times and
the bytes moved. Then, per prompt length, where a disaggregated request's time to
first token went, in order (medians, ms), from this client's clock and the
connector's own timestamps (``kvxfer.client.integrations.vllm.stats``):
``prefill`` (request sent to the prefill engine's offer of its KV: prefill compute,
copy-out and the offer call), ``to_decode`` (offer to the decode scheduler planning
the load: the prefill's answer through the proxy to the decode engine), ``to_start``
(plan to the worker queueing it), ``lease_and_pull`` (queued until the worker's start
thread's one call to its daemon returned), ``transfer`` (the daemons' pull until the worker took its ending),
``copy_in``, and ``first_token`` (copy-in done to the first token streamed here).

With ``--burst N``, each round then sends N streams together (``--burst-gap-ms`` apart,
``--burst-tokens`` long prompts), to each deployment in turn, so that running decodes
generate tokens while the later streams' KV lands, and prints the inter-token latency
of those streams (the gaps between the chunks streamed after each one's first; vLLM may
put several tokens in one chunk under load), p50 and p99, for both. Always:
from the connector's own records (``role: step``), per engine, the time its calls took
in each model step that carried a save or a load (per rank, not counting an idle step's
wait for endings), p50, p99 and max.
Needs the vLLM environment (./scripts/setup-vllm.sh).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvxfer.client.integrations.vllm.deploy import Disaggregation, VllmServer
from kvxfer.client.integrations.vllm.stats import LOAD_STEPS
from kvxfer.client.integrations.vllm.tiny_model import build, prompt

#: The segments of a disaggregated request's time to first token, in order.
SEGMENTS = ("prefill", "to_decode", "to_start", "lease_and_pull", "transfer", "copy_in",
            "first_token")


def stream(http: Any, model: str, text: str, request_id: str, new_tokens: int) -> tuple[float, float]:
    """Seconds to the first streamed token, and to the end."""
    body = {"model": model, "prompt": text, "max_tokens": new_tokens, "temperature": 0,
            "stream": True}
    start = time.perf_counter()
    first = 0.0
    with http.stream("POST", "/v1/completions", json=body,
                     headers={"X-Request-Id": request_id}) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: {") and not first:
                first = time.perf_counter() - start
    return first, time.perf_counter() - start


def ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 2)


def quantiles_ms(values: list[float]) -> dict[str, float]:
    """How many ``values`` (seconds), and their p50, p99 and max in ms."""
    if not values:
        return {"n": 0}
    p99 = statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 else values[0]
    return {"n": len(values), "p50": round(statistics.median(values) * 1e3, 3),
            "p99": round(p99 * 1e3, 3), "max": round(max(values) * 1e3, 3)}


def chunk_times(http: Any, model: str, text: str, request_id: str, new_tokens: int) -> list[float]:
    """When each streamed chunk of a completion arrived (``time.perf_counter()``)."""
    body = {"model": model, "prompt": text, "max_tokens": new_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    arrived = []
    with http.stream("POST", "/v1/completions", json=body,
                     headers={"X-Request-Id": request_id}) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                arrived.append(time.perf_counter())
    return arrived


def burst(http: Any, model: str, tag: str, args: argparse.Namespace, seed: int) -> list[float]:
    """``args.burst`` streams sent ``args.burst_gap_ms`` apart; every inter-token gap (s)."""
    results: list[list[float]] = [[] for _ in range(args.burst)]

    def one(i: int) -> None:
        results[i] = chunk_times(http, model, prompt(seed + i, args.burst_tokens),
                                 f"burst-{tag}-{seed}-{i}", args.new_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(args.burst)]
    for thread in threads:
        thread.start()
        time.sleep(args.burst_gap_ms / 1e3)
    for thread in threads:
        thread.join(timeout=300)
    return [b - a for times in results for a, b in zip(times, times[1:])]


def stats_lines(workdir: Path, side: str) -> list[str]:
    """The connector's records of one engine so far (its stats file)."""
    path = workdir / f"{side}-stats.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Run both deployments side by side in ``workdir`` and gather the figures."""
    lengths = [int(n) for n in args.lengths.split(",")]
    model = args.model or str(build(str(workdir / "model")))
    times: dict[str, dict[int, dict[str, list[float]]]] = {
        kind: {n: {"ttft": [], "total": []} for n in lengths} for kind in ("single", "disaggregated")}
    sent: dict[str, tuple[int, float, float]] = {}  # request id: prompt length, sent, first token
    gaps: dict[str, list[float]] = {"single": [], "disaggregated": []}
    baseline = VllmServer("baseline", model, workdir, max_model_len=2048).spawn()
    try:
        with Disaggregation(model, workdir, num_pages=2048, max_model_len=2048) as d:
            baseline.wait_ready()
            with baseline.client() as single, d.client() as disagg:
                for n in lengths:  # warm-up: first requests pay one-time costs
                    stream(single, model, prompt(0, n), f"warm-s-{n}", args.new_tokens)
                    stream(disagg, model, prompt(0, n), f"warm-d-{n}", args.new_tokens)
                warmed = {side: len(stats_lines(workdir, side)) for side in ("prefill", "decode")}
                for r in range(args.rounds):
                    order = [("single", single), ("disaggregated", disagg)]
                    for n in lengths:
                        for kind, http in order if r % 2 == 0 else order[::-1]:
                            request_id = f"bench-{kind[0]}-{r}-{n}"
                            start_unix = time.time()
                            first, total = stream(http, model, prompt(1000 * r + n, n),
                                                  request_id, args.new_tokens)
                            sent[request_id] = (n, start_unix, start_unix + first)
                            times[kind][n]["ttft"].append(first)
                            times[kind][n]["total"].append(total)
                    for kind, http in (order if r % 2 == 0 else order[::-1]) if args.burst else ():
                        gaps[kind] += burst(http, model, kind[0], args, 100_000 * (r + 1))
            stats = {side: [json.loads(x) for x in stats_lines(workdir, side)]
                     for side in ("prefill", "decode")}
    finally:
        baseline.stop()
    copy_out = {s["transfer_id"]: s for s in stats["prefill"] if s.get("role") == "prefill"}
    per_request = []
    segments: dict[int, dict[str, list[float]]] = {n: {k: [] for k in SEGMENTS} for n in lengths}
    steps = {side: [s["seconds"] for s in stats[side][warmed[side]:] if s.get("role") == "step"]
             for side in ("prefill", "decode")}
    for s in stats["decode"]:
        if s.get("role") != "decode" or "-bench-d-" not in s["transfer_id"] or not s.get("ok"):
            continue
        out = copy_out.get(s["transfer_id"], {})
        request_id = next((r for r in sent if f"-{r}-" in s["req_id"]), None)
        if request_id is not None and out:
            n, start_unix, first_unix = sent[request_id]
            planned = s["planned_unix"]
            marks = [start_unix, out["unix_time"], planned,
                     *(planned + s[f"{step}_s"] for step in LOAD_STEPS), first_unix]
            for name, (a, b) in zip(SEGMENTS, zip(marks, marks[1:]), strict=True):
                segments[n][name].append(b - a)
        per_request.append({"request": s["req_id"], "pages": s["pages"], "bytes": s["bytes"],
                            "transfer_ms": round(s["transfer_s"] * 1e3, 2),
                            "daemon_transfer_ms": round(s["daemon_s"] * 1e3, 2),
                            "copy_out_ms": round(out.get("copy_s", 0.0) * 1e3, 3),
                            "copy_in_ms": round(s["copy_s"] * 1e3, 3)})
    result: dict[str, Any] = {"model": args.model or "the tiny test model", "rounds": args.rounds,
                              "new_tokens": args.new_tokens, "by_prompt_tokens": {},
                              "requests": per_request}
    result["ttft_breakdown_ms"] = {n: {k: ms(v) for k, v in segments[n].items() if v}
                                   for n in lengths}
    result["connector_ms_per_step"] = {side: quantiles_ms(v) for side, v in steps.items()}
    if args.burst:
        result["burst"] = {"streams": args.burst, "prompt_tokens": args.burst_tokens,
                           "gap_ms": args.burst_gap_ms,
                           "inter_token_ms": {k: quantiles_ms(v) for k, v in gaps.items()}}
    for n in lengths:
        one, split = times["single"][n], times["disaggregated"][n]
        result["by_prompt_tokens"][n] = {
            "single_ttft_ms": ms(one["ttft"]), "disaggregated_ttft_ms": ms(split["ttft"]),
            "single_total_ms": ms(one["total"]), "disaggregated_total_ms": ms(split["total"]),
            "ttft_ratio": round(statistics.median(split["ttft"]) / statistics.median(one["ttft"]), 2),
            "total_ratio": round(statistics.median(split["total"]) / statistics.median(one["total"]), 2),
        }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every prompt (default 3)")
    parser.add_argument("--lengths", default="32,128,512,1000",
                        help="prompt lengths in tokens, comma-separated (default 32,128,512,1000)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated (default 16)")
    parser.add_argument("--burst", type=int, default=0,
                        help="streams sent together after each round's prompts (default 0: none)")
    parser.add_argument("--burst-tokens", type=int, default=256,
                        help="prompt tokens of a burst's streams (default 256)")
    parser.add_argument("--burst-gap-ms", type=float, default=20.0,
                        help="between a burst's streams (default 20)")
    parser.add_argument("--model", help="a model directory (default: build the tiny test model)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvxfer-vllm-bench-"))
    try:
        result = measure(args, workdir)
    except BaseException:
        print(f"the engines' logs are kept in {workdir}", file=sys.stderr)
        raise
    shutil.rmtree(workdir)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"model {result['model']}, {args.rounds} rounds, {args.new_tokens} new tokens; medians in ms")
    print(f"{'prompt tokens':>13} {'TTFT single':>12} {'TTFT disagg':>12} {'ratio':>6} "
          f"{'total single':>13} {'total disagg':>13} {'ratio':>6}")
    for n, row in result["by_prompt_tokens"].items():
        print(f"{n:>13} {row['single_ttft_ms']:>12} {row['disaggregated_ttft_ms']:>12} "
              f"{row['ttft_ratio']:>6} {row['single_total_ms']:>13} "
              f"{row['disaggregated_total_ms']:>13} {row['total_ratio']:>6}")
    print("\nwhere a disaggregated request's time to first token went (medians, ms):")
    print(f"{'prompt tokens':>13} " + " ".join(f"{k:>11}" for k in SEGMENTS))
    for n, row in result["ttft_breakdown_ms"].items():
        print(f"{n:>13} " + " ".join(f"{row.get(k, 0.0):>11}" for k in SEGMENTS))
    print("\nconnector time per step that carried a save or a load (ms):")
    for side, q in result["connector_ms_per_step"].items():
        print(f"  {side:>8}: {q}")
    if "burst" in result:
        print(f"inter-token latency of bursts of {args.burst} streams (ms):")
        for kind, q in result["burst"]["inter_token_ms"].items():
            print(f"  {kind:>13}: {q}")
    print(f"\n{'request':>44} {'pages':>5} {'bytes':>9} {'transfer':>9} {'daemon':>7} "
          f"{'copy-out':>9} {'copy-in':>8}")
    for x in result["requests"]:
        print(f"{x['request'][-44:]:>44} {x['pages']:>5} {x['bytes']:>9} {x['transfer_ms']:>9} "
              f"{x['daemon_transfer_ms']:>7} {x['copy_out_ms']:>9} {x['copy_in_ms']:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
