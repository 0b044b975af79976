"""Fault-matrix cases that need a real scheduler (tests/live_airflow.py): tasks run in their own processes,
so the node can die under them. Case 2 (a shard task SIGKILLed mid-shard, then one mapped task cleared) is
tests/live/test_airflow_ui.py's REST test.
"""

import json
import os
import re
import signal
import time

import pyarrow.parquet as pq
from live_airflow import completion_ids, published_manifest, run_dir

SHARD_LINE = re.compile(r"shard (\d+) on .*?: (\d+) prompts, (\d+) done before, (\d+) quarantined before, "
                        r"(\d+) to send")


def results_on_disk(folder) -> int:
    """Samples with a result (completion or a server's refusal), merged shard files or checkpoint parts."""
    total = 0
    for kind in ("completions", "failures"):
        files = list((folder / kind).glob("shard-*.parquet"))
        merged = {p.stem for p in files}
        files += [p for d in (folder / kind).glob("shard-*") if d.is_dir() and d.name not in merged
                  for p in d.glob("*.parquet")]
        total += sum(pq.read_metadata(p).num_rows for p in files)
    return total


def test_9_node_dies_mid_run_and_the_same_run_id_resumes_without_redoing_work(live_airflow):
    af = live_airflow
    run_id, conf = "node_crash", {"shard_size": 20, "checkpoint_every": 4, "dataset_name": "node-crash"}
    af.trigger(run_id, conf)
    folder = run_dir(af, run_id)
    deadline = time.monotonic() + 300
    while results_on_disk(folder) < 12:  # a few checkpoints in, far from done
        assert time.monotonic() < deadline, f"no progress: {af.task_states(run_id)}"
        time.sleep(0.05)

    # The node dies: the scheduler with its executor and every task process, and every SGLang server.
    af.kill_component("scheduler")
    for spec in (folder / "fleet").glob("server-*.json"):
        pid = int(re.search(r'"pid": (\d+)', spec.read_text()).group(1))
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    kept = results_on_disk(folder)
    assert af.run_state(run_id) == "running"

    # The operator marks the dead run failed, deletes it, brings the node back, triggers the same run id.
    af.api("PATCH", f"/api/v2/dags/dflash_regen/dagRuns/{run_id}", json={"state": "failed"})
    af.api("DELETE", f"/api/v2/dags/dflash_regen/dagRuns/{run_id}")
    af.start_component("scheduler")
    af.trigger(run_id, conf)
    assert af.wait_run(run_id, timeout_s=600) == "success", af.task_states(run_id)

    sent = 0
    for ti in af.task_instances(run_id):
        if ti["task_id"] == "generate":
            log = af.task_log(run_id, "generate", ti["try_number"], map_index=ti["map_index"])
            match = SHARD_LINE.search(log)  # a shard finished before the crash logs "already complete"
            sent += int(match[5]) if match else 0
    accepted = json.loads((folder / "reports" / "plan.json").read_text())["accepted"]
    assert 0 < kept < accepted
    assert sent == accepted - kept, "the rerun redid finished samples or skipped missing ones"
    ids = completion_ids(folder)
    assert len(ids) == len(set(ids)), "a sample was generated twice"
    counts = published_manifest(af, run_id, "node-crash")["counts"]
    assert counts["prompts"] == counts["published"] + counts["quarantined"]
    versions = list((af.output_root / "published" / "node-crash").iterdir())
    assert [v.name for v in versions] == [folder.name], "published more than once, or a partial version"
