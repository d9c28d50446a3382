#!/usr/bin/env bash
# Create .venv (if needed) and install kvxfer's three distributions into it, editable, with
# the dev tools: kvxfer (the core, kvxfer/), kvxfer-client (client/) and kvxfer-server
# (server/). torch is installed first, pinned to the CPU wheel: an unpinned torch pulls a
# multi-GB CUDA build. pip's output goes to .logs/setup.log; the terminal gets one line per
# step. Idempotent: nothing is redone until a pyproject.toml or this script changes.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/steps.sh
PYTHON=${PYTHON:-python3}
LOG=$PWD/.logs/setup.log
stamp=$(cat pyproject.toml client/pyproject.toml server/pyproject.toml "$0" | sha256sum | cut -c1-16)
if [ -f .venv/.kvxfer-ready ] && [ "$(cat .venv/.kvxfer-ready)" = "$stamp" ]; then
  exit 0
fi
mkdir -p .logs && : >"$LOG"
[ -x .venv/bin/python ] || step "$LOG" "creating .venv" "$PYTHON" -m venv .venv
step "$LOG" "installing pip and torch==2.13.0 (CPU)" install_torch .venv/bin/python
step "$LOG" "installing kvxfer, kvxfer-client and kvxfer-server (editable, with the dev tools)" \
  .venv/bin/python -m pip install -e ".[dev]" -e "./client[vllm]" -e ./server
echo "$stamp" > .venv/.kvxfer-ready
