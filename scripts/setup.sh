#!/usr/bin/env bash
# Create .venv from the committed lock file, install the project, and migrate the local Airflow DB.
set -euo pipefail
source "$(dirname "$0")/env.sh"
cd "$ROOT"
UV_VERSION=0.13.8
if ! command -v uv >/dev/null 2>&1 || [ "$(uv --version | cut -d' ' -f2)" != "$UV_VERSION" ]; then
  python3 -m pip install --quiet "uv==$UV_VERSION"
fi
[ -x .venv/bin/python ] || uv venv --quiet --python "$(command -v python3)" .venv
# Bytecode compiled once here: where PYTHONDONTWRITEBYTECODE is set (as on the boxes CI runs on), every process (each
# Airflow task, each emulated server) would compile Airflow and its libraries from source again: 8 s of CPU for
# `import airflow.sdk, dflash_regen.tasks` without .pyc files, 3.3 s with them; ~45 s of CPU once here.
VIRTUAL_ENV="$ROOT/.venv" uv pip sync --quiet --compile-bytecode requirements.lock
VIRTUAL_ENV="$ROOT/.venv" uv pip install --quiet --no-deps -e .
.venv/bin/python -m compileall -q include >/dev/null  # the project's own modules (editable: not compiled by uv)
mkdir -p "$AIRFLOW_HOME"
airflow db migrate >"$AIRFLOW_HOME/db-migrate.log" 2>&1 || { tail -20 "$AIRFLOW_HOME/db-migrate.log"; exit 1; }
echo "setup done: .venv ready, AIRFLOW_HOME=$AIRFLOW_HOME"
