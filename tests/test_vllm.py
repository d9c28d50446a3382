"""Real vLLM engines, disaggregated through kvxfer, answer exactly like one engine.

``vllm_scenario.py`` runs under the vLLM environment (``./scripts/setup-vllm.sh``
makes ``.venv-vllm``; ``./scripts/test.sh`` runs it): a single-engine baseline,
and two kvxfer daemons with a prefill and a decode engine (``vllm serve`` with
KvxferConnector) behind kvxfer's development proxy (the trust phase: vllm-router).
The same prompts go to both, concurrently, greedy. This module asserts on what it reports. Without ``.venv-vllm`` it
skips, unless KVXFER_REQUIRE_VLLM=1 (CI), where that is a failure.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from vllm_env import vllm_python

from kvxfer.client.integrations.vllm.deploy import shm_segments
from kvxfer.ucx_settings import LOOPBACK_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HERE = Path(__file__).resolve().parent


def scenario(tmp_path_factory: pytest.TempPathFactory, *args: str,
             script: str = "vllm_scenario.py") -> dict[str, Any]:
    """What ``script`` (``vllm_scenario.py``) answered and counted (one to three minutes)."""
    python = vllm_python()
    workdir = tmp_path_factory.mktemp("vllm")
    segments_before = shm_segments()
    out = subprocess.run([str(python), str(HERE / script), str(workdir), *args],
                         capture_output=True, text=True, timeout=800,
                         env={**os.environ, **LOOPBACK_ENV})
    assert out.returncode == 0, out.stderr[-6000:] + log_tails(workdir)
    result: dict[str, Any] = json.loads(out.stdout)
    result["shm_segments_left"] = sorted(map(str, shm_segments() - segments_before))
    return result


def log_tails(workdir: Path, chars: int = 3000) -> str:
    """The end of every engine, proxy and daemon log the scenario left, for a failure message."""
    return "".join(f"\n--- {log.relative_to(workdir)} ---\n{log.read_text(errors='replace')[-chars:]}"
                   for log in sorted(workdir.rglob("*.log")))


#: How many generated params (refused or not asked for, by the oracle) the decode engine gets.
SAMPLED = 12
#: How far a logprob of an engine that loaded KV computed at another TP size may be from
#: its plain answer's: 0.0020 to 0.0038 measured here, as far as plain TP 1 and TP 2
#: engines' answers are from each other (0.0035 to 0.0039); with each page copied among the
#: wrong heads, the tokens differ.
MIXED_TP_LOGPROB = 5e-3


def fits_int64(value: Any) -> bool:
    """Whether every integer in ``value`` (nested lists and dicts) is a 64-bit one, as vLLM
    requires of ``extra_args``."""
    if isinstance(value, bool):
        return True
    if isinstance(value, int):
        return -(1 << 63) <= value < 1 << 63
    if isinstance(value, dict):
        return all(fits_int64(k) and fits_int64(v) for k, v in value.items())
    if isinstance(value, list):
        return all(fits_int64(v) for v in value)
    return True


def params_sample(count: int) -> list[tuple[Any, str]]:
    """``count`` params that ``test_vllm_params``'s strategy generates with a fixed seed,
    and what its oracle predicts for each: those it predicts no load for (a load needs a
    real offer), and that JSON can carry."""
    from hypothesis import given, settings
    from test_vllm_params import cases

    found: list[tuple[Any, str]] = []

    @settings(max_examples=2000, database=None, derandomize=True)
    @given(case=cases())
    def collect(case: tuple[Any, str]) -> None:
        params, outcome = case
        if len(found) < count and outcome in ("none", "malformed", "version", "layout"):
            try:
                json.dumps(params, allow_nan=False)
            except (TypeError, ValueError):
                return
            if not fits_int64(params):  # vLLM answers 400 to such a request before any connector
                return
            found.append(case)

    collect()
    return found


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One engine per role, the negative controls, and the trust phase (with a sample of
    generated params)."""
    sample = tmp_path_factory.mktemp("params") / "sample.json"
    sample.write_text(json.dumps(params_sample(SAMPLED)))
    return scenario(tmp_path_factory, "--params-sample", str(sample))


@pytest.fixture(scope="module")
def run_tp2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every engine with two tensor-parallel ranks (a transfer per rank); no controls; the
    decode engine's ``kv_load_failure_policy`` is ``fail`` (every transfer of it succeeds
    but the one ``fail_policy_case`` breaks)."""
    return scenario(tmp_path_factory, "--tp", "2", "--no-controls", "--failure-policy", "fail")


@pytest.fixture(scope="module")
def unguarded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The trust guards' negative controls through real engines (``vllm_unguarded.py``)."""
    return scenario(tmp_path_factory, script="vllm_unguarded.py")


