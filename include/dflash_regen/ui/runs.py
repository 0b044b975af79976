"""The runs list and one run's state: from Airflow when it knows the run, else what the run folder alone says."""

from __future__ import annotations

import os
import time
from pathlib import Path

from dflash_regen.errors import RunNotFound
from dflash_regen.layout import RunLayout, runs_dir
from dflash_regen.settings.run_config import safe_run_id
from dflash_regen.ui.files import node_assignment, read_json, shard_statuses

# Tasks in pipeline order: where a failed run stopped, what never ran.
PIPELINE = ("stage_weights", "launch_fleet", "health_check", "smoke_test", "plan_shards", "calibrate", "generate",
            "tokenize", "validate", "publish", "stop_fleet")
# The run's verdict (a teardown): it fails whenever nothing was published, so it says nothing while the run goes on.
VERDICT = "check_published"
RUNNING_STATES = {"running", "queued", "scheduled", "up_for_retry", "up_for_reschedule", "restarting", "deferred"}


def resolve_run(output_root: Path, run_id: str) -> Path:
    """The run folder for an Airflow run id; never a path outside `<output_root>/runs/`."""
    runs = runs_dir(output_root).resolve()
    try:
        name = safe_run_id(run_id)
    except ValueError as exc:
        raise RunNotFound(str(exc)) from exc
    candidate = (runs / name).resolve()
    if candidate.parent != runs or not candidate.is_dir():
        raise RunNotFound(f"no run {run_id!r} under {runs}")
    return candidate


def _ti_label(t: dict) -> str:
    return t["task_id"] + (f"[{t['map_index']}]" if t["map_index"] >= 0 else "")


def _pipeline_order(t: dict) -> tuple[int, int]:
    return PIPELINE.index(t["task_id"]) if t["task_id"] in PIPELINE else 99, t["map_index"]


def first_failed(tasks: list[dict]) -> dict | None:
    """Where a run stopped: its failed task earliest in pipeline order (`task` its label), the verdict only when
    nothing else failed; None if none failed."""
    ordered = sorted(tasks, key=lambda t: (t["task_id"] == VERDICT, *_pipeline_order(t)))
    return {**ordered[0], "task": _ti_label(ordered[0])} if ordered else None


def first_line(text) -> str:
    return (str(text or "").strip().splitlines() or [""])[0]


def run_state(run: Path | None, airflow_run: dict | None) -> dict:
    """The run's state, dates, failed tasks with their first error line where the folder has it, and where it
    stopped; from Airflow when it knows the run, else what the folder alone can tell. `run` is None for a run
    that has no folder yet (queued, or failed before it wrote one): Airflow's state alone."""
    errors, statuses = (_folder_errors(run), shard_statuses(run)) if run else ({}, {})
    if airflow_run is None:
        return {"known": False, "state": None, "start": None, "end": None, "duration_s": None, "stopped_by": None,
                "failed": [],
                "stopped_at": None, "not_run": [], "running": []}
    tasks = sorted(airflow_run.get("tasks", []), key=_pipeline_order)
    state = airflow_run.get("state")
    going = state in RUNNING_STATES  # a running run's failures can still be cleared: nothing here is final yet
    stopped = airflow_run.get("stopped") if state == "failed" else None  # {by, at}: marked failed by a user
    failed = []
    for t in tasks:
        if t["state"] != "failed" or (going and t["task_id"] == VERDICT):
            continue
        # the folder's reports, else the first line Airflow's log of the task holds (the plugin reads it)
        error = errors.get(t["task_id"]) or t.get("error") or ""
        if run and (t["task_id"] == "generate" or t["task_id"].endswith(".generate")):
            shard = next((n for n, ti in generate_tis(run, airflow_run).items() if ti is t), t["map_index"])
            attempts = (statuses.get(shard) or {}).get("attempts", [])
            error = next((a.get("error", "") for a in reversed(attempts) if a.get("state") == "failed"),
                         t.get("error") or "")
        if stopped and (t.get("end") or 0) >= stopped["at"]:  # ended by the operator's stop, not by a fault
            error = f"stopped with the run by {stopped['by']}"
        failed.append({"task": _ti_label(t), "task_id": t["task_id"], "map_index": t["map_index"],
                       "try_number": t["try_number"], "error": error})
    not_run = []
    for name in PIPELINE:
        states = {t["state"] for t in tasks if t["task_id"] == name}
        # a task with no state yet is only waiting while the run goes on
        if states and states <= {"upstream_failed", "skipped", "removed"} | (set() if going else {None}):
            not_run.append(name)
    start, end = airflow_run.get("start"), airflow_run.get("end")
    return {"known": True, "run_id": airflow_run["run_id"], "state": state, "start": start, "end": end,
            "duration_s": None if start is None else (end or time.time()) - start,
            "stopped_by": stopped,
            "failed": failed, "stopped_at": failed[0]["task"] if failed else None, "not_run": not_run,
            "running": [_ti_label(t) for t in tasks if t["state"] in {"running", "queued", "up_for_retry"}]}


