"""The report pages over a hand-made run folder: what they show, what they refuse, and that they need auth."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi import Header, HTTPException
from fastapi.testclient import TestClient

from dflash_regen import charts, run_report
from dflash_regen.report_pages import build_app, offline_html

RUN = "manual__2026-12-03T10:00:00+00:00"
FOLDER = "manual__2026-12-03T10_00_00_00_00"


def write_parquet(path, columns: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)


@pytest.fixture
def root(tmp_path):
    run = tmp_path / "out" / "runs" / FOLDER
    reports = run / "reports"
    reports.mkdir(parents=True)
    (reports / "plan.json").write_text(json.dumps({"rows": 10, "accepted": 9}))
    (reports / "quality.json").write_text(json.dumps({
        "success": False, "samples": 8, "kept": 4, "settings": {"empty_mask_tokens": 6}, "statistics": {},
        "expectations": [
            {"expectation": "expect_column_values_to_be_between", "success": False, "error": None,
             "kwargs": {"column": "loss_mask_sum", "min_value": 7, "mostly": 0.98}, "observed": "4 unexpected"},
            {"expectation": "expect_table_row_count_to_equal", "success": True, "error": None,
             "kwargs": {"value": 8}, "observed": 8}]}))
    (reports / "health.json").write_text(json.dumps({"passed": True, "servers": [
        {"server": "server 0 (GPU 0, 127.0.0.1:30000)", "healthy": True, "binding": "Mamba slots (80 // 5 = 16)",
         "allocation": {"kv_tokens": 1139584, "mamba_slots": 80, "running_slots": 16}, "problems": []}]}))
    (reports / "smoke.json").write_text(json.dumps({"passed": True, "max_tokens": 16384, "servers": [
        {"server": "server 0 (GPU 0, 127.0.0.1:30000)", "ok": True, "results": [
            {"prompt": "coding", "ok": True, "finish_reason": "stop", "tokens_per_s": 150.0, "problem": ""}]}]}))
    (reports / "capacity.json").write_text(json.dumps({
        "binding": {"resource": "Mamba slots", "detail": "80 Mamba slots // 5 = 16 running requests"},
        "advice": {"server_flags": "--max-mamba-cache-size 160 --max-running-requests 32",
                   "concurrency_per_server_advised": 36, "notes": []},
        "table": [{"fleet tok/s": "10,280", "settings": "current"}, {"fleet tok/s": "11,809", "settings": "advised"}]}))
    write_parquet(run / "tokenized" / "summary-00000.parquet",
                  {"loss_mask_sum": [6, 6, 6, 6, 900, 1200, 1500, 2000]})
    write_parquet(run / "failures" / "plan.parquet", {"sample_id": ["a"], "reason": ["bad_role"]})
    write_parquet(run / "failures" / "shard-00000.parquet", {"sample_id": ["b"], "reason": ["http_400"]})
    write_parquet(run / "quality" / "quarantine.parquet",
                  {"sample_id": ["c", "d", "e", "f"], "reason": ["empty_answer_mask"] * 4})
    rows = {"sample_id": [f"s{i}" for i in range(8)], "server": ["server 0 <b>"] * 8,
            "finished_at": [1000.0 + i for i in range(8)], "completion_tokens": [100] * 8}
    write_parquet(run / "completions" / "shard-00000.parquet", rows)
    write_parquet(run / "completions" / "shard-00000" / "part-1.parquet", rows)  # same rows: not counted twice
    docs = reports / "data_docs"
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


def test_fleet_page_shows_allocation_smoke_and_progress_without_double_counting_parts(client):
    report = client.get(f"/runs/{RUN}/fleet.json").json()
    progress = report["progress"]
    assert progress["planned"] == 9 and progress["done"] == 8 + 1  # completions + a sample the server refused
    assert progress["rate_per_s"] == pytest.approx(1.0)
    assert progress["eta_s"] == pytest.approx(0.0)  # nothing left
    html = client.get(f"/runs/{RUN}/fleet").text
    assert "1,139,584" in html and "Mamba slots (80 // 5 = 16)" in html and "coding" in html
    assert "server 0 <b>" not in html and "server 0 &lt;b&gt;" in html  # names are escaped
    assert "<b>Mamba slots</b>" in html and "--max-mamba-cache-size 160 --max-running-requests 32" in html
    assert html.index("<th>settings</th>") < html.index("<th>fleet tok/s</th>") and "11,809" in html


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


def test_offline_html_strips_remote_tags_but_keeps_local_ones():
    html = ('<html><head><link rel="icon" href="./static/x.ico"/><link href="//cdn.example/x.css">'
            '<script src="https://cdn.example/v.js"></script></head><body><img src="https://x/logo.png">hi</body>')
    out = offline_html(html)
    assert "./static/x.ico" in out and "cdn.example" not in out and "logo.png" not in out and "hi" in out


def test_histogram_keeps_the_6_token_spike_in_its_own_bin():
    values = [6] * 50 + [5] + list(range(7, 4000, 10))
    assert next(b for b in run_report.histogram(values) if b["start"] <= 6 <= b["end"])["count"] > 51  # blended
    bins = run_report.histogram(values, bins=40, split_at=6)
    assert bins[0] == {"start": 5, "end": 6, "count": 51}
    assert all(b["start"] > 6 for b in bins[1:]) and sum(b["count"] for b in bins) == len(values)
    svg = charts.histogram(bins, highlight_at_or_below=6, x_title="mask")
    assert svg.count('class="bar bad"') == 1


def test_time_series_escapes_names_and_draws_one_line_per_server():
    svg = charts.time_series({"<a>": [1, 2, 3], "b": [3, 2, 1]}, bin_s=5, x_title="t", y_title="tok/s")
    assert svg.count("<polyline") == 2 and "<a>" not in svg and "&lt;a&gt;" in svg
