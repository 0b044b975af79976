"""The pipeline's Prometheus text: the newest runs only, each series labelled by the run id Airflow knows, shard
states from Airflow's task states. (A real Prometheus scrapes it in tests/integration/test_monitoring.py.)"""

import json
import os
import re

from dflash_regen.layout import RunLayout
from dflash_regen.settings.run_config import safe_run_id
from dflash_regen.ui.metrics import MAX_RUNS, pipeline_metrics


def write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for name, labels, value in re.findall(r"^(\w+)\{([^}]*)\} (\S+)$", text, re.M):
        out[name, frozenset(re.findall(r'(\w+)="([^"]*)"', labels))] = float(value)
    return out


def test_only_the_newest_runs_are_exported(tmp_path):
    for i in range(MAX_RUNS + 2):
        run = RunLayout.of(tmp_path, f"run_{i}").run_dir
        run.mkdir(parents=True)
        os.utime(run, (1000 + i, 1000 + i))
    exported = {dict(labels)["run_id"] for _, labels in samples(pipeline_metrics([tmp_path]))}
    assert exported == {f"run_{i}" for i in range(2, MAX_RUNS + 2)}

    class Listing:  # Airflow's runs, newest first
        def runs(self):
            return [{"run_id": f"run_{i}", "state": "success"} for i in range(MAX_RUNS + 1)]

        def run(self, run_id):
            return {"run_id": run_id, "state": "success", "tasks": []}

    exported = {dict(labels)["run_id"] for _, labels in samples(pipeline_metrics([tmp_path], Listing()))}
    assert exported == {f"run_{i}" for i in range(MAX_RUNS)}


class Airflow:
    def runs(self):
        return [{"run_id": "manual__2026-12-05T10:00:00+00:00", "state": "running", "start": 900.0, "end": None},
                {"run_id": "queued_without_a_folder", "state": "queued", "start": None, "end": None}]

    def run(self, run_id):
        tasks = [{"task_id": "generate", "map_index": 0, "state": "success", "try_number": 1},
                 {"task_id": "generate", "map_index": 1, "state": "up_for_retry", "try_number": 2}]
        return {**self.runs()[0], "tasks": tasks}


def test_with_airflow_each_run_is_labelled_by_its_run_id_and_shards_by_their_task_state(tmp_path):
    run_id = Airflow().runs()[0]["run_id"]
    run = RunLayout.of(tmp_path, safe_run_id(run_id))  # the folder's name; the label is Airflow's run id
    write(run.report("plan"), {"rows": 22, "accepted": 20, "quarantined_by_reason": {"duplicate_id": 2}})
    write(run.plan, {"shards": [{"shard": i, "prompts": 10} for i in range(2)]})
    text = pipeline_metrics([tmp_path], Airflow(), now=2000.0)
    found = samples(text)
    runs = {dict(labels)["run_id"] for _, labels in found}
    assert runs == {run_id}  # the queued run has no folder yet: nothing to export
    key = frozenset({("run_id", run_id)})
    assert found["dflash_regen_prompts_planned", key] == 20
    assert found["dflash_regen_shards", key | {("state", "success")}] == 1
    assert found["dflash_regen_shards", key | {("state", "up_for_retry")}] == 1
    assert found["dflash_regen_quarantined", key | {("stage", "plan"), ("reason", "duplicate_id")}] == 2
    assert "# TYPE dflash_regen_eta_seconds gauge" in text