def _folder_errors(run: Path) -> dict[str, str]:
    """The first error line of each task whose failure the run folder records (the gates' reports)."""
    layout = RunLayout(run)
    errors = {"health_check": first_line((read_json(layout.report("health")) or {}).get("error")),
              "smoke_test": first_line((read_json(layout.report("smoke")) or {}).get("error"))}
    quality = read_json(layout.report("quality"))
    if quality is not None and not quality.get("success"):
        failed = [f"{e['expectation']} {e.get('kwargs', {}).get('column', '')}: observed {e.get('observed')}"
                  for e in quality.get("expectations", []) if not e.get("success")]
        errors["validate"] = "quality gate failed: " + "; ".join(failed)
    return errors


def list_runs(roots: list[Path], airflow_runs: list[dict] | None = None) -> dict:
    """Airflow's runs of the DAG with their folder's counts, each under the output root its conf named (the
    first root when it named none), and the folders no Airflow run matches. A run whose root is not in `roots`
    is listed as refused: its folder is not read."""
    folders = {(root, p.name): p for root in roots for p in runs_dir(root).glob("*") if p.is_dir()}
    rows = []
    for r in airflow_runs or []:
        root = run_root(roots, r)
        folder = folders.pop((root, safe_run_id(r["run_id"])), None) if root else None
        rows.append({**r, "duration_s": None if r.get("start") is None else (r.get("end") or time.time()) - r["start"],
                     "folder": folder is not None, "refused": root is None,
                     **(_run_counts(folder) if folder else NO_COUNTS)})
    orphans = [{"run_id": name, "root": str(root), "modified": p.stat().st_mtime, **_run_counts(p)}
               for (root, name), p in sorted(folders.items(), key=lambda kv: kv[1].stat().st_mtime, reverse=True)]
    return {"airflow": airflow_runs is not None, "runs": rows, "folders": orphans}


def run_root(roots: list[Path], airflow_run: dict) -> Path | None:
    """The output root of a run Airflow knows: the one its conf named, if the deployment serves it (None if not),
    else the default (first) root."""
    named = airflow_run.get("output_root")
    if not named:
        return roots[0]
    root = Path(os.path.normpath(str(named)))
    return root if root in roots else None


# A run with no folder yet (queued, or failed before it wrote one) has no counts: every row has the same keys.
NO_COUNTS = {"prompts": None, "published": None, "quarantined": None, "quality": None, "data_docs": False}


def _run_counts(run: Path) -> dict:
    layout = RunLayout(run)
    plan = read_json(layout.report("plan")) or {}
    quality = read_json(layout.report("quality"))
    return {"prompts": plan.get("rows"), "published": (quality or {}).get("kept"),
            "quarantined": None if quality is None else plan.get("rows", 0) - quality.get("kept", 0),
            "quality": None if quality is None else bool(quality.get("success")),
            "data_docs": layout.data_docs_index.is_file()}


def generate_tis(run: Path, airflow_run: dict | None) -> dict[int, dict]:
    """The generate task instance of each shard: `generate[i]` is shard i; with several nodes,
    `<node>.generate[i]` is the node's i-th assigned shard."""
    assignment, out = node_assignment(run), {}
    for t in (airflow_run or {}).get("tasks", []):
        if t["task_id"] == "generate":
            out[t["map_index"]] = t
        elif t["task_id"].endswith(".generate") and t["map_index"] >= 0:
            mine = assignment.get(t["task_id"].split(".")[0], {}).get("shards", [])
            if t["map_index"] < len(mine):
                out[mine[t["map_index"]]] = t
    return out
