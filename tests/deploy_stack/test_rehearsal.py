"""The GPU node's deployment, rehearsed end to end (issue 34): README "Run on a GPU node" through the real stack,
Postgres metadata DB and Celery result backend, Redis broker, api-server, scheduler, dag-processor, triggerer and
the Celery workers, with the emulator in place of SGLang. Run in order, one stack: each check starts from where
the last one left it (pytest -x). docs/testing.md, "The deployment rehearsal".
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from stack import (
    AIRFLOW_UID,
    COMPOSE,
    DAG_ID,
    LONG_RUNNING,
    MODEL_NAME,
    PROJECT,
    SECRETS,
    Stack,
    docker,
    env_from_example,
    generated_secret,
    loaded,
    read_env,
    v1_copy,
)

from dflash_regen.demo.model import write_demo_model
from dflash_regen.demo.prompts import write_demo_prompts
from dflash_regen.fleet import smoke
from dflash_regen.layout import COMPLETIONS, RunLayout
from dflash_regen.settings.run_config import safe_run_id

DATASET = "qwen3.6-27b-regen"
PROMPTS = 40  # + 2 rows the planner quarantines: 4 shards of 10
PROFILE = {"mean_output_tokens": 200, "min_reasoning_tokens": 40, "startup_s": 0.1, "decode_tokens_per_s": 2000}
CONF = {"shard_size": 10, "calibration_prompts": 4, "server_flags": "--max-running-requests 4",
        "min_running_requests": 4, "checkpoint_every": 2, "ready_timeout_s": 120, "autotune": "off",
        "generate_retries": 0, "emulator_profile": PROFILE}
CHAT = '"POST /v1/chat/completions HTTP/1.1" 200'  # a chat request in a server's access log
CONTAINER_ROOT = "/data/dflash-regen"  # DFLASH_OUTPUT_ROOT in every container


def published_ids(stack: Stack, run_id: str) -> list[str]:
    version = stack.data / "published" / DATASET / safe_run_id(run_id)
    return [sid for p in sorted(version.rglob("*.parquet"))
            for sid in pq.read_table(p, columns=["sample_id"]).column("sample_id").to_pylist()] \
        if version.is_dir() else []


def run_layout(stack: Stack, run_id: str) -> RunLayout:
    return RunLayout.of(stack.data, safe_run_id(run_id))


def planned_ids(stack: Stack, run_id: str) -> set[str]:
    return {json.loads(line)["id"] for line in (stack.data / "prompts" / "rehearsal.jsonl").read_text().splitlines()
            if json.loads(line)["id"] != "demo-bad-role"}


def run_to_the_end(stack: Stack, run_id: str, conf: dict | None = None, timeout_s: float = 900) -> dict[str, str]:
    stack.trigger(run_id, {**CONF, **(conf or {})})
    return stack.wait_settled(run_id, timeout_s)


# ------------------------------------------------------------------------------------------ 1: .env and secrets
def test_1_env_from_the_example_with_generated_secrets_and_compose_refuses_an_empty_one(stack):
    host = {"DFLASH_DATA_DIR": str(stack.data), "DFLASH_MODELS_DIR": str(stack.models),
            "DFLASH_MODEL_NAME": MODEL_NAME, "SGLANG_VENV_DIR": str(stack.venv),
            "DFLASH_PROMPT_SOURCE": f"{CONTAINER_ROOT}/prompts/rehearsal.jsonl", "AIRFLOW_API_ADDRESS": stack.address}
    values = {name: generated_secret(name) for name in SECRETS} | host
    stack.env_file.write_text(env_from_example(values))
    stack.env_file.chmod(0o600)
    env = read_env(stack.env_file)
    assert all(env[name] for name in SECRETS) and len(set(env[name] for name in SECRETS)) == len(SECRETS)
    assert stack.compose("config", "--quiet").returncode == 0
    for name in SECRETS:
        empty = stack.work / f"env-without-{name}"
        empty.write_text(env_from_example({**values, name: ""}))
        done = stack.compose("up", "-d", "--no-build", env_file=empty, check=False)
        assert done.returncode != 0 and f"set {name} in .env" in done.stderr, (name, done.stderr[-500:])
    started = docker("ps", "-aq", "--filter", "label=com.docker.compose.project=dflash-regen").stdout.strip()
    assert not started, "a container started while a secret was empty"


def test_the_rehearsal_runs_the_file_as_it_is():
    """Its copy differs from docker-compose.yaml only where Compose v1 cannot follow: the top-level name, the GPU
    reservations."""
    original = loaded(COMPOSE)
    copy = yaml.safe_load(v1_copy(COMPOSE.read_text()))
    assert original.pop("name") == "dflash-regen"
    for service in original["services"].values():
        deploy = service.pop("deploy", None)
        assert deploy is None or set(deploy) == {"resources"}
    assert copy == original


# ------------------------------------------------------------------------------------------ 2: up, healthy
def test_2_build_and_up_every_long_running_service_healthy_and_init_exits_0(stack):
    # README: `sudo install -d -o 50000 -g 0 /data/dflash-regen /opt/sglang-venv`; the model on a local disk.
    for folder in (stack.data, stack.venv):
        os.chown(folder, AIRFLOW_UID, 0)
    write_demo_model(stack.models / MODEL_NAME, with_tokenizer=True)
    prompts = write_demo_prompts(stack.data / "prompts" / "rehearsal.jsonl", PROMPTS)
    for path in (stack.models, *stack.models.rglob("*")):
        path.chmod(path.stat().st_mode | stat.S_IROTH | (stat.S_IXOTH if path.is_dir() else 0))
    os.chown(prompts.parent, AIRFLOW_UID, 0)
    os.chown(prompts, AIRFLOW_UID, 0)
    stack.compose("build", timeout=3600)
    stack.compose("up", "-d", timeout=1800)
    stack.wait_healthy(LONG_RUNNING)
    init = stack.inspect("airflow-init", "{{.State.Status}} {{.State.ExitCode}}")
    assert init == "exited 0", stack.logs("airflow-init")
    # Nothing published beyond loopback, and only on the networks the rehearsal made.
    for name in docker("ps", "--format", "{{.Names}}").stdout.split():
        ports = json.loads(docker("inspect", "--format", "{{json .NetworkSettings.Ports}}", name).stdout) or {}
        for bindings in ports.values():
            for binding in bindings or []:
                assert binding["HostIp"].startswith("127."), (name, binding)
    networks = set(docker("network", "ls", "--format", "{{.Name}}").stdout.split())
    assert networks == {"dflash-regen_default", "host", "none"}, networks


# ------------------------------------------------------------------------------------------ 3: a run over REST
FIRST_RUN = "rehearsal__first"


def test_3_a_run_triggered_over_rest_with_a_token_publishes_on_the_host_owned_by_uid_50000(stack):
    stack.wait_dag()
    states = run_to_the_end(stack, FIRST_RUN)
    assert stack.run_state(FIRST_RUN) == "success", stack.failures(FIRST_RUN)
    assert states["check_published"] == "success", states
    ids = published_ids(stack, FIRST_RUN)
    assert len(ids) == len(set(ids)) == PROMPTS and set(ids) == planned_ids(stack, FIRST_RUN)
    version = stack.data / "published" / DATASET / safe_run_id(FIRST_RUN)
    owners = {(p.stat().st_uid, p.stat().st_gid) for p in (version, *version.rglob("*"))}
    assert owners == {(AIRFLOW_UID, 0)}, owners  # README: the data dir is uid 50000's, group 0


# ------------------------------------------------------------------------------------------ 8: an unwritable root
def test_8_a_data_dir_the_airflow_user_cannot_write_fails_the_first_task_naming_the_path_and_the_uid(stack):
    run_id = "rehearsal__unwritable"
    stack.data.chmod(0o755)
    os.chown(stack.data, 0, 0)
    try:
        states = run_to_the_end(stack, run_id, timeout_s=300)
    finally:
        os.chown(stack.data, AIRFLOW_UID, 0)
    assert stack.run_state(run_id) == "failed"
    failed = [t for t, s in states.items() if s == "failed"]
    first = next(ti for ti in stack.task_instances(run_id) if ti["task_id"] == "plan_shards")
    assert first["state"] == "failed", states
    log = stack.task_log(run_id, "plan_shards", first["try_number"])
    line = next(line for line in log.splitlines() if "not writable" in line)
    assert CONTAINER_ROOT in line and f"uid {AIRFLOW_UID}" in line, line
    assert "stage_weights" not in failed or states["stage_weights"] != "success", states


# ------------------------------------------------------------------------------------------ node faults (issue 35)
@pytest.mark.node_faults
def test_f8_a_gpu_worker_with_dockers_own_dev_shm_fails_staging_before_copying_naming_the_size_and_the_volume(stack):
    """The fault: the GPU worker without the host's RAM disk (its `- /dev/shm:/dev/shm` volume lost), so Docker's
    own 64 MB /dev/shm; the model and the servers' margin need more."""
    text = stack.compose_file.read_text()
    mount = "      - /dev/shm:/dev/shm\n"
    at = text.index(mount, text.index("\n  airflow-gpu-worker:\n"))
    variant = stack.work / "docker-compose.own-shm.yaml"
    variant.write_text(text[:at] + text[at + len(mount):])
    run_id = "rehearsal__own_shm"
    try:
        stack.compose("up", "-d", "--no-deps", "airflow-gpu-worker", compose_file=variant)
        stack.wait_healthy(("airflow-gpu-worker",))
        shm = stack.exec("airflow-gpu-worker", "df", "--output=size", "-B1M", "/dev/shm").stdout.split()[-1]
        assert shm == "64", f"/dev/shm is {shm} MB: not Docker's own"
        states = run_to_the_end(stack, run_id, {"reuse": "off"}, timeout_s=600)
        staged = stack.exec("airflow-gpu-worker", "find", "/dev/shm", "-type", "f").stdout.split()
    finally:
        stack.compose("up", "-d", "--no-deps", "airflow-gpu-worker")
        stack.wait_healthy(("airflow-gpu-worker",))
    assert states["stage_weights"] == "failed" and stack.run_state(run_id) == "failed", states
    assert not staged, staged  # failed before copying
    ti = next(ti for ti in stack.task_instances(run_id) if ti["task_id"] == "stage_weights")
    line = next(line for line in stack.task_log(run_id, "stage_weights", ti["try_number"]).splitlines()
                if "not enough free space" in line)
    assert re.search(r"need [\d.]+ MB .* only [\d.]+ MB free", line) and "`- /dev/shm:/dev/shm`" in line \
        and "shm_size" in line, line


