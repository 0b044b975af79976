"""Shared fixtures. Airflow reads its config at import, so the environment is set before anything imports it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ["AIRFLOW_HOME"] = tempfile.mkdtemp(prefix="dflash-airflow-home-")
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(ROOT / "dags")
os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(ROOT / "plugins")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION"] = "False"
os.environ.pop("DFLASH_SGLANG_API_KEY", None)
os.environ["HF_HUB_OFFLINE"] = "1"  # `datasets` must never reach for a hub in tests
os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="dflash-hf-datasets-")

# tests/deploy_stack/ is the deployment rehearsal: only `make test-deploy` runs it (its own dockerd and images).
collect_ignore = [] if os.environ.get("DFLASH_REHEARSAL_STATE") else ["deploy_stack"]

# Fast emulated model for tests: a 2,000-token answer streams in ~0.1 s.
FAST_PROFILE = {"decode_tokens_per_s": 20000, "startup_s": 0.1}


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_block(n: int) -> int:
    """A base port with n consecutive free ports, below the kernel's ephemeral range: a port free now stays
    free, as no client connection can take it as its local port later (tests avoid production's 30000-30006)."""
    low, high = 20000, _ephemeral_low() - n
    for _ in range(200):
        base = random.randrange(low, high)
        if base <= 30006 and base + n > 30000:
            continue
        if all(_port_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no block of free ports found")


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            pids.append(int(proc.name))
    return pids


@contextlib.contextmanager
def tmpfs(path: Path, options: str, why: str):
    """A real small or read-only filesystem at `path` (mounted for the block, then unmounted); skips without root."""
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                      check=False).returncode != 0:
        pytest.skip(f"needs root to mount {why}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


@pytest.fixture
def no_leftover_servers(tmp_path):
    """Fails the test if any process launched with a path under tmp_path is still running afterwards."""
    yield
    import signal
    import time

    deadline = time.monotonic() + 30  # a poll: on a busy machine a stopped server's watcher may take a moment to end
    while (left := processes_mentioning(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left running after the test: {left}"


@pytest.fixture
def run_params(tmp_path):
    """Params for a small, fast emulated run inside tmp_path; tests override what they exercise."""
    from dflash_regen.settings.run_config import DEFAULTS

    def make(num_servers: int = 7, **overrides) -> dict:
        params = {
            **DEFAULTS,
            "model_source_dir": "demo",
            "staging_dir": str(tmp_path / "shm" / "model"),
            "server_command": "emulator",
            "num_servers": num_servers,
            "base_port": free_port_block(num_servers),
            "ready_timeout_s": 60.0,
            "smoke_timeout_s": 60.0,
            "output_root": str(tmp_path / "out"),
            "emulator_profile": dict(FAST_PROFILE),
            "emulator_faults": {},
            "autotune": "off",  # tries ~6 server settings; tests/integration/test_autotune_on_fleet.py covers it
        }
        params.update(overrides)
        return params

    return make


@pytest.fixture
def receivers(monkeypatch):
    """A local SMTP server and webhook receiver (tests/notify_receivers.py), the SMTP connection in the
    environment; `receivers.params()` points a run's notify Params at both."""
    from notify_receivers import Receivers

    with Receivers() as started:
        for name, value in started.connection_env().items():
            monkeypatch.setenv(name, value)
        yield started


@pytest.fixture
def launch(run_params, tmp_path, no_leftover_servers):
    """Launch an emulated fleet from Params overrides; returns (cfg, servers, api key); always stopped.
    `launch.params` holds the last launch's Params, for calling tasks with them."""
    from dflash_regen.demo.model import write_demo_model
    from dflash_regen.fleet.servers import launch_fleet, read_api_key, stop_fleet
    from dflash_regen.settings.run_config import RunConfig

    fleet_dirs = []
    model = write_demo_model(tmp_path / "model")

    def start(num_servers=7, **overrides):
        start.params = run_params(num_servers, **overrides)
        cfg = RunConfig.from_params(start.params, "test_run")
        fleet_dirs.append(cfg.fleet_dir)
        servers = launch_fleet(cfg.fleet, model, cfg.fleet_dir)
        return cfg, servers, read_api_key(cfg.fleet_dir)

    yield start
    for d in fleet_dirs:
        stop_fleet(d)


@pytest.fixture(scope="session")
def airflow_db_template(tmp_path_factory) -> Path:
    """A migrated SQLite metadata DB, made once per test session (one `airflow db migrate`, ~13 s on a loaded
    2-core box) and copied into each Airflow home the tests start; pytest-xdist workers share it under a lock."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's folder, above each worker's own
    folder = shared / "airflow-db-template"
    folder.mkdir(exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "airflow.db").exists():
            home = folder / "home"
            airflow = Path(sys.executable).parent / "airflow"
            done = subprocess.run([str(airflow), "db", "migrate"], env={**os.environ, "AIRFLOW_HOME": str(home)},
                                  capture_output=True, text=True, timeout=300, check=False)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
            (home / "airflow.db").rename(folder / "airflow.db")
    return folder / "airflow.db"


@pytest.fixture(scope="session")
def airflow_db(airflow_db_template):
    """dag.test needs a migrated metadata DB (SQLite in the session's AIRFLOW_HOME)."""
    shutil.copyfile(airflow_db_template, Path(os.environ["AIRFLOW_HOME"]) / "airflow.db")


@pytest.fixture(scope="session")
def dag(airflow_db):
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(ROOT / "dags")).dags["dflash_regen"]


# The slowest tests, slowest first (each takes minutes on a loaded 2-core box): handed out first, so no worker
# starts one near the end while the other sits idle.
SLOW_FIRST = ("tests/live/test_two_nodes_celery.py", "tests/bench/", "tests/e2e/", "tests/faults/test_fault_matrix.py",
              "tests/integration/test_autotune_on_fleet.py", "tests/faults/", "tests/contract/", "tests/integration/")


def _slowness(item) -> int:
    path = item.nodeid.split("::")[0]
    return next((i for i, prefix in enumerate(SLOW_FIRST) if path.startswith(prefix)), len(SLOW_FIRST))


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the mark into the node id's @group
def pytest_collection_modifyitems(items):
    """Under pytest-xdist (`--dist loadgroup`), every test of the one live Airflow runs on one worker, so the
    session starts it once (xdist hands out the largest group first); the other workers take the rest of the
    suite meanwhile, slowest first."""
    for item in items:
        if "live_airflow" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("live_airflow"))
    items.sort(key=_slowness)  # stable: within a file, tests keep their order


LIVE_METRICS_TOKEN = "live-metrics-token"  # the live api-server's DFLASH_METRICS_TOKEN (tests/live/)


@pytest.fixture(scope="session")
def live_airflow(tmp_path_factory, airflow_db_template):
    """One real Airflow for every test that asks (tests/live_airflow.py); runs are kept apart by run id and
    dataset name. Failed shards are not retried, so a test can clear them itself."""
    from live_airflow import LIVE_PROFILE, LiveAirflow

    tmp = tmp_path_factory.mktemp("live")
    af = LiveAirflow(tmp / "airflow-home", free_port_block(3), {
        "DFLASH_OUTPUT_ROOT": str(tmp / "out"),
        "DFLASH_STAGING_DIR": str(tmp / "shm" / "model"),
        "DFLASH_BASE_PORT": str(free_port_block(7)),
        "DFLASH_EMULATOR_PROFILE": json.dumps(LIVE_PROFILE),
        "DFLASH_GENERATE_RETRIES": "0",
        "DFLASH_METRICS_TOKEN": LIVE_METRICS_TOKEN,
    })
    try:
        af.start(db=airflow_db_template)
        yield af
    finally:
        af.stop()
        left = processes_mentioning(str(tmp))
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes left running after the live tests: {left}"
