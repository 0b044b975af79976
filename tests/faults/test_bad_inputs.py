"""Bad inputs through the whole DAG (`dag.test`): each fails at once, with a first line naming the Param and
the fix, before any GPU work where the input is knowable then, and leaves no process running (fixture)."""

import re

import pytest
from dag_helpers import check_invariants, layout_of, logs, states

pytestmark = pytest.mark.usefixtures("no_leftover_servers")


def tries(dag_run, task_id: str) -> int:
    return max(ti.try_number for ti in dag_run.get_task_instances() if ti.task_id == task_id)


def test_a_missing_prompt_source_fails_the_first_task_before_staging_or_launch(dag, run_params, tmp_path, caplog,
                                                                                  capfd):
    conf = run_params(2, prompt_source=str(tmp_path / "no-such-prompts.jsonl"))
    dag_run = dag.test(run_conf=conf)
    got = states(dag_run)
    # planning comes first (it decides, with the completion store, whether the fleet is needed at all)
    assert got["plan_shards"] == "failed" and tries(dag_run, "plan_shards") == 1
    assert got["stage_weights"] == got["launch_fleet"] == "upstream_failed"
    assert f"prompt source {tmp_path / 'no-such-prompts.jsonl'} does not exist; set Param prompt_source" in \
        logs(caplog, capfd)
    assert not (tmp_path / "shm" / "model").exists() and not layout_of(conf, dag_run).fleet_dir.exists()
    check_invariants(conf, dag_run, published=False)


def test_an_unknown_server_flag_fails_the_launch_once_without_a_retry(dag, run_params, caplog, capfd):
    conf = run_params(2, server_flags="--no-such-flag 1")
    dag_run = dag.test(run_conf=conf)
    got = states(dag_run)
    assert got["launch_fleet"] == "failed" and tries(dag_run, "launch_fleet") == 1
    text = logs(caplog, capfd)
    # both servers refuse the flag; whichever exits first is named
    assert re.search(r"LaunchRefused: server (\d) \(GPU \1, ", text) and "exited with code 2" in text
    assert "it refused its flags: fix Param server_flags" in text and "--no-such-flag" in text
    check_invariants(conf, dag_run, published=False)