@pytest.mark.node_faults
def test_f9_a_full_data_volume_fails_the_task_naming_the_host_path(stack):
    """The fault: the disk under the output root full (a 64 KB tmpfs on the host, under the data dir the workers
    mount). The first line names the folder as the host sees it, beside the container's path."""
    full = stack.data / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=64k,uid={AIRFLOW_UID},gid=0,mode=0755", "tmpfs", str(full)],
                   check=True)
    run_id = "rehearsal__full_disk"
    try:
        # A container's bind mount holds the host's submounts made before it started.
        docker("restart", stack.container("airflow-gpu-worker"))
        stack.wait_healthy(("airflow-gpu-worker",))
        run_to_the_end(stack, run_id, {"output_root": f"{CONTAINER_ROOT}/full"}, timeout_s=600)
    finally:
        subprocess.run(["umount", "-l", str(full)], check=False)
        docker("restart", stack.container("airflow-gpu-worker"))
        stack.wait_healthy(("airflow-gpu-worker",))
        full.rmdir()
    assert stack.run_state(run_id) == "failed"
    failed = [ti for ti in stack.task_instances(run_id) if ti["state"] == "failed" and ti["try_number"]]
    assert failed, stack.task_states(run_id)
    first = min(failed, key=lambda ti: ti["end_date"])  # the task that met the full disk; the rest followed it
    lines = stack.task_log(run_id, first["task_id"], first["try_number"], first["map_index"]).splitlines()
    line = next((line for line in lines if f"{first['task_id']} failed: " in line), "\n".join(lines[-15:]))
    assert f"{CONTAINER_ROOT}/full" in line and f"(on the host: {full}" in line, (first["task_id"], line)