@pytest.fixture(scope="module")
def run_hybrid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A hybrid model (sliding-window and full-attention layers) with vLLM's hybrid KV cache
    manager on, behind vllm-router (``vllm_hybrid.py``)."""
    return scenario(tmp_path_factory, script="vllm_hybrid.py")


@pytest.fixture(scope="module")
def run_mamba(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A Mamba2 hybrid served plainly, then with the connector (``vllm_mamba.py``)."""
    return scenario(tmp_path_factory, script="vllm_mamba.py")


def differences(want: list[dict[str, Any]], got: list[dict[str, Any]]) -> list[str]:
    """How each answer differs (tokens, or logprobs bit for bit); empty when identical."""
    found = []
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        if w["tokens"] != g["tokens"]:
            found.append(f"prompt {i}: tokens {g['tokens']} != {w['tokens']}")
        elif w["logprobs"] != g["logprobs"]:
            worst = max(abs(a - b) for a, b in zip(w["logprobs"], g["logprobs"]))
            found.append(f"prompt {i}: logprobs differ by up to {worst:.3g}")
    return found


def test_disaggregated_answers_equal_one_engine_token_for_token_logprob_for_logprob(run) -> None:
    want, got = run["baseline"]["A"], run["disaggregated"]
    assert len(got) == 8 and max(a["prompt_tokens"] for a in got) >= 4 * 32  # several blocks
    assert sorted({a["prompt_tokens"] for a in got}) == sorted(a["prompt_tokens"] for a in got)
    assert differences(want, got) == []


def test_the_decode_engine_loaded_every_prompt_token_and_computed_none(run) -> None:
    before, after = run["before"], run["after_disaggregated"]
    prompt_tokens = sum(a["prompt_tokens"] for a in run["disaggregated"])
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == prompt_tokens
    assert after["local_compute"] == before["local_compute"] == 0
    assert after["prefill_local_compute"] == prompt_tokens
    assert after["decode_daemon_done"] == after["prefill_daemon_done"] == 8


def test_a_streamed_answer_through_the_proxy_is_the_same_text(run) -> None:
    assert run["streamed"]["text"] == run["baseline"]["A"][5]["text"]


def test_a_corrupted_page_changes_the_answer(run) -> None:
    """The negative control: the decode daemon flips one byte of these transfers (its test-only
    fault hook), unchecked; if the decode engine did not use the transferred KV, nothing would change."""
    assert len(differences(run["baseline"]["B"], run["corrupted"])) == len(run["corrupted"]) == 4
    assert run["after_corrupted"]["decode_daemon_failed"] == 0


def test_with_checksums_a_corrupted_transfer_fails_and_the_prompt_is_recomputed(run) -> None:
    before, after = run["after_corrupted"], run["after_corrupted_verified"]
    assert differences(run["baseline"]["C"], run["corrupted_verified"]) == []
    assert after["decode_daemon_failed"] - before["decode_daemon_failed"] == 4
    recomputed = sum(a["prompt_tokens"] for a in run["corrupted_verified"])
    assert after["local_compute"] - before["local_compute"] == recomputed
    failures = [s for s in run["decode_stats"] if s.get("ok") is False]
    assert len(failures) == 4 and all("checksum" in s["error"] for s in failures)


