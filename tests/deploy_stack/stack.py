"""The deployment rehearsal's stack: docker-compose.yaml run by Compose v1 against the rehearsal's own dockerd
(scripts/test-deploy.sh starts it, builds the stand-in images and exports DFLASH_REHEARSAL_*)."""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import socket
import subprocess
import time
from pathlib import Path

import requests
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yaml"
OVERRIDE = Path(__file__).resolve().parent / "compose.rehearsal.yaml"
STATE = Path(os.environ.get("DFLASH_REHEARSAL_STATE", "/var/tmp/dflash-deploy-docker"))
DOCKER = os.environ.get("DFLASH_REHEARSAL_DOCKER", "/usr/bin/docker")
PROJECT = "dflash-regen"  # the compose file's top-level `name:`, given with -p (Compose v1 cannot read it)
SECRETS = ("POSTGRES_PASSWORD", "AIRFLOW_FERNET_KEY", "AIRFLOW_JWT_SECRET", "AIRFLOW_API_SECRET_KEY",
           "AIRFLOW_ADMIN_PASSWORD", "DFLASH_SGLANG_API_KEY", "DFLASH_METRICS_TOKEN")
LONG_RUNNING = ("postgres", "redis", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
                "airflow-triggerer", "airflow-worker", "airflow-gpu-worker")
AIRFLOW_UID = 50000
MODEL_NAME = "dflash-rehearsal-model"  # staged to the host's /dev/shm/<name> (the worker mounts /dev/shm)
DAG_ID = "dflash_regen"
FINISHED = {"success", "failed"}


def generated_secret(name: str) -> str:
    """What .env.example's comment for `name` makes: hex, or a Fernet key (url-safe base64 of 32 bytes)."""
    if name == "AIRFLOW_FERNET_KEY":
        return base64.urlsafe_b64encode(secrets.token_bytes(32)).decode()
    return secrets.token_hex(24)


def env_from_example(values: dict[str, str]) -> str:
    """.env.example with each `NAME=` line given `values[NAME]` (the rest kept as they are): an operator's .env."""
    out = []
    for line in (ROOT / ".env.example").read_text().splitlines():
        m = re.match(r"^([A-Z0-9_]+)=", line)
        out.append(f"{m[1]}={values[m[1]]}" if m and m[1] in values else line)
    return "\n".join(out) + "\n"


def read_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if re.match(r"^[A-Z0-9_]+=", line))


def v1_copy(text: str) -> str:
    """The compose file as Compose v1 can run it here: without the top-level `name:` (v1 rejects it; -p gives the
    project name) and without the GPU reservations (no NVIDIA runtime; v1 merges an override's device list into
    the file's instead of replacing it). Nothing else changes (test_the_rehearsal_runs_the_file_as_it_is checks)."""
    kept, skip_indent = [], None
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if not line.strip() or indent > skip_indent:
                continue
            skip_indent = None
        if line == "name: dflash-regen":
            continue
        if line.strip() == "deploy:" and indent == 4:
            skip_indent = indent
            continue
        kept.append(line)
    return "\n".join(kept) + "\n"


def free_loopback_address(port: int) -> str:
    """127.0.0.1, or the next loopback address where `port` is free (another Airflow may hold 127.0.0.1:8080)."""
    for last in range(1, 255):
        address = f"127.0.0.{last}"
        with socket.socket() as s:
            try:
                s.bind((address, port))
            except OSError:
                continue
        return address
    raise AssertionError(f"port {port} is taken on every loopback address")