# The fault runs count each prompt's sends in the servers' access logs: calibrate is off, its windows send a number
# of measurement requests that depends on the box's speed (check 3 runs it).
SLOW = {"reuse": "off", "generate_retries": 2, "calibration_prompts": 0,
        "emulator_profile": {**PROFILE, "decode_tokens_per_s": 40}}


def chat_requests(stack: Stack, run_id: str) -> int:
    return sum(p.read_text().count(CHAT) for p in run_layout(stack, run_id).fleet.dir.glob("server-*.log"))


def assert_whole_once(stack: Stack, run_id: str) -> None:
    assert stack.run_state(run_id) == "success", stack.failures(run_id)
    ids = published_ids(stack, run_id)
    assert len(ids) == len(set(ids)) == PROMPTS and set(ids) == planned_ids(stack, run_id)


def assert_nothing_ran_twice(stack: Stack, run_id: str) -> None:
    """The run published every prompt once, each task had one try, and each prompt was sent once (beside the
    smoke test's): no task lost, none run again, nothing re-sent."""
    assert_whole_once(stack, run_id)
    tries = {ti["task_id"] + f"[{ti['map_index']}]": ti["try_number"] for ti in stack.task_instances(run_id)}
    servers = len(run_layout(stack, run_id).fleet.server_specs())
    assert set(tries.values()) == {1} and chat_requests(stack, run_id) - len(smoke.PROMPTS) * servers == PROMPTS, \
        (tries, chat_requests(stack, run_id))


