"""Print the model fingerprint vLLM's own engine config gives (run under the vLLM environment).

``python tests/vllm_model_identity.py WORKDIR`` builds the tiny model (seed 0), copies it to
another path, builds a model of the same shapes from seed 1, and prints ``NAME FINGERPRINT``
for each (``seed0``, ``copy0``, ``seed1``), computed by the connector's ``model_identity``
from ``EngineArgs(...).create_engine_config()``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from vllm.engine.arg_utils import EngineArgs

from kvxfer.client.integrations.vllm.connector import model_identity
from kvxfer.client.integrations.vllm.tiny_model import DTYPE, build


def main() -> None:
    workdir = Path(sys.argv[1])
    models = {"seed0": build(str(workdir / "seed0"), seed=0)}
    models["copy0"] = Path(shutil.copytree(models["seed0"], workdir / "elsewhere" / "copy0"))
    models["seed1"] = build(str(workdir / "seed1"), seed=1)
    for name, path in models.items():
        config = EngineArgs(model=str(path), dtype=DTYPE, block_size=32, max_model_len=512,
                            enforce_eager=True).create_engine_config()
        print(name, model_identity(config).fingerprint, flush=True)


if __name__ == "__main__":
    main()