class Stack:
    """One rehearsal: its host folders, .env, the compose copy, and the commands on them."""

    def __init__(self, work: Path):
        self.work = work
        self.data = work / "data"  # DFLASH_DATA_DIR
        self.models = work / "models"  # DFLASH_MODELS_DIR
        self.venv = work / "sglang-venv"  # SGLANG_VENV_DIR: mounted, unused (the emulator runs instead)
        self.env_file = work / ".env"
        self.compose_file = work / "docker-compose.yaml"
        self.address = "127.0.0.1"
        self._token: str | None = None

    # ------------------------------------------------------------------------------------------ compose
    def args(self, env_file: Path | None = None, compose_file: Path | None = None) -> list[str]:
        return ["--project-directory", str(ROOT), "--env-file", str(env_file or self.env_file), "-p", PROJECT,
                "-f", str(compose_file or self.compose_file), "-f", str(OVERRIDE)]

    def compose(self, *args: str, env_file: Path | None = None, compose_file: Path | None = None, check: bool = True,
                timeout: float = 900) -> subprocess.CompletedProcess:
        # Only the daemon and the stand-ins' tags from this process: every variable of the file comes from .env.
        env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"),
               "DOCKER_HOST": os.environ["DOCKER_HOST"], "COMPOSE_INTERACTIVE_NO_CLI": "1",
               **{k: v for k, v in os.environ.items() if k.startswith("DFLASH_REHEARSAL_") and k.endswith("_IMAGE")}}
        done = subprocess.run(["docker-compose", *self.args(env_file, compose_file), *args], capture_output=True,
                              text=True, env=env, timeout=timeout, check=False)
        if check:
            assert done.returncode == 0, \
                f"docker-compose {' '.join(args)}: exit {done.returncode}\n{done.stderr[-4000:]}"
        return done

    def container(self, service: str, index: int = 1) -> str:
        return f"{PROJECT}_{service}_{index}"

    def inspect(self, service: str, template: str) -> str:
        done = docker("inspect", "--format", template, self.container(service), check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    def wait_healthy(self, services: tuple[str, ...], timeout_s: float = 900) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            health = {s: self.inspect(s, "{{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{end}}")
                      for s in services}
            if all(h == "running/healthy" for h in health.values()):
                return
            # not at the first "unhealthy": a loaded machine can time a check out and pass the next one
            if time.monotonic() > deadline:
                raise AssertionError(f"not all healthy: {health}\n{self.logs(tail=30)}")
            time.sleep(3)

    def logs(self, *services: str, tail: int = 200) -> str:
        return self.compose("logs", "--no-color", f"--tail={tail}", *services, check=False).stdout[-8000:]

    def exec(self, service: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return docker("exec", self.container(service), *argv, check=check)

    # ------------------------------------------------------------------------------------------ REST
    @property
    def url(self) -> str:
        return f"http://{self.address}:8080"

    def token(self) -> str:
        if self._token is None:
            password = read_env(self.env_file)["AIRFLOW_ADMIN_PASSWORD"]
            r = requests.post(f"{self.url}/auth/token", json={"username": "admin", "password": password}, timeout=30)
            assert r.ok, f"POST /auth/token: HTTP {r.status_code} {r.text[:300]}"
            self._token = r.json()["access_token"]
        return self._token

    def api(self, method: str, path: str, *, check: bool = True, **kwargs) -> requests.Response:
        headers = {"Authorization": f"Bearer {self.token()}", **kwargs.pop("headers", {})}
        r = requests.request(method, f"{self.url}{path}", headers=headers, timeout=60, **kwargs)
        if check:
            assert r.ok, f"{method} {path}: HTTP {r.status_code} {r.text[:500]}"
        return r

    def wait_dag(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.api("GET", f"/api/v2/dags/{DAG_ID}", check=False).ok:
            assert time.monotonic() < deadline, f"the DAG is not parsed after {timeout_s:.0f} s"
            time.sleep(2)

    def trigger(self, run_id: str, conf: dict) -> None:
        self.api("POST", f"/api/v2/dags/{DAG_ID}/dagRuns", json={"dag_run_id": run_id, "logical_date": None,
                                                                   "conf": conf})

    def run_state(self, run_id: str) -> str:
        return self.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}").json()["state"]

    def task_instances(self, run_id: str) -> list[dict]:
        r = self.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances", params={"limit": 100})
        return r.json()["task_instances"]

    def task_states(self, run_id: str) -> dict[str, str]:
        return {ti["task_id"] + (f"[{ti['map_index']}]" if ti["map_index"] >= 0 else ""): ti["state"]
                for ti in self.task_instances(run_id)}

    def wait_settled(self, run_id: str, timeout_s: float = 900) -> dict[str, str]:
        """Until the run has ended and none of its tasks is still going (teardowns run after a failure)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = self.task_states(run_id)
            going = set(states.values()) & {"running", "queued", "scheduled", "up_for_retry", "restarting", None}
            if states and not going and self.run_state(run_id) in FINISHED:
                return states
            time.sleep(3)
        raise AssertionError(f"run {run_id} did not settle in {timeout_s:.0f} s: {self.task_states(run_id)}\n"
                             f"{self.logs('airflow-scheduler', 'airflow-gpu-worker', tail=40)}")

    def task_log(self, run_id: str, task_id: str, try_number: int, map_index: int = -1) -> str:
        r = self.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
                     params={"map_index": map_index, "full_content": True}, headers={"Accept": "application/json"})
        return "\n".join(e.get("event", "") if isinstance(e, dict) else str(e) for e in r.json()["content"])

    def failures(self, run_id: str) -> str:
        out = [json.dumps(self.task_states(run_id))]
        for ti in self.task_instances(run_id):
            if ti["state"] == "failed" and ti["try_number"]:
                log = self.task_log(run_id, ti["task_id"], ti["try_number"], ti["map_index"])
                out.append(f"--- {ti['task_id']}[{ti['map_index']}]\n" + "\n".join(log.splitlines()[-25:]))
        return "\n".join(out)


def docker(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check:
        assert done.returncode == 0, f"docker {' '.join(args)}: exit {done.returncode}\n{done.stderr[-3000:]}"
    return done


def loaded(path: Path) -> dict:
    return yaml.safe_load(path.read_text())
