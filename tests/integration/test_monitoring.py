"""The `monitoring` compose profile on loopback: a real Prometheus (Debian's package, as the profile's image
version) with deploy/monitoring/prometheus.yml's jobs scrapes an emulated fleet launched by the pipeline's launcher
and the pipeline's /metrics app (ui/metrics.py, mounted at its plugin prefix, behind its token) while the real
generate code runs a shard; then the expected series, and every panel query of the provisioned Grafana dashboards
(the SGLang fleet's and the pipeline's), come back with data through Prometheus' HTTP query API. The fleet emulates
the newest supported SGLang, whose counters and latency histograms carry `is_streaming` (docs/sglang-versions.md).

Grafana is not in Debian's archive: its template variables are resolved as it resolves them (a
`label_values(...)` variable from Prometheus' label API; `$__rate_interval` from the scrape interval), and the
queries run as its range queries.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import uvicorn
import yaml
from conftest import FAST_PROFILE, free_port_block
from fastapi import FastAPI

from dflash_regen import tasks
from dflash_regen.demo.model import write_demo_model
from dflash_regen.demo.prompts import write_demo_prompts
from dflash_regen.fleet.servers import launch_fleet, stop_fleet
from dflash_regen.layout import COMPLETIONS, RunLayout
from dflash_regen.settings.run_config import DEFAULTS, RunConfig
from dflash_regen.sglang.api import NEWEST_CHECKED
from dflash_regen.ui.metrics import URL_PREFIX, build_metrics_app, pipeline_metrics

# One worker holds the module's fleet and Prometheus.
pytestmark = pytest.mark.xdist_group("monitoring")

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
RUN_ID = "monitoring_run"
TOKEN = "test-metrics-token"
SCRAPE_S = 1
# Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval); a few scrapes more here,
# so two shards generated at once on a busy machine still finish inside one window (and a late scrape is no gap).
RATE_INTERVAL = f"{30 * SCRAPE_S}s"
DEADLINE_S = 90  # for series to appear: generous, it is only reached when something is broken


@dataclass
class Monitored:
    prometheus: str  # its URL
    pipeline: str  # the pipeline's /metrics URL
    started: float  # before the fleet started: every range query starts here
    generated: list[dict]  # generate's result for each shard it ran
    plan: dict  # reports/plan.json
    output_root: Path


def _wait(what: str, check, proc: subprocess.Popen | None = None, log: Path | None = None):
    """Poll `check()` until it returns something truthy; fail naming `what` (and the log's tail) at the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    tail = (lambda: log.read_text()[-2000:]) if log else (lambda: "")
    while True:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: the process exited ({proc.returncode}): {tail()}")
        try:
            found = check()
        except requests.RequestException:
            found = None
        if found:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not seen within {DEADLINE_S} s; {tail()}")
        time.sleep(0.2)


def query(prometheus: str, promql: str) -> list[dict]:
    body = requests.get(f"{prometheus}/api/v1/query", params={"query": promql}, timeout=30).json()
    assert body["status"] == "success", (promql, body)
    return body["data"]["result"]


def query_range(prometheus: str, promql: str, start: float) -> list[dict]:
    body = requests.get(f"{prometheus}/api/v1/query_range", timeout=30,
                        params={"query": promql, "start": start, "end": time.time(), "step": SCRAPE_S}).json()
    assert body["status"] == "success", (promql, body)
    return body["data"]["result"]


def value(prometheus: str, promql: str) -> float | None:
    result = query(prometheus, promql)
    return float(result[0]["value"][1]) if len(result) == 1 else None


def prometheus_config(tmp: Path, sglang: list[str], pipeline: str) -> Path:
    """The committed config, pointed at this test's ports, its token file and a short scrape interval."""
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = f"{SCRAPE_S}s"
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["sglang"]["static_configs"] = [{"targets": sglang}]
    jobs["dflash-regen"]["static_configs"] = [{"targets": [pipeline]}]
    token = tmp / "token"
    token.write_text(TOKEN)
    jobs["dflash-regen"]["authorization"]["credentials_file"] = str(token)
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def monitored(tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus is missing: bash scripts/install-test-packages.sh (scripts/test.sh runs it)"
    tmp = tmp_path_factory.mktemp("monitoring")
    started = time.time()
    params = {**DEFAULTS, "model_source_dir": "demo", "staging_dir": str(tmp / "model"), "server_command": "emulator",
              "num_servers": 2, "base_port": free_port_block(2), "output_root": str(tmp / "out"),
              "ready_timeout_s": 60.0, "autotune": "off", "emulator_faults": {}, "shard_size": 14,
              # the demo prompts hold two rows planning quarantines (a duplicate id, a bad role)
              "prompt_source": str(write_demo_prompts(tmp / "prompts.jsonl", 40)), "max_bad_row_share": 0.1,
              # the newest supported SGLang: its series are split by is_streaming, and `generate` streams every
              # request, so the non-streaming series stay idle (the dashboards' means must sum before dividing);
              # the contract tests check the dashboards' names against the oldest version's too
              "emulator_profile": {**FAST_PROFILE, "sglang_version": NEWEST_CHECKED}}
    cfg = RunConfig.from_params(params, RUN_ID)
    servers = launch_fleet(cfg.fleet, write_demo_model(tmp / "model"), cfg.fleet_dir)
    app = FastAPI()  # as the Airflow plugin mounts it in the api-server
    app.mount(URL_PREFIX, build_metrics_app([Path(params["output_root"])], TOKEN))
    port = free_port_block(2)
    http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    proc = None
    try:
        thread.start()
        log = tmp / "prometheus.log"
        config = prometheus_config(tmp, [f"127.0.0.1:{s.port}" for s in servers], f"127.0.0.1:{port}")
        prometheus = f"http://127.0.0.1:{port + 1}"
        with open(log, "w") as out:
            proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                                     f"--web.listen-address=127.0.0.1:{port + 1}"],
                                    stdout=out, stderr=subprocess.STDOUT)
        _wait("Prometheus ready", lambda: requests.get(f"{prometheus}/-/ready", timeout=5).ok, proc=proc, log=log)
        # Every target scraped before any work: the rates and latency histograms then see the shards' requests.
        _wait("all three targets up", lambda: len(query(prometheus, "up == 1")) == 3, proc=proc, log=log)
        # The DAG's own task bodies: plan three shards (reports/plan.json, the shards), generate two at once, one
        # per server.
        shards = tasks.plan_shards(params, RUN_ID)
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda shard: tasks.generate(params, RUN_ID, shard), shards[:2]))
        plan = json.loads(cfg.layout.report("plan").read_text())
        yield Monitored(prometheus, f"http://127.0.0.1:{port}{URL_PREFIX}/metrics", started, results, plan,
                        Path(params["output_root"]))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        http.should_exit = True
        thread.join(timeout=30)
        stop_fleet(cfg.fleet_dir)


