#!/usr/bin/env bash
# Set up, then run the whole test suite: unit, property and multi-process integration tests,
# and real vLLM engines disaggregated through kvxfer. The vLLM environment (.venv-vllm) takes
# about 2.5 min and 3.7 GB the first time; KVXFER_VLLM=0 skips it (its tests then skip).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if [ "${KVXFER_VLLM:-1}" != 0 ]; then
  ./scripts/setup-vllm.sh
fi
export UCX_NET_DEVICES=lo
exec .venv/bin/python -m pytest "$@"
