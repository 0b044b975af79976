"""The report pages over a hand-made run folder: what they show, what they refuse, and that they need auth."""

import json
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi import Header, HTTPException
from fastapi.testclient import TestClient

from dflash_regen.layout import COMPLETIONS, FAILURES, RunLayout, runs_dir
from dflash_regen.ui import charts
from dflash_regen.ui.app import build_app, offline_html
from dflash_regen.ui.fleet_page import fleet_report
from dflash_regen.ui.progress import THROUGHPUT_POINTS, progress, throughput_series
from dflash_regen.ui.quality_page import histogram

RUN = "manual__2026-12-03T10:00:00+00:00"


def capacity(advised_wall_s: float) -> dict:
    scenario = {"wall_s": 160_560.0, "gpu_hours": 311.9, "extrapolated": False, "requests_per_s_per_server": 0.8}
    return {
        "binding": {"resource": "Mamba slots", "detail": "80 Mamba slots // 5 = 16 running requests, while the KV "
                                                         "cache could hold 526 requests of ~2,166 tokens"},
        "advice": {"server_flags": "--max-mamba-cache-size 160 --max-running-requests 32",
                   "concurrency_per_server_advised": 36, "notes": []},
        "allocation": [{"kv_tokens": 1139584}], "run": {"mean_prompt_tokens": 346.0, "mean_output_tokens": 1820.0},
        "curve": {"measured_up_to": 16},
        "scenarios": [{"name": "current", **scenario},
                      {"name": "advised", **scenario, "wall_s": advised_wall_s, "gpu_hours": 271.8,
                       "extrapolated": True}],
        "table": [{"fleet tok/s": "10,280", "settings": "current", "running / server": "16"},
                  {"fleet tok/s": "11,809", "settings": "advised", "running / server": "32 *"}]}


class Airflow:
    """Airflow's view of the runs, as the plugin hands it over (plain dicts)."""

    def __init__(self, state="success", failed=()):
        self.state, self.failed = state, set(failed)

    def runs(self):
        return [{"run_id": RUN, "state": self.state, "start": 900.0, "end": 1100.0}]

    def run(self, run_id):
        if run_id != RUN:
            return None
        tasks = [{"task_id": t, "map_index": -1, "state": "success", "try_number": 1} for t in
                 ("stage_weights", "launch_fleet", "health_check", "smoke_test", "plan_shards", "calibrate",
                  "validate", "publish")]
        tasks += [{"task_id": "generate", "map_index": i, "state": "success", "try_number": 1} for i in (0, 1)]
        for t in tasks:
            label = t["task_id"] + (f"[{t['map_index']}]" if t["map_index"] >= 0 else "")
            if label in self.failed:
                t["state"] = "failed"
            elif self.failed and t["task_id"] in ("validate", "publish"):
                t["state"] = "upstream_failed"
        return {**self.runs()[0], "tasks": tasks}
FOLDER = "manual__2026-12-03T10_00_00_00_00"


def write_parquet(path, columns: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)


