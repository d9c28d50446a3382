#!/usr/bin/env bash
# Set up, then run the whole test suite: unit, property and multi-process integration tests,
# real vLLM engines disaggregated through kvxfer, the container image and the deployment
# files. The vLLM environment (.venv-vllm, with NIXL for the NixlConnector benchmark) takes
# about 3 min and 4 GB the first time; KVXFER_VLLM=0 skips it (its tests then skip). The
# deployment checkers (.venv-deploy) take about 30 s; KVXFER_DEPLOY_TOOLS=0 skips them. The
# container test needs a Docker engine.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if [ "${KVXFER_VLLM:-1}" != 0 ]; then
  ./scripts/setup-vllm.sh
  ./scripts/setup-nixl.sh --vllm  # vLLM's NixlConnector, for benchmarks/vllm_vs_nixl.py
fi
if [ "${KVXFER_DEPLOY_TOOLS:-1}" != 0 ]; then
  ./scripts/setup-deploy-tools.sh
fi
export UCX_NET_DEVICES=lo
exec .venv/bin/python -m pytest "$@"
