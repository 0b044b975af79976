"""The pipeline's progress in Prometheus' text format: prompts planned and done, shards by state, quarantined rows
by stage and reason, and the ETA, per run; scraped by the `monitoring` compose profile's Prometheus and drawn by
its Grafana (deploy/monitoring/, docs/be-told-and-watch.md).

The figures are the Fleet page's own (ui/progress.py: `shards` and `progress`), from the same small files: the
plan and quality reports, each shard's status file, parquet footers, and the answers' finish times, each read
again only when its file changed (ui/files.py's cache, shared with the pages in the api-server), so a scrape
does not re-read a run's completions.

Cardinality stays small: the newest `MAX_RUNS` runs, labelled by `run_id`; shard states are Airflow's task states
or a status file's; quarantine reasons are short keys (duplicate_id, too_long, http_400, ...).

`build_metrics_app` is mounted by the Airflow plugin (plugins/dflash_regen_ui.py) beside the pages, as its own app:
the pages require an Airflow login, which Prometheus cannot keep (Airflow's tokens expire); it sends instead a
bearer token the deployment sets once (DFLASH_METRICS_TOKEN in .env). Without a token nothing is exported.
"""

from __future__ import annotations

import hmac
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from fastapi import FastAPI, Header, HTTPException
from fastapi.responses import PlainTextResponse

from dflash_regen.errors import RunNotFound
from dflash_regen.layout import FAILURES, RunLayout, runs_dir
from dflash_regen.ui.files import read_column, read_json
from dflash_regen.ui.progress import run_progress
from dflash_regen.ui.runs import resolve_run, run_root

MAX_RUNS = 5
URL_PREFIX = "/dflash-metrics"  # where the plugin mounts the app: GET /dflash-metrics/metrics
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FAMILIES = {  # name: (type, help)
    "dflash_regen_prompts_planned": ("gauge", "Prompts this run generates (accepted by plan_shards, less those "
                                              "the completion store supplied)."),
    "dflash_regen_prompts_done": ("gauge", "Prompts of this run done: answered or quarantined by generate."),
    "dflash_regen_shards": ("gauge", "Shards by state (Airflow's task state, else the shard's status file)."),
    "dflash_regen_quarantined": ("gauge", "Input rows quarantined, by stage (plan, generate, gate) and reason."),
    "dflash_regen_eta_seconds": ("gauge", "Seconds until the run's prompts are all done, as the Fleet page "
                                          "predicts it (absent while unknown)."),
}


def _label(value) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _runs(roots: Sequence[Path], airflow) -> list[tuple[Path, dict | None]]:
    """The newest MAX_RUNS runs with a folder, with Airflow's record of each (None without Airflow)."""
    found: list[tuple[Path, dict | None]] = []
    if airflow is not None:
        for known in airflow.runs()[:MAX_RUNS]:
            root = run_root(list(roots), known)
            try:
                folder = resolve_run(root, known["run_id"]) if root is not None else None
            except RunNotFound:  # no folder yet: nothing to export
                folder = None
            if folder is not None:
                found.append((folder, airflow.run(known["run_id"])))
        return found
    folders = [p for root in roots for p in runs_dir(root).glob("*") if p.is_dir()]
    return [(p, None) for p in sorted(folders, key=lambda p: p.stat().st_mtime, reverse=True)[:MAX_RUNS]]


def run_samples(run: Path, airflow_run: dict | None = None, now: float | None = None) -> list[tuple[str, dict, float]]:
    """(metric, labels, value) of one run."""
    now = time.time() if now is None else now
    layout = RunLayout(run)
    rows, progressed = run_progress(run, airflow_run, now)
    run_id = (airflow_run or {}).get("run_id", run.name)
    out: list[tuple[str, dict, float]] = []
    if progressed["planned"] is not None:
        out.append(("dflash_regen_prompts_planned", {"run_id": run_id}, progressed["planned"]))
    out.append(("dflash_regen_prompts_done", {"run_id": run_id}, progressed["done"]))
    for state, n in sorted(Counter(r["state"] for r in rows).items()):
        out.append(("dflash_regen_shards", {"run_id": run_id, "state": state}, n))
    quarantined = {("plan", reason): n for reason, n in
                   ((read_json(layout.report("plan")) or {}).get("quarantined_by_reason") or {}).items()}
    quarantined.update({("generate", reason): n for reason, n in
                        Counter(read_column(layout.result_files(FAILURES), "reason")).items()})
    quarantined.update({("gate", reason): n for reason, n in
                        ((read_json(layout.report("quality")) or {}).get("quarantined_by_reason") or {}).items()})
    for (stage, reason), n in sorted(quarantined.items()):
        out.append(("dflash_regen_quarantined", {"run_id": run_id, "stage": stage, "reason": reason}, n))
    if progressed["eta_s"] is not None:
        out.append(("dflash_regen_eta_seconds", {"run_id": run_id}, progressed["eta_s"]))
    return out


def pipeline_metrics(roots: Sequence[Path], airflow=None, now: float | None = None) -> str:
    """Prometheus text of the newest runs under `roots` (`airflow`: the pages' read-only view, or None)."""
    samples = [s for run, known in _runs(roots, airflow) for s in run_samples(run, known, now)]
    lines = []
    for name, (kind, help_text) in FAMILIES.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for metric, labels, value in samples:
            if metric == name:
                text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
                lines.append(f"{name}{{{text}}} {float(value)}")
    return "\n".join(lines) + "\n"


def build_metrics_app(roots: Sequence[Path], token: str, airflow=None) -> FastAPI:
    """`GET /metrics`, answered only to `Authorization: Bearer <token>`; every request is refused while `token`
    is empty."""
    roots = [Path(r) for r in roots]
    app = FastAPI(title="dflash-regen metrics", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics")
    def metrics(authorization: str = Header(default="")):
        if not token:
            raise HTTPException(403, "the pipeline's metrics are not exported: set DFLASH_METRICS_TOKEN for the "
                                     "api-server (and the same token in Prometheus' scrape job)")
        if not hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, "send the api-server's DFLASH_METRICS_TOKEN as 'Authorization: Bearer <token>'",
                                headers={"WWW-Authenticate": "Bearer"})
        return PlainTextResponse(pipeline_metrics(roots, airflow), media_type=CONTENT_TYPE)

    return app