@pytest.fixture
def root(tmp_path):
    run = RunLayout.of(tmp_path / "out", FOLDER)
    run.reports_dir.mkdir(parents=True)
    run.report("plan").write_text(json.dumps({"rows": 10, "accepted": 9}))
    run.report("quality").write_text(json.dumps({
        "success": False, "samples": 8, "kept": 4, "settings": {"empty_mask_tokens": 6}, "statistics": {},
        "expectations": [
            {"expectation": "expect_column_values_to_be_between", "success": False, "error": None,
             "kwargs": {"column": "loss_mask_sum", "min_value": 7, "mostly": 0.98}, "observed": "4 unexpected"},
            {"expectation": "expect_table_row_count_to_equal", "success": True, "error": None,
             "kwargs": {"value": 8}, "observed": 8}]}))
    run.report("health").write_text(json.dumps({"passed": True, "servers": [
        {"server": "server 0 (GPU 0, 127.0.0.1:30000)", "healthy": True, "binding": "Mamba slots (80 // 5 = 16)",
         "allocation": {"kv_tokens": 1139584, "mamba_slots": 80, "running_slots": 16}, "problems": []}]}))
    run.report("smoke").write_text(json.dumps({"passed": True, "max_tokens": 16384, "servers": [
        {"server": "server 0 (GPU 0, 127.0.0.1:30000)", "ok": True, "results": [
            {"prompt": "coding", "ok": True, "finish_reason": "stop", "tokens_per_s": 150.0, "problem": ""}]}]}))
    run.report("capacity").write_text(json.dumps(capacity(advised_wall_s=139_680.0)))
    run.shards_dir.mkdir()
    run.plan.write_text(json.dumps({"shards": [{"shard": 0, "prompts": 9}, {"shard": 1,
                                                                                                 "prompts": 8}]}))
    # Shard 0 failed on server 2 (killed), was retried on server 0 and finished; shard 1 runs with 5 done in
    # memory (its heartbeat) but only 2 checkpointed.
    run.status_dir.mkdir()
    run.status(0).write_text(json.dumps({"shard": 0, "total": 9, "state": "done", "done": 8,
        "quarantined": 1, "output_tokens": 600, "attempts": [
            {"server": "server 2 (GPU 2)", "started_at": 990.0, "updated_at": 995.0, "ended_at": 995.0,
             "state": "failed", "done_before": 0, "done": 2, "output_tokens": 200,
             "error": "shard 0 stopped on server 2 (GPU 2): server 2 stopped answering"},
            {"server": "server 0 (GPU 0)", "started_at": 1000.0, "updated_at": 1006.0, "ended_at": 1006.0,
             "state": "done", "done_before": 2, "done": 8, "output_tokens": 600}]}))
    run.status(1).write_text(json.dumps({"shard": 1, "total": 8, "state": "running", "done": 5,
        "quarantined": 0, "output_tokens": 500, "attempts": [
            {"server": "server 1 (GPU 1)", "started_at": 1000.0, "updated_at": 1005.0, "state": "running",
             "done_before": 0, "done": 5, "output_tokens": 500}]}))
    run.fleet_dir.mkdir()
    run.fleet.unhealthy(2).write_text("server 2 (GPU 2) stopped answering (8 failures in a row)")
    run.fleet.server_spec(0).write_text(json.dumps({"pid": 1, "launched_at": 998.0}))
    write_parquet(run.parts(COMPLETIONS, 1) / "part-1.parquet",
                  {"sample_id": ["t0", "t1"], "server": ["server 1 (GPU 1)"] * 2, "finished_at": [1003.0, 1004.0],
                   "completion_tokens": [100, 100]})
    write_parquet(run.summary(0),
                  {"loss_mask_sum": [6, 6, 6, 6, 900, 1200, 1500, 2000]})
    write_parquet(run.planning_quarantine, {"sample_id": ["a"], "reason": ["bad_role"]})
    write_parquet(run.merged(FAILURES, 0), {"sample_id": ["b"], "reason": ["http_400"]})
    write_parquet(run.gate_quarantine,
                  {"sample_id": ["c", "d", "e", "f"], "reason": ["empty_answer_mask"] * 4})
    rows = {"sample_id": [f"s{i}" for i in range(8)], "server": ["server 0 <b>"] * 8,
            "finished_at": [1000.0 + i for i in range(8)], "completion_tokens": [100] * 8}
    write_parquet(run.merged(COMPLETIONS, 0), rows)
    write_parquet(run.parts(COMPLETIONS, 0) / "part-1.parquet", rows)  # same rows: not counted twice
    docs = run.data_docs
    (docs / "validations" / "suite").mkdir(parents=True)
    (docs / "index.html").write_text(
        '<html><head><link rel="stylesheet" href="https://maxcdn.bootstrapcdn.com/b.css"/>'
        '<script src="https://code.jquery.com/jquery.js"></script></head><body><p>GX index</p></body></html>')
    (docs / "validations" / "suite" / "run.html").write_text("<html><head></head><body>result</body></html>")
    (tmp_path / "out" / "secret.txt").write_text("top secret")
    (docs / "escape.html").symlink_to(tmp_path / "out" / "secret.txt")
    return tmp_path / "out"


def require_token(authorization: str | None = Header(None)):
    if authorization != "Bearer good":
        raise HTTPException(401, "not authenticated")


@pytest.fixture
def client(root):
    return TestClient(build_app(root, require_token), headers={"Authorization": "Bearer good"})


def test_every_page_requires_the_auth_dependency(root):
    anonymous = TestClient(build_app(root, require_token))
    for path in ("/", f"/runs/{RUN}/quality", f"/runs/{RUN}/quality.json", f"/runs/{RUN}/fleet",
                 f"/runs/{RUN}/fleet.json", f"/runs/{RUN}/data-docs/index.html", f"/runs/{RUN}/data-docs",
                 "/docs", "/openapi.json"):
        assert anonymous.get(path).status_code in (401, 404), path
        assert anonymous.get(path).status_code != 200, path


