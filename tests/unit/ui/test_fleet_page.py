"""The Fleet page of a run on several nodes: every node's gates, share, progress and servers, and each
`<node>.generate[i]` task read as the node's i-th assigned shard."""

import json

from fastapi.testclient import TestClient

from dflash_regen.layout import RunLayout
from dflash_regen.ui.app import build_app

RUN = "two_nodes"


class Airflow:
    def runs(self):
        return [{"run_id": RUN, "state": "running", "start": 900.0, "end": None}]

    def run(self, run_id):
        tasks = [{"task_id": "fast.generate", "map_index": 0, "state": "success", "try_number": 1},
                 {"task_id": "fast.generate", "map_index": 1, "state": "running", "try_number": 1},
                 {"task_id": "slow.generate", "map_index": 0, "state": "failed", "try_number": 1}]
        return {**self.runs()[0], "tasks": tasks}


def write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def status(shard, state, done, server, started, ended=None, error=None):
    attempt = {"server": server, "started_at": started, "updated_at": ended or started + 1, "state": state,
               "done_before": 0, "done": done, "output_tokens": 10 * done}
    if ended:
        attempt["ended_at"] = ended
    if error:
        attempt["error"] = error
    return {"shard": shard, "total": 10, "state": state, "done": done, "quarantined": 0,
            "output_tokens": 10 * done, "attempts": [attempt]}


def test_fleet_page_of_a_run_on_two_nodes(tmp_path):
    run = RunLayout.of(tmp_path, RUN)
    write(run.report("plan"), {"rows": 30, "accepted": 30})
    write(run.plan, {"shards": [{"shard": i, "prompts": 10} for i in range(3)]})
    write(run.report("assignment"), {"basis": "calibrated prompts/s", "left_out": {}, "nodes": {
        "fast": {"shards": [0, 2], "prompts": 20, "rate_share": 0.67, "predicted_s": 8.0, "servers": 1},
        "slow": {"shards": [1], "prompts": 10, "rate_share": 0.33, "predicted_s": 8.0, "servers": 1}}})
    for node, port in (("fast", 30000), ("slow", 31000)):
        server = f"server 0 (GPU 0, 127.0.0.1:{port})"
        write(run.node_report("health", node), {"passed": True, "servers": [
            {"server": server, "healthy": True, "allocation": {"kv_tokens": 1000, "mamba_slots": 20,
                                                         "running_slots": 4}}]})
        write(run.node_report("smoke", node), {"passed": True, "servers": [
            {"server": server, "ok": True, "results": []}]})
    write(run.status(0), status(0, "done", 10, "server 0 (GPU 0, 127.0.0.1:30000)", 1000, 1008))
    write(run.status(2), status(2, "running", 4, "server 0 (GPU 0, 127.0.0.1:30000)", 1008))
    write(run.status(1), status(1, "failed", 3, "server 0 (GPU 0, 127.0.0.1:31000)", 1000,
                                    1005, error="shard 1 stopped on server 0: was killed"))
    client = TestClient(build_app(tmp_path, auth=lambda: None, airflow=Airflow()))

    report = client.get(f"/runs/{RUN}/fleet.json").json()
    shards = {s["shard"]: s["state"] for s in report["shards"]}
    assert shards == {0: "success", 1: "failed", 2: "running"}  # slow.generate[0] is shard 1, fast's [1] shard 2
    nodes = {n["node"]: n for n in report["nodes"]}
    assert (nodes["fast"]["done"], nodes["fast"]["prompts"], nodes["fast"]["running_shards"]) == (14, 20, 1)
    assert (nodes["slow"]["done"], nodes["slow"]["measured_s"]) == (3, 5.0)
    assert [s["node"] for s in report["servers"]] == ["fast", "slow"] and report["health_passed"] is True
    assert report["progress"]["done"] == 17 and report["progress"]["planned"] == 30
    assert report["run_state"]["failed"][0]["error"] == "shard 1 stopped on server 0: was killed"

    html = client.get(f"/runs/{RUN}/fleet").text
    assert 'id="nodes"' in html and "fast: server 0" in html and "slow: server 0" in html and "67%" in html
