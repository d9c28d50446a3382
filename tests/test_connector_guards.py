"""KvxferConnector itself (the shell vLLM calls, which needs vLLM: run under .venv-vllm):
no entry point lets an exception of its half reach vLLM's scheduler or worker loop. Each
answers its fallback and counts the failure; the negative control (``_guarded`` calling
straight through) shows every one of them would raise."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from vllm_env import vllm_python

from kvxfer.ucx_settings import LOOPBACK_ENV

pytestmark = pytest.mark.slow  # vLLM's import takes about 10 s

HERE = Path(__file__).resolve().parent
#: What each entry point answers when its half raised (docs/trust.md, the failure contract).
FALLBACKS = {
    "get_num_new_matched_tokens": "(0, False)",  # load nothing: computed here
    "update_state_after_alloc": "None",  # a load that fails at once is planned
    "build_connector_meta": "KvxferMetadata(plan=StepPlan(saves=[], loads=[], cancels=[], idle=False))",
    "update_connector_output": "None",
    "request_finished": "(False, None)",  # blocks freed, no params: the decode side computes
    "request_finished_all_groups": "(False, None)",  # the same, with vLLM's hybrid manager
    "get_loaded_kv_cache_group_ids": "()",  # no group restored: vLLM may zero them all
    "bind_connector_metadata": "None",
    "start_load_kv": "None",
    "save_kv_layer": "None",
    "wait_for_save": "None",
    "get_transfer_results": "KVConnectorTransferResults(finished_sending=set(), "
                            "finished_recving=set(), failed_recving=set())",
    "get_kv_connector_stats": "None",  # this interval's figures are lost, not the engine
}


def entry_points(*args: str) -> dict[str, Any]:
    out = subprocess.run([str(vllm_python()), str(HERE / "connector_guards.py"), *args],
                         capture_output=True, text=True, timeout=300, cwd=HERE,
                         env={**os.environ, **LOOPBACK_ENV})
    assert out.returncode == 0, out.stderr[-4000:]
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def test_no_entry_point_lets_its_halfs_exception_reach_vllm() -> None:
    report = entry_points()
    assert {name: (r["raised"], r["answer"], r["failures"]) for name, r in report.items()} == {
        name: (False, answer, 1) for name, answer in FALLBACKS.items()}


def test_negative_control_without_the_guard_every_entry_point_raises() -> None:
    report = entry_points("--unguarded")
    assert {name: r["raised"] for name, r in report.items()} == dict.fromkeys(FALLBACKS, True)
