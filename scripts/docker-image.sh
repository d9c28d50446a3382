#!/usr/bin/env bash
# Build the kvxfer image on a machine that reaches a package index but no image registry
# (CI here): the base image is made with debootstrap from the machine's Debian mirror, and
# every wheel comes from this machine's pip (its CPU torch wheel among them), so the build
# itself needs no network. The Dockerfile is the one users build; only its arguments differ.
#   usage: scripts/docker-image.sh [IMAGE]   (default kvxfer:local)
# Rebuilds nothing when IMAGE exists with the same sources (label dev.kvxfer.sources).
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${1:-kvxfer:local}
BASE=kvxfer-base:bookworm
PYTHON=${PYTHON:-python3}
sources=$({ git ls-files -z -co --exclude-standard pyproject.toml README.md kvxfer server client \
  protos docker | xargs -0 sha256sum 2>/dev/null || true; } | sha256sum | cut -c1-16)
if [ "$(docker image inspect -f '{{index .Config.Labels "dev.kvxfer.sources"}}' "$IMAGE" 2>/dev/null)" = "$sources" ]; then
  echo "$IMAGE is up to date ($sources)"; exit 0
fi
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  [ -n "$mirror" ] || mirror=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list)
  root=$(mktemp -d)
  trap 'rm -rf "$root"' EXIT
  echo "making $BASE with debootstrap from $mirror"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$root" "$mirror" >/dev/null
  tar -C "$root" -c . | docker import - "$BASE" >/dev/null
fi
echo "collecting wheels in docker/wheels"
"$PYTHON" -m pip download -q -d docker/wheels "torch==2.13.0" "setuptools>=77" wheel \
  ".[ucx,certs]" ./client ./server 2>&1 \
  | { grep -v "is ignored: it is neither" || true; }
started=$(date +%s)
docker build -q --network host -f docker/Dockerfile -t "$IMAGE" \
  --build-arg BASE="$BASE" --build-arg PIP_ARGS="--no-index --find-links /wheels" \
  --build-arg REVISION="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
  --label dev.kvxfer.sources="$sources" . >/dev/null
# A rebuild leaves the replaced image and, without BuildKit, each build stage's image
# untagged (1.3 and 1.8 GB): remove them, but the newest build stage (the next build's cache).
docker image prune -f --filter label=org.opencontainers.image.title=kvxfer >/dev/null
docker images -q --filter dangling=true --filter label=dev.kvxfer.stage=build | tail -n +2 \
  | xargs -r docker rmi >/dev/null
size=$(docker image inspect -f '{{.Size}}' "$IMAGE")
echo "built $IMAGE in $(( $(date +%s) - started )) s: $(( size / 1000000 )) MB"
