#!/usr/bin/env bash
# Command one: set everything up and run the whole DAG once on seven emulated SGLang servers.
set -euo pipefail
source "$(dirname "$0")/env.sh"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
RUN_ID="demo__$(date -u +%Y%m%dT%H%M%S)"
CONF='{"staging_dir": "/dev/shm/dflash-demo-model", "emulator_profile": {"decode_tokens_per_s": 3000}}'
echo "running DAG dflash_regen (run id $RUN_ID) on the emulated fleet; task logs: $AIRFLOW_HOME/logs"
started=$(date +%s)
airflow dags test dflash_regen --conf "$CONF" >"$AIRFLOW_HOME/demo-$RUN_ID.log" 2>&1 && rc=0 || rc=$?
python -m dflash_regen.demo_summary "$DFLASH_OUTPUT_ROOT" "$AIRFLOW_HOME/demo-$RUN_ID.log" "$rc"
echo "wall time: $(( $(date +%s) - started )) s"
exit "$rc"
