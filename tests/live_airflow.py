"""A real Airflow for tests: api-server, scheduler and dag-processor as separate processes (LocalExecutor,
SQLite) in their own AIRFLOW_HOME, on loopback and free ports, reading this repo's dags/ and plugins/.

Unlike `dag.test`, tasks run in their own processes under the scheduler, so tests can trigger runs through
the REST API or the UI, SIGKILL a task, clear one mapped task instance and watch the scheduler recover.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import requests

from dflash_regen.layout import COMPLETIONS, RunLayout
from dflash_regen.settings.run_config import safe_run_id

ROOT = Path(__file__).resolve().parents[1]
AIRFLOW = str(Path(sys.executable).parent / "airflow")
DAG_ID = "dflash_regen"
FINISHED = {"success", "failed"}


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class LiveAirflow:
    def __init__(self, home: Path, port: int, extra_env: dict[str, str]):
        self.home, self.port = home, port
        self.url = f"http://127.0.0.1:{port}"
        self.password = secrets.token_hex(8)
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "DFLASH_"))},
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__API__DEFAULT_WRAP": "True",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "8",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(port),
            "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),  # shared by every component
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(port + 1),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(port + 2),
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "60",
            # The DAG file does not change during a session: parsed once, not again every 30 s (CPU the tests need).
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",
            # A second output root the report pages serve, for a run whose conf names it.
            "DFLASH_SERVED_ROOTS": str(home.parent / "out-second"),
            **extra_env,
        }
        self.output_root = Path(extra_env["DFLASH_OUTPUT_ROOT"])  # where the DAG's runs land by default
        self.second_root = Path(self.env["DFLASH_SERVED_ROOTS"].split(os.pathsep)[0])
        self._token: str | None = None

    # ------------------------------------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 180, db: Path | None = None) -> None:
        """Start every component; `db`: a migrated metadata DB to copy (conftest's template) instead of migrating."""
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "passwords.json").write_text(json.dumps({"admin": self.password}))
        if db:
            shutil.copyfile(db, self.home / "airflow.db")
        else:
            done = subprocess.run([AIRFLOW, "db", "migrate"], env=self.env, capture_output=True, text=True,
                                  timeout=300, check=False)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        for name in ("api-server", "scheduler", "dag-processor"):
            self.start_component(name)
        self.wait_ready(timeout_s)

    def start_component(self, name: str, args: list[str] | None = None) -> None:
        """`airflow <name>`, or `airflow <args>` kept under `name` (e.g. a Celery worker per queue)."""
        log = open(self.home / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child for its whole life
        self.procs[name] = subprocess.Popen([AIRFLOW, *(args or [name])], env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def kill_component(self, name: str) -> None:
        """SIGKILL a component and every process under it: task processes run in process groups of their
        own (the Task SDK's setpgid), so killing the component's group alone would leave them running."""
        proc = self.procs.pop(name)
        pids = [proc.pid, *descendants(proc.pid)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
        # Every one of them gone before the caller looks at what they left: on a busy machine a killed task process
        # can still finish the write it was in after os.kill returns.
        deadline = time.monotonic() + 30
        while any(_running(pid) for pid in pids):
            assert time.monotonic() < deadline, f"processes of airflow {name} outlived SIGKILL by 30 s"
            time.sleep(0.02)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                assert proc.poll() is None, f"airflow {name} exited:\n{self.log_tail(name)}"
            try:
                health = requests.get(f"{self.url}/api/v2/monitor/health", timeout=5).json()
                dag = self.api("GET", f"/api/v2/dags/{DAG_ID}", check=False)
                if health["scheduler"]["status"] == "healthy" and dag.status_code == 200:
                    return
            except (requests.RequestException, ValueError, KeyError):
                pass
            time.sleep(1)
        raise AssertionError(f"Airflow not ready in {timeout_s:.0f} s:\n"
                             + "\n".join(self.log_tail(n) for n in self.procs))

    def stop(self) -> None:
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 20
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:  # the scheduler can hang on an idle worker (Airflow 3.3)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self.procs.clear()

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.home / f"{name}.log"
        text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
        return f"--- {name} ---\n" + "\n".join(text)

    # --------------------------------------------------------------------------------------------- REST
    def token(self) -> str:
        if self._token is None:
            r = requests.post(f"{self.url}/auth/token", json={"username": "admin", "password": self.password},
                              timeout=30)
            r.raise_for_status()
            self._token = r.json()["access_token"]
        return self._token

    def api(self, method: str, path: str, *, check: bool = True, **kwargs) -> requests.Response:
        headers = {"Authorization": f"Bearer {self.token()}", **kwargs.pop("headers", {})}
        r = requests.request(method, f"{self.url}{path}", headers=headers, timeout=60, **kwargs)
        if check:
            assert r.ok, f"{method} {path}: HTTP {r.status_code} {r.text[:500]}"
        return r

    def api_until_written(self, method: str, path: str, timeout_s: float = 60, **kwargs) -> requests.Response:
        """A write through the REST API. On SQLite a busy scheduler can hold the write lock past the api-server's
        wait, and the write answers 500 "Database error" with nothing written: asked again until it answers."""
        deadline = time.monotonic() + timeout_s
        while True:
            r = self.api(method, path, check=False, **kwargs)
            if r.ok or r.status_code != 500 or time.monotonic() > deadline:
                assert r.ok, f"{method} {path}: HTTP {r.status_code} {r.text[:500]}"
                return r
            time.sleep(1)

    def delete_run(self, run_id: str) -> None:
        self.api_until_written("DELETE", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}")

    def trigger(self, run_id: str, conf: dict) -> dict:
        return self.api("POST", f"/api/v2/dags/{DAG_ID}/dagRuns",
                        json={"dag_run_id": run_id, "logical_date": None, "conf": conf}).json()

    def pause(self, paused: bool) -> None:
        """Pause or unpause the DAG: the scheduler starts no queued run of a paused DAG and examines none of its
        running ones, so a run triggered meanwhile stays queued for as long as a test needs to look at it."""
        self.api_until_written("PATCH", f"/api/v2/dags/{DAG_ID}", json={"is_paused": paused})

    def run_state(self, run_id: str) -> str:
        return self.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}").json()["state"]

    def wait_run(self, run_id: str, timeout_s: float = 300, states: set[str] = FINISHED) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.run_state(run_id)
            if state in states:
                return state
            time.sleep(1)
        raise AssertionError(f"run {run_id} still {self.run_state(run_id)} after {timeout_s:.0f} s; tasks: "
                             f"{self.task_states(run_id)}\n{self.log_tail('scheduler')}")

    def wait_settled(self, run_id: str, timeout_s: float = 120) -> dict[str, str]:
        """Wait until no task of the run is still going (a run can be 'failed' while its teardown runs) and the run
        has ended: the scheduler sets its state a moment after its last task, and a clear in that moment finds it
        running, leaves it so (Airflow re-queues only a finished run), and the scheduler's verdict then fails it
        with the cleared tasks never scheduled."""
        deadline = time.monotonic() + timeout_s
        while (states := self.task_states(run_id)) and time.monotonic() < deadline:
            if not set(states.values()) & {"running", "queued", "scheduled", "up_for_retry", "restarting", None} \
                    and self.run_state(run_id) in FINISHED:
                return states
            time.sleep(1)
        raise AssertionError(f"run {run_id} did not settle in {timeout_s:.0f} s: {self.run_state(run_id)}, {states}")

    def task_instances(self, run_id: str) -> list[dict]:
        r = self.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances", params={"limit": 500})
        return r.json()["task_instances"]

    def task_states(self, run_id: str, tis: list[dict] | None = None) -> dict[str, str]:
        """'task' or 'task[i]' -> state (of `tis`, the run's task instances when given)."""
        return {ti["task_id"] + (f"[{ti['map_index']}]" if ti["map_index"] >= 0 else ""): ti["state"]
                for ti in (self.task_instances(run_id) if tis is None else tis)}

    def failures(self, run_id: str, lines: int = 25) -> str:
        """Every task's state, then each failed task with the end of its log: what an assertion on a run's state
        shows (a string: pytest prints a dict message cut short)."""
        tis = self.task_instances(run_id)
        out = [json.dumps(self.task_states(run_id, tis))]
        for ti in tis:
            if ti["state"] in ("failed", "upstream_failed") and ti["try_number"]:
                try:
                    log = self.task_log(run_id, ti["task_id"], ti["try_number"], ti["map_index"])
                except (AssertionError, requests.RequestException, ValueError, KeyError) as exc:
                    log = f"(log not readable: {exc})"
                tail = "\n".join(log.splitlines()[-lines:])
                out.append(f"--- {ti['task_id']}[{ti['map_index']}] try {ti['try_number']}: {ti['state']}\n{tail}")
        return "\n".join(out)

    def task_log(self, run_id: str, task_id: str, try_number: int, map_index: int = -1) -> str:
        r = self.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
                     params={"map_index": map_index, "full_content": True}, headers={"Accept": "application/json"})
        content = r.json()["content"]
        return "\n".join(e.get("event", "") if isinstance(e, dict) else str(e) for e in content)


# ------------------------------------------------------------------------------------ fixtures and helpers
# Slow enough that a shard takes seconds (so a fault can land in the middle of it), fast enough for CI.
LIVE_PROFILE = {"decode_tokens_per_s": 600, "startup_s": 0.1}


def run_dir(af: LiveAirflow, run_id: str) -> Path:
    return RunLayout.of(af.output_root, safe_run_id(run_id)).run_dir


def kill_in_the_middle_of_shard(folder: Path, shard: int, victim: str, timeout_s: float = 240) -> threading.Thread:
    """SIGKILL a server ('server') or a shard task ('task') once shard `shard` has checkpointed some results.

    Runs in the background; the thread's `.killed` holds what was killed and how many results were on disk.
    """
    def wait_and_kill():
        deadline = time.monotonic() + timeout_s
        run = RunLayout(folder)
        while time.monotonic() < deadline:
            done = sum(pq.read_metadata(p).num_rows for p in run.result_files(COMPLETIONS, shard))
            files = run.fleet
            leases = [i for i in range(len(files.server_specs())) if files.lease_lock(i).is_file()
                      and files.lease_lock(i).read_text().startswith(f"shard {shard} pid ")]  # who holds its server
            if done and leases:
                server = leases[0]
                if victim == "server":
                    pid = json.loads(files.server_spec(server).read_text())["pid"]
                else:
                    pid = int(files.lease_lock(server).read_text().split("pid")[1])
                os.kill(pid, signal.SIGKILL)
                thread.killed = {"victim": victim, "pid": pid, "results_on_disk": done}
                return
            time.sleep(0.05)
        thread.killed = None

    thread = threading.Thread(target=wait_and_kill, daemon=True)
    thread.killed = None
    thread.start()
    return thread


def published_manifest(af: LiveAirflow, run_id: str, dataset: str) -> dict:
    version = af.output_root / "published" / dataset / safe_run_id(run_id)
    return json.loads((version / "manifest.json").read_text())


def completion_ids(folder: Path) -> list[str]:
    return [sid for p in RunLayout(folder).merged_files(COMPLETIONS)
            for sid in pq.read_table(p, columns=["sample_id"]).column("sample_id").to_pylist()]