@pytest.mark.node_faults
def test_f4_the_scheduler_and_dag_processor_killed_mid_shard_and_started_again_the_run_goes_on(stack):
    """The fault: both containers killed while a shard generates. The Celery worker's tasks talk to the api-server,
    not to the scheduler, so they go on; the scheduler started again takes the run up where it was."""
    run_id = "rehearsal__scheduler_killed"
    stack.trigger(run_id, {**CONF, **SLOW})
    shard_of_the_kill(stack, run_id)
    for service in ("airflow-scheduler", "airflow-dag-processor"):
        docker("kill", stack.container(service))
    stack.compose("start", "airflow-scheduler", "airflow-dag-processor")
    stack.wait_healthy(("airflow-scheduler", "airflow-dag-processor"))
    stack.wait_settled(run_id)
    assert_nothing_ran_twice(stack, run_id)


@pytest.mark.node_faults
def test_f1_the_api_server_restarted_mid_shard_the_run_finishes_from_its_checkpoints(stack):
    """The fault: the api-server (also the Execution API the running tasks heartbeat to) restarted while a shard
    generates. A task that rides it out goes on; one that fails is retried by Airflow (generate_retries) and sends
    only what it had not checkpointed."""
    run_id = "rehearsal__apiserver_restarted"
    stack.trigger(run_id, {**CONF, **SLOW})
    shard_of_the_kill(stack, run_id)
    docker("restart", stack.container("airflow-apiserver"))
    stack.wait_healthy(("airflow-apiserver",))
    stack._token = None  # its JWT secret is the same, but log in as a user's script would
    stack.wait_settled(run_id)
    assert_whole_once(stack, run_id)
    assert_resent_at_most_in_flight(stack, run_id)


CELERY_APP = "airflow.providers.celery.executors.celery_executor.app"


def celery_control(stack: Stack, command: str, queue: str) -> None:
    host = stack.inspect("airflow-gpu-worker", "{{.Config.Hostname}}")
    stack.exec("airflow-gpu-worker", "celery", "--app", CELERY_APP, "control", command, queue, "-d", f"celery@{host}")


