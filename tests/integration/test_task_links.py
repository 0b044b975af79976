"""Guarantees kept through the task bodies users run (dags/dflash_regen.py calls exactly these), with Airflow's
real run ids (`+` and `:` in them, so each run's folder name differs from its id): the run lock, the reaping of a
dead run's servers, a cleared shard keeping away from the server it failed on, the first task's input checks,
planning within Airflow's map limit, a node's fresh decision, publish re-reading the gate's verdict, and the
verdict of a run that published nothing."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException
from airflow.sdk.execution_time.context import set_current_context

from dflash_regen import tasks
from dflash_regen.demo.model import write_demo_model
from dflash_regen.demo.prompts import write_demo_prompts
from dflash_regen.errors import ShardFailed
from dflash_regen.fleet import runlock
from dflash_regen.fleet.servers import is_alive, load_servers, stop_fleet
from dflash_regen.settings.run_config import RunConfig, safe_run_id

RUN = "manual__2026-12-05T03:00:00+00:00"
OTHER = "scheduled__2026-12-05T04:00:00+00:00"


class AirflowSays:
    """The running task's context as Airflow gives it: `ti.get_dagrun_state` answers for the exact run ids."""

    def __init__(self, states: dict[str, str]):
        self.ti = SimpleNamespace(dag_id="dflash_regen", get_dagrun_state=lambda dag_id, run_id: states[run_id])

    def __enter__(self):
        self._cm = set_current_context({"ti": self.ti})
        return self._cm.__enter__()

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


@pytest.fixture
def params(run_params, tmp_path):
    def make(num_servers=1, **overrides):
        model = tmp_path / "model"
        if not model.is_dir():
            write_demo_model(model)
        return run_params(num_servers, model_source_dir=str(model), **overrides)

    return make


def test_the_first_task_holds_the_run_lock_under_airflows_run_id(params):
    p = params()
    root = RunConfig.from_params(p, RUN).output_root
    (root.parent / "params.json").write_text(json.dumps(p))
    script = ("import json, sys; from dflash_regen import tasks; "
              "tasks.check_inputs(json.load(open(sys.argv[1])), sys.argv[2]); print('held', flush=True); "
              "sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", script, str(root.parent / "params.json"), RUN],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"  # the other run's check_inputs took the lock
        record = runlock.read_holder(root)
        assert (record["run_id"], record["run_dir"]) == (RUN, safe_run_id(RUN))
        # Another run, and the same run triggered again from another process, are refused by the first task.
        for task, run_id in ((tasks.stage_weights, OTHER), (tasks.check_inputs, RUN)):
            with pytest.raises(AirflowFailException) as refused:
                task(p, run_id)
            assert str(refused.value).startswith(f"RunLocked: output root {root} is held by run {RUN!r} since ")
            assert f"its process (pid {holder.pid} on " in str(refused.value)
    finally:
        holder.kill()
        holder.wait()
    # The holder's process is gone (the scheduler runs each task in its own process): Airflow, asked with the run's
    # own id, decides whether the run still lives.
    with AirflowSays({RUN: "running", OTHER: "running"}), pytest.raises(AirflowFailException) as refused:
        tasks.stage_weights(p, OTHER)
    assert str(refused.value).startswith(f"RunLocked: output root {root} is held by run {RUN!r}")
    assert "(Airflow reports it running)" in str(refused.value)
    with AirflowSays({RUN: "failed", OTHER: "running"}):
        assert tasks.stage_weights(p, OTHER)["model_path"] == p["staging_dir"]
    record = runlock.read_holder(root)
    assert (record["run_id"], record["run_dir"]) == (OTHER, safe_run_id(OTHER))


def test_launch_fleet_stops_the_servers_a_dead_run_left_behind(params):
    p = params(num_servers=2)
    old, new = (RunConfig.from_params(p, run_id) for run_id in (RUN, OTHER))
    try:
        tasks.check_inputs(p, RUN)
        left = load_servers(old.fleet_dir) if tasks.launch_fleet(p, RUN, p["model_source_dir"]) else []
        assert len(left) == 2 and all(is_alive(s) for s in left)
        # The run died before its teardown (its servers hold the ports). The next run takes the lock and launches
        # on the same ports: only after its launch_fleet stopped the dead run's servers.
        tasks.check_inputs(p, OTHER)
        launched = tasks.launch_fleet(p, OTHER, p["model_source_dir"])
        assert launched["fleet_dir"] == str(new.fleet_dir) and new.fleet_dir.parent.name == safe_run_id(OTHER)
        assert not any(is_alive(s) for s in left)
        assert all(is_alive(s) for s in load_servers(new.fleet_dir))
    finally:
        stop_fleet(old.fleet_dir)
        stop_fleet(new.fleet_dir)