def test_quality_page_shows_failed_expectations_counts_and_the_empty_answer_spike(client):
    report = client.get(f"/runs/{RUN}/quality.json").json()
    assert report["status"] == "failed"
    assert report["quarantined_by_stage"] == {"planning": {"bad_role": 1}, "generation": {"http_400": 1},
                                              "quality gate": {"empty_answer_mask": 4}}
    assert report["prompts"] == 10 and report["kept"] == 4 and report["quarantined"] == 6
    assert report["loss_mask"]["empty"] == 4
    failed = report["expectations"][0]
    assert (failed["success"], failed["column"], failed["threshold"]) == (False, "loss_mask_sum",
                                                                         ">= 7 for >= 98% of rows")
    html = client.get(f"/runs/{RUN}/quality").text
    assert "counts reconcile" in html and "4 unexpected" in html and 'class="badge fail">fail' in html
    assert 'class="bar bad"' in html  # the bin holding the 6-token masks is drawn as bad
    assert "expect_<wbr>column_<wbr>values_<wbr>to_<wbr>be_<wbr>between" in html  # wraps between words only


def test_quality_page_shows_the_samples_held_against_their_servers_ids(client, root):
    html = client.get(f"/runs/{RUN}/quality").text
    assert "No sample was compared" in html  # a report before issue 37, or a version without ids while streaming
    path = RunLayout.of(root, FOLDER).report("quality")
    report = json.loads(path.read_text())
    path.write_text(json.dumps({**report, "prompt_ids_compared": 8, "prompt_ids_mismatch": 2,
                                "prompt_ids_mismatch_samples": ["s3", "s7"], "token_exact": 6, "record_exact": 4,
                                "rerender_drift": {"compared": 6, "whitespace": 2, "tool_value": 1, "other": 0}}))
    assert client.get(f"/runs/{RUN}/quality.json").json()["server_ids"]["prompt_ids_mismatch"] == 2
    html = client.get(f"/runs/{RUN}/quality").text
    assert '<b id="prompt-ids-mismatch">2</b> of 8 samples' in html and "2 prompts differ" in html
    assert "s3, s7" in html and "6 last turns are published token-exact" in html
    assert "differs in 3 (2 whitespace, 1 tool values re-typed, 0 other)" in html
    assert "re-render to the model's ids on 4." in html


def test_fleet_page_shows_allocation_smoke_and_progress_without_double_counting_parts(client):
    report = client.get(f"/runs/{RUN}/fleet.json").json()
    progress = report["progress"]
    # shard 0: 8 completions + a sample the server refused; shard 1: 5 done by its heartbeat (2 checkpointed)
    assert progress["planned"] == 9 and progress["done"] == 8 + 1 + 5
    assert progress["running_shards"] == [1]
    shards = {s["shard"]: s for s in report["shards"]}
    assert (shards[0]["attempts"], shards[0]["server"], shards[0]["done"]) == (2, "server 0 (GPU 0)", 9)
    assert (shards[1]["state"], shards[1]["done"], shards[1]["tok_s"]) == ("running", 5, 100.0)
    html = client.get(f"/runs/{RUN}/fleet").text
    assert "1,139,584" in html and "Mamba slots (80 // 5 = 16)" in html and "coding" in html
    assert "server 0 <b>" not in html and "server 0 &lt;b&gt;" in html  # names are escaped
    assert "<b>Mamba slots</b>" in html and "--max-mamba-cache-size 160 --max-running-requests 32" in html
    assert html.index("<th>settings</th>") < html.index("<th>fleet tok/s</th>") and "11,809" in html
    assert 'id="extrapolated"' in html  # the table's "*" is explained
    assert set(re.findall(r"(\d[\d,]*) requests(?:</b>)? of ~", html)) == {"526"}  # one KV figure: measured


def test_a_refresh_reads_only_the_files_that_changed(root, monkeypatch):
    """The page keeps what it read (status files, completion footers and columns) until a file changes: a
    refresh of a run of 902 finished shards reads none of them again, only the one a running shard rewrote."""
    from dflash_regen.generate import status
    from dflash_regen.ui import files

    run = RunLayout.of(root, FOLDER).run_dir
    read = []
    for owner, name in ((status, "read"), (files.pq, "read_table"), (files.pq, "read_metadata")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda p, *a, real=real, **k: (read.append(Path(p).name), real(p, *a, **k))[1])
    first = fleet_report(run, now=2000.0)
    assert {"shard-00000.json", "shard-00001.json", "shard-00000.parquet", "part-1.parquet"} <= set(read)
    read.clear()
    assert fleet_report(run, now=2000.0)["progress"] == first["progress"] and read == []
    status = RunLayout(run).status(1)
    status.write_text(status.read_text().replace('"done": 5', '"done": 6', 1))
    assert fleet_report(run, now=2000.0)["progress"]["done"] == first["progress"]["done"] + 1
    assert read == ["shard-00001.json"]


