"""A Mamba2 hybrid through real engines: run by test_vllm.py under the vLLM environment;
prints what it saw as JSON.

The tiny Mamba2 hybrid (``tiny_model.build_mamba_hybrid``) is served plainly (vLLM's CPU
build runs it: its answer is recorded), then with KvxferConnector, which does not move Mamba
state yet: that engine must stop at start, naming the Mamba group (``block_tables``). No
daemon is needed for it to get that far.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

from vllm_client import ask

from kvxfer.client.integrations.vllm.deploy import VllmServer, connector_config
from kvxfer.client.integrations.vllm.tiny_model import build_mamba_hybrid, prompt

#: How long the engine with the connector may take to stop (it loads the model first).
REFUSAL_S = 300


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    workdir = Path(parser.parse_args().workdir)
    model = str(build_mamba_hybrid(str(workdir / "model")))
    out: dict[str, Any] = {"model": model}
    with VllmServer("plain", model, workdir) as plain:  # started, and stopped after
        with plain.client() as http:
            out["plain"] = ask(http, model, prompt(seed=600, words=40), "mamba-plain")
        out["plain_groups"] = [line.split("]", 1)[-1].strip() for line in plain.log().splitlines()
                               if "kv cache group sizes" in line]
    refused = VllmServer("refused", model, workdir, kv_transfer=connector_config(
        "kv_both", f"unix://{workdir}/no-daemon.sock")).spawn()
    assert refused.process is not None
    try:
        out["refused_exit"] = refused.process.wait(timeout=REFUSAL_S)
    except subprocess.TimeoutExpired:
        out["refused_exit"] = None
    finally:
        refused.stop()
    out["refusal"] = sorted({line.split("InvalidSpecError: ", 1)[1]
                             for line in refused.log().splitlines()
                             if "InvalidSpecError: " in line})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