def test_every_transfer_is_recorded_and_no_page_stays_leased(run) -> None:
    assert run["leased_pages_at_end"] == {"prefill": {"kv": 0}, "decode": {"kv": 0}}
    done = [s for s in run["decode_stats"] if s.get("ok")]
    assert len(done) == 13 and all(s["bytes"] > 0 and s["copy_s"] > 0 for s in done)
    assert len(run["prefill_stats"]) == 17 and all(s["copy_s"] > 0 for s in run["prefill_stats"])


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``samples`` of metric ``name`` whose labels include ``labels``."""
    want = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(value for sample, value in samples.items()
               if sample.partition("{")[0] == name and all(w in sample for w in want))


def test_vllms_own_metrics_count_every_load_save_and_failure_by_reason(run) -> None:
    """The connector's figures reach each engine's ``/metrics`` through vLLM's
    KVConnectorStats: taken before the trust phase, after 13 good loads and 4 corrupted
    ones refused by their checksums (the JSONL records count the same)."""
    decode, prefill = run["engine_metrics"]["decode"], run["engine_metrics"]["prefill"]
    done = [s for s in run["decode_stats"] if s.get("ok")]
    assert total(decode, "vllm:kvxfer_load_time_seconds_count") == len(done) == 13
    assert total(decode, "vllm:kvxfer_load_bytes_sum") == sum(s["bytes"] for s in done)
    assert total(decode, "vllm:kvxfer_load_pages_sum") == sum(s["pages"] for s in done)
    assert 0 < total(decode, "vllm:kvxfer_load_time_seconds_sum") < 13 * 30
    assert total(decode, "vllm:kvxfer_failed_loads_total") == 4
    assert total(decode, "vllm:kvxfer_failed_loads_total", reason="INTEGRITY_CHECK_FAILED") == 4
    assert total(prefill, "vllm:kvxfer_save_time_seconds_count") == len(run["prefill_stats"]) == 17
    assert total(prefill, "vllm:kvxfer_save_bytes_sum") == sum(s["bytes"] for s in run["prefill_stats"])
    assert total(prefill, "vllm:kvxfer_failed_saves_total") == 0
    assert total(decode, "vllm:kvxfer_connector_errors_total") == 0
    assert total(prefill, "vllm:kvxfer_load_time_seconds_count") == 0
    for side, samples in (("decode", decode), ("prefill", prefill)):  # the connector's time per
        steps = run[f"{side}_steps"]  # step that carried a save or a load, as its records say
        assert len(steps) > 0 and all(s["saves"] + s["loads"] + s["ended"] + s["landed"] > 0
                                      for s in steps)
        assert total(samples, "vllm:kvxfer_step_time_seconds_count") == len(steps)
        assert total(samples, "vllm:kvxfer_step_time_seconds_sum") == pytest.approx(
            sum(s["seconds"] for s in steps))


def check_shared_prefix(run: dict[str, Any]) -> None:
    """The second of two prompts sharing a 4-block prefix: its answer equals a plain
    engine's, the decode engine took the prefix from its own cache, and only the pages past
    it crossed the wire (the connector's loaded pages and the prefill daemon's bytes)."""
    shared = run["shared_prefix"]
    assert differences(run["baseline_shared"], shared["answers"]) == []
    first, second = shared["moved"]
    tokens = [a["prompt_tokens"] for a in shared["answers"]]
    ranks = run["tp"]
    assert first["local_cache_hit"] == 0 and first["load_pages"] == ranks * math.ceil(tokens[0] / 32)
    assert first["local_compute"] == second["local_compute"] == 0
    hit_blocks = second["local_cache_hit"] // 32
    assert hit_blocks >= 4 and second["local_cache_hit"] % 32 == 0
    assert second["load_pages"] == ranks * (math.ceil(tokens[1] / 32) - hit_blocks)
    page_bytes = first["sent_bytes"] / first["load_pages"]
    assert second["sent_bytes"] == page_bytes * second["load_pages"]


def test_the_decode_engine_pulls_only_what_its_prefix_cache_lacks(run) -> None:
    check_shared_prefix(run)


def test_with_two_ranks_each_rank_pulls_only_what_its_prefix_cache_lacks(run_tp2) -> None:
    check_shared_prefix(run_tp2)


def test_with_two_tensor_parallel_ranks_the_answers_still_equal_one_engine(run_tp2) -> None:
    assert run_tp2["tp"] == 2
    assert differences(run_tp2["baseline"]["A"], run_tp2["disaggregated"]) == []
    assert run_tp2["streamed"]["text"] == run_tp2["baseline"]["A"][5]["text"]


def logprob_gaps(answers: dict[str, Any], plain: dict[str, Any]) -> dict[str, float]:
    """Per prompt, the largest logprob gap to its plain answer (infinite: other tokens)."""
    return {name: max(abs(a - b) for a, b in zip(got["logprobs"], plain[name]["logprobs"],
                                                   strict=True))
            if got["tokens"] == plain[name]["tokens"] else float("inf")
            for name, got in answers.items()}


def test_a_decode_engine_of_one_rank_loads_what_two_prefill_ranks_computed(run_tp2) -> None:
    """TP 2 -> 1: the narrow engine takes every prompt token from the transfers (one per
    prefill rank, both pulled by its one rank) and answers as it does plainly: the same
    tokens; logprobs as close as KV computed on two ranks is to KV computed on one (its
    all-reduce adds in another order)."""
    mixed = run_tp2["mixed_tp"]
    assert set(mixed["narrowed"]) == {"K0", "K1", "K2"}
    for name, got in mixed["narrowed"].items():
        assert got["loaded"] == got["prompt_tokens"], (name, got)
    gaps = logprob_gaps(mixed["narrowed"], mixed["plain_narrow"])
    assert max(gaps.values()) < MIXED_TP_LOGPROB, gaps
    pulled = {tid.rsplit("/", 1)[-1] for tid, (role, state, _) in
              mixed["narrow_transfers"].items() if role == "RECEIVER" and state == "DONE"}
    assert pulled == {"tp0", "tp1"}


def test_a_decode_engine_of_two_ranks_loads_what_one_prefill_rank_computed(run_tp2) -> None:
    """TP 1 -> 2: each decode rank pulls its own part of the one transfer (its KV head's
    pages); every prompt token comes from it, and the answers are the TP 2 engine's plain
    tokens, logprobs as close as KV computed on one rank is to KV computed on two."""
    mixed = run_tp2["mixed_tp"]
    for name, got in mixed["widened"].items():
        assert got["loaded"] == got["prompt_tokens"], (name, got)
    gaps = logprob_gaps(mixed["widened"], mixed["plain_pair"])
    assert max(gaps.values()) < MIXED_TP_LOGPROB, gaps
    parts = {tid.rsplit("#", 1)[-1] for tid, (role, state, _) in
             mixed["pair_transfers"].items() if role == "RECEIVER" and state == "DONE"}
    assert parts == {"0", "1"}, mixed["pair_transfers"]


def test_stopped_tensor_parallel_engines_leave_no_shared_memory(run_tp2) -> None:
    assert run_tp2["shm_segments_left"] == []


def test_with_two_ranks_each_rank_moves_its_own_shard_and_nothing_is_computed_twice(run_tp2) -> None:
    after = run_tp2["after_disaggregated"]
    assert after["external_kv_transfer"] == sum(a["prompt_tokens"] for a in run_tp2["disaggregated"])
    assert after["local_compute"] == 0
    assert after["decode_daemon_done"] == after["prefill_daemon_done"] == 2 * 8
    ranks = [s["rank"] for s in run_tp2["decode_stats"] if s.get("ok")]
    assert sorted(set(ranks)) == [0, 1] and ranks.count(0) == ranks.count(1)
    assert run_tp2["leased_pages_at_end"] == {"prefill": {"kv": 0}, "decode": {"kv": 0}}
    metrics = run_tp2["engine_metrics"]["decode"]  # vLLM summed both ranks' figures
    assert total(metrics, "vllm:kvxfer_load_time_seconds_count") == len(ranks)
    assert total(metrics, "vllm:kvxfer_load_bytes_sum") == sum(
        s["bytes"] for s in run_tp2["decode_stats"] if s.get("ok"))


#: How far a logprob of the trust phase may be from the plain engine's: vllm-router
#: re-encodes the JSON floats it passes on (4.4e-16 off seen here); everything else was
#: bit-identical. One corrupted byte of a transfer moved logprobs by 0.0037 to 0.016 here
#: (the negative control above), KV of another prompt much more.
TOLERANCE = 1e-6


def same_as_plain(trust: dict[str, Any], base: dict[str, Any], answer: dict[str, Any]) -> str:
    """How ``answer`` differs from the plain engine's for its prompt ("" when it does not):
    other tokens, or a logprob of a token or of a step's top-5 more than ``TOLERANCE`` off,
    or another top-5 (a near tie at the 5th place may swap in a token within tolerance)."""
    if "error" in answer:
        return f"{answer['prompt']}: {answer['error'][:300]}"
    want = base[answer["prompt"]]
    if want["tokens"] != answer["tokens"]:
        return f"{answer['prompt']}: tokens {answer['tokens']} != {want['tokens']}"
    for step, (w, g) in enumerate(zip(want["logprobs"], answer["logprobs"], strict=True)):
        if abs(w - g) > TOLERANCE:
            return f"{answer['prompt']}: step {step}'s token logprob off by {abs(w - g):.3g}"
    for step, (w, g) in enumerate(zip(want["top_logprobs"], answer["top_logprobs"], strict=True)):
        for token in set(w) | set(g):
            has, lacks = (w, g) if token in w else (g, w)
            # in both: the same logprob; in one only: a near tie at the edge of the other's top-5
            off = abs(w[token] - g[token]) if token in lacks else abs(has[token] - min(lacks.values()))
            if off > TOLERANCE:
                return f"{answer['prompt']}: step {step}'s top-5 token {token!r} off by {off:.3g}"
    return ""


def test_malformed_params_never_kill_the_decode_engine_nor_change_its_answer(run) -> None:
    """Straight to the decode engine: a string for the kvxfer params, v4 params with an
    extra num_tokens of 100,000, do_remote_prefill "yes". Each is refused, named in the
    log, and the prompt computed there: the plain engine's answer, top-5 logprobs included."""
    trust, base = run["trust"], run["baseline_trust"]
    assert [same_as_plain(trust, base, a) for a in trust["malformed"]] == ["", "", ""]
    log = trust["decode_log"]
    assert "kvxfer.num_tokens: Extra inputs" in log  # the counts: the next test
    assert trust["healthy_after_forgeries"]


