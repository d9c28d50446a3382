#!/usr/bin/env bash
# Create .venv (if needed) and install kvxfer with its dev extras.
# torch is installed first, pinned to the CPU wheel: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