@pytest.mark.node_faults
def test_f2_redis_restarted_with_tasks_queued_and_running_none_lost_none_run_twice(stack):
    """The fault: the Celery broker restarted while shards generate and a task waits in its queue (the GPU worker
    stops taking its queue for the while, so a task is queued in Redis, not yet in a worker). Redis saves its data
    set on a clean shutdown (the image's default save points), so the queued message is there after the restart."""
    run_id = "rehearsal__redis_restarted"
    queue = read_env(stack.env_file).get("DFLASH_WORKER_QUEUE") or "gpu-node-1"
    stack.trigger(run_id, {**CONF, **SLOW})
    shard_of_the_kill(stack, run_id)
    celery_control(stack, "cancel_consumer", queue)
    try:
        deadline = time.monotonic() + 300
        while "queued" not in stack.task_states(run_id).values():
            assert time.monotonic() < deadline, stack.task_states(run_id)
            time.sleep(0.5)
        docker("restart", stack.container("redis"))
        stack.wait_healthy(("redis",))
    finally:
        celery_control(stack, "add_consumer", queue)
    stack.wait_settled(run_id)
    assert_nothing_ran_twice(stack, run_id)
    # No task waited out Airflow's task_queued_timeout (what a message lost in the broker would need).
    events = stack.api("GET", "/api/v2/eventLogs", params={"run_id": run_id, "limit": 100}).json()["event_logs"]
    assert not [e for e in events if "stuck in queued" in (e["event"] or "")], events


@pytest.mark.node_faults
def test_f3_postgres_restarted_mid_shard_the_scheduler_and_the_tasks_recover(stack):
    """The fault: the metadata DB (also the Celery result backend) restarted while shards generate. The services
    reconnect (or exit and compose's `restart: always` starts them); a task that failed is retried and sends only
    what it had not checkpointed."""
    run_id = "rehearsal__postgres_restarted"
    stack.trigger(run_id, {**CONF, **SLOW})
    shard_of_the_kill(stack, run_id)
    docker("restart", stack.container("postgres"))
    stack.wait_healthy(LONG_RUNNING)
    stack._token = None
    stack.wait_settled(run_id)
    assert_whole_once(stack, run_id)
    assert_resent_at_most_in_flight(stack, run_id)


def assert_resent_at_most_in_flight(stack: Stack, run_id: str) -> None:
    """A retried shard re-sends at most what was in flight or not yet checkpointed when its try ended."""
    tis = stack.task_instances(run_id)
    launches = next(ti["try_number"] for ti in tis if ti["task_id"] == "launch_fleet")
    retried = sum(ti["try_number"] - 1 for ti in tis if ti["task_id"] == "generate")
    servers = len(run_layout(stack, run_id).fleet.server_specs())
    resent = chat_requests(stack, run_id) - len(smoke.PROMPTS) * servers * launches - PROMPTS
    in_flight = CONF["min_running_requests"] + CONF["checkpoint_every"]
    assert 0 <= resent <= in_flight * retried, (resent, retried, stack.task_states(run_id))


def kept_completions(stack: Stack, run_id: str) -> set[str]:
    layout = run_layout(stack, run_id)
    return {sid for p in layout.result_files(COMPLETIONS)
            for sid in pq.read_table(p, columns=["sample_id"]).column("sample_id").to_pylist()}