def test_generated_params_through_the_decode_engine_meet_the_oracle(run) -> None:
    """A sample of test_vllm_params' generated params (no load predicted: a load needs a
    real offer), each straight to the decode engine: the plain engine's answer every time,
    and the log's refusals by reason are the hand-written cases' plus the oracle's, as
    are the decode engine's ``vllm:kvxfer_refused_params_total`` by reason."""
    trust, base = run["trust"], run["baseline_trust"]
    sampled = trust["sampled"]
    assert len(sampled) == SAMPLED
    assert [same_as_plain(trust, base, a) for a in sampled] == [""] * SAMPLED
    predicted = Counter(a["predicted"] for a in sampled)
    assert predicted["malformed"] and predicted["layout"], predicted  # the sample has both
    hand_written = {"malformed": 3, "version": 1, "layout": 1, "model": 1}
    log = trust["decode_log"]
    want = {reason: count + predicted[reason] for reason, count in hand_written.items()}
    assert {reason: log.count(f"(params {reason}:") for reason in hand_written} == want
    metrics = trust["engine_metrics"]
    assert {reason: total(metrics, "vllm:kvxfer_refused_params_total", reason=reason)
            for reason in hand_written} == want


def test_forged_or_replayed_params_never_change_an_answer(run) -> None:
    """Another prompt's params (same length), params used twice, an altered transfer id, a
    wrong capability, a closed peer port, a peer outside the decode daemon's --dial-allow
    (never dialled: counted), params of another version (refused before any load): each load
    fails or is refused, the prompt is computed on the decode engine,
    and the answer is the plain engine's; the forged prompt asked plainly afterwards too (no
    KV of another prompt entered its prefix cache)."""
    trust, base = run["trust"], run["baseline_trust"]
    cases = ("other_prompt", "other_prompt_plain_after", "replay_first", "replay_again",
             "altered_id", "wrong_capability", "closed_peer", "outside_policy", "other_version")
    assert {c: same_as_plain(trust, base, trust[c]) for c in cases} == dict.fromkeys(cases, "")
    log = trust["decode_log"]
    assert log.count("holds KV computed from another prompt than the puller's") == 1
    assert log.count("here is open to this caller") == 3  # replayed, altered id, capability
    assert trust["dials_refused"] == 1 and "outside this daemon's dial_allow" in log
    assert "(params version: params version int 1; this connector reads version 4)" in log


