"""The whole DAG, run by Airflow (`dag.test`) against seven emulated SGLang servers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def airflow_db():
    """dag.test needs a migrated metadata DB (SQLite in the session's AIRFLOW_HOME)."""
    airflow = Path(sys.executable).parent / "airflow"
    done = subprocess.run([str(airflow), "db", "migrate"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.fixture(scope="session")
def dag(airflow_db):
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(ROOT / "dags")).dags["dflash_regen"]


def states(dag_run) -> dict[str, str]:
    return {ti.task_id: ti.state for ti in dag_run.get_task_instances()}


def test_demo_dag_runs_green_on_seven_emulated_servers(dag, run_params, no_leftover_servers):
    conf = run_params(7)
    dag_run = dag.test(run_conf=conf)
    assert states(dag_run) == {t: "success" for t in
                               ("stage_weights", "launch_fleet", "health_check", "smoke_test", "stop_fleet")}
    assert dag_run.state == "success"
    run_dir = Path(conf["output_root"]) / "runs" / dag_run.run_id.replace(":", "_").replace("+", "_")
    health = json.loads((run_dir / "reports" / "health.json").read_text())
    smoke = json.loads((run_dir / "reports" / "smoke.json").read_text())
    assert health["passed"] and len(health["servers"]) == 7
    assert smoke["passed"] and all(s["ok"] for s in smoke["servers"])
    assert sorted(p.name for p in (run_dir / "fleet").glob("server-*.log")) == [f"server-{i}.log" for i in range(7)]
    assert (Path(conf["staging_dir"]) / "config.json").is_file()


def test_low_allocation_fails_health_check_and_still_stops_the_fleet(dag, run_params, no_leftover_servers):
    conf = run_params(7, emulator_faults={"4": {"kv_tokens": 150_000}})
    dag_run = dag.test(run_conf=conf)
    got = states(dag_run)
    assert got["launch_fleet"] == "success"
    assert got["health_check"] == "failed"
    assert got["smoke_test"] == "upstream_failed"
    assert got["stop_fleet"] == "success"  # the teardown runs although a gate failed
    assert dag_run.state == "failed"
    run_dir = next((Path(conf["output_root"]) / "runs").iterdir())
    report = json.loads((run_dir / "reports" / "health.json").read_text())
    assert not report["passed"] and "server 4 (GPU 4" in report["error"]
