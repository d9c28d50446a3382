"""The trust phase of ``vllm_scenario.py``: bad params, forged params and daemon restarts
against the running disaggregated engines (docs/trust.md). Run under the vLLM environment.

Every case sends one of the ``PROMPTS`` (whose baseline answers the scenario recorded with
top-5 logprobs) and records what came back, so that ``test_vllm_trust.py`` compares it with
the plain engine's answer. Cases that bypass the proxy send straight to the decode engine,
as a client that can reach it would.
"""

from __future__ import annotations

import copy
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from vllm_client import ask, ask_all, counters, metric

from kvxfer.client import KvxferClient
from kvxfer.client.integrations.vllm.deploy import Disaggregation, VllmServer
from kvxfer.client.integrations.vllm.router import VllmRouter
from kvxfer.client.integrations.vllm.tiny_model import prompt

#: Top logprobs compared per generated token.
TOP = 5
#: The prompts of the phase, by name (lengths in words = tokens); F and G have one length.
PROMPTS = {
    **{f"M{i}": prompt(seed=300 + i, words=40 + 20 * i) for i in range(3)},
    "F": prompt(seed=310, words=90), "G": prompt(seed=311, words=90),
    **{f"R{i}": prompt(seed=320 + i, words=50 + 10 * i) for i in range(6)},
    **{f"D{i}": prompt(seed=330 + i, words=60 + 10 * i) for i in range(3)},
    **{f"P{i}": prompt(seed=340 + i, words=60 + 10 * i) for i in range(3)},
    **{f"K{i}": prompt(seed=350 + i, words=70 + 10 * i) for i in range(6)},
    **{f"W{i}": prompt(seed=360 + i, words=45 + 5 * i) for i in range(12)},
    "A0": prompt(seed=370, words=120), "A1": prompt(seed=371, words=30),
    **{f"C{i}": prompt(seed=380 + i, words=55 + 10 * i) for i in range(3)},
    **{f"B{i}": prompt(seed=390 + i, words=70 + 30 * i) for i in range(4)},
}
#: How long the client of a request that is then aborted waits for its answer.
ABANDON_S = 3.0
#: How long after a daemon restart transfers must flow again.
RESUME_S = 60.0


def malformed(layout: dict[str, Any], model: dict[str, Any]) -> list[dict[str, Any]]:
    """Params the decode engine must refuse (and compute the prompt itself)."""
    return [
        {"do_remote_prefill": True, "kvxfer": "x" * 64},
        {"do_remote_prefill": True, "kvxfer": {"version": 4, "transfer_id": "x",
                                               "peer": "127.0.0.1:1", "capabilities": ["0" * 32],
                                               "num_tokens": 100_000, "layout": layout,
                                               "model": model}},
        {"do_remote_prefill": "yes", "kvxfer": {"version": 4}},
    ]