def test_fleet_page_lists_the_incidents_and_marks_them_on_the_chart(client):
    report = client.get(f"/runs/{RUN}/fleet.json").json()
    kinds = [(i["kind"], i["text"]) for i in report["incidents"]]
    assert ("shard failed", "shard 0 stopped on server 2 (GPU 2): server 2 stopped answering") in kinds
    assert ("relaunch", "fleet relaunched (1 servers) after shard work had started") in kinds
    assert any(k == "retry" and "shard 0 retried on server 0 (GPU 0) (2 done before" in t for k, t in kinds)
    assert ("server unhealthy", "server 2 (GPU 2) stopped answering (8 failures in a row)") in kinds
    html = client.get(f"/runs/{RUN}/fleet").text
    assert html.count('<g class="mark">') == len(kinds) and 'class="incident shard-failed"' in html


def test_advice_is_given_only_when_the_plan_predicts_a_gain(root, client):
    html = client.get(f"/runs/{RUN}/fleet").text
    assert "relaunch with <code>server_flags --max-mamba-cache-size 160" in html and "13% less" in html
    RunLayout.of(root, FOLDER).report("capacity").write_text(json.dumps(capacity(advised_wall_s=170_000.0)))
    html = client.get(f"/runs/{RUN}/fleet").text
    assert "relaunch with" not in html and "No change advised" in html and "not predicted to be faster" in html


def test_pages_keep_their_stylesheet_unescaped(client):
    """Autoescaping the inline CSS turned '"Segoe UI"' into '&#34;Segoe UI&#34;' and the browser dropped the
    font rule: every page rendered in Times."""
    for path in ("/", f"/runs/{RUN}/quality", f"/runs/{RUN}/fleet", f"/runs/{RUN}/data-docs/index.html",
                 f"/runs/{RUN}/data-docs/nope.html"):
        html = client.get(path).text
        style = html.split("<style>", 1)[1].split("</style>", 1)[0]
        assert 'font:14px/1.45 system-ui,-apple-system,"Segoe UI"' in style and "&#34;" not in style, path


def test_a_failed_run_says_where_it_stopped_on_every_page(root):
    RunLayout.of(root, FOLDER).report("quality").unlink()
    shutil.rmtree(RunLayout.of(root, FOLDER).data_docs)
    client = TestClient(build_app(root, require_token, Airflow("failed", failed={"generate[0]"})),
                        headers={"Authorization": "Bearer good"})
    for page in ("quality", "fleet"):
        html = client.get(f"/runs/{RUN}/{page}").text
        assert 'class="badge fail">run failed' in html and "<b>generate[0]</b> failed" in html, page
        assert "server 2 stopped answering" in html and "not run: validate, publish" in html, page
        assert "/tasks/generate/mapped/0" in html, page  # the link to the failed shard's log
    assert "The gate never ran: the run failed at generate[0]" in client.get(f"/runs/{RUN}/quality").text
    docs = client.get(f"/runs/{RUN}/data-docs/index.html")
    assert docs.status_code == 404 and docs.headers["content-type"].startswith("text/html")
    assert "the run failed at <b>generate[0]</b>, before validating" in docs.text


def test_runs_table_lists_airflows_run_ids_with_state_counts_and_links(root):
    (runs_dir(root) / "dag_test_leftover").mkdir()
    client = TestClient(build_app(root, require_token, Airflow()), headers={"Authorization": "Bearer good"})
    html = client.get("/").text
    row = html.split('id="runs"', 1)[1].split("</table>", 1)[0]
    assert f">{RUN}</a>" in row and 'class="badge ok">success' in row and "3m 20s" in row
    assert '<td class="num">10</td><td class="num">4</td><td class="num">6</td>' in row  # prompts, published, quar.
    assert 'href="../dags/dflash_regen/runs/manual__2026-12-03T10%3A00%3A00%2B00%3A00" target="_top"' in row
    assert 'href="runs/manual__2026-12-03T10%3A00%3A00%2B00%3A00/fleet"' in row and "Data Docs" in row
    assert "dag_test_leftover" in html.split('id="folders"', 1)[1]


def test_throughput_chart_cuts_out_the_pause_between_attempts():
    # 30 s of work, 10 minutes of nothing (a failed shard waiting for its clear), 30 s of work
    finished = np.array([1000.0 + i for i in range(30)] + [1630.0 + i for i in range(30)])
    series = throughput_series({"s0": (finished, np.full(60, 100.0))},
                                          marks=[{"at": 1040.0, "kind": "retry", "text": "shard 0 retried"}])
    assert len(series["breaks"]) == 1 and series["breaks"][0]["idle_s"] == pytest.approx(601.0)
    assert series["bins"] <= THROUGHPUT_POINTS + 2 and series["bin_s"] == pytest.approx(1.0)
    assert series["marks"][0]["at_bin"] == pytest.approx(series["breaks"][0]["at"])  # in the pause: at the cut
    assert sum(series["servers"]["s0"]) * series["bin_s"] == pytest.approx(6000.0)  # no token lost
    svg = charts.time_series(series["servers"], bin_s=series["bin_s"], x_title="t", y_title="tok/s",
                             ticks=series["ticks"], breaks=series["breaks"], marks=series["marks"])
    assert "10m01 idle" in svg and svg.count("<polyline") == 2 and "10m30" in svg
    # the idle label sits at the bottom of the plot, below the incident marks stacked from the top
    idle_y = float(re.search(r'<text class="break" x="[\d.]+" y="([\d.]+)"', svg).group(1))
    mark_y = [float(y) for y in re.findall(r'<circle cx="[\d.]+" cy="([\d.]+)" r="7"', svg)]
    assert mark_y and all(idle_y > y + 20 for y in mark_y)