def test_engines_are_compatible_by_bytes_and_model_not_by_names_or_versions(run) -> None:
    """The prefill engine's params with another model path and vLLM version (the same
    fingerprint and bytes) load; with another model fingerprint, or another in-block format
    (an AMX CPU's), they are refused naming what differs, and the decode engine computes
    the prompt. Each answer is the plain engine's."""
    trust, base = run["trust"], run["baseline_trust"]
    cases = ("renamed", "other_model", "other_format")
    assert {c: same_as_plain(trust, base, trust[c]) for c in cases} == dict.fromkeys(cases, "")
    assert trust["renamed_loaded"] > 0  # its prompt came from the transfer
    assert trust["block_format"] == "mha_head_major"  # vLLM's CPU attention, vec kernel
    log = trust["decode_log"]
    assert "(params model: the prefill engine ran another model: fingerprint" in log
    assert "block_format: ours 'mha_head_major', theirs 'LBHNC/cpu-amx'" in log


def test_engines_of_other_block_sizes_exchange_kv_through_pages_both_ways(run) -> None:
    """An engine of 64-token blocks loads the KV the pair's prefill engine (blocks of 32)
    computed, and the pair's decode engine loads what the 64-token engine computed, every
    daemon keeping head-major pages of 32 tokens: each answer is the plain engine's, every
    prompt token came from the transfer, and each transfer moved 32-token pages."""
    blocks, base = run["blocks"], run["baseline_trust"]
    cases = ("to_wide_B0", "to_wide_B1", "from_wide_B2")
    assert {c: same_as_plain({}, base, blocks[c]) for c in cases} == dict.fromkeys(cases, "")
    # Its block size alone changes no answer (so the negative control's change is the
    # tiling's): a prompt it computes itself is the plain engine's answer too.
    assert same_as_plain({}, base, blocks["wide_plain_B3"]) == ""
    tokens = {c: blocks[c]["prompt_tokens"] for c in cases}
    assert all(t % 64 not in (0, 32) for t in tokens.values()), tokens  # partial blocks
    before, after = blocks["wide_before"], blocks["wide_after"]
    assert (after["external_kv_transfer"] - before["external_kv_transfer"]
            == tokens["to_wide_B0"] + tokens["to_wide_B1"])
    assert after["local_compute"] == before["local_compute"]
    d_before, d_after = blocks["decode_before"], blocks["decode_after"]
    assert (d_after["external_kv_transfer"] - d_before["external_kv_transfer"]
            == tokens["from_wide_B2"])
    assert d_after["local_compute"] == d_before["local_compute"]
    moved = {case: [role, state, pages] for case in cases
             for transfer_id, (role, state, pages) in blocks["wide_transfers"].items()
             if case.replace("_", "-") in transfer_id}
    assert moved == {"to_wide_B0": ["RECEIVER", "DONE", math.ceil(tokens["to_wide_B0"] / 32)],
                     "to_wide_B1": ["RECEIVER", "DONE", math.ceil(tokens["to_wide_B1"] / 32)],
                     "from_wide_B2": ["SENDER", "DONE", math.ceil(tokens["from_wide_B2"] / 32)]}


