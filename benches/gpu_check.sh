#!/usr/bin/env bash
# nanolab's GPU checks in one run, under a hard time limit (docs/gpu-check.md).
#
#   bash benches/gpu_check.sh                          # every check; summary in $OUT
#   OUT=/tmp/res bash benches/gpu_check.sh --only flash,bench_124m
#   python benches/gpu_check.py --list                 # the checks and their time caps
#
# Writes $OUT/gpu_check.json, $OUT/gpu_check.md and $OUT/logs/ (OUT defaults to runs/gpu_check).
# GPU_CHECK_TIMEOUT (default 720 s: a 15-minute lent session less start-up and margin) bounds
# the whole run; the driver's own deadline is 30 s shorter so it can write the summary of what
# it finished. Without a GPU it stops at once with
# exit code 2. Replaces benches/gpu_124m.sh (its bench is the bench_124m check).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
LIMIT=${GPU_CHECK_TIMEOUT:-720}
case "$LIMIT" in
  ''|*[!0-9]*) echo "gpu_check: error: GPU_CHECK_TIMEOUT must be whole seconds, got '$LIMIT'" >&2; exit 2 ;;
esac
if [ "$LIMIT" -lt 60 ]; then
  echo "gpu_check: error: GPU_CHECK_TIMEOUT $LIMIT s is too short (at least 60)" >&2
  exit 2
fi
PYTHON=${PYTHON:-python}
started=$(date +%s)
set +e
# --foreground: the driver stays in this script's process group, so a Ctrl-C reaches it (it
# kills the check in flight, writes the summary, removes its scratch folder); at the limit
# timeout sends it SIGTERM, which it handles the same way.
timeout --foreground --kill-after=15 "$LIMIT" "$PYTHON" benches/gpu_check.py --out "$OUT" --deadline $((LIMIT - 30)) "$@"
rc=$?
set -e
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  summary="$OUT/gpu_check.json"
  if [ -f "$summary" ] && [ "$(stat -c %Y "$summary")" -ge "$started" ]; then
    echo "gpu_check: error: stopped after GPU_CHECK_TIMEOUT=$LIMIT s; what finished is in $summary" >&2
  else
    echo "gpu_check: error: stopped after GPU_CHECK_TIMEOUT=$LIMIT s before any summary was written (no $summary from this run)" >&2
  fi
fi
exit "$rc"