def test_data_docs_are_served_offline_and_nothing_outside_them(client):
    index = client.get(f"/runs/{RUN}/data-docs/index.html")
    assert index.status_code == 200
    assert "bootstrapcdn" not in index.text and "jquery" not in index.text and "<style>" in index.text
    assert 'href="validations/suite/run.html"' in index.text  # the offline list of pages
    assert client.get(f"/runs/{RUN}/data-docs/validations/suite/run.html").status_code == 200
    for path in (f"/runs/{RUN}/data-docs/escape.html", f"/runs/{RUN}/data-docs/..%2F..%2F..%2Fsecret.txt",
                 f"/runs/{RUN}/data-docs/%2E%2E/plan.json", "/runs/..%2Fsecret.txt/quality", "/runs/../quality",
                 "/runs/nope/quality"):
        r = client.get(path)
        assert r.status_code == 404 and "top secret" not in r.text, path


def test_gx_data_docs_lose_what_only_works_online():
    html = ('<html><head></head><body><div id="t-body-table-toolbar"><button>Clear Filters</button></div>'
            '<span>Expectation Suite: x<br> Data asset: None<br> Status: ok</span></body></html>')
    out = offline_html(html, [("validations/a.html", "validation of a")], back="../quality")
    assert "Data asset" not in out and "[id$=-table-toolbar]" in out and "footer" in out
    assert '<body class="gx-docs"><nav><a href="../quality"' in out and ">validation of a</a>" in out


def test_offline_html_strips_remote_tags_but_keeps_local_ones():
    html = ('<html><head><link rel="icon" href="./static/x.ico"/><link href="//cdn.example/x.css">'
            '<script src="https://cdn.example/v.js"></script></head><body><img src="https://x/logo.png">hi</body>')
    out = offline_html(html)
    assert "./static/x.ico" in out and "cdn.example" not in out and "logo.png" not in out and "hi" in out


def test_histogram_keeps_the_6_token_spike_in_its_own_bin():
    values = [6] * 50 + [5] + list(range(7, 4000, 10))
    assert next(b for b in histogram(values) if b["start"] <= 6 <= b["end"])["count"] > 51  # blended
    bins = histogram(values, bins=40, split_at=6)
    assert bins[0] == {"start": 5, "end": 6, "count": 51}
    assert all(b["start"] > 6 for b in bins[1:]) and sum(b["count"] for b in bins) == len(values)
    svg = charts.histogram(bins, highlight_at_or_below=6, x_title="mask")
    assert svg.count('class="bar bad"') == 1


def test_time_series_escapes_names_and_draws_one_line_per_server():
    svg = charts.time_series({"<a>": [1, 2, 3], "b": [3, 2, 1]}, bin_s=5, x_title="t", y_title="tok/s")
    assert svg.count("<polyline") == 2 and "<a>" not in svg and "&lt;a&gt;" in svg


def test_fleet_page_shows_the_autotune_table_and_the_train_length_budget(client, root):
    from dflash_regen.capacity import autotune

    run = RunLayout.of(root, FOLDER)
    row = {"wall_s_interval": [140_000.0, 150_000.0], "gpu_hours": 280.0, "gpu_hours_interval": [270.0, 290.0]}
    autotune.write_report(run.reports_dir, {
        "tuning_s": 1_080.0, "candidate_s": 180.0, "budget_s": 1800.0, "sample_prompts": 128,
        "run": {"prompts": 902_087, "servers": 7}, "chosen": "mamba pool x2", "mode": "advise",
        "chosen_flags": "--max-mamba-cache-size 160 --max-running-requests 32", "action": "fleet relaunched as it was",
        "candidates": [
            {"candidate": "current", "flags": "", "running": 16, "tok_s": 1469.0, "wall_s": 160_000.0,
             "wall_with_tuning_s": 161_080.0, "chosen": False, **row},
            {"candidate": "mamba pool x2", "flags": "--max-mamba-cache-size 160 --max-running-requests 32",
             "running": 32, "tok_s": 1836.0, "wall_s": 139_000.0, "wall_with_tuning_s": 140_080.0, "chosen": True,
             **row},
            {"candidate": "FP8 KV cache", "flags": "--kv-cache-dtype fp8_e4m3", "running_slots": 16,
             "skipped": "fails smoke: no parsed tool call", "chosen": False}]})
    capacity_report = json.loads(run.report("capacity").read_text())
    capacity_report["budget"] = {"train_max_length": 4096, "tokens_past_share": 0.062, "saving_share": 0.071,
                                 "samples_cut_share": 0.09, "reasoning_only_share": 0.021}
    run.report("capacity").write_text(json.dumps(capacity_report))
    html = client.get(f"/runs/{RUN}/fleet").text
    assert 'id="autotune"' in html and "Chosen: <b>mamba pool x2</b>" in html
    assert "skipped: fails smoke: no parsed tool call" in html and "1,836" in html
    assert "6.2% of the output tokens lie past it" in html and "save 7.1%" in html
    assert "2.1% left reasoning-only" in html


