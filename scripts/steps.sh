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