def test_a_request_aborted_while_its_load_waits_frees_its_blocks(run) -> None:
    """Its client gives up while the prefill daemon is frozen (the load waits on it): vLLM
    aborts the request, the connector reports the load finished, and once a later request
    has run the decode engine holds no request and no KV block."""
    trust, base = run["trust"], run["baseline_trust"]
    assert trust["abandoned_answered"] is False  # the client did go away first
    assert same_as_plain(trust, base, trust["after_abandoned"]) == ""
    assert trust["after_abandoned_gauges"] == {
        "num_requests_running": 0.0, "num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0,
    }, (trust["before_abandoned_gauges"], trust["after_abandoned_gauges"])


def test_when_one_rank_fails_the_request_fails_on_every_rank_at_once(run_tp2) -> None:
    """Rank 1's load is refused (a wrong capability for it alone) while rank 0's stalls (the
    decode daemon never asks for it): rank 1 aborts rank 0's transfer, so the request fails
    (policy ``fail``) without waiting for the 30 s deadline of rank 0's transfer. The proof
    is tp0's state and reason, not a clock: only this abort ends tp0 ABORTED with rank 1's
    reason. (0.3 s on an idle machine, but 34.6 s in a clean-clone CI run on 2 cores under
    two TP 2 engines: a wall-clock bound here measured the host.)"""
    fail = run_tp2["fail_policy"]
    assert sibling_aborted(fail["one_rank_failed"], fail["one_rank_transfers"], "tp0", "tp1",
                           "TRANSFER_NOT_FOUND") == ""


def sibling_aborted(answer: dict[str, Any], transfers: dict[str, list[str]], stalled: str,
                    failed: str, reason: str) -> str:
    """What is wrong ("" if nothing) with a request whose rank 1 pull (``failed``) failed for
    ``reason`` while rank 0's (``stalled``) waited: it must answer an error (policy
    ``fail``), rank 0's pull be aborted by rank 1, and rank 1's have failed."""
    if "HTTP 500" not in answer.get("error", ""):
        return f"not an error: {answer}"
    if transfers[stalled][0] != "ABORTED" or (
            f"rank 1's load of it failed ({reason})" not in transfers[stalled][1]):
        return f"{stalled} not aborted by rank 1: {transfers}"
    return "" if transfers[failed][0] == "FAILED" else f"{failed} did not fail: {transfers}"


def test_when_one_decode_rank_of_a_shared_offer_fails_its_sibling_is_aborted_at_once(
        run_tp2) -> None:
    """TP 1 -> 2: the decode engine's two ranks pull parts of one offer. Part 1 fails its
    checksum (a flipped byte) while part 0 is never asked for: rank 1 aborts part 0 with its
    reason, so the request fails (policy ``fail``) without waiting for part 0's deadline.
    As above, the proof is part 0's state and reason, not a clock."""
    mixed = run_tp2["mixed_tp"]
    assert sibling_aborted(mixed["widened_fail"], mixed["widened_fail_transfers"], "0", "1",
                           "INTEGRITY_CHECK_FAILED") == ""


def test_with_policy_fail_a_failed_load_is_a_clean_error_and_the_engine_serves_on(run_tp2) -> None:
    """vLLM's default policy: a load refused (a wrong capability on both ranks, straight to
    the decode engine) answers HTTP 500 (streamed: an error chunk, no text) instead of an
    answer from KV that is not the prompt's;
    the engine stays healthy, runs no request, and the same prompt asked without params
    afterwards is the plain engine's answer (the failed load left nothing in its prefix
    cache)."""
    fail, base = run_tp2["fail_policy"], {"F": run_tp2["baseline_fail"]}
    assert "HTTP 500" in fail["failed_load"].get("error", ""), fail["failed_load"]
    chunks = [json.loads(line) for line in fail["failed_stream"]["lines"] if line != "[DONE]"]
    assert any("error" in chunk for chunk in chunks), chunks  # streamed: an error chunk,
    assert [choice["text"] for chunk in chunks for choice in chunk.get("choices", [])
            if choice["text"]] == [], chunks  # and no generated text
    assert same_as_plain({}, base, fail["plain_after"]) == ""
    assert fail["healthy_after"] and fail["running_after"] == 0


def test_no_log_holds_a_capability_with_request_logging_on(run) -> None:
    """Both engines run with --enable-log-requests: the decode engine's request logger wrote
    the params of the requests sent to it, with their capabilities redacted by kvxfer's vLLM
    plugin (``kvxfer_redaction``), and no log of the deployment (engines, daemons, proxy,
    vllm-router) holds any capability a prefill answer carried."""
    logged = run["trust"]["capabilities_logged"]
    assert logged["minted"] >= 9
    assert logged["decode_params_logged"] >= logged["minted"]
    assert logged["decode_redacted"] >= logged["minted"]
    assert {log: n for log, n in logged["found"].items() if n} == {}, logged["found"]