@pytest.mark.node_faults
@pytest.mark.parametrize("fault", ["down", "reboot"])
def test_f6_f7_compose_down_or_a_reboot_mid_run_then_a_new_run_sends_only_the_missing_prompts(stack, fault):
    """The faults: `docker compose down` while shards generate (6); a reboot (7): every container killed at once and
    the RAM disk emptied. Then `up`, the stale run marked failed, and a new run on the same root (reuse on): it
    restages the weights if they are gone and sends only the prompts no checkpoint kept."""
    run_id = f"rehearsal__{fault}"
    seed = {"seed": 6 if fault == "down" else 7}  # its own fingerprint: the store has no other run's answers for it
    stack.trigger(run_id, {**CONF, **SLOW, **seed})
    shard_of_the_kill(stack, run_id)
    if fault == "down":
        stack.compose("down", timeout=600)
    else:
        running = docker("ps", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}").stdout.split()
        docker("kill", *running)
        subprocess.run(["rm", "-rf", f"/dev/shm/{MODEL_NAME}"], check=True)
    stack.compose("up", "-d", timeout=1800)
    stack.wait_healthy(LONG_RUNNING)
    stack._token = None
    runs = stack.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns", params={"limit": 100}).json()["dag_runs"]
    assert run_id in {r["dag_run_id"] for r in runs}  # the history survived
    # The operator's recovery (docs/operations.md): its tasks died with their containers.
    stack.api("PATCH", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}", json={"state": "failed"})
    stack.wait_settled(run_id)
    kept = kept_completions(stack, run_id)
    assert 0 < len(kept) < PROMPTS, len(kept)
    again = f"{run_id}__again"
    run_to_the_end(stack, again, {**seed, "calibration_prompts": 0})
    assert_whole_once(stack, again)
    plan = json.loads(run_layout(stack, again).report("plan").read_text())["reuse"]
    servers = len(run_layout(stack, again).fleet.server_specs())
    assert plan["reused"] >= len(kept) and chat_requests(stack, again) - len(smoke.PROMPTS) * servers == \
        PROMPTS - plan["reused"], (plan, len(kept), chat_requests(stack, again))
    staged = stack.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{again}/taskInstances/stage_weights/xcomEntries/"
                              "return_value").json()["value"]
    assert (staged["copied_bytes"] > 0) == (fault == "reboot"), staged  # restaged only when the RAM disk was emptied


# ------------------------------------------------------------------------------------------ 5: down and up
def test_5_after_down_and_up_history_and_output_survive_and_a_second_run_reuses_every_completion(stack):
    stack.compose("down", timeout=600)  # keeps the volumes: the Postgres DB, the logs, the password file
    stack.compose("up", "-d", timeout=1800)
    stack.wait_healthy(LONG_RUNNING)
    stack._token = None  # a new api-server: log in again
    runs = stack.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns", params={"limit": 100}).json()["dag_runs"]
    history = {r["dag_run_id"]: r["state"] for r in runs}
    assert {run: history.get(run) for run in (FIRST_RUN, "rehearsal__unwritable")} == \
        {FIRST_RUN: "success", "rehearsal__unwritable": "failed"}, history
    assert len(published_ids(stack, FIRST_RUN)) == PROMPTS
    run_id = "rehearsal__second"
    states = run_to_the_end(stack, run_id)
    assert stack.run_state(run_id) == "success", stack.failures(run_id)
    assert set(published_ids(stack, run_id)) == set(published_ids(stack, FIRST_RUN))
    # Every completion came from the first run: the second starts no server (README, "The two commands").
    layout = run_layout(stack, run_id)
    assert not list(layout.fleet.dir.glob("server-*.log")), states
    plan = json.loads(layout.report("plan").read_text())
    assert plan["reuse"]["reused"] == PROMPTS and plan["reuse"]["to_generate"] == 0, plan["reuse"]


# ------------------------------------------------------------------------------------------ 6 and 4: one run
@pytest.fixture(scope="module")
def slow_run(stack):
    """A run slow enough to watch its fleet and kill its worker in the middle of a shard (~20 s each)."""
    run_id = "rehearsal__monitored"
    stack.wait_dag()  # parsed (it is, after check 5; not when a cut run skips or fails it)
    stack.compose("--profile", "monitoring", "up", "-d", "prometheus", timeout=900)
    stack.wait_healthy(("prometheus",), timeout_s=300)
    stack.trigger(run_id, {**CONF, "reuse": "off", "emulator_profile": {**PROFILE, "decode_tokens_per_s": 40}})
    return run_id


