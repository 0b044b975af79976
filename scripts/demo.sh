#!/usr/bin/env bash
# Command one: set everything up and run the whole DAG once on seven emulated SGLang servers, the way
# production runs it: a real scheduler (LocalExecutor) with the shards in parallel on all servers, and the
# Airflow UI up while it runs (address and login printed). Airflow stops when the run has ended.
set -euo pipefail
source "$(dirname "$0")/env.sh"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
free_port() { python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PORT="${PORT:-8080}"
python -c "import socket, sys; socket.socket().bind(('127.0.0.1', int(sys.argv[1])))" "$PORT" 2>/dev/null \
  || PORT=$(free_port)  # 8080 taken (another Airflow?): any free port
export AIRFLOW__API__HOST=127.0.0.1 AIRFLOW__API__PORT="$PORT" AIRFLOW__API__BASE_URL="http://127.0.0.1:$PORT"
export AIRFLOW__CORE__EXECUTION_API_SERVER_URL="http://127.0.0.1:$PORT/execution/"
export AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT=$(free_port) AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT=$(free_port)
RUN_ID="demo__$(date -u +%Y%m%dT%H%M%S)"
LOG="$AIRFLOW_HOME/demo-${RUN_ID#demo__}.log"
# Small shards so the demo fans out over all seven servers; a fast emulated decode so it takes seconds.
# autotune (advise) tries its candidates on the first server for at most 3 s each: seconds, not minutes.
CONF='{"staging_dir": "'"${DFLASH_STAGING_DIR:-/dev/shm/dflash-demo-model}"'", "shard_size": 20, '\
'"emulator_profile": {"decode_tokens_per_s": 3000, "saturation_tokens_per_s": 24000}, "autotune_candidate_s": 3}'
started=$(date +%s)
setsid airflow standalone >"$LOG" 2>&1 &
PID=$!
# standalone's scheduler can hang on an idle worker at shutdown (Airflow 3.3's LocalExecutor): TERM, then KILL the group.
stop_airflow() { kill -TERM -- -"$PID" 2>/dev/null || true; for _ in $(seq 20); do kill -0 "$PID" 2>/dev/null || return 0; sleep 0.5; done; kill -KILL -- -"$PID" 2>/dev/null || true; }
trap 'stop_airflow; exit 130' INT TERM
URL="http://127.0.0.1:$PORT"
json() { python -c "import json, sys; d = json.load(sys.stdin); print($1)"; }
for _ in $(seq 300); do
  curl -fs "$URL/api/v2/monitor/health" 2>/dev/null | grep -q '"scheduler":{"status":"healthy"' && break
  kill -0 "$PID" 2>/dev/null || { tail -30 "$LOG"; exit 1; }
  sleep 1
done
PASSWORD=$(json 'd["admin"]' <"$AIRFLOW_HOME/simple_auth_manager_passwords.json.generated")
TOKEN=$(curl -fs -X POST "$URL/auth/token" -H 'Content-Type: application/json' \
  -d "{\"username\": \"admin\", \"password\": \"$PASSWORD\"}" | json 'd["access_token"]')
api() { curl -fs -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' "$@"; }
for _ in $(seq 120); do api "$URL/api/v2/dags/dflash_regen" >/dev/null 2>&1 && break; sleep 1; done  # parsed yet?
api -X POST "$URL/api/v2/dags/dflash_regen/dagRuns" \
  -d "{\"dag_run_id\": \"$RUN_ID\", \"logical_date\": null, \"conf\": $CONF}" >/dev/null
cat <<INFO
running DAG dflash_regen (run $RUN_ID) on 7 emulated SGLang servers under a real scheduler (LocalExecutor)
  Airflow UI: $URL/dags/dflash_regen/runs/$RUN_ID   login: admin / $PASSWORD
  Airflow output: $LOG
INFO
state=queued
while [[ "$state" != success && "$state" != failed ]]; do
  sleep 2
  state=$(api "$URL/api/v2/dags/dflash_regen/dagRuns/$RUN_ID" | json 'd["state"]')
done
# A failed run's teardowns may still be running: wait until no task instance of the run is unfinished.
for _ in $(seq 120); do
  api "$URL/api/v2/dags/dflash_regen/dagRuns/$RUN_ID/taskInstances?limit=500" \
    | json 'any(t["state"] in ("running", "queued", "scheduled", "up_for_retry", None) for t in d["task_instances"])' \
    | grep -q False && break
  sleep 1
done
stop_airflow
rc=0; [[ "$state" == success ]] || rc=1
python -m dflash_regen.demo.summary "$DFLASH_OUTPUT_ROOT" "$AIRFLOW_HOME/logs/dag_id=dflash_regen/run_id=$RUN_ID" "$rc"
echo "wall time: $(( $(date +%s) - started )) s"
exit "$rc"