def test_the_pipelines_metrics_answer_only_its_token(monitored):
    assert requests.get(monitored.pipeline, timeout=30).status_code == 401
    assert requests.get(monitored.pipeline, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    ok = requests.get(monitored.pipeline, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert ok.status_code == 200 and ok.headers["content-type"].startswith("text/plain; version=0.0.4")
    closed = FastAPI()
    closed.mount(URL_PREFIX, build_metrics_app([Path("/nonexistent")], ""))  # no token set: nothing exported
    from fastapi.testclient import TestClient

    refused = TestClient(closed).get(f"{URL_PREFIX}/metrics", headers={"Authorization": "Bearer "})
    assert refused.status_code == 403 and "DFLASH_METRICS_TOKEN" in refused.json()["detail"]


def test_prometheus_returns_the_pipelines_and_the_fleets_series(monitored):
    prometheus, run = monitored.prometheus, f'run_id="{RUN_ID}"'
    done = sum(r["completed"] + r["quarantined"] for r in monitored.generated)
    assert done == 28
    def shards() -> dict[str, float]:
        return {r["metric"]["state"]: float(r["value"][1]) for r in query(prometheus, f"dflash_regen_shards{{{run}}}")}

    # the first scrape after both shards wrote their last status: the series then hold what the run folder says
    # (a scrape between a shard's last answer and its status "done" counts its prompts with the shard running)
    _wait("prompts and shards done", lambda: value(prometheus, f"dflash_regen_prompts_done{{{run}}}") == done
          and shards() == {"done": 2, "waiting": 1})
    assert value(prometheus, f"dflash_regen_prompts_planned{{{run}}}") == monitored.plan["accepted"] == 40
    quarantined = {r["metric"]["reason"]: float(r["value"][1])
                   for r in query(prometheus, f'dflash_regen_quarantined{{{run},stage="plan"}}')}
    assert quarantined == monitored.plan["quarantined_by_reason"] and quarantined["duplicate_id"] == 1
    assert value(prometheus, f"dflash_regen_eta_seconds{{{run}}}") > 0  # shard 2 is left
    # the fleet, in the newest version's form: one series per is_streaming value, the streamed one fed by generate
    streaming = {r["metric"].get("is_streaming"): float(r["value"][1])
                 for r in query(prometheus, "sum by (is_streaming) (sglang:num_requests_total)")}
    assert set(streaming) == {"true", "false"} and streaming["true"] > 0
    # each server answered one shard's requests
    for result in monitored.generated:
        assert result["generated_now"] > 0
    per_server = "sum by (instance) (sglang:num_requests_total)"
    _wait("each server's share of the shards' requests in its counter",  # each target is scraped on its own beat
          lambda: sorted(float(r["value"][1]) for r in query(prometheus, per_server))[0]
          >= min(r["generated_now"] for r in monitored.generated))


def template_values(prometheus: str, dashboard: dict) -> dict[str, str]:
    """Each `label_values(...)` variable's first value, from Prometheus' label API as Grafana asks for it, and
    Grafana's built-in interval variables for this scrape interval."""
    found = {"__rate_interval": RATE_INTERVAL, "__interval": f"{SCRAPE_S}s"}
    for variable in dashboard.get("templating", {}).get("list", []):
        m = re.fullmatch(r"label_values\((?:\s*([^,()]+?)\s*,)?\s*(\w+)\s*\)", variable["definition"])
        assert m, f"{dashboard['title']}: variable {variable['name']} is not a label_values() query"
        params = {"match[]": m[1]} if m[1] else {}
        body = requests.get(f"{prometheus}/api/v1/label/{m[2]}/values", params=params, timeout=30).json()
        assert body["status"] == "success" and body["data"], (variable["name"], body)
        found[variable["name"]] = sorted(body["data"])[0]
    return found


def substitute(expr: str, values: dict[str, str]) -> str:
    def one(m: re.Match) -> str:
        name = m[1] or m[2]
        assert name in values, f"{expr}: Grafana variable ${name} is not resolved"
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def has_data(result: list[dict]) -> bool:
    return any(math.isfinite(float(v)) for series in result for _, v in series["values"])


def test_every_panel_query_of_the_provisioned_dashboards_returns_data(monitored):
    dashboards = sorted((MONITORING / "grafana" / "dashboards").rglob("*.json"))
    assert {p.name for p in dashboards} == {"fleet.json", "pipeline.json"}
    queries = []
    for path in dashboards:
        dashboard = json.loads(path.read_text())
        values = template_values(monitored.prometheus, dashboard)
        for panel in dashboard["panels"]:
            assert panel.get("targets"), f"{path.name} '{panel['title']}' has no query"
            queries += [(path.name, panel["title"], substitute(t["expr"], values)) for t in panel["targets"]]
    assert len(queries) >= 20
    empty = []
    deadline = time.monotonic() + DEADLINE_S
    for file, title, promql in queries:
        while not has_data(query_range(monitored.prometheus, promql, monitored.started)):
            if time.monotonic() > deadline:
                empty.append(f"{file} '{title}': {promql.strip()}")
                break
            time.sleep(0.5)
    assert not empty, "panel queries without data:\n" + "\n".join(empty)


def test_a_scrape_reads_a_completion_file_again_only_when_it_changed(monitored):
    """The Fleet page's file cache serves the scrapes: a completion file whose (mtime, size) did not change is not
    read again, so a scrape every few seconds costs the new checkpoint parts only."""
    now = time.time()
    before = pipeline_metrics([monitored.output_root], now=now)
    assert "dflash_regen_eta_seconds{" in before  # from the answers' finish times in the completion files
    saved = {p: (p.read_bytes(), p.stat()) for p in RunLayout.of(monitored.output_root, RUN_ID)
             .result_files(COMPLETIONS)}
    assert saved
    try:
        for path, (data, st) in saved.items():  # unreadable now, with the stamp the cache knows
            path.write_bytes(b"\0" * len(data))
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert pipeline_metrics([monitored.output_root], now=now) == before
    finally:
        for path, (data, st) in saved.items():
            path.write_bytes(data)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