def test_after_daemon_restarts_answers_stay_right_and_transfers_resume(run) -> None:
    """SIGKILL and restart of each daemon, between requests and under 3 requests in flight
    (the daemon frozen first, so they wait on it): every answer is the plain engine's (a
    request in flight may fail cleanly instead), the engines stay healthy, transfers flow
    again within 60 s, and no page stays leased."""
    trust, base = run["trust"], run["baseline_trust"]
    for side in ("decode", "prefill"):
        answers = trust[f"after_{side}_restart"]
        assert [same_as_plain(trust, base, a) for a in answers] == [""] * 3, side
        assert trust[f"loaded_after_{side}_restart"] > 0, f"nothing loaded after the {side} restart"
        for answer in trust[f"inflight_{side}"]:  # an error is an HTTP status with a body
            if "error" in answer:
                assert re.search(r": HTTP 5\d\d: .+", answer["error"]), answer["error"]
            else:
                assert same_as_plain(trust, base, answer) == "", answer["prompt"]
        assert trust[f"resumed_{side}_s"] is not None and trust[f"resumed_{side}_s"] < 60
    assert [same_as_plain(trust, base, a) for a in trust["waves"]] == [""] * len(trust["waves"])
    assert trust["healthy_after_restarts"]
    assert trust["leased_pages_at_end"] == {"prefill": {"kv": 0}, "decode": {"kv": 0}}


# The negative controls of the trust guards, through real engines: each guard switched off
# through a test-only seam (tests/unguarded_daemon.py, tests/unguarded_engine/) and the
# case it guards does its harm. The guarded cases above answer right.

def test_negative_control_without_the_prompt_digest_another_prompts_kv_changes_the_answer(
        unguarded) -> None:
    """An answer (HTTP 200, its prompt loaded from the transfer), not the plain one."""
    answer = unguarded["other_prompt"]
    assert "error" not in answer and unguarded["other_prompt_loaded"] > 0, answer
    assert same_as_plain({}, unguarded["plain"], answer) != ""


def test_negative_control_without_the_capability_check_a_wrong_capability_loads(unguarded) -> None:
    assert unguarded["wrong_capability_loaded"] > 0


def test_negative_control_without_the_dial_policy_a_peer_outside_it_is_dialled(unguarded) -> None:
    assert unguarded["outside_dials"] >= 1


def test_negative_control_without_the_memory_epoch_a_restart_changes_the_answer(unguarded) -> None:
    """An answer (HTTP 200, its prompt loaded from the transfer), not the plain one."""
    answer = unguarded["after_decode_restart"]
    assert "error" not in answer and unguarded["after_decode_restart_loaded"] > 0, answer
    assert same_as_plain({}, unguarded["plain"], answer) != ""


def test_negative_control_without_the_block_tiling_another_block_size_changes_the_answer(
        unguarded) -> None:
    """The 64-token engine fills each block with its two pages' bytes one after the other,
    and cuts pages from its blocks so (the tests' seam), not where its format keeps each
    slot: what it loads, and what the 32-token decode engine loads from it, are answers
    (their prompts loaded from the transfers), not the plain ones."""
    for case in ("naive_tiling", "naive_tiling_out"):
        answer = unguarded[case]
        assert "error" not in answer and unguarded[f"{case}_loaded"] > 0, (case, answer)
        assert same_as_plain({}, unguarded["plain"], answer) != "", case


def test_negative_control_without_strict_parsing_one_request_kills_the_decode_engine(
        unguarded) -> None:
    assert "HTTP 500" in unguarded["malformed"]["error"]
    assert unguarded["decode_healthy_after_malformed"] is False


# Hybrid models (#32 point 4): vLLM's hybrid KV cache manager keeps a block table per KV
# cache group; the connector declares SupportsHMA and copies each layer through its own.

def off_by(want: dict[str, Any], got: dict[str, Any]) -> str:
    """How ``got`` differs from ``want`` (other tokens, or a logprob more than ``TOLERANCE``
    off: vllm-router re-encodes floats); "" when it does not."""
    if "error" in got:
        return got["error"][:300]
    if want["tokens"] != got["tokens"]:
        return f"tokens {got['tokens']} != {want['tokens']}"
    worst = max(abs(a - b) for a, b in zip(want["logprobs"], got["logprobs"], strict=True))
    return f"a logprob off by {worst:.3g}" if worst > TOLERANCE else ""


def test_a_hybrid_model_loads_every_prompt_token_through_two_block_tables_and_answers_right(
        run_hybrid) -> None:
    """Both engines keep two KV cache groups (vLLM did not turn its hybrid manager off); each
    prompt, longer than the sliding window (one of 143 tokens: its last token's window starts
    on a block boundary), is loaded from the transfer but its last token, which the decode
    engine computes, and answered as the prefill engine answers it by itself."""
    assert run_hybrid["logs"] == dict.fromkeys(("prefill", "decode"),
                                               {"two_groups": True, "hma_off": False})
    lengths = run_hybrid["lengths"]
    assert min(lengths) > 2 * run_hybrid["window"] and 143 in lengths
    assert [off_by(w, g) for w, g in zip(run_hybrid["plain"], run_hybrid["routed"],
                                          strict=True)] == ["", ""]
    moved = run_hybrid["routed_moved"]
    assert moved["external_kv_transfer"] == sum(lengths) - len(lengths)
    assert moved["local_compute"] == len(lengths)
    assert moved["decode_daemon_done"] == moved["prefill_daemon_done"] == len(lengths)


