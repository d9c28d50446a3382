"""Disaggregated prefill -> decode with real model compute gives the single-process tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvxfer.client.examples.disagg import PROMPTS, compare, daemon_config, reference, run_disaggregated
from kvxfer.client.spawn import LocalDaemon

pytestmark = pytest.mark.slow  # see docs/development.md

NEW_TOKENS = 8
HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("flavour", ["mha", "mla", "hybrid"])
def test_decode_worker_continues_exactly_where_prefill_stopped(flavour: str, tmp_path) -> None:
    config = str(daemon_config(flavour, tmp_path / "pools.yaml"))
    want = reference(flavour, PROMPTS, NEW_TOKENS)
    with LocalDaemon("prefill", [], workdir=str(tmp_path / "p"), extra_args=["--config", config]) as pre, \
            LocalDaemon("decode", [], workdir=str(tmp_path / "d"), extra_args=["--config", config]) as dec:
        got = run_disaggregated(flavour, PROMPTS, NEW_TOKENS, verify=True, daemons=(pre, dec))
        assert set(got["_offered"].values()) == {"DONE"}
        assert len(got["_offered"]) == len(PROMPTS) * (2 if flavour == "hybrid" else 1)
        report = compare(got, want)
        for rid, r in report.items():
            assert r["tokens_equal"], (rid, r["tokens"], want[rid]["tokens"])
            assert r["logits_close"], (rid, r["max_logit_diff"])

        # The test can fail: overwrite one transferred page of r1 on the decode side.
        corrupted = compare(run_disaggregated(
            flavour, PROMPTS, NEW_TOKENS, daemons=(pre, dec),
            decode_launcher=[sys.executable, str(HERE / "corrupting_decode_worker.py"), "r1"]), want)
        assert not corrupted["r1"]["logits_close"]
        assert all(corrupted[r]["tokens_equal"] for r in ("r0", "r2", "r3"))


def test_the_reference_depends_on_the_prompt() -> None:
    a = reference("mha", [PROMPTS[0]], NEW_TOKENS)["r0"]["tokens"]
    b = reference("mha", [PROMPTS[0][:-1] + [PROMPTS[0][-1] + 1]], NEW_TOKENS)["r0"]["tokens"]
    assert a != b
