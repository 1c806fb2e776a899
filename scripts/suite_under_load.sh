#!/usr/bin/env bash
# The test suite N times in a row with a CPU-bound busy loop on every core beside it (issue 37):
# the tests must wait on conditions, not on timing, so a busy machine must not fail them.
#
#   scripts/suite_under_load.sh [RUNS] [PYTEST ARGS...]    e.g. scripts/suite_under_load.sh 5
#
# RUNS defaults to 5. The load is one `while :; do :; done` per core (nproc), at the tests' own
# priority, started before the first run and killed on exit (a trap: also on Ctrl-C or a
# failure). Each run is the README's test command (`.venv/bin/python -m pytest`; PYTHON=... for
# another interpreter), its output kept in $LOG_DIR (a new temporary folder unless given); the
# script stops at the first failed run and exits with its status. For people, not for CI
# (.ci/run runs the suite once, unloaded).
set -uo pipefail
cd "$(dirname "$0")/.."

runs=5
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
    runs=$1
    shift
fi
python=${PYTHON:-.venv/bin/python}
log_dir=${LOG_DIR:-$(mktemp -d -t suite-under-load.XXXXXX)}
mkdir -p "$log_dir"

load=()
stop_load() {
    # Only the loops this script started, by their pids.
    for pid in "${load[@]}"; do
        kill "$pid" 2>/dev/null
    done
    wait "${load[@]}" 2>/dev/null
}
trap stop_load EXIT
trap 'exit 130' INT TERM

cores=$(nproc)
for _ in $(seq "$cores"); do
    (while :; do :; done) &
    load+=("$!")
done
echo "load: $cores busy loop(s) (while :; do :; done), pids ${load[*]}"
echo "runs: $runs of $python -m pytest $*; logs in $log_dir"

total_start=$(date +%s)
for run in $(seq "$runs"); do
    start=$(date +%s)
    "$python" -m pytest "$@" >"$log_dir/run-$run.log" 2>&1
    rc=$?
    took=$(($(date +%s) - start))
    # pytest's last line: "N passed, M skipped in T s (H:MM:SS)", or what failed.
    summary=$(tail -n 1 "$log_dir/run-$run.log")
    if [[ $rc -eq 0 ]]; then
        verdict=passed
    else
        verdict="FAILED (exit $rc)"
    fi
    printf 'run %d/%d: %s in %d s (%d:%02d): %s\n' "$run" "$runs" "$verdict" "$took" \
        $((took / 60)) $((took % 60)) "$summary"
    if [[ $rc -ne 0 ]]; then
        grep -E '^(FAILED|ERROR) ' "$log_dir/run-$run.log"
        echo "stopped at run $run; its output: $log_dir/run-$run.log"
        exit "$rc"
    fi
done
took=$(($(date +%s) - total_start))
echo "all $runs runs passed under load in $took s"