def test_a_run_without_a_folder_is_a_row_and_its_tabs_show_airflows_state(root):
    WHY = "ConfigError: Param model_source_dir: /nowhere does not exist; give the model directory"
    """A queued run and one that failed at stage_weights have no run folder: the list must not break (it once
    answered Internal Server Error) and the tabs show the state and the failed task instead of a bare 404."""

    class TwoMore(Airflow):
        def runs(self):
            return [{"run_id": "manual__queued", "state": "queued", "start": None, "end": None},
                    {"run_id": "manual__early", "state": "failed", "start": 900.0, "end": 910.0,
                     "failed_at": "stage_weights", "error": WHY}] + super().runs()

        def run(self, run_id):
            if run_id == "manual__early":
                return {"run_id": run_id, "state": "failed", "start": 900.0, "end": 910.0, "tasks": [
                    {"task_id": "stage_weights", "map_index": -1, "state": "failed", "try_number": 1,
                     "error": WHY},  # the plugin reads it from the task's log
                    {"task_id": "publish", "map_index": -1, "state": "upstream_failed", "try_number": 0}]}
            if run_id == "manual__queued":
                return {"run_id": run_id, "state": "queued", "start": None, "end": None, "tasks": []}
            return super().run(run_id)

    client = TestClient(build_app(root, require_token, TwoMore()), headers={"Authorization": "Bearer good"})
    index = client.get("/")
    assert index.status_code == 200
    rows = index.text.split('id="runs"', 1)[1].split("</table>", 1)[0]
    assert ">manual__queued</a>" in rows and "(queued)" in rows and ">manual__early</a>" in rows
    assert f"failed at <b>stage_weights</b>: {WHY}" in rows
    for page in ("quality", "fleet"):
        early = client.get(f"/runs/manual__early/{page}")
        assert early.status_code == 200 and early.headers["content-type"].startswith("text/html"), page
        assert 'class="badge fail">run failed' in early.text and "<b>stage_weights</b> failed" in early.text
        assert "failed at <b>stage_weights</b> before writing one" in early.text
        assert f"<b>stage_weights</b> failed: {WHY}" in early.text, page
        queued = client.get(f"/runs/manual__queued/{page}")
        assert queued.status_code == 200 and "it is queued" in queued.text
    assert client.get("/runs/manual__unknown/quality").status_code == 404


def test_a_run_on_a_second_served_root_is_shown_and_a_conf_naming_another_root_is_refused(root, tmp_path):
    """Each run is read under the output root its conf named, if the deployment serves that root; a conf naming
    any other path opens nothing."""
    second = tmp_path / "second"
    shutil.copytree(runs_dir(root) / FOLDER, runs_dir(second) / "manual__elsewhere")
    (tmp_path / "outside" / "runs" / "manual__outside" / "reports").mkdir(parents=True)

    class Roots(Airflow):
        def runs(self):  # Airflow.run reads its own run from the first row
            return super().runs() + [{"run_id": "manual__elsewhere", "state": "success", "start": 1.0, "end": 2.0,
                                      "output_root": str(second) + "/"},
                                     {"run_id": "manual__outside", "state": "success", "start": 1.0, "end": 2.0,
                                      "output_root": str(tmp_path / "outside")}]

        def run(self, run_id):
            listed = {r["run_id"]: r for r in self.runs()}
            return {**listed[run_id], "tasks": []} if run_id in listed and run_id != RUN else super().run(run_id)

    client = TestClient(build_app([root, second], require_token, Roots()), headers={"Authorization": "Bearer good"})
    rows = client.get("/").text.split('id="runs"', 1)[1].split("</table>", 1)[0]
    elsewhere = rows.split(">manual__elsewhere</a>", 1)[1].split("</tr>", 1)[0]
    assert '<td class="num">10</td><td class="num">4</td>' in elsewhere  # its counts, read under the second root
    outside = rows.split(">manual__outside</a>", 1)[1].split("</tr>", 1)[0]
    assert "is not served here" in outside and "runs/manual__outside/quality" not in outside
    assert "loss_mask_sum" in client.get("/runs/manual__elsewhere/quality").text
    assert client.get("/runs/manual__elsewhere/quality.json").json()["kept"] == 4
    for path in ("quality", "fleet", "quality.json", "data-docs/index.html"):
        refused = client.get(f"/runs/manual__outside/{path}")
        assert refused.status_code == 403 and "DFLASH_SERVED_ROOTS" in refused.text, path
    assert client.get(f"/runs/{RUN}/quality.json").json()["kept"] == 4


