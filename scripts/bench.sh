#!/usr/bin/env bash
# Set everything up (as scripts/test.sh does) and run every benchmark in bench/: writes
# bench/results/latest.json and latest.md. Not part of CI. Extra args go to bench/run.py (e.g. --quick).
set -euo pipefail
source "$(dirname "$0")/env.sh"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
python bench/run.py "$@"
