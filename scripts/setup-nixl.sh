#!/usr/bin/env bash
# Create .venv-nixl: NIXL (nixl-cu12, its UCX backend) for benchmarks/vs_nixl.py only; it is
# no dependency of kvxfer. torch is pinned to the CPU wheel first: nixl-cu12 asks for torch,
# and an unpinned one is a 5 GB CUDA build. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-nixl
stamp=$(sha256sum "$0" | cut -c1-16)
if [ -f "$VENV/.ready" ] && [ "$(cat "$VENV/.ready")" = "$stamp" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
echo "torch==2.13.0" > "$VENV/constraints.txt"
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -c "$VENV/constraints.txt" "nixl-cu12==1.5.1" numpy
echo "$stamp" > "$VENV/.ready"
