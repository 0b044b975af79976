# Sourced by the other scripts: a project-local Airflow (SQLite) that reads this repo's dags/ and plugins/.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export AIRFLOW_HOME="${AIRFLOW_HOME:-$ROOT/.airflow}"
export AIRFLOW__CORE__DAGS_FOLDER="$ROOT/dags"
export AIRFLOW__CORE__PLUGINS_FOLDER="$ROOT/plugins"
export AIRFLOW__CORE__LOAD_EXAMPLES=False
export AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION=False
export AIRFLOW__API__DEFAULT_WRAP=True  # task logs wrap: a failure's first line is read whole, not cut at the right
# 2-core machines: 32 idle LocalExecutor workers cost ~1 GB and make shutdown hang (Airflow 3.3's LocalExecutor).
export AIRFLOW__CORE__PARALLELISM="${AIRFLOW__CORE__PARALLELISM:-8}"
export DFLASH_OUTPUT_ROOT="${DFLASH_OUTPUT_ROOT:-$ROOT/.demo/output}"
export PATH="$ROOT/.venv/bin:$PATH"
