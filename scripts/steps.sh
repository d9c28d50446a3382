# Where the CPU build of torch comes from (PyPI's torch is a multi-GB CUDA build); set
# KVXFER_TORCH_INDEX to another index, or to nothing where pip finds the CPU wheel anyway.
TORCH_INDEX=${KVXFER_TORCH_INDEX-https://download.pytorch.org/whl/cpu}

# `install_torch PYTHON`: torch==2.13.0, the CPU build, into PYTHON's environment. The
# torch index is asked for torch alone (--no-deps), so an index this machine cannot reach
# costs one lookup, not one per dependency; its dependencies come from the usual index.
install_torch() {
  local python=$1 index=()
  [ -z "$TORCH_INDEX" ] || index=(--extra-index-url "$TORCH_INDEX")
  "$python" -m pip install --upgrade pip &&
    "$python" -m pip install --no-deps "${index[@]}" "torch==2.13.0" &&
    "$python" -m pip install "torch==2.13.0"
}

# Sourced by the set-up scripts: `step LOG WHAT COMMAND...` runs COMMAND with its output
# appended to LOG and prints one line for it: WHAT, then how long it took, or FAILED with
# the log's last lines and its path.
step() {
  local log=$1 what=$2 start=$SECONDS
  shift 2
  mkdir -p "$(dirname "$log")"
  printf '%s ... ' "$what" >&2
  if "$@" >>"$log" 2>&1; then
    printf 'done (%d s)\n' $((SECONDS - start)) >&2
  else
    printf 'FAILED\n' >&2
    tail -n 20 "$log" | sed 's/^/  | /' >&2
    printf 'the whole output is in %s\n' "$log" >&2
    return 1
  fi
}