def prometheus_api(stack: Stack, path: str) -> dict:
    done = stack.exec("prometheus", "wget", "-q", "-O", "-", f"http://127.0.0.1:9090/api/v1/{path}")
    body = json.loads(done.stdout)
    assert body["status"] == "success", body
    return body["data"]


def prometheus_query(stack: Stack, query: str) -> list[dict]:
    from urllib.parse import quote

    return prometheus_api(stack, f"query?query={quote(query)}")["result"]


def test_6_prometheus_in_the_workers_netns_scrapes_every_server_and_the_pipeline_with_the_token(stack, slow_run):
    deadline = time.monotonic() + 300
    while True:
        up = {(r["metric"]["job"], r["metric"]["instance"]): r["value"][1] for r in prometheus_query(stack, "up")}
        if len(up) == 8 and set(up.values()) == {"1"}:
            break
        targets = prometheus_api(stack, "targets")["activeTargets"]
        refused = [t["scrapeUrl"] + ": " + t["lastError"] for t in targets if re.search(r"\b40[13]\b", t["lastError"])]
        assert not refused, f"a scrape is refused (no retry will pass): {refused}"
        assert time.monotonic() < deadline, f"targets not all up: {up}\n{stack.task_states(slow_run)}"
        time.sleep(3)
    assert {job for job, _ in up} == {"sglang", "dflash-regen"}
    # The first panel of each dashboard answers with data (Grafana's variables as "All", $__rate_interval 1m).
    dashboards = Path(__file__).resolve().parents[2] / "deploy" / "monitoring" / "grafana" / "dashboards"
    answers = {}
    for name in ("sglang/fleet.json", "dflash-regen/pipeline.json"):
        expr = json.loads((dashboards / name).read_text())["panels"][0]["targets"][0]["expr"]
        expr = re.sub(r"\$\w+", lambda m: "1m" if m[0] == "$__rate_interval" else ".*", expr)
        deadline = time.monotonic() + 120
        while not (answer := prometheus_query(stack, expr)) and time.monotonic() < deadline:
            time.sleep(3)
        answers[name] = answer
    assert float(answers["sglang/fleet.json"][0]["value"][1]) == 7, answers  # "Servers up"
    assert {r["metric"]["run_id"] for r in answers["dflash-regen/pipeline.json"]} >= {slow_run}, answers
    # Without the token the pipeline's metrics are refused: the scrape carried it.
    anonymous = stack.exec("prometheus", "wget", "-q", "-O", "/dev/null",
                           "http://airflow-apiserver:8080/dflash-metrics/metrics", check=False)
    assert anonymous.returncode != 0


