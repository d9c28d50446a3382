#!/usr/bin/env bash
# Set up, then run the whole test suite (unit, property and multi-process integration tests).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export UCX_NET_DEVICES=lo
exec .venv/bin/python -m pytest "$@"
