#!/usr/bin/env bash
# NIXL 1.5.1 (nixl-cu12, its UCX backend) for the benchmarks that compare kvxfer with it;
# no dependency of kvxfer. torch is pinned to the CPU wheel: nixl-cu12 asks for torch, and
# an unpinned one is a 5 GB CUDA build. pip's output goes to .logs/setup-nixl.log.
# Idempotent.
#   ./scripts/setup-nixl.sh          .venv-nixl, for benchmarks/vs_nixl.py
#   ./scripts/setup-nixl.sh --vllm   into .venv-vllm (made by ./scripts/setup-vllm.sh), for
#                                    vLLM's NixlConnector in benchmarks/vllm_vs_nixl.py: also
#                                    the `nixl` meta package, without its dependencies (vLLM
#                                    imports `nixl._api`; the meta package would pull nixl-cu13)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/steps.sh
PYTHON=${PYTHON:-python3}
VENV=.venv-nixl
[ "${1:-}" = "--vllm" ] && VENV=.venv-vllm
LOG=$PWD/.logs/setup-nixl.log
stamp=$(sha256sum "$0" | cut -c1-16)
if [ -f "$VENV/.nixl-ready" ] && [ "$(cat "$VENV/.nixl-ready")" = "$stamp" ]; then
  exit 0
fi
mkdir -p .logs && : >"$LOG"
if [ "$VENV" = .venv-vllm ]; then
  [ -x "$VENV/bin/python" ] || { echo "run ./scripts/setup-vllm.sh first" >&2; exit 1; }
else
  [ -x "$VENV/bin/python" ] || step "$LOG" "creating $VENV" "$PYTHON" -m venv "$VENV"
  step "$LOG" "installing pip and torch==2.13.0 (CPU) into $VENV" install_torch "$VENV/bin/python"
fi
echo "torch==2.13.0" > "$VENV/nixl-constraints.txt"
step "$LOG" "installing nixl-cu12==1.5.1 into $VENV" \
  "$VENV/bin/python" -m pip install -c "$VENV/nixl-constraints.txt" "nixl-cu12==1.5.1" numpy
if [ "$VENV" = .venv-vllm ]; then
  step "$LOG" "installing the nixl==1.5.1 meta package into $VENV" \
    "$VENV/bin/python" -m pip install --no-deps "nixl==1.5.1"
fi
echo "$stamp" > "$VENV/.nixl-ready"