def test_while_the_run_goes_on_its_failures_read_as_so_far_not_as_a_verdict(root):
    """A failed shard of a running run is cleared and finishes; the verdict task and the tasks that merely wait
    must not read as final."""

    class Running(Airflow):
        def run(self, run_id):
            run = super().run(run_id)
            run["tasks"] += [{"task_id": "check_published", "map_index": -1, "state": "failed", "try_number": 1},
                             {"task_id": "stop_fleet", "map_index": -1, "state": None, "try_number": 0},
                             {"task_id": "generate", "map_index": 2, "state": "running", "try_number": 1}]
            return run

    client = TestClient(build_app(root, require_token, Running("running", failed={"generate[0]"})),
                        headers={"Authorization": "Bearer good"})
    html = client.get(f"/runs/{RUN}/fleet").text
    assert "<b>generate[0]</b> failed" in html and "Failed so far" in html
    assert "<b>check_published</b>" not in html
    held = html.split("held back by the failures above", 1)[1].split("</p>", 1)[0]
    assert "validate, publish" in held and "stop_fleet" not in held
    done = TestClient(build_app(root, require_token, Running("failed", failed={"generate[0]"})),
                      headers={"Authorization": "Bearer good"}).get(f"/runs/{RUN}/fleet").text
    assert "<b>check_published</b> failed" in done and "not run: validate, publish, stop_fleet" in done


def test_a_run_the_operator_stopped_says_who_stopped_it_not_that_the_hardware_failed(root):
    class Stopped(Airflow):
        def run(self, run_id):
            run = super().run(run_id)
            for t in run["tasks"]:
                t["end"] = 1090.0 if t["task_id"] == "generate" and t["map_index"] == 1 else 1000.0
            return {**run, "stopped": {"by": "alice", "at": 1080.0}}

    client = TestClient(build_app(root, require_token, Stopped("failed", failed={"generate[0]", "generate[1]"})),
                        headers={"Authorization": "Bearer good"})
    html = client.get(f"/runs/{RUN}/fleet").text
    assert "Stopped by <b>alice</b>" in html and "marked failed by hand" not in html
    failures = html.split('id="failures"', 1)[1].split("</ul>", 1)[0]
    one = failures.split("<b>generate[1]</b>", 1)[1].split("</li>", 1)[0]
    assert "stopped with the run by alice" in one  # ended after the stop: the stop ended it
    zero = failures.split("<b>generate[0]</b>", 1)[1].split("</li>", 1)[0]
    assert "server 2 stopped answering" in zero  # failed before the stop: its own cause stays


def test_a_relaunch_keeps_the_history_the_dead_gpu_its_incident_and_each_shards_servers(root):
    """After a kill, a clear relaunches the fleet (its unhealthy markers cleared) and health_check passes again:
    the incident, the GPU that died and the servers each shard ran on must all still be shown."""
    import os

    from dflash_regen.fleet.servers import Server, mark_unhealthy

    run = RunLayout.of(root, FOLDER)
    dead = Server(index=2, gpu="2", host="127.0.0.1", port=30002, argv=[], log_path="")
    mark_unhealthy(run.fleet_dir, dead, "the server process was killed by SIGKILL\nlast lines: ...")
    for marker in run.fleet.launch_markers():  # what a relaunch clears
        marker.unlink()
    health = json.loads(run.report("health").read_text())
    health["servers"].append({**health["servers"][0], "server": "server 2 (GPU 2, 127.0.0.1:30002)"})
    run.report("health").write_text(json.dumps(health))
    later = time.time() + 60
    os.utime(run.report("health"), (later, later))  # the health check of the relaunched fleet came after

    client = TestClient(build_app(root, require_token), headers={"Authorization": "Bearer good"})
    report = client.get(f"/runs/{RUN}/fleet.json").json()
    assert any(i["kind"] == "server unhealthy" and "SIGKILL" in i["text"] for i in report["incidents"])
    html = client.get(f"/runs/{RUN}/fleet").text
    row = server_row(html, "server 2")
    assert "was marked unhealthy" in row and "SIGKILL" in row and "health check passed" in row
    shards = html.split('id="shards"', 1)[1].split("</table>", 1)[0]
    assert "server 2 &rarr; server 0" in shards  # shard 0's first try and its retry

    os.utime(run.report("health"), (later - 7200, later - 7200))  # no health check since the marking
    row = server_row(client.get(f"/runs/{RUN}/fleet").text, "server 2")
    assert 'class="badge fail">unhealthy' in row and "marked unhealthy" in row


