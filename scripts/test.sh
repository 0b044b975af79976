#!/usr/bin/env bash
# Command two: set everything up and run the test suite (plus the lint). Extra args go to pytest.
set -euo pipefail
source "$(dirname "$0")/env.sh"
"$ROOT/scripts/setup.sh"
"$ROOT/scripts/install-chromium.sh"
cd "$ROOT"
ruff check .
pytest "$@"
