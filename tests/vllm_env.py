"""The vLLM environment the tests run engines in (``.venv-vllm``, ``./scripts/setup-vllm.sh``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

#: Its interpreter.
VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"


def vllm_python() -> Path:
    """``VLLM_PYTHON``; a skip when it is missing, or a failure where CI requires it
    (``KVXFER_REQUIRE_VLLM=1``)."""
    if not VLLM_PYTHON.exists():
        message = f"{VLLM_PYTHON} is missing: run ./scripts/setup-vllm.sh (./scripts/test.sh does)"
        if os.environ.get("KVXFER_REQUIRE_VLLM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return VLLM_PYTHON
