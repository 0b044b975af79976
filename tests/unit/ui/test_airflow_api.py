"""ui/airflow_api.py against a stand-in of Airflow's REST API (httpx.MockTransport) that answers like /api/v2:
pages capped by `limit`, `updated_at_gte` filtering, 404 for an unknown run. The real API: the contract test
(tests/contract/test_airflow_contract.py) and the live tests."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from urllib.parse import unquote

import httpx

from dflash_regen.ui.airflow_api import OVERLAP_S, AirflowApi, error_line

RUN = "manual__2026-12-07T01:02:03.456789+00:00"  # ':' and '+' must reach Airflow intact


def iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat()


class FakeAirflow:
    def __init__(self, shards: int, cap: int = 40):
        self.cap, self.requests = cap, []
        self.tis = [{"task_id": "plan_shards", "map_index": -1, "try_number": 1}] + [
            {"task_id": "generate", "map_index": i, "try_number": 1} for i in range(shards)]
        for ti in self.tis:
            ti.update(state="success", start_date=iso(1000), end_date=iso(1100), updated_at=1100.0, dag_run_id=RUN)

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path, q = unquote(request.url.path), request.url.params
        if path.endswith("/tasks"):
            return httpx.Response(200, json={"tasks": [{"task_id": "plan_shards", "downstream_task_ids": ["generate"]},
                                                       {"task_id": "generate", "downstream_task_ids": []}]})
        if path.endswith(f"/dagRuns/{RUN}/taskInstances"):
            rows = [t for t in self.tis if "updated_at_gte" not in q
                    or t["updated_at"] >= datetime.fromisoformat(q["updated_at_gte"]).timestamp()]
            offset, limit = int(q["offset"]), min(int(q["limit"]), self.cap)
            return httpx.Response(200, json={"task_instances": rows[offset:offset + limit], "total_entries": len(rows)})
        if path.endswith(f"/dagRuns/{RUN}"):
            return httpx.Response(200, json={"dag_run_id": RUN, "state": "running", "start_date": iso(1000),
                                             "end_date": None, "run_after": iso(999), "conf": {}})
        if "/dagRuns/" in path and path.count("/") == 6:
            return httpx.Response(404, json={"detail": "not found"})
        if path.endswith("/eventLogs"):
            return httpx.Response(200, json={"event_logs": [], "total_entries": 0})
        return httpx.Response(500, json={"detail": f"unexpected {path}"})


def reader(fake: FakeAirflow) -> AirflowApi:
    return AirflowApi(httpx.Client(base_url="http://airflow", transport=httpx.MockTransport(fake.handler)),
                      "dflash_regen")


def test_a_run_is_read_whole_once_then_only_what_airflow_changed_since():
    fake = FakeAirflow(shards=100, cap=40)
    api = reader(fake)
    first = api.run(RUN)
    assert first["run_id"] == RUN and len(first["tasks"]) == 101  # every page read: 40 + 40 + 21
    ti_reads = [r for r in fake.requests if r.url.path.endswith("/taskInstances")]
    assert len(ti_reads) == 3 and all("updated_at_gte" not in r.url.params for r in ti_reads)
    assert all(r.method == "GET" for r in fake.requests)  # never a request Airflow writes to its audit log

    fake.requests.clear()
    now = time.time()
    fake.tis[5].update(state="failed", updated_at=now)  # generate[4] fails after the first view
    second = api.run(RUN)
    ti_reads = [r for r in fake.requests if r.url.path.endswith("/taskInstances")]
    assert len(ti_reads) == 1  # only the changed one comes back
    since = datetime.fromisoformat(ti_reads[0].url.params["updated_at_gte"]).timestamp()
    assert now - OVERLAP_S - 60 < since <= now - OVERLAP_S + 1  # the margin for a late commit
    states = {(t["task_id"], t["map_index"]): t["state"] for t in second["tasks"]}
    assert len(states) == 101 and states[("generate", 4)] == "failed" and states[("generate", 3)] == "success"


def test_an_unknown_run_is_none_and_a_logs_first_error_line_is_found():
    fake = FakeAirflow(shards=1)
    assert reader(fake).run("manual__nope") is None
    assert reader(fake).run("..") is None and reader(fake).run(".") is None  # not the DAG's own path
    log = [{"event": "starting"}, {"event": "generate failed: shard 3 stopped", "level": "error"}]
    assert error_line(log) == "shard 3 stopped"
    detail = [{"event": "Task failed", "error_detail": [{"exc_type": "DiskFull", "exc_value": "out of space\nmore"}]}]
    assert error_line(detail) == "DiskFull: out of space"