def shard_of_the_kill(stack: Stack, run_id: str) -> tuple[int, int]:
    """Waits until a shard has checkpointed some answers and is not done; returns it and its answers on disk."""
    layout = run_layout(stack, run_id)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        states = stack.task_states(run_id)
        for shard in range(PROMPTS // CONF["shard_size"]):
            if states.get(f"generate[{shard}]") != "running":
                continue
            done = sum(pq.read_metadata(p).num_rows for p in layout.result_files(COMPLETIONS, shard))
            if 0 < done < CONF["shard_size"]:
                return shard, done
        time.sleep(0.3)
    raise AssertionError(f"no shard in the middle of its work: {stack.task_states(run_id)}")


def test_4_the_gpu_worker_killed_mid_shard_restarted_and_a_rest_clear_finishes_it(stack, slow_run):
    run_id = slow_run
    shard, done_at_kill = shard_of_the_kill(stack, run_id)
    docker("kill", stack.container("airflow-gpu-worker"))
    stack.compose("start", "airflow-gpu-worker")
    stack.wait_healthy(("airflow-gpu-worker",))
    # The killed shards fail once the scheduler misses their heartbeats (Airflow's task_instance_heartbeat_timeout).
    states = stack.wait_settled(run_id, timeout_s=900)
    failed = sorted(int(k[len("generate["):-1]) for k, s in states.items()
                    if k.startswith("generate[") and s == "failed")
    assert shard in failed and stack.run_state(run_id) == "failed", states
    layout = run_layout(stack, run_id)
    kept_before = {s: sum(pq.read_metadata(p).num_rows for p in layout.result_files(COMPLETIONS, s)) for s in failed}
    assert kept_before[shard] >= done_at_kill
    logs = {p.name: len(p.read_text()) for p in layout.fleet.dir.glob("server-*.log")}
    body = {"dag_run_id": run_id, "task_ids": [["generate", s] for s in failed], "only_failed": False,
            "include_downstream": True, "dry_run": False}
    stack.api("POST", f"/api/v2/dags/{DAG_ID}/clearTaskInstances", json=body)
    time.sleep(5)
    states = stack.wait_settled(run_id, timeout_s=900)
    assert stack.run_state(run_id) == "success", stack.failures(run_id)
    ids = published_ids(stack, run_id)
    assert len(ids) == len(set(ids)) == PROMPTS and set(ids) == planned_ids(stack, run_id)  # nothing lost or doubled
    # The relaunched fleet sent the cleared shards' missing prompts only, each once, and kept every answer.
    sent = sum(p.read_text()[logs.get(p.name, 0):].count(CHAT) for p in layout.fleet.dir.glob("server-*.log"))
    servers = len(layout.fleet.server_specs())
    missing = sum(CONF["shard_size"] - kept_before[s] for s in failed)
    assert sent - len(smoke.PROMPTS) * servers == missing, (sent, servers, missing, kept_before)
    ids = [sid for p in layout.merged_files(COMPLETIONS)
           for sid in pq.read_table(p, columns=["sample_id"]).column("sample_id").to_pylist()]
    assert len(ids) == len(set(ids)) == PROMPTS


# ------------------------------------------------------------------------------------------ 7: a second node
def test_7_two_gpu_workers_on_two_queues_run_one_run(stack):
    """`--profile second-node`: airflow-gpu-worker-2 on queue gpu-node-2 against node 1's services at
    DFLASH_CONTROL_HOST (here one forwarding container standing in for node 1's address), the same output root."""
    stack.compose("--profile", "monitoring", "rm", "--stop", "--force", "prometheus", check=False)
    nodes = [{"name": "node1", "queue": "gpu-node-1", "gpus": "0,1"},
             {"name": "node2", "queue": "gpu-node-2", "gpus": "0,1",  # its own RAM disk on a real second machine
              "staging_dir": f"/dev/shm/{MODEL_NAME}-node-2"}]
    env = read_env(stack.env_file)
    stack.env_file.write_text(env_from_example({**env, "DFLASH_NODES": json.dumps(nodes)}))
    assert read_env(stack.env_file)["DFLASH_CONTROL_HOST"] == "node-1"  # .env.example's default
    stack.compose("--profile", "second-node", "up", "-d", timeout=1800)
    stack.wait_healthy((*LONG_RUNNING, "airflow-gpu-worker-2"))
    stack._token = None
    stack.wait_dag()
    run_id = "rehearsal__two_nodes"
    states = run_to_the_end(stack, run_id, {"reuse": "off"})
    assert stack.run_state(run_id) == "success", stack.failures(run_id)
    ids = published_ids(stack, run_id)
    assert len(ids) == len(set(ids)) == PROMPTS and set(ids) == planned_ids(stack, run_id)
    hosts = {name: stack.inspect(name, "{{.Config.Hostname}}")
             for name in ("airflow-gpu-worker", "airflow-gpu-worker-2")}
    ran = {(ti["queue"], ti["hostname"]) for ti in stack.task_instances(run_id)
           if ti["task_id"].endswith("generate") and ti["state"] == "success"}
    assert ran == {("gpu-node-1", hosts["airflow-gpu-worker"]), ("gpu-node-2", hosts["airflow-gpu-worker-2"])}, \
        (ran, hosts, states)
