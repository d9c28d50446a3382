"""The benchmark scripts still run and report what they claim (smoke runs, no speed asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from vllm_env import vllm_python

from kvxfer.ucx_settings import LOOPBACK_ENV

pytestmark = pytest.mark.slow  # see docs/development.md

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
#: Whether madvise(MADV_HUGEPAGE) gets anonymous memory huge pages here ("[never]" otherwise).
THP_ENABLED = THP.exists() and "[never]" not in THP.read_text()


#: Where vllm_disagg.py says a disaggregated request's time to first token went.
SEGMENTS = {"prefill", "to_decode", "to_start", "lease_and_pull", "transfer", "copy_in",
            "first_token"}


def run_benchmark(script: str, *args: str, timeout: float = 240, python: str = sys.executable) -> dict:
    """Run ``benchmarks/script`` on loopback and parse the JSON it prints last."""
    env = {**os.environ, **LOOPBACK_ENV}
    out = subprocess.run([python, str(BENCHMARKS / script), *args], cwd=BENCHMARKS,
                         env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(out.stdout[out.stdout.index("{"):])


@pytest.mark.parametrize("path", ["cma", "tcp"])
def test_kernel_copy_measures_each_path_and_mode(path: str) -> None:
    for extra in ([], ["--resend"], ["--idle-s", "0.05"], ["--memory", "perftest"],
                  ["--memory", "perftest", "--resend"], ["--piece", str(3 << 20)]):
        got = run_benchmark("kernel_copy.py", path, "--bytes", str(8 << 20), "--repeats", "2",
                            *extra, timeout=60)
        assert got["path"] == path and len(got["gbps"]) == 2
        assert got["memory"] == ("perftest" if "perftest" in extra else "pool")
        assert all(rate > 0 for rate in got["gbps"])
        if "perftest" in extra and THP_ENABLED:
            assert got["dst_huge_page_share"] > 0.5, "perftest's kind of memory is huge pages"


@pytest.mark.parametrize("eh, transport", [("on", "tcp"), ("off", "cma")])
def test_engine_bandwidth_moves_and_checks_the_bytes(eh: str, transport: str) -> None:
    got = run_benchmark("engine_bandwidth.py", "--eh", eh, "--rounds", "1", "--per-round", "1",
                        "--json")
    assert got["bytes_verified"] is True
    assert f" over {transport}" in got["ucx_protocol"]
    assert got["kernel_copy_path"] == transport
    assert got["engine_gbps_median"] > 0 and got["ratio_engine_vs_kernel_copy"] > 0


def test_rma_against_tag_moves_checked_pages_both_ways() -> None:
    got = run_benchmark("rma_vs_tag.py", "--rounds", "1", "--json", timeout=120)
    assert got["get_gbps_median"] > 0 and got["tag_gbps_median"] > 0
    assert got["ratio_get_vs_tag"] > 0 and got["registration_us_per_page"] > 0
    assert got["source_cpu_s_per_gb_get"] > 0 and got["source_cpu_s_per_gb_tag"] > 0


def test_transfer_latency_reports_every_case() -> None:
    got = run_benchmark("transfer_latency.py", "--rounds", "1", "--per-round", "1", "--json")
    cases = [f"{verb}_pages{pages}_verify_{verify}" for verb in ("push", "pull")
             for pages in (1, 16) for verify in ("off", "on")]
    for case in cases:
        assert got[f"{case}_ms_median"] > got["grpc_health_ms_median"] > 0
        parts = [got[f"{case}_cpu_ms_{side}"] for side in ("prefill", "decode", "client")]
        assert got[f"{case}_cpu_ms_client"] > 0  # the daemons' may round to 0 (10 ms ticks)
        assert got[f"{case}_cpu_ms_total"] == pytest.approx(sum(parts), abs=0.01)


@pytest.mark.timeout(600)
def test_the_vllm_benchmark_times_both_ways_and_records_each_transfer() -> None:
    workdirs = set(Path(tempfile.gettempdir()).glob("kvxfer-vllm-bench-*"))
    got = run_benchmark("vllm_disagg.py", "--rounds", "1", "--lengths", "32,96", "--new-tokens", "4",
                        "--burst", "2", "--burst-tokens", "64", "--json", timeout=500,
                        python=str(vllm_python()))
    assert set(Path(tempfile.gettempdir()).glob("kvxfer-vllm-bench-*")) == workdirs, \
        "the benchmark left its work directory behind"
    for row in got["by_prompt_tokens"].values():
        assert row["single_ttft_ms"] > 0 and row["disaggregated_total_ms"] > 0
    assert [r["pages"] for r in got["requests"]] == [1, 3]
    assert all(r["bytes"] == r["pages"] * 32768 and r["copy_in_ms"] > 0 and r["copy_out_ms"] > 0
               for r in got["requests"])
    for n in ("32", "96"):  # every segment of the time to first token, each taking some time
        assert set(got["ttft_breakdown_ms"][n]) == set(SEGMENTS)
        assert all(ms > 0 for ms in got["ttft_breakdown_ms"][n].values()), got["ttft_breakdown_ms"]
    for side in ("prefill", "decode"):  # saves and loads, after the sequential and burst prompts
        steps = got["connector_ms_per_step"][side]
        assert steps["n"] >= 4 and 0 < steps["p50"] <= steps["p99"] <= steps["max"], steps
    for kind in ("single", "disaggregated"):  # 2 streams of 4 tokens: at most 3 gaps each
        assert 0 < got["burst"]["inter_token_ms"][kind]["n"] <= 6, got["burst"]  # (vLLM may
        # stream several tokens in one chunk)


@pytest.mark.timeout(600)
def test_the_nixl_benchmark_runs_every_deployment_through_vllm_router() -> None:
    """kvxfer P/D, NixlConnector P/D and the plain engine, each behind vllm-router, timed by
    vLLM's bench serve (the stock-NIXL phase is left out here: it busy-polls a core)."""
    workdirs = set(Path(tempfile.gettempdir()).glob("kvxfer-vllm-vs-nixl-*"))
    got = run_benchmark("vllm_vs_nixl.py", "--rounds", "1", "--lengths", "64", "--prompts", "2",
                        "--new-tokens", "4", "--no-stock", "--json", timeout=500,
                        python=str(vllm_python()))
    assert set(Path(tempfile.gettempdir()).glob("kvxfer-vllm-vs-nixl-*")) == workdirs, \
        "the benchmark left its work directory behind"
    row = got["side_by_side"]["64"]
    assert all(row[f"{kind}_ttft_ms"] > 0 for kind in ("single", "kvxfer", "nixl"))
    assert row["kvxfer_vs_nixl"] > 0 and got["stock_nixl_phase"] == {}
