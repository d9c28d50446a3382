#!/usr/bin/env bash
# Set up, then run the main job: a prefill and a decode daemon on loopback, a real UCX
# transfer of KV pages, a check through the decode worker's views, and a summary.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export UCX_NET_DEVICES=lo
exec .venv/bin/kvxfer demo "$@"
