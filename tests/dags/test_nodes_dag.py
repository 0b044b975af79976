"""Several GPU nodes (env DFLASH_NODES, read when the DAG is parsed): a task group per node on its own queue;
without it, the one-node DAG exactly as before."""

import json
from pathlib import Path

from airflow.dag_processing.dagbag import DagBag

DAGS = Path(__file__).resolve().parents[2] / "dags"
ONE_NODE_TASKS = {"stage_weights", "launch_fleet", "health_check", "smoke_test", "plan_shards", "autotune", "calibrate",
                  "generate", "tokenize", "validate", "publish", "stop_fleet", "check_published"}
PER_NODE = {"stage_weights", "launch_fleet", "health_check", "smoke_test", "autotune", "calibrate", "node_ready",
            "node_shards", "generate", "tokenize", "stop_fleet"}
NODES = [{"name": "rtx", "queue": "gpu-node-1", "gpus": "0,1,2,3"}, {"name": "b200", "queue": "gpu-node-2"}]


def parse(monkeypatch, nodes):
    monkeypatch.delenv("DFLASH_WORKER_QUEUE", raising=False)
    if nodes is None:
        monkeypatch.delenv("DFLASH_NODES", raising=False)
    else:
        monkeypatch.setenv("DFLASH_NODES", json.dumps(nodes))
    bag = DagBag(dag_folder=str(DAGS))
    assert bag.import_errors == {}
    return bag.dags["dflash_regen"]


def test_without_nodes_the_dag_is_the_one_node_dag(monkeypatch):
    dag = parse(monkeypatch, None)
    assert set(dag.task_dict) == ONE_NODE_TASKS
    assert "node_failure" not in dag.params


def test_each_node_gets_its_group_on_its_queue_and_the_run_wide_tasks_run_once(monkeypatch):
    dag = parse(monkeypatch, NODES)
    run_wide = {"check_inputs", "plan_shards", "assign_shards", "validate", "publish", "check_published"}
    assert set(dag.task_dict) == run_wide | {f"{n['name']}.{t}" for n in NODES for t in PER_NODE}
    for node in NODES:
        for name in PER_NODE - {"node_shards"}:  # node_shards only reads the assignment: any worker
            assert dag.task_dict[f"{node['name']}.{name}"].queue == node["queue"], name
        setups = {t for t in PER_NODE if dag.task_dict[f"{node['name']}.{t}"].is_setup}
        assert setups == {"launch_fleet", "health_check", "smoke_test", "autotune", "calibrate"}
    assert dag.params["node_failure"] == "fail"


def test_clearing_a_shard_reruns_only_its_own_nodes_setups_and_teardown(monkeypatch):
    """Airflow re-runs every upstream setup without a teardown, whichever node's: each node's setups have its
    teardown, and only the teardown downstream of the cleared shard counts."""
    dag = parse(monkeypatch, NODES)
    for node in ("rtx", "b200"):
        cleared = {t.task_id for t in dag.task_dict[f"{node}.generate"].get_upstreams_only_setups_and_teardowns()}
        assert cleared == {f"{node}.{t}" for t in ("launch_fleet", "health_check", "smoke_test", "autotune",
                                                    "calibrate", "stop_fleet")}


def test_one_node_left_out_does_not_stop_the_others(monkeypatch):
    dag = parse(monkeypatch, NODES)
    assert dag.task_dict["assign_shards"].trigger_rule == "none_failed"
    assert dag.task_dict["validate"].trigger_rule == "none_failed_min_one_success"
    assert dag.task_dict["assign_shards"].upstream_task_ids == {"plan_shards", "rtx.node_ready", "b200.node_ready"}


def test_each_nodes_shards_are_one_mapped_group_per_shard_on_its_queue(monkeypatch):
    dag = parse(monkeypatch, NODES)
    for node in ("rtx", "b200"):
        generate, tokenize = dag.task_dict[f"{node}.generate"], dag.task_dict[f"{node}.tokenize"]
        group = generate.get_closest_mapped_task_group()
        assert group is not None and group.group_id == f"{node}.shard"
        assert tokenize.get_closest_mapped_task_group() is group
        assert tokenize.upstream_task_ids == {generate.task_id, f"{node}.node_shards"}
        assert group.upstream_task_ids == {f"{node}.node_shards"}  # the node's own shards
        assert tokenize.task_id not in dag.task_dict[f"{node}.stop_fleet"].get_flat_relative_ids(upstream=True)
