"""The trust guards' negative controls through real vLLM engines (run by test_vllm.py).

usage: .venv-vllm/bin/python tests/vllm_unguarded.py WORKDIR

A disaggregated deployment (two daemons, a prefill and a decode engine, the proxy) whose
guards are switched off through the tests' seams: the daemons run
``unguarded_daemon.py capability,digest,dial``, the engines load
``unguarded_engine/sitecustomize.py`` with ``KVXFER_UNGUARDED=epoch,parsing,tiling`` (the
last matters only to the engine of 64-token blocks the tiling case adds). Each case
is one that the guarded scenario (``vllm_trust_phase.py``) answers right; here it must do
the harm the guard prevents. The plain answer of a prompt is the prefill engine's, asked
without params (the same model, seed and settings as the decode engine). Prints one JSON
object of what each case did; test_vllm.py asserts on it.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from vllm_block_phase import PAGE, SOURCE, WIDE_BLOCK
from vllm_client import ask, counters
from vllm_trust_phase import PROMPTS, TOP, Phase

from kvxfer.client.integrations.vllm.deploy import Disaggregation
from kvxfer.client.integrations.vllm.tiny_model import build

HERE = Path(__file__).resolve().parent


class Listener:
    """A TCP listener on ``host`` that counts the connections it accepts: where an
    unguarded daemon dials a peer outside its policy."""

    def __init__(self, host: str) -> None:
        self._socket = socket.create_server((host, 0))
        self.address = f"{host}:{self._socket.getsockname()[1]}"
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return
            self.accepted += 1
            connection.close()

    def close(self) -> None:
        self._socket.close()


def plain(d: Disaggregation, model: str, name: str) -> dict[str, Any]:
    """``PROMPTS[name]`` asked of the prefill engine without params: the plain answer."""
    assert d.prefill is not None
    with d.prefill.client() as http:
        return ask(http, model, PROMPTS[name], f"plain-{name}", top=TOP)


def main() -> None:
    workdir = Path(sys.argv[1])
    model = str(build(str(workdir / "model")))
    env = {"PYTHONPATH": str(HERE / "unguarded_engine"),
           "KVXFER_UNGUARDED": "epoch,parsing,tiling"}
    with Disaggregation(model, workdir, num_pages=512, more_engines=("wide",),
                        daemon_launcher=[sys.executable, str(HERE / "unguarded_daemon.py"),
                                         "capability,digest,dial"],
                        daemon_args=["--dial-allow", "127.0.0.1/32"], engine_env=env) as d:
        phase = Phase(d, model)
        out: dict[str, Any] = {"plain": {name: plain(d, model, name)
                                         for name in ("G", "R2", "D0", "B1", "B2")}}

        # digest: another prompt's params load that prompt's KV into this one.
        f_params = phase.prefilled("F", "forge-source")
        before = counters(d, model)["external_kv_transfer"]
        out["other_prompt"] = phase.direct("G", f_params, "forged-other-prompt")
        out["other_prompt_loaded"] = counters(d, model)["external_kv_transfer"] - before

        # capability: a wrong capability pulls the transfer anyway.
        stolen = phase.prefilled("R2", "capability-source")
        stolen["kvxfer"]["capabilities"] = ["0" * 32]
        before = counters(d, model)["external_kv_transfer"]
        out["wrong_capability"] = phase.direct("R2", stolen, "wrong-capability")
        out["wrong_capability_loaded"] = counters(d, model)["external_kv_transfer"] - before

        # dial policy: a peer outside --dial-allow is dialled.
        outside = Listener("127.0.0.2")
        try:
            params = phase.prefilled("R4", "outside-source")
            params["kvxfer"]["peer"] = outside.address
            out["outside_policy"] = phase.direct("R4", params, "outside-policy")
            out["outside_dials"] = outside.accepted
        finally:
            outside.close()

        # block tiling: an engine of 64-token blocks fills each block with its two pages'
        # bytes one after the other, and cuts its blocks into pages so, ignoring where its
        # format keeps each slot: what it loads, and what it hands the decode engine.
        _, wide = d.add_engine("wide", block_size=WIDE_BLOCK, page_size=PAGE)
        b_params = phase.prefilled("B1", "tiling-source")
        before = wide.metric(SOURCE % (model, "external_kv_transfer"))
        out["naive_tiling"] = phase.direct("B1", b_params, "naive-tiling", engine=wide)
        out["naive_tiling_loaded"] = wide.metric(SOURCE % (model, "external_kv_transfer")) - before
        out_params = phase.prefilled("B2", "tiling-out-source", engine=wide)
        before = counters(d, model)["external_kv_transfer"]
        out["naive_tiling_out"] = phase.direct("B2", out_params, "naive-tiling-out")
        out["naive_tiling_out_loaded"] = counters(d, model)["external_kv_transfer"] - before
        wide.stop()

        # memory identity: after a restart of the decode daemon, a transfer lands in the
        # new arena while the decode worker copies from its old mapping.
        assert d.decode_daemon is not None
        d.decode_daemon.restart()
        restart_params = phase.prefilled("D0", "restart-source")
        before = counters(d, model)["external_kv_transfer"]
        out["after_decode_restart"] = phase.direct("D0", restart_params, "after-restart")
        out["after_decode_restart_loaded"] = counters(d, model)["external_kv_transfer"] - before

        # parsing: one malformed request raises into vLLM's scheduler (last: it kills it).
        try:
            out["malformed"] = phase.direct("M0", {"do_remote_prefill": True, "kvxfer": "x" * 64},
                                            "malformed")
        except Exception as exc:  # noqa: BLE001 - a dying engine may drop the connection
            out["malformed"] = {"error": repr(exc)[:500]}
        out["decode_healthy_after_malformed"] = decode_healthy(d)
    print(json.dumps(out))


def decode_healthy(d: Disaggregation) -> bool:
    """Whether the decode engine still answers ``/health`` with 200."""
    assert d.decode is not None
    try:
        with d.decode.client(timeout_s=10) as http:
            return bool(http.get("/health").status_code == 200)
    except Exception:  # noqa: BLE001 - a dead engine's client errors are the answer
        return False


if __name__ == "__main__":
    main()