def test_a_cleared_shard_avoids_the_server_it_crashed_on_after_a_relaunch(params, tmp_path):
    # Server 0 (shard 0's first choice) crashes after 5 answers, and again after each relaunch (a faulty GPU).
    p = params(num_servers=2, emulator_faults={"0": {"crash_after_requests": 5}}, shard_size=40,
               max_bad_row_share=0.5, prompt_source=str(write_demo_prompts(tmp_path / "prompts.jsonl", 30)))
    cfg = RunConfig.from_params(p, RUN)
    try:
        tasks.launch_fleet(p, RUN, p["model_source_dir"])
        (shard,) = tasks.plan_shards(p, RUN)
        with pytest.raises(ShardFailed, match=r"^shard 0 failed on server 0 .*: the server process "):
            tasks.generate(p, RUN, shard)
        # A clear re-runs the fleet setups: a fresh fleet, server 0 healthy again, before the shard runs again.
        tasks.launch_fleet(p, RUN, p["model_source_dir"])
        assert not cfg.layout.fleet.unhealthy_markers()
        done = tasks.generate(p, RUN, shard)
        servers = load_servers(cfg.fleet_dir)
        assert done["server"] == servers[1].name and done["completed"] + done["quarantined"] == shard["prompts"]
        assert is_alive(servers[0])  # not sent there again: it would have crashed once more
    finally:
        stop_fleet(cfg.fleet_dir)


def test_the_first_task_checks_the_output_root_and_the_prompt_source_before_any_gpu_work(params, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(AirflowFailException) as bad_root:
        tasks.stage_weights(params(output_root=str(tmp_path / "a-file" / "out")), RUN)
    assert str(bad_root.value).startswith(f"ConfigError: Param output_root '{tmp_path / 'a-file' / 'out'}'")
    (tmp_path / "bad.jsonl").write_text('{"messages": []}\n{"broken\n')
    p = params(prompt_source=str(tmp_path / "bad.jsonl"))
    with pytest.raises(AirflowFailException) as bad_source:
        tasks.stage_weights(p, RUN)
    assert str(bad_source.value).startswith(f"ConfigError: Param prompt_source '{tmp_path / 'bad.jsonl'}': none of")
    assert not Path(p["staging_dir"]).exists()  # refused before staging the weights


def test_plan_shards_refuses_more_shards_than_airflow_can_map(params, tmp_path, monkeypatch):
    monkeypatch.setenv("AIRFLOW__CORE__MAX_MAP_LENGTH", "2")  # what plan_shards reads from Airflow's config
    p = params(prompt_source=str(write_demo_prompts(tmp_path / "prompts.jsonl", 30)), shard_size=10,
               max_bad_row_share=0.5)
    with pytest.raises(AirflowFailException, match=r"^PlanFailed: 30 prompts in shards of 10 make 3 shards, more "
                                                   r"than the 2 mapped tasks Airflow allows .*set Param shard_size "
                                                   r"to at least 15"):
        tasks.plan_shards(p, RUN)


def test_check_published_fails_a_run_that_published_nothing(params):
    with pytest.raises(AirflowFailException, match=rf"^PublishRefused: run {safe_run_id(RUN)} published nothing"):
        tasks.check_published(params(), RUN)


def test_a_node_decides_afresh_whether_it_takes_part_when_the_same_run_id_runs_again(params):
    """With several nodes, a node left out (or ready) in an earlier run of this run id must not stay so: its first
    task clears both records before staging."""
    node = {"name": "b200", "queue": "q2", "gpus": "0"}
    p = params()
    cfg = RunConfig.from_params(p, RUN, node="b200")
    for name in ("ready", "left_out"):
        cfg.layout.node_report(name).parent.mkdir(parents=True, exist_ok=True)
        cfg.layout.node_report(name).write_text('{"node": "b200", "error": "from the earlier run"}')
    tasks.stage_weights(p, RUN, None, {"model_source_dir": p["model_source_dir"]}, node=node)
    assert not cfg.layout.node_report("ready").exists() and not cfg.layout.node_report("left_out").exists()


def test_publish_refuses_a_run_whose_quality_gate_failed_even_when_cleared_alone(params):
    """publish runs after validate; cleared on its own (validate failed before), it reads the verdict again."""
    p = params()
    cfg = RunConfig.from_params(p, RUN)
    cfg.layout.plan.parent.mkdir(parents=True, exist_ok=True)
    cfg.layout.plan.write_text(json.dumps({"rows": 1, "source": "p", "fingerprint": "f", "shards": []}))
    cfg.layout.report("quality").parent.mkdir(parents=True, exist_ok=True)
    cfg.layout.report("quality").write_text(json.dumps({"success": False}))
    with pytest.raises(AirflowFailException, match=r"^GateFailed: the quality report says the gate failed"):
        tasks.publish_dataset(p, RUN, {"kept": 1, "quarantined": 0})
    assert not cfg.publish_dir.exists()