def server_row(html: str, server: str) -> str:
    table = html.split('id="servers"', 1)[1].split("</table>", 1)[0]
    return next(r for r in table.split("<tr>") if f'title="{server} (' in r)


def test_the_rate_and_eta_come_from_checkpointed_answers_and_hold_steady(root):
    """The rate is this run's prompts done over the time the fleet worked since its first checkpointed answer:
    the wait for the first answers does not count, answers another run made (the store's) are ignored, it names
    the slow server, gives a clock time, and a finished run keeps its final rate as time passes."""
    run = RunLayout.of(root, FOLDER).run_dir
    RunLayout(run).report("plan").write_text(json.dumps({"rows": 400, "accepted": 400}))
    started = 1000.0
    answers = {"server 0 (GPU 0)": (np.arange(1001.0, 1101.0), np.full(100, 200.0)),  # 1 answer/s, 200 tok/s
               "server 1 (GPU 1)": (np.arange(1001.0, 1101.0, 2.0), np.full(50, 200.0)),  # half as fast
               "server 2 (GPU 2)": (np.array([100.0, 101.0]), np.array([5.0, 5.0]))}  # before this run started
    rows = [{"shard": 0, "state": "running", "done": 160, "history": [{"started_at": started, "done_before": 0}]}]
    running = {"state": "running"}
    p = progress(run, rows, running, None, answers, now=1100.0)
    rate = 160 / 99  # done (150 on disk, 10 more in memory), over the time since the first answer (1001 s)
    assert p["rate_per_s"] == pytest.approx(rate) and p["work_s"] == pytest.approx(99.0)
    assert p["eta_s"] == pytest.approx(240 / rate) and p["eta_at"] == pytest.approx(1100.0 + 240 / rate)
    assert [s["server"] for s in p["servers"] if s["slow"]] == ["server 1 (GPU 1)"]
    assert "server 2 (GPU 2)" not in [s["server"] for s in p["servers"]]
    # Heartbeats alone (nothing checkpointed yet): no rate, no ETA from it.
    assert progress(run, rows, running, None, {}, now=1100.0)["rate_per_s"] is None
    # The first answers came 30 s after the shard started (the requests in flight took that long): the wait before
    # them does not count, or the first checkpoints would read a rate far below the one the run goes on at.
    late = {name: (f + 30.0 * (f > started), t) for name, (f, t) in answers.items()}
    assert progress(run, rows, running, None, late, now=1130.0)["rate_per_s"] == pytest.approx(rate)
    # Finished: the rate is over the time it worked, not over the time since.
    done = {"state": "success"}
    assert progress(run, rows, done, None, answers, now=9999.0)["rate_per_s"] == pytest.approx(rate)


def test_a_user_allowed_to_change_runs_drains_a_running_run_from_the_fleet_page(root):
    class User:
        def get_name(self):
            return "alice"

    def signed_in(authorization: str | None = Header(None)):
        require_token(authorization)
        return User()

    refused = []

    def may_change_runs(authorization: str | None = Header(None)):
        if refused:
            raise HTTPException(403, "not allowed")

    def client(state, may_drain=may_change_runs):
        return TestClient(build_app(root, signed_in, Airflow(state), may_drain),
                          headers={"Authorization": "Bearer good"}, follow_redirects=False)

    running = client("running")
    assert 'id="drain"' in running.get(f"/runs/{RUN}/fleet").text
    refused.append(True)
    assert running.post(f"/runs/{RUN}/drain").status_code == 403  # Airflow's own permission check says no
    refused.clear()
    assert client("success").post(f"/runs/{RUN}/drain").status_code == 409  # nothing to drain
    assert not RunLayout.of(root, FOLDER).drain_request.exists()
    without = client("running", may_drain=None)
    assert 'id="drain"' not in without.get(f"/runs/{RUN}/fleet").text
    assert without.post(f"/runs/{RUN}/drain").status_code == 403

    answer = running.post(f"/runs/{RUN}/drain")
    assert answer.status_code == 303 and answer.headers["location"] == "fleet"
    assert json.loads(RunLayout.of(root, FOLDER).drain_request.read_text())["by"] == "alice"
    page = running.get(f"/runs/{RUN}/fleet").text
    assert "<b>Draining</b>, asked by <b>alice</b>" in page and 'id="drain"' not in page
