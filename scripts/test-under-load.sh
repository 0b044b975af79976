#!/usr/bin/env bash
# The test suite (scripts/test.sh, extra args to pytest) with the CPU kept busy: one busy-loop process per core for
# the whole run, started here and stopped on exit. Tests must hold on a loaded machine: no retries, no longer
# timeouts. BUSY_LOOPS overrides the number of loops (default: the cores, nproc).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
loops=()
stop_loops() {
    for pid in "${loops[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait "${loops[@]}" 2>/dev/null || true
}
trap stop_loops EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
for _ in $(seq "${BUSY_LOOPS:-$(nproc)}"); do
    python3 -c 'while True: pass' &
    loops+=("$!")
done
echo "test-under-load: ${#loops[@]} busy loop(s) running (pids ${loops[*]})"
started=$(date +%s)
status=0
"$ROOT/scripts/test.sh" "$@" || status=$?
echo "test-under-load: suite exited $status after $(( $(date +%s) - started )) s with ${#loops[@]} busy loop(s)"
exit "$status"
