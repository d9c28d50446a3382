"""Drive real vLLM servers through kvxfer and report what they answered (run by test_vllm.py).

usage: .venv-vllm/bin/python tests/vllm_scenario.py WORKDIR [--tp N] [--no-controls]
                                                       [--failure-policy fail]

Runs under the vLLM environment: builds the tiny model, starts a single-engine
baseline beside a disaggregated deployment (two kvxfer daemons, a prefill and
a decode engine with KvxferConnector, the development proxy), sends the same prompts to
both, concurrently, and prints one JSON object: every answer's tokens and
logprobs, the engines' and daemons' counters after each phase, and the
connector's per-transfer records. The decode daemon is the tests' fault double
(``corrupting_daemon.py``): it corrupts every transfer whose id contains
"corrupt"; requests of the negative controls are named so (X-Request-Id). Then
the trust phase (``vllm_trust_phase.py``): malformed and forged params, daemons
killed and restarted; before it, the block-size phase (``vllm_block_phase.py``): an engine
of 64-token blocks beside the pair. ``--tp 2`` runs every engine with two tensor-parallel
ranks; ``--no-controls`` leaves the negative controls and the trust phase out;
``--failure-policy fail`` gives the decode engine that ``kv_load_failure_policy`` and
ends with a load that fails (``vllm_trust_phase.fail_policy_case``). With the controls,
both engines log requests (``--enable-log-requests``), and the trust phase counts the
capabilities their logs hold.
test_vllm.py asserts on the output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import vllm_block_phase
import vllm_tp_phase
import vllm_trust_phase
from vllm_client import ask, ask_all, counters, metric

from kvxfer.client.integrations.vllm.deploy import Disaggregation, VllmServer
from kvxfer.client.integrations.vllm.processes import free_port
from kvxfer.client.integrations.vllm.tiny_model import build, prompt

HERE = Path(__file__).resolve().parent
#: Prompt lengths in tokens (blocks are 32 tokens): from under one block to seven.
LENGTHS = [5, 17, 31, 32, 33, 70, 130, 200]
#: Two prompts sharing a 130-word prefix (4 whole blocks), asked one after the other.
SHARED = [prompt(seed=300, words=130) + " " + prompt(seed=301 + i, words=40) for i in range(2)]


def leased_pages_settled(d: Disaggregation, timeout_s: float = 45.0) -> dict[str, dict[str, int]]:
    """Both daemons' leased pages, once none are (or after ``timeout_s``: what is left). An
    offer whose puller died holds its pages until its deadline (the connector's 30 s)."""
    from kvxfer.client import KvxferClient

    assert d.prefill_daemon is not None and d.decode_daemon is not None
    deadline = time.monotonic() + timeout_s
    with KvxferClient(d.prefill_daemon.worker_address) as p, \
            KvxferClient(d.decode_daemon.worker_address) as q:
        while True:
            leased = {"prefill": p.leased_pages(), "decode": q.leased_pages()}
            if all(n == 0 for pools in leased.values() for n in pools.values()):
                return leased
            if time.monotonic() > deadline:
                return leased
            time.sleep(0.5)


def ask_in_turn(make_client: Any, model: str, prompts: list[str], prefix: str) -> list[dict[str, Any]]:
    """Each prompt once the one before was answered (a later one may hit the earlier's
    prefix cache, on a plain engine as on a disaggregated pair)."""
    with make_client() as http:
        return [ask(http, model, text, f"{prefix}-{i}") for i, text in enumerate(prompts)]


def shared_prefix_phase(d: Disaggregation, model: str) -> dict[str, Any]:
    """``SHARED`` through the pair, in turn: the answers, and for each what the decode engine
    took from its prefix cache and from the transfer, the pages the connector loaded
    (``vllm:kvxfer_load_pages``) and the bytes the prefill daemon sent."""
    assert d.decode is not None and d.prefill_daemon is not None
    pages = f'vllm:kvxfer_load_pages_sum{{engine="0",model_name="{model}"}}'
    sent = 'kvxfer_bytes_total{role="sender"}'

    def now() -> dict[str, float]:
        assert d.decode is not None and d.prefill_daemon is not None
        return {**counters(d, model), "load_pages": d.decode.metric(pages),
                "sent_bytes": metric(d.prefill_daemon.metrics_port, sent)}

    out: dict[str, Any] = {"answers": [], "moved": []}
    for i, text in enumerate(SHARED):
        before = now()
        out["answers"] += ask_in_turn(d.client, model, [text], f"pd-shared-{i}")
        leased_pages_settled(d, timeout_s=15.0)  # the sender's transfer ended: counted
        after = now()
        out["moved"].append({k: after[k] - before[k] for k in after})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--no-controls", dest="controls", action="store_false")
    parser.add_argument("--failure-policy", choices=["recompute", "fail"], default="recompute")
    parser.add_argument("--params-sample", help="JSON [[params, predicted outcome], ...] the "
                                                "trust phase sends to the decode engine")
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
        free = free_port
        # TCP ports where vllm-router (the trust phase) must reach the engines. The phases
        # before it go through kvxfer's development proxy, which keeps the X-Request-Id the
        # fault double keys on and passes a client's kv_transfer_params ({"verify": true})
        # on; vllm-router replaces both.
        ports = (free(), free(), free()) if args.controls else None
        # The daemons may dial 127.0.0.1 only: the trust phase names 127.0.0.2 as a peer.
        # Heartbeats every 2 s (a peer is lost after 7 s of silence, not 4): with three TP 2
        # engines on 2 cores a daemon went 4 s without beating once (2026-12-07), and the
        # load it served failed.
        with Disaggregation(model, workdir, num_pages=512, tp=args.tp, ports=ports,
                            more_engines=("wide",) if args.controls else ("narrow",),
                            daemon_args=["--dial-allow", "127.0.0.1/32", "--heartbeat-s", "2"],
                            engine_args=["--enable-log-requests"] if args.controls else [],
                            failure_policy=args.failure_policy,
                            decode_daemon_launcher=[sys.executable, str(HERE / "corrupting_daemon.py"),
                                                    "corrupt"]) as d:
            baseline.wait_ready()
            out["baseline"] = {name: ask_all(baseline.client, model, prompts, f"base-{name}")
                               for name, prompts in sets.items()}
            out["baseline_shared"] = ask_in_turn(baseline.client, model, SHARED, "base-shared")
            if args.controls:
                names = list(vllm_trust_phase.PROMPTS)
                answers = ask_all(baseline.client, model, list(vllm_trust_phase.PROMPTS.values()),
                                  "base-trust", top=vllm_trust_phase.TOP)
                out["baseline_trust"] = dict(zip(names, answers))
            if args.failure_policy == "fail":
                with baseline.client() as http:
                    out["baseline_fail"] = ask(http, model, vllm_trust_phase.PROMPTS["F"],
                                               "base-fail", top=vllm_trust_phase.TOP)
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
            settling = time.monotonic()  # workers release leases off their step, soon after
            out["leased_pages_at_end"] = leased_pages_settled(d, timeout_s=15.0)
            out["leased_settled_s"] = time.monotonic() - settling
            for side in ("prefill", "decode"):
                path = workdir / f"{side}-stats.jsonl"
                records = [json.loads(line) for line in
                           (path.read_text().splitlines() if path.exists() else [])]
                out[f"{side}_stats"] = [r for r in records if r.get("role") != "step"]
                out[f"{side}_steps"] = [r for r in records if r.get("role") == "step"]
            assert d.prefill is not None and d.decode is not None
            out["engine_metrics"] = {"prefill": d.prefill.samples("vllm:kvxfer_"),
                                     "decode": d.decode.samples("vllm:kvxfer_")}
            out["shared_prefix"] = shared_prefix_phase(d, model)
            if args.failure_policy == "fail":
                out["fail_policy"] = vllm_trust_phase.fail_policy_case(d, model)
            if args.tp == 2:
                out["mixed_tp"] = vllm_tp_phase.run(d, model)
            if args.controls:
                out["blocks"] = vllm_block_phase.run(d, model)
                sample = json.loads(Path(args.params_sample).read_text()) if args.params_sample else []
                out["trust"] = vllm_trust_phase.run(d, model, sample)
                out["trust"]["leased_pages_at_end"] = leased_pages_settled(d)
                out["trust"]["engine_metrics"] = d.decode.samples("vllm:kvxfer_")
                assert d.decode is not None
                out["trust"]["decode_log"] = "\n".join(  # all but the request logger's lines
                    line for line in d.decode.log().splitlines() if "request_logger" not in line)
    finally:
        baseline.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
