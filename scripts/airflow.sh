#!/usr/bin/env bash
# Start a local Airflow (`airflow standalone`: api-server, scheduler, dag-processor, triggerer) with the
# dflash_regen DAG ready to trigger on the emulated fleet, and print the URL and the login. Ctrl-C stops it.
set -euo pipefail
source "$(dirname "$0")/env.sh"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
PORT="${PORT:-8080}"
export AIRFLOW__API__HOST=127.0.0.1 AIRFLOW__API__PORT="$PORT" AIRFLOW__API__BASE_URL="http://127.0.0.1:$PORT"
export AIRFLOW__CORE__EXECUTION_API_SERVER_URL="http://127.0.0.1:$PORT/execution/"
# The form's defaults: a demo-speed emulator, the demo's RAM-disk folder and demo-sized shards, so a run
# takes about a minute.
DEMO_PROFILE='{"decode_tokens_per_s": 3000}'
export DFLASH_EMULATOR_PROFILE="${DFLASH_EMULATOR_PROFILE:-$DEMO_PROFILE}"
export DFLASH_STAGING_DIR="${DFLASH_STAGING_DIR:-/dev/shm/dflash-demo-model}"
# The 120 demo prompts in 6 shards, spread over the servers (the table's 1,000 would make one shard on one server).
export DFLASH_SHARD_SIZE="${DFLASH_SHARD_SIZE:-20}"
LOG="$AIRFLOW_HOME/standalone.log"
setsid airflow standalone >"$LOG" 2>&1 &
PID=$!
# standalone's scheduler can hang on an idle worker at shutdown (Airflow 3.3's LocalExecutor): TERM, then KILL the group.
trap 'kill -TERM -- -$PID 2>/dev/null; sleep 10; kill -KILL -- -$PID 2>/dev/null; exit 0' INT TERM
for _ in $(seq 300); do
  curl -fs "http://127.0.0.1:$PORT/api/v2/monitor/health" 2>/dev/null | grep -q '"scheduler":{"status":"healthy"' && break
  kill -0 "$PID" 2>/dev/null || { tail -30 "$LOG"; exit 1; }
  sleep 1
done
PASSWORD=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['admin'])" \
  "$AIRFLOW_HOME/simple_auth_manager_passwords.json.generated")
cat <<INFO
Airflow is up: http://127.0.0.1:$PORT   (log: $LOG)
Login: admin / $PASSWORD
Open DAG dflash_regen, press Trigger, adjust the form (or keep the emulator defaults), Trigger.
Reports: the run's "Data quality" and "Fleet" tabs, or Browse > dflash-regen runs. Ctrl-C stops Airflow.
INFO
wait "$PID"
