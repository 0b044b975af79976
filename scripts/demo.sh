#!/usr/bin/env bash
# Command one: set everything up and run the whole DAG once on seven emulated SGLang servers.
set -euo pipefail
source "$(dirname "$0")/env.sh"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
LOG="$AIRFLOW_HOME/demo-$(date -u +%Y%m%dT%H%M%S).log"
# Small shards so the demo fans out over all seven servers; a fast emulated decode so it takes seconds.
CONF='{"staging_dir": "/dev/shm/dflash-demo-model", "shard_size": 20, "emulator_profile": {"decode_tokens_per_s": 3000}}'
echo "running DAG dflash_regen on 7 emulated SGLang servers; Airflow output: $LOG"
started=$(date +%s)
airflow dags test dflash_regen --conf "$CONF" >"$LOG" 2>&1 && rc=0 || rc=$?
python -m dflash_regen.demo_summary "$DFLASH_OUTPUT_ROOT" "$LOG" "$rc"
echo "wall time: $(( $(date +%s) - started )) s"
exit "$rc"
