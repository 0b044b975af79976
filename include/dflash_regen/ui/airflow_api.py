"""Airflow's record of the DAG's runs, read through Airflow's public REST API (/api/v2) as the pages take it.

The run folder cannot tell a run the operator marked failed, a task killed before it wrote anything, or Airflow's
run id and dates; Airflow can. Airflow 3's public interface for that is its REST API (and `airflow.sdk` for task
code); its ORM models are internal and move between releases (3.4 dropped `airflow.models.taskinstancehistory`),
so the plugin asks the REST API, as any client would, with GET requests only: those are never written to the
audit log, where a POST to a `/list` endpoint would add a row per page view.

What a page view costs (each a GET of at most `PAGE` rows): the run, its task instances changed since the last
view (all of them once, then only those Airflow updated since, with `OVERLAP_S` of margin for a transaction
that committed late), the newest "mark failed" event, and the first task's tries when it was cleared. The runs
list: the newest `RUNS_LISTED` runs, the first task of each, and the failed task instances. A failed task's
first error line comes from its log (Airflow's own reader: a local file or the worker's log server) and is
kept, as a finished try's log does not change; at most `LINES_PER_VIEW` logs are read per view.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import httpx

from dflash_regen.ui.runs import first_failed

log = logging.getLogger(__name__)
API = "/api/v2"
PAGE = 100  # rows per request: the REST API's default `[api] maximum_page_limit`
RUNS_LISTED = 200
LINES_PER_VIEW = 20  # failed tasks whose log a page view may read (each once: a finished try's log does not change)
OVERLAP_S = 300.0  # a task instance updated this long before the last read is read again (late commits)
KEPT_RUNS = 20  # runs whose task instances are kept between views


def _ts(value: str | None) -> float | None:
    return datetime.fromisoformat(value).timestamp() if value else None


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat()


def _earliest(*stamps: float | None) -> float | None:
    return min((t for t in stamps if t is not None), default=None)


def _run(row: dict) -> dict:
    """A run as the pages take it; `output_root` is the root its conf named (None: the deployment's default)."""
    return {"run_id": row["dag_run_id"], "state": row["state"], "start": _ts(row["start_date"]),
            "end": _ts(row["end_date"]), "run_after": _ts(row["run_after"]),
            "output_root": (row.get("conf") or {}).get("output_root")}


def _task(row: dict) -> dict:
    return {"task_id": row["task_id"], "map_index": row["map_index"], "state": row["state"],
            "try_number": row["try_number"], "start": _ts(row["start_date"]), "end": _ts(row["end_date"])}


def _stopped(event: dict | None) -> dict | None:
    """Who marked the run failed and when, from Airflow's audit log (the UI's "Mark run as failed" and the REST
    API's PATCH of the run both log a patch_dag_run event); None if the last change of its state was not that."""
    if event is None:
        return None
    try:
        state = json.loads(event.get("extra") or "{}").get("state")
    except ValueError:
        return None
    return {"by": event.get("owner"), "at": _ts(event["when"])} if state == "failed" else None


def error_line(messages: list) -> str:
    """The first line of the exception a task's log records (Airflow's error_detail), else of the line
    `tasks.log_reason` ends a failed task's log with ("<task> failed: <first line>")."""
    reason = ""
    for entry in messages:
        if not isinstance(entry, dict):
            continue
        for error in entry.get("error_detail") or []:
            value = (str(error.get("exc_value") or "").strip().splitlines() or [""])[0]
            kind = str(error.get("exc_type") or "")
            # fail_fast re-raises the library's error as AirflowFailException("<Type>: <message>")
            return value if kind.startswith("Airflow") or not value else f"{kind}: {value}"
        event = str(entry.get("event") or "")
        if " failed: " in event and entry.get("level") == "error":
            reason = event.split(" failed: ", 1)[1]
    return reason


class AirflowApi:
    """The DAG's runs and task instances as plain dicts (what `ui/app.py` expects of `airflow`), from `client`:
    an httpx client whose base URL is the api-server and whose auth Airflow accepts (plugins/dflash_regen_ui.py)."""

    def __init__(self, client: httpx.Client, dag_id: str):
        self.client, self.dag_id = client, dag_id
        self._dag = f"{API}/dags/{quote(dag_id, safe='')}"
        self._lines: dict[tuple, str] = {}  # (run_id, task_id, map_index, try) -> a failed try's first error line
        self._tis: dict[str, tuple[float, dict[tuple[str, int], dict]]] = {}  # run_id -> (read at, TIs by key)
        self._roots: tuple[float, list[str]] = (0.0, [])

    # ------------------------------------------------------------------------------------------------- requests
    def _get(self, path: str, **params: Any) -> httpx.Response:
        return self.client.get(path, params={k: v for k, v in params.items() if v is not None})

    def _json(self, path: str, **params: Any) -> dict:
        response = self._get(path, **params)
        response.raise_for_status()
        return response.json()

    def _all(self, path: str, key: str, most: int | None = None, **params: Any) -> list[dict]:
        """Every row of a collection (at most `most`), a page at a time; the server may cap a page below PAGE."""
        rows: list[dict] = []
        while most is None or len(rows) < most:
            page = self._json(path, limit=PAGE, offset=len(rows), **params)
            rows += page[key]
            if not page[key] or len(rows) >= page["total_entries"]:
                break
        return rows[:most]

    def _run_path(self, run_id: str) -> str:
        return f"{self._dag}/dagRuns/{quote(run_id, safe='')}"

    # ------------------------------------------------------------------------------------------------ the reads
    def roots(self) -> list[str]:
        """The DAG's first tasks (no upstream): a run's first try started with one of them."""
        read_at, roots = self._roots
        if time.time() - read_at > 60:
            tasks = self._json(f"{self._dag}/tasks")["tasks"]
            below = {d for t in tasks for d in t.get("downstream_task_ids") or []}
            roots = [t["task_id"] for t in tasks if t["task_id"] not in below]
            self._roots = (time.time(), roots)
        return roots

    def first_try_start(self, run_id: str, root: dict) -> float | None:
        """When a first task cleared since began its first try (its earlier tries are in Airflow's history)."""
        path = f"{self._run_path(run_id)}/taskInstances/{quote(root['task_id'], safe='')}"
        if root["map_index"] >= 0:
            path += f"/{root['map_index']}"
        tries = self._json(f"{path}/tries")["task_instances"]
        return _earliest(*(_ts(t["start_date"]) for t in tries))

    def _first_start(self, run_id: str, roots: list[dict]) -> float | None:
        """A clear resets the run's own start date; the first try of its first task is when it really began."""
        return _earliest(*(self.first_try_start(run_id, r) if r["try_number"] > 1 else r["start"] for r in roots))

    def task_instances(self, run_id: str) -> list[dict]:
        """The run's task instances: all of them once, then only those Airflow changed since the last read."""
        read_at, known = self._tis.pop(run_id, (0.0, {}))
        now = time.time()
        since = _iso(read_at - OVERLAP_S) if known else None
        for row in self._all(f"{self._run_path(run_id)}/taskInstances", "task_instances", updated_at_gte=since):
            known[(row["task_id"], row["map_index"])] = _task(row)
        self._tis[run_id] = (now, known)
        while len(self._tis) > KEPT_RUNS:
            self._tis.pop(next(iter(self._tis)))
        return [dict(t) for t in known.values()]

    def error_line(self, run_id: str, task: dict, budget: list[int]) -> str:
        """A failed task's first error line from its log ('' if none or past this view's `budget`)."""
        key = (run_id, task["task_id"], task["map_index"], task["try_number"])
        if key in self._lines or budget[0] <= 0:
            return self._lines.get(key, "")
        budget[0] -= 1
        try:
            response = self.client.get(
                f"{self._run_path(run_id)}/taskInstances/{quote(key[1], safe='')}/logs/{key[3]}",
                params={"map_index": key[2], "full_content": "true"}, headers={"Accept": "application/json"})
            response.raise_for_status()
            line = error_line(response.json().get("content") or [])
        except (httpx.HTTPError, ValueError) as exc:  # a log that cannot be read must not break the page
            log.warning("no first error line for %s: %s: %s", key, type(exc).__name__, exc)
            return ""
        if line:  # kept once found; a log still being written is read again next time
            if len(self._lines) > 5000:
                self._lines.clear()
            self._lines[key] = line
        return line

    # ---------------------------------------------------------------------------------- what the pages ask for
    def runs(self) -> list[dict]:
        rows = [_run(r) for r in self._all(f"{self._dag}/dagRuns", "dag_runs", RUNS_LISTED, order_by="-run_after")]
        if not rows:
            return []
        oldest = _iso(min(r["run_after"] for r in rows))
        firsts: dict[str, list[dict]] = {}
        for root in self.roots():
            for t in self._all(f"{self._dag}/dagRuns/~/taskInstances", "task_instances", task_id=root,
                               run_after_gte=oldest):
                firsts.setdefault(t["dag_run_id"], []).append(_task(t))
        failed: dict[str, list[dict]] = {}
        for t in self._all(f"{self._dag}/dagRuns/~/taskInstances", "task_instances", state="failed",
                           run_after_gte=oldest):
            failed.setdefault(t["dag_run_id"], []).append(_task(t))
        runs, budget = [], [LINES_PER_VIEW]
        for run in rows:
            where = first_failed(failed.get(run["run_id"], []))  # where it stopped, with its first line
            runs.append({**run, "start": _earliest(run["start"], self._first_start(run["run_id"],
                                                                                    firsts.get(run["run_id"], []))),
                         "failed_at": where and where["task"],
                         "error": where and self.error_line(run["run_id"], where, budget)})
        return runs

    def run(self, run_id: str) -> dict | None:
        if run_id in (".", ".."):  # a dot segment would be resolved away by the URL: another resource's path
            return None
        response = self._get(self._run_path(run_id))
        if response.status_code == 404:
            return None
        response.raise_for_status()
        found = _run(response.json())
        tasks = self.task_instances(run_id)
        events = self._json(f"{API}/eventLogs", dag_id=self.dag_id, run_id=run_id, event="patch_dag_run",
                            order_by="-when", limit=1)["event_logs"]
        roots = set(self.roots())
        budget = [LINES_PER_VIEW]
        for t in tasks:
            # a shard's status file holds its error: its (long) generate log is not read for it
            if t["state"] == "failed" and not t["task_id"].endswith("generate"):
                t["error"] = self.error_line(run_id, t, budget)
        start = _earliest(found["start"], self._first_start(run_id, [t for t in tasks if t["task_id"] in roots]),
                          *(t["start"] for t in tasks))
        return {**found, "start": start, "stopped": _stopped(next(iter(events), None)), "tasks": tasks}