def test_a_hybrid_prompt_past_a_prefix_cache_hit_loads_each_table_past_it(run_hybrid) -> None:
    """A prompt extending the first: its start is a hit in the decode engine's prefix cache
    (both groups), the rest comes from the transfer, and the answer is the prefill engine's."""
    moved = run_hybrid["extended_moved"]
    assert moved["local_cache_hit"] > 0 and moved["external_kv_transfer"] > 0, moved
    assert moved["local_compute"] == 1, moved
    assert off_by(run_hybrid["plain_extended"], run_hybrid["routed_extended"]) == ""


def test_with_a_hybrid_models_two_block_tables_a_failed_load_is_reported_per_request(
        run_hybrid) -> None:
    """A load that fails (another capability in its params) with two KV cache groups, where
    vLLM's block-level load-error path raises: the connector reports it per request, the
    decode engine computes the prompt itself and answers right, and it stays healthy."""
    assert off_by(run_hybrid["plain_forged"], run_hybrid["forged"]) == ""
    assert run_hybrid["forged_moved"] == {"external_kv_transfer": 0,
                                          "local_compute": run_hybrid["plain_forged"][
                                              "prompt_tokens"],
                                          "local_cache_hit": 0}
    assert run_hybrid["decode_healthy"] is True


def test_negative_control_one_block_table_for_every_layer_changes_a_hybrid_answer(
        run_hybrid) -> None:
    """A decode engine copying every layer through the first block table (the tests' seam)
    loads the prompt from the transfer and answers otherwise."""
    assert run_hybrid["careless_moved"]["external_kv_transfer"] == run_hybrid["lengths"][1] - 1
    assert off_by(run_hybrid["plain"][1], run_hybrid["careless"]).startswith("tokens")


def test_negative_control_loading_a_hybrid_prompts_last_token_too_changes_its_answer(
        run_hybrid) -> None:
    """A decode engine loading the whole 143-token prompt (the tests' seam): vLLM recomputes
    its last token with the oldest token of that token's window in a null block."""
    assert run_hybrid["unwindowed_moved"]["external_kv_transfer"] == 143
    assert off_by(run_hybrid["plain"][0], run_hybrid["unwindowed"]).startswith(
        ("a logprob off", "tokens")), run_hybrid["unwindowed"]


def test_a_mamba_hybrid_runs_here_and_the_connector_refuses_it_at_start_by_name(
        run_mamba) -> None:
    """vLLM's CPU build serves the tiny Mamba2 hybrid (two KV cache groups); kvxfer does not
    move Mamba state yet, so an engine with the connector stops at start, naming the group."""
    assert len(run_mamba["plain"]["tokens"]) == 12 and run_mamba["plain_groups"], run_mamba
    assert run_mamba["refused_exit"] not in (None, 0), run_mamba
    assert any("is MambaSpec" in line and "model.layers.0.mixer" in line
               for line in run_mamba["refusal"]), run_mamba["refusal"]


# Offers outlive long queues (#32 point 9), on the hybrid pair: one request at a time, offers
# of OFFER_S seconds unless kept, prompts queued behind long plain requests.

def test_a_queue_longer_than_an_offers_lifetime_still_loads_every_prompt(run_hybrid) -> None:
    """Prefilled prompts queued at the decode engine for over twice an offer's lifetime: the
    connector kept their offers alive at the prefill daemon, and every prompt token came from
    a transfer."""
    phase = run_hybrid["queue"]
    assert min(phase["seconds"]) > 2 * run_hybrid["offer_s"], phase["seconds"]
    queued = len(phase["seconds"])  # each computes its last prompt token
    assert phase["moved"] == {"external_kv_transfer": phase["prompt_tokens"] - queued,
                              "local_compute": queued, "local_cache_hit": 0}
    assert phase["keeps"] >= 1


def test_negative_control_without_keeping_offers_a_long_queue_outlives_them(run_hybrid) -> None:
    """The same queue at ``careless`` (``keep_offers_every_s: 0``): no offer kept, each ended
    at its deadline while its request waited, and every prompt was computed there."""
    phase = run_hybrid["careless_queue"]
    assert min(phase["seconds"]) > 2 * run_hybrid["offer_s"], phase["seconds"]
    assert phase["keeps"] == 0
    assert phase["moved"] == {"external_kv_transfer": 0, "local_compute": phase["prompt_tokens"],
                              "local_cache_hit": 0}
