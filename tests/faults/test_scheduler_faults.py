"""Fault-matrix cases that need a real scheduler (tests/live_airflow.py): tasks run in their own processes,
so the node can die under them, and a task can be stopped and stepped to the exact moment to kill it.
Both cases share one run: the node dies (case 9), the same run id resumes, and its publish is killed mid-copy
(case 10). Case 2 (a shard task SIGKILLed mid-shard, then one mapped task cleared) is in
tests/live/test_airflow_ui.py.
"""

import json
import os
import re
import signal
import time

import pyarrow.parquet as pq
from conftest import processes_mentioning
from live_airflow import completion_ids, published_manifest, run_dir

from dflash_regen.layout import COMPLETIONS, FAILURES, RunLayout
from dflash_regen.settings.run_config import safe_run_id

SHARD_LINE = re.compile(r"shard (\d+) on .*?: (\d+) prompts, (\d+) done before, (\d+) quarantined before, "
                        r"(\d+) to send")


def results_on_disk(folder) -> int:
    """Samples with a result (completion or a server's refusal), merged shard files or checkpoint parts."""
    run = RunLayout(folder)
    return sum(pq.read_metadata(p).num_rows for kind in (COMPLETIONS, FAILURES) for p in run.result_files(kind))


def step_until(pid: int, done, slice_s: float = 0.002, timeout_s: float = 120) -> bool:
    """Run a stopped process in short slices until `done()` holds while it is stopped; leaves it stopped."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return True
        os.kill(pid, signal.SIGCONT)
        time.sleep(slice_s)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.001)  # let the stop land before looking at the files
    return False


def kill_publish_mid_copy(af, run_id: str, published) -> None:
    """SIGKILL the run's publish task while its copy is half-written; no version may be visible then."""
    deadline = time.monotonic() + 600
    while True:  # the publish task's own process: the Task SDK titles it "airflow worker -- <ti id>"
        ti = next(t for t in af.task_instances(run_id) if t["task_id"] == "publish")
        pids = processes_mentioning(f"airflow worker -- {ti['id']}") if ti["state"] == "running" else []
        if pids:
            break
        assert time.monotonic() < deadline and ti["state"] not in ("success", "failed"), af.task_states(run_id)
        time.sleep(0.02)
    os.kill(pids[0], signal.SIGSTOP)

    def mid_copy() -> bool:
        return any(published.glob(".*.tmp/conversations.jsonl")) if published.is_dir() else False

    caught = step_until(pids[0], mid_copy)
    os.kill(pids[0], signal.SIGKILL)
    assert caught, "publish never got to its copy while being stepped"
    assert [p.name for p in published.iterdir() if not p.name.startswith(".")] == [], "a partial version is visible"


def test_9_and_10_node_dies_mid_run_the_same_run_id_resumes_and_publish_killed_mid_copy_publishes_once(
        live_airflow):
    af = live_airflow
    run_id, dataset = "node_crash", "node-crash"
    # 2 shards on 2 servers: the fewest tasks (each costs seconds of Airflow time) that still run side by side.
    # reuse off: the session's other live runs answer the same demo prompts, whose completions would be reused
    conf = {"num_servers": 2, "shard_size": 60, "checkpoint_every": 4, "calibration_prompts": 0,
            "dataset_name": dataset, "reuse": "off"}
    af.trigger(run_id, conf)
    folder = run_dir(af, run_id)
    deadline = time.monotonic() + 300
    while results_on_disk(folder) < 12:  # a few checkpoints in, far from done
        assert time.monotonic() < deadline, f"no progress: {af.task_states(run_id)}"
        time.sleep(0.05)

    # Case 9. The node dies: the scheduler with its executor and every task process, and every SGLang server.
    af.kill_component("scheduler")
    for spec in RunLayout(folder).fleet.server_specs():
        pid = int(re.search(r'"pid": (\d+)', spec.read_text()).group(1))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    kept = results_on_disk(folder)
    assert af.run_state(run_id) == "running"

    # The operator brings the node back, marks the dead run failed, deletes it once it has ended and triggers
    # the same run id again. Airflow still runs the teardowns first; the run stays failed (check_published:
    # skipped leaves alone would have turned it green).
    af.start_component("scheduler")
    af.api("PATCH", f"/api/v2/dags/dflash_regen/dagRuns/{run_id}", json={"state": "failed"})
    assert af.wait_run(run_id, timeout_s=300) == "failed", af.task_states(run_id)
    af.delete_run(run_id)
    af.trigger(run_id, conf)

    # Case 10, on the rerun: publish is killed mid-copy; its own retry publishes once.
    published = af.output_root / "published" / dataset
    kill_publish_mid_copy(af, run_id, published)
    assert af.wait_run(run_id, timeout_s=600) == "success", af.failures(run_id)
    versions = sorted(p.name for p in published.iterdir())
    assert versions == [safe_run_id(run_id)] == [folder.name], \
        f"published more than once or left a temporary dir: {versions}"
    ti = next(t for t in af.task_instances(run_id) if t["task_id"] == "publish")
    assert ti["try_number"] == 2

    # Case 9: the rerun sent exactly what the dead run had not kept.
    sent = 0
    for ti in af.task_instances(run_id):
        if ti["task_id"] == "generate":
            log = af.task_log(run_id, "generate", ti["try_number"], map_index=ti["map_index"])
            # The same run id writes to the same log file: the last line is the rerun's. A shard that
            # finished before the crash logs "already complete" instead and sends nothing.
            lines = SHARD_LINE.findall(log.split("already complete")[-1])
            sent += int(lines[-1][4]) if lines else 0
    accepted = json.loads(RunLayout(folder).report("plan").read_text())["accepted"]
    assert 0 < kept < accepted
    assert sent == accepted - kept, "the rerun redid finished samples or skipped missing ones"
    ids = completion_ids(folder)
    assert len(ids) == len(set(ids)), "a sample was generated twice"
    counts = published_manifest(af, run_id, dataset)["counts"]
    assert counts["prompts"] == counts["published"] + counts["quarantined"]
    assert pq.read_table(published / versions[0] / "tokenized").num_rows == counts["published"]
