#!/usr/bin/env bash
# Create .venv-nixl: NIXL (nixl-cu12, its UCX backend) for benchmarks/vs_nixl.py only; it is
# no dependency of kvxfer. torch is pinned to the CPU wheel first: nixl-cu12 asks for torch,
# and an unpinned one is a 5 GB CUDA build. pip's output goes to .logs/setup-nixl.log.
# Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/steps.sh
PYTHON=${PYTHON:-python3}
VENV=.venv-nixl
LOG=$PWD/.logs/setup-nixl.log
stamp=$(sha256sum "$0" | cut -c1-16)
if [ -f "$VENV/.ready" ] && [ "$(cat "$VENV/.ready")" = "$stamp" ]; then
  exit 0
fi
mkdir -p .logs && : >"$LOG"
[ -x "$VENV/bin/python" ] || step "$LOG" "creating $VENV" "$PYTHON" -m venv "$VENV"
echo "torch==2.13.0" > "$VENV/constraints.txt"
step "$LOG" "installing pip and torch==2.13.0 (CPU) into $VENV" install_torch "$VENV/bin/python"
step "$LOG" "installing nixl-cu12==1.5.1 into $VENV" \
  "$VENV/bin/python" -m pip install -c "$VENV/constraints.txt" "nixl-cu12==1.5.1" numpy
echo "$stamp" > "$VENV/.ready"
