"""The DAG, the plugin and the report pages on each Airflow the project supports: 3.3.2 (the lock's, this venv)
and the newest 3.4 release on PyPI (a side venv from tests/contract/airflow-3.4-requirements.txt).

Each version's own CLI migrates a fresh metadata DB and serializes the DAG; its own api-server loads the plugin.
Runs are made and changed through the REST API as an operator would (trigger, a task marked failed, a run marked
failed), then the pages are read over HTTP: the runs list, a run's tab and the metrics. They must show Airflow's
record (states, where a run stopped, who stopped it) and, reading with GET requests only, add no audit-log row.
What 3.4 changed for the project: docs/testing.md ("Airflow versions").

The side venv is built once under ~/.cache/dflash-regen/ (tests/side_venv.py) and reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import requests
from side_venv import built_once

from dflash_regen.settings.run_config import safe_run_id

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = Path(__file__).with_name("airflow-3.4-requirements.txt")
DAG_ID = "dflash_regen"
METRICS_TOKEN = "contract-metrics-token"


def side_venv() -> Path:
    """The 3.4 side venv's bin/ (built first if missing)."""
    def build(folder: Path) -> None:
        uv = shutil.which("uv") or "uv"
        # relocatable: its scripts (bin/airflow) still run once the folder is renamed into place
        subprocess.run([uv, "venv", "--quiet", "--relocatable", "--python", sys.base_prefix + "/bin/python3",
                        str(folder)], check=True, timeout=300)
        subprocess.run([uv, "pip", "sync", "--quiet", "--compile-bytecode", str(REQUIREMENTS)], check=True,
                       timeout=1800, env={**os.environ, "VIRTUAL_ENV": str(folder)})

    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:10]
    return built_once(f"airflow-3.4-venv-{digest}", build, ready="bin/airflow") / "bin"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Airflow:
    """One Airflow version's CLI and api-server on a fresh home: no scheduler, so runs stay as the test sets them."""

    def __init__(self, bin_dir: Path, home: Path):
        self.bin, self.home, port = bin_dir, home, _free_port()
        self.url, self.password = f"http://127.0.0.1:{port}", secrets.token_hex(8)
        self.out = home / "out"
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "DFLASH_", "VIRTUAL_ENV"))},
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(ROOT / "include"),  # the project's package, in whichever venv runs Airflow
            "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
            "AIRFLOW__API__HOST": "127.0.0.1", "AIRFLOW__API__PORT": str(port), "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API__WORKERS": "1", "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
            "DFLASH_OUTPUT_ROOT": str(self.out), "DFLASH_METRICS_TOKEN": METRICS_TOKEN,
        }
        self.server: subprocess.Popen | None = None
        self.headers: dict[str, str] = {}

    def cli(self, *args: str) -> str:
        done = subprocess.run([str(self.bin / "airflow"), *args], env=self.env, capture_output=True, text=True,
                              timeout=600, check=False)
        assert done.returncode == 0, f"airflow {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "passwords.json").write_text(json.dumps({"admin": self.password}))
        self.cli("db", "migrate")
        self.cli("dags", "reserialize")
        log = open(self.home / "api-server.log", "wb")  # noqa: SIM115 - the child's for its whole life
        self.server = subprocess.Popen([str(self.bin / "airflow"), "api-server"], env=self.env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 300
        while True:
            assert self.server.poll() is None, self.log_tail()
            try:
                if requests.get(f"{self.url}/api/v2/monitor/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, "api-server not up in 300 s\n" + self.log_tail()
            time.sleep(0.5)
        r = requests.post(f"{self.url}/auth/token", json={"username": "admin", "password": self.password}, timeout=30)
        r.raise_for_status()
        self.headers = {"Authorization": f"Bearer {r.json()['access_token']}"}

    def stop(self) -> None:
        if self.server is not None:
            os.killpg(self.server.pid, signal.SIGTERM)
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait(timeout=10)

    def log_tail(self) -> str:
        path = self.home / "api-server.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def api(self, method: str, path: str, **kwargs) -> requests.Response:
        r = requests.request(method, self.url + path, headers=self.headers, timeout=60, **kwargs)
        assert r.status_code < 400, (method, path, r.status_code, r.text[:2000])
        return r

    def audit_rows(self) -> int:
        return self.api("GET", "/api/v2/eventLogs", params={"limit": 1}).json()["total_entries"]


@pytest.fixture(params=["3.3.2", "3.4"], scope="module")
def airflow(request, tmp_path_factory):
    import airflow as ours

    bin_dir = Path(sys.executable).parent if request.param == "3.3.2" else side_venv()
    if request.param == "3.3.2":
        assert ours.__version__ == "3.3.2", ours.__version__
    af = Airflow(bin_dir, tmp_path_factory.mktemp(f"airflow-{request.param}"))
    try:
        af.start()
        yield af
    finally:
        af.stop()


def test_the_dag_the_plugin_and_the_pages_work_through_airflows_public_interface(airflow):
    af, dag = airflow, f"/api/v2/dags/{DAG_ID}"
    version = af.api("GET", "/api/v2/version").json()["version"]
    # The DAG parses: its tasks are there, and no import error is recorded.
    tasks = {t["task_id"] for t in af.api("GET", f"{dag}/tasks").json()["tasks"]}
    assert {"plan_shards", "stage_weights", "launch_fleet", "health_check", "smoke_test", "validate",
            "publish"} <= tasks, (version, tasks)
    assert af.api("GET", "/api/v2/importErrors").json()["total_entries"] == 0
    # The plugin loads, with its pages and tabs.
    plugins = af.api("GET", "/api/v2/plugins").json()["plugins"]
    ours = next((p for p in plugins if p["name"] == "dflash_regen_ui"), None)
    assert ours is not None, (version, plugins, af.log_tail())
    assert {v["name"] for v in ours["external_views"]} == {"dflash-regen runs", "Data quality", "Fleet"}

    # Two runs, as an operator leaves them: one with its first task failed, one marked failed by the admin.
    af.api("PATCH", dag, json={"is_paused": True})  # no scheduler runs here; nothing else changes them
    early, stopped = (af.api("POST", f"{dag}/dagRuns", json={"logical_date": None, "conf": {}}).json()["dag_run_id"]
                      for _ in range(2))
    af.api("PATCH", f"{dag}/dagRuns/{quote(early, safe='')}/taskInstances/stage_weights",
           json={"new_state": "failed"})
    # Its teardowns would keep the run going until a scheduler ran them: every task instance is settled first.
    for ti in af.api("GET", f"{dag}/dagRuns/{quote(stopped, safe='')}/taskInstances").json()["task_instances"]:
        af.api("PATCH", f"{dag}/dagRuns/{quote(stopped, safe='')}/taskInstances/{ti['task_id']}",
               json={"new_state": "skipped"})
    af.api("PATCH", f"{dag}/dagRuns/{quote(stopped, safe='')}", json={"state": "failed"})
    (af.out / "runs" / safe_run_id(stopped)).mkdir(parents=True)  # a run folder, as plan_shards would make
    audit = af.audit_rows()

    listed = af.api("GET", "/dflash/").text
    assert early in listed and stopped in listed and "stage_weights" in listed, (version, listed[-3000:])
    tab = af.api("GET", f"/dflash/runs/{quote(early, safe='')}/fleet").text
    assert "stage_weights" in tab and "failed" in tab, (version, tab[-3000:])
    report = af.api("GET", f"/dflash/runs/{quote(stopped, safe='')}/fleet.json").json()
    state = report["run_state"]
    assert state["known"] and state["state"] == "failed" and state["run_id"] == stopped, (version, state)
    assert state["stopped_by"] and state["stopped_by"]["by"] == "admin", (version, state)
    assert {t["task_id"] for t in state["failed"]} == set(), (version, state)  # skipped, not failed
    metrics = requests.get(f"{af.url}/dflash-metrics/metrics", timeout=60,
                           headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert metrics.status_code == 200 and f'run_id="{stopped}"' in metrics.text, (version, metrics.text[:2000])
    # Reads only: the pages and the scrape added no row to Airflow's audit log.
    assert af.audit_rows() == audit, version