class Phase:
    """The running deployment, and a record of what each case answered."""

    def __init__(self, d: Disaggregation, model: str) -> None:
        assert d.decode is not None and d.prefill is not None
        self.d, self.model = d, model
        self.out: dict[str, Any] = {}
        #: Every capability a prefill answer carried (a secret no log may hold).
        self.capabilities: list[str] = []

    def direct(self, name: str, params: dict[str, Any] | None, case: str,
               engine: VllmServer | None = None) -> dict[str, Any]:
        """``PROMPTS[name]`` straight to ``engine`` (default: the decode engine) with ``params``."""
        engine = engine or self.d.decode
        assert engine is not None
        with engine.client() as http:
            return self._asked(http, name, params, case)

    def routed(self, router: VllmRouter, name: str, case: str) -> dict[str, Any]:
        """``PROMPTS[name]`` through vllm-router."""
        with router.client() as http:
            return self._asked(http, name, None, case)

    def _asked(self, http: Any, name: str, params: dict[str, Any] | None, case: str) -> dict[str, Any]:
        try:
            answer = ask(http, self.model, PROMPTS[name], case, params, top=TOP)
        except RuntimeError as exc:  # an HTTP error: recorded, the test says if it may be
            answer = {"error": str(exc)[:500]}
        answer["prompt"] = name
        return answer

    def prefilled(self, name: str, case: str, engine: VllmServer | None = None) -> dict[str, Any]:
        """The ``kv_transfer_params`` ``engine`` (default: the prefill engine) answers for
        ``PROMPTS[name]``."""
        engine = engine or self.d.prefill
        assert engine is not None
        with engine.client() as http:
            reply = http.post("/v1/completions", headers={"X-Request-Id": case}, json={
                "model": self.model, "prompt": PROMPTS[name], "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True}})
            reply.raise_for_status()
            params: dict[str, Any] = reply.json()["kv_transfer_params"]
            self.capabilities.extend(params["kvxfer"]["capabilities"])
            return params

    def healthy(self) -> bool:
        assert self.d.decode is not None and self.d.prefill is not None
        for engine in (self.d.decode, self.d.prefill):
            with engine.client(timeout_s=10) as http:
                if http.get("/health").status_code != 200:
                    return False
        return True

    def loaded_tokens(self) -> float:
        return counters(self.d, self.model)["external_kv_transfer"]


def dials_refused(d: Disaggregation) -> float:
    """Peer addresses the decode daemon refused to dial (``--dial-allow``), so far."""
    assert d.decode_daemon is not None
    return metric(d.decode_daemon.metrics_port, "kvxfer_dials_refused_total")


def forged_cases(phase: Phase) -> None:
    out = phase.out
    probe = phase.prefilled("M0", "layout-probe")["kvxfer"]
    out["malformed"] = [phase.direct(f"M{i}", params, f"malformed-{i}")
                        for i, params in enumerate(malformed(probe["layout"], probe["model"]))]
    f_params = phase.prefilled("F", "forge-source")
    out["other_prompt"] = phase.direct("G", f_params, "forged-other-prompt")
    out["other_prompt_plain_after"] = phase.direct("G", None, "plain-after-forgery")
    replayed = phase.prefilled("R0", "replay-source")
    out["replay_first"] = phase.direct("R0", replayed, "replay-first")
    out["replay_again"] = phase.direct("R0", copy.deepcopy(replayed), "replay-again")
    altered = phase.prefilled("R1", "altered-source")
    altered["kvxfer"]["transfer_id"] += "x"
    out["altered_id"] = phase.direct("R1", altered, "altered-id")
    stolen = phase.prefilled("R2", "capability-source")
    stolen["kvxfer"]["capabilities"] = ["0" * 32]
    out["wrong_capability"] = phase.direct("R2", stolen, "wrong-capability")
    closed = phase.prefilled("R3", "closed-peer-source")
    closed["kvxfer"]["peer"] = "127.0.0.1:1"
    out["closed_peer"] = phase.direct("R3", closed, "closed-peer")
    outside = phase.prefilled("R4", "outside-source")
    outside["kvxfer"]["peer"] = outside["kvxfer"]["peer"].replace("127.0.0.1:", "127.0.0.2:")
    refused_before = dials_refused(phase.d)
    out["outside_policy"] = phase.direct("R4", outside, "outside-policy")
    out["dials_refused"] = dials_refused(phase.d) - refused_before
    versioned = phase.prefilled("R5", "version-source")
    versioned["kvxfer"]["version"] = 1
    out["other_version"] = phase.direct("R5", versioned, "other-version")
    compatibility_cases(phase)
    out["healthy_after_forgeries"] = phase.healthy()


def compatibility_cases(phase: Phase) -> None:
    """Compatibility is by bytes and model: the same model under another path and vLLM
    release loads; another fingerprint, or another in-block format, is refused."""
    out = phase.out
    renamed = phase.prefilled("C0", "renamed-source")
    renamed["kvxfer"]["model"].update(name="/elsewhere/tiny-model", vllm_version="0.31.0")
    loaded_before = phase.loaded_tokens()
    out["renamed"] = phase.direct("C0", renamed, "renamed")
    out["renamed_loaded"] = phase.loaded_tokens() - loaded_before
    other_model = phase.prefilled("C1", "other-model-source")
    fingerprint = other_model["kvxfer"]["model"]["fingerprint"]
    other_model["kvxfer"]["model"]["fingerprint"] = fingerprint[::-1]
    out["other_model"] = phase.direct("C1", other_model, "other-model")
    other_format = phase.prefilled("C2", "other-format-source")
    out["block_format"] = other_format["kvxfer"]["layout"]["block_format"]
    other_format["kvxfer"]["layout"]["block_format"] = "LBHNC/cpu-amx"  # an AMX CPU's bfloat16
    out["other_format"] = phase.direct("C2", other_format, "other-format")


def engine_gauge(phase: Phase, name: str) -> float:
    assert phase.d.decode is not None
    return phase.d.decode.metric(f'vllm:{name}{{engine="0",model_name="{phase.model}"}}')


def aborted_case(phase: Phase) -> None:
    """A request aborted (its client went away) while its load waits on a frozen prefill
    daemon: once a later request has run, the decode engine holds no request and no block."""
    d, out = phase.d, phase.out
    assert d.decode is not None and d.prefill_daemon is not None and d.prefill_daemon.process
    params = phase.prefilled("A0", "abandoned-source")
    out["before_abandoned_gauges"] = {name: engine_gauge(phase, name) for name in (
        "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
    d.prefill_daemon.process.send_signal(signal.SIGSTOP)
    try:
        with d.decode.client(timeout_s=ABANDON_S) as http:
            try:
                ask(http, phase.model, PROMPTS["A0"], "abandoned", params, top=TOP)
                out["abandoned_answered"] = True
            except httpx.TimeoutException:
                out["abandoned_answered"] = False
        time.sleep(1.0)  # the engine sees the disconnect and aborts the request
    finally:
        d.prefill_daemon.process.send_signal(signal.SIGCONT)
    out["after_abandoned"] = phase.direct("A1", None, "after-abandoned")
    time.sleep(1.0)
    out["after_abandoned_gauges"] = {name: engine_gauge(phase, name) for name in (
        "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}


def restart_cases(phase: Phase, router: VllmRouter) -> None:
    """A daemon killed (SIGKILL) and restarted between requests (through the proxy), then
    under 3 requests in flight through vllm-router; each time, answers and how soon
    transfers moved again."""
    d, out = phase.d, phase.out
    assert d.decode_daemon is not None and d.prefill_daemon is not None
    waves = iter(f"W{i}" for i in range(12))
    for side, daemon in (("decode", d.decode_daemon), ("prefill", d.prefill_daemon)):
        batch = [f"D{i}" for i in range(3)] if side == "decode" else [f"P{i}" for i in range(3)]
        daemon.restart()
        before = phase.loaded_tokens()
        out[f"after_{side}_restart"] = ask_all_named(phase, batch, f"after-{side}-restart")
        out[f"loaded_after_{side}_restart"] = phase.loaded_tokens() - before
    for side, daemon in (("prefill", d.prefill_daemon), ("decode", d.decode_daemon)):
        names = [f"K{i}" for i in (range(3) if side == "prefill" else range(3, 6))]
        daemon.process.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        with ThreadPoolExecutor(len(names)) as pool:
            flying = [pool.submit(phase.routed, router, name, f"inflight-{side}-{name}")
                      for name in names]
            time.sleep(1.0)  # the requests now wait on the frozen daemon: surely in flight
            restarted = time.monotonic()
            daemon.restart()  # SIGKILL, then the same socket and peer port
            out[f"inflight_{side}"] = [f.result(300) for f in flying]
        out[f"resumed_{side}_s"] = resume(phase, router, waves, restarted,
                                          out.setdefault("waves", []))
    out["healthy_after_restarts"] = phase.healthy()


def ask_all_named(phase: Phase, names: list[str], prefix: str) -> list[dict[str, Any]]:
    answers = ask_all(phase.d.client, phase.model, [PROMPTS[n] for n in names], prefix, top=TOP)
    for name, answer in zip(names, answers):
        answer["prompt"] = name
    return answers


def resume(phase: Phase, router: VllmRouter, waves: Any, since: float,
           record: list[dict[str, Any]]) -> float | None:
    """Seconds from ``since`` until a new prompt through vllm-router is loaded from the
    prefill side again (None if not within ``RESUME_S``); every answer goes to ``record``."""
    while time.monotonic() - since < RESUME_S:
        name = next(waves, None)
        if name is None:
            return None
        before = phase.loaded_tokens()
        record.append(phase.routed(router, name, f"wave-{name}"))
        if phase.loaded_tokens() > before:
            return time.monotonic() - since
        time.sleep(2)
    return None


def sampled_cases(phase: Phase, sample: list[tuple[Any, str]]) -> None:
    """Generated params (``test_vllm_params``' strategy) straight to the decode engine, each
    with one of the M prompts; what the oracle predicted for each is kept beside the answer."""
    phase.out["sampled"] = [
        {"predicted": outcome, **phase.direct(f"M{i % 3}", params, f"sampled-{i}")}
        for i, (params, outcome) in enumerate(sample)]


def capabilities_logged(phase: Phase) -> dict[str, Any]:
    """How many of the capabilities the phase saw each log of the deployment holds (engines
    run with ``--enable-log-requests``), and how many redacted values the decode engine's
    log holds (its request logger wrote the params, with their capabilities redacted)."""
    logs = {str(path.relative_to(phase.d.workdir)): path.read_text(errors="replace")
            for path in sorted(phase.d.workdir.rglob("*.log"))}
    return {"minted": len(phase.capabilities),
            "found": {name: sum(cap in text for cap in phase.capabilities)
                      for name, text in logs.items()},
            "decode_params_logged": logs.get("decode.log", "").count("'kv_transfer_params'"),
            "decode_redacted": logs.get("decode.log", "").count("<redacted>")}


def streamed_lines(phase: Phase, name: str, params: dict[str, Any], case: str) -> dict[str, Any]:
    """``PROMPTS[name]`` streamed straight to the decode engine: the HTTP status and every
    ``data:`` line it sent."""
    assert phase.d.decode is not None
    body = {"model": phase.model, "prompt": PROMPTS[name], "max_tokens": 12, "temperature": 0,
            "stream": True, "kv_transfer_params": params}
    with phase.d.decode.client() as http, http.stream(
            "POST", "/v1/completions", json=body, headers={"X-Request-Id": case}) as reply:
        lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
        return {"status": reply.status_code, "lines": lines}


def fail_policy_case(d: Disaggregation, model: str) -> dict[str, Any]:
    """With ``kv_load_failure_policy: fail`` on the decode engine: a load refused (a wrong
    capability) answers an HTTP error instead of a wrong answer (streamed: an error chunk),
    the engine stays healthy,
    and the prompt asked again without params is answered as a plain engine would (no
    poisoned prefix cache)."""
    phase = Phase(d, model)
    params = phase.prefilled("F", "fail-source")
    params["kvxfer"]["capabilities"] = ["0" * 32 for _ in params["kvxfer"]["capabilities"]]
    phase.out["failed_load"] = phase.direct("F", params, "fail-wrong-capability")
    streamed = phase.prefilled("F", "fail-stream-source")
    streamed["kvxfer"]["capabilities"] = ["0" * 32 for _ in streamed["kvxfer"]["capabilities"]]
    phase.out["failed_stream"] = streamed_lines(phase, "F", streamed, "fail-stream")
    assert d.decode_daemon is not None
    split = phase.prefilled("F", "stall-rank0-split")
    if len(split["kvxfer"]["capabilities"]) == 2:  # rank 1's refused, rank 0's stalls
        split["kvxfer"]["capabilities"][1] = "0" * 32
        phase.out["one_rank_failed"] = phase.direct("F", split, "fail-one-rank")
        with KvxferClient(d.decode_daemon.worker_address) as client:
            phase.out["one_rank_transfers"] = {
                i.transfer_id.rsplit("/", 1)[-1]: [i.state.name, i.error]
                for i in client.transfers() if "stall-rank0-split" in i.transfer_id}
    phase.out["plain_after"] = phase.direct("F", None, "fail-plain-after")
    phase.out["healthy_after"] = phase.healthy()
    phase.out["running_after"] = engine_gauge(phase, "num_requests_running")
    return phase.out


def run(d: Disaggregation, model: str, sample: list[tuple[Any, str]]) -> dict[str, Any]:
    """Every case, in order; what each answered."""
    phase = Phase(d, model)
    forged_cases(phase)
    sampled_cases(phase, sample)
    aborted_case(phase)
    assert d.prefill is not None and d.decode is not None
    with VllmRouter.pd(d.prefill.address, d.decode.address, d.workdir / "router.log") as router:
        restart_cases(phase, router)
    phase.out["capabilities_logged"] = capabilities_logged(phase)
    return phase.out
