"""The pages' work per request does not grow with the run: a refresh of the Fleet page, the Data quality page, the
runs list or the metrics endpoint reads the same number of files with 10 finished shards as with 100 (each
finished shard's files are read once, then served from the cache in ui/files.py). At the seed's 903 shards a page
that re-read every shard on each refresh would take seconds; docs/benchmarks.md has the timings."""

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient

from dflash_regen.layout import COMPLETIONS, RunLayout
from dflash_regen.ui.app import build_app
from dflash_regen.ui.fleet_page import SHARDS_LISTED
from dflash_regen.ui.metrics import build_metrics_app

RUN = "big_run"
PROMPTS = 20  # per shard
PAGES = (f"/runs/{RUN}/fleet", f"/runs/{RUN}/quality", "/", "/metrics")


def write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def finished_run(root, shards: int) -> RunLayout:
    """A run whose `shards` shards all finished: plan, status, completions and tokenized summary per shard."""
    run = RunLayout.of(root, RUN)
    write(run.report("plan"), {"rows": shards * PROMPTS, "accepted": shards * PROMPTS})
    write(run.plan, {"shards": [{"shard": i, "prompts": PROMPTS} for i in range(shards)]})
    write(run.report("quality"), {"passed": True, "quarantined_by_reason": {}})
    for n in range(shards):
        server = f"server {n % 7} (GPU {n % 7}, 127.0.0.1:{30000 + n % 7})"
        attempt = {"server": server, "started_at": 1000.0 + n, "updated_at": 1010.0 + n, "ended_at": 1010.0 + n,
                   "state": "done", "done_before": 0, "done": PROMPTS, "output_tokens": 100 * PROMPTS}
        write(run.status(n), {"shard": n, "total": PROMPTS, "state": "done", "done": PROMPTS, "quarantined": 0,
                              "output_tokens": 100 * PROMPTS, "attempts": [attempt]})
        merged = run.merged(COMPLETIONS, n)
        merged.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"finished_at": [1001.0 + n + i / PROMPTS for i in range(PROMPTS)],
                                 "completion_tokens": [100] * PROMPTS, "server": [server] * PROMPTS}), merged)
        run.summary(n).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"loss_mask_sum": [50 + i for i in range(PROMPTS)]}), run.summary(n))
    return run


@pytest.fixture
def reads(monkeypatch):
    """Count the files the pages read: Python's opens (JSON reports, shard status) through an audit hook, and
    pyarrow's parquet reads, which open files in C++ where no audit hook sees them."""
    counter = {"on": False, "n": 0}

    def hook(event, args):
        if counter["on"] and event == "open" and isinstance(args[0], str) and RUN in args[0]:
            counter["n"] += 1

    sys.addaudithook(hook)  # cannot be removed: inert once the test has switched it off
    for name in ("read_table", "read_metadata", "read_schema"):
        real = getattr(pq, name)

        def counted(*args, _real=real, **kwargs):
            if counter["on"]:
                counter["n"] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(pq, name, counted)
    yield counter
    counter["on"] = False


def reads_per_refresh(root, reads) -> dict[str, int]:
    pages = TestClient(build_app(root, auth=lambda: None))
    metrics = TestClient(build_metrics_app([root], token="t"))
    out = {}
    for path in PAGES:
        client, headers = (metrics, {"Authorization": "Bearer t"}) if path == "/metrics" else (pages, {})
        assert client.get(path, headers=headers).status_code == 200, path  # the first reads every shard once
        reads.update(on=True, n=0)
        assert client.get(path, headers=headers).status_code == 200, path
        reads["on"] = False
        out[path] = reads["n"]
    return out


def test_a_refresh_reads_as_many_files_at_10_as_at_100_finished_shards(tmp_path, reads):
    finished_run(tmp_path / "small", 10)
    finished_run(tmp_path / "large", 100)
    small = reads_per_refresh(tmp_path / "small", reads)
    large = reads_per_refresh(tmp_path / "large", reads)
    assert large == small, f"files read per refresh: {small} at 10 shards, {large} at 100"


def test_the_fleet_page_lists_the_shards_that_need_the_operator_first(tmp_path):
    run = finished_run(tmp_path, SHARDS_LISTED + 30)
    failed = run.status(40)
    status = json.loads(failed.read_text())
    status["attempts"][0].update(state="failed", error="shard 40 stopped on server 5: connection refused")
    status["state"] = "failed"
    write(failed, status)
    slow = run.status(70)  # finished on its first attempt, at a tenth of the others' rate
    status = json.loads(slow.read_text())
    status["attempts"][0]["output_tokens"] //= 10
    write(slow, status)
    page = TestClient(build_app(tmp_path, auth=lambda: None)).get(f"/runs/{RUN}/fleet.json").json()
    listed = [r["shard"] for r in page["shards_listed"]]
    assert len(page["shards"]) == SHARDS_LISTED + 30 and len(listed) == SHARDS_LISTED
    assert listed[:2] == [40, 70], listed  # the failed shard, then the slowest finished one
    assert page["shards_unlisted"] == {"done": 30}
    html = TestClient(build_app(tmp_path, auth=lambda: None)).get(f"/runs/{RUN}/fleet").text
    assert f"{SHARDS_LISTED} of {SHARDS_LISTED + 30} shards listed" in html and "Not listed: 30 done" in html
