"""Airflow UI pages for dflash-regen: a run's data-quality report (with its GX Data Docs) and its fleet.

The pages are the library's FastAPI app (`dflash_regen.ui.app`), mounted at /dflash. A mounted plugin
app gets no authentication from Airflow, so every route requires Airflow's own `get_user` (the UI's `_token`
cookie or a Bearer token): anonymous requests get 401. Runs are read from the output root each run's conf
named, among the roots the api-server serves (env DFLASH_OUTPUT_ROOT, the form's default, and DFLASH_SERVED_ROOTS);
a run naming any other root is refused, so a conf cannot open arbitrary paths to the UI.

Run and task states come from Airflow's metadata DB, read-only, through the api-server's own session: the run
folder cannot tell a run the operator marked failed, a task killed before it wrote anything, or Airflow's run
id and dates; the DB can, at the cost of two small indexed queries per page view. A failed task's first error
line comes from its log, read once through Airflow's own log reader (local file or the worker's log server) and
kept: the run folder records it only for the tasks that write a report or a shard status.

The pipeline's progress in Prometheus' format (`dflash_regen.ui.metrics`) is a second app at /dflash-metrics: it
answers only the bearer token DFLASH_METRICS_TOKEN, as Prometheus cannot keep an Airflow login.
"""

import json
import logging
from datetime import datetime
from typing import Any
from urllib.parse import quote

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.core_api.security import get_user, requires_access_dag
from airflow.models.dagrun import DagRun
from airflow.models.log import Log
from airflow.models.taskinstance import TaskInstance
from airflow.models.taskinstancehistory import TaskInstanceHistory
from airflow.plugins_manager import AirflowPlugin
from airflow.utils.log.log_reader import TaskLogReader
from airflow.utils.session import create_session
from sqlalchemy import func, select
from sqlalchemy.orm import joinedload

from dflash_regen.settings.deployment import deployment
from dflash_regen.ui.app import build_app
from dflash_regen.ui.metrics import URL_PREFIX as METRICS_PREFIX
from dflash_regen.ui.metrics import build_metrics_app
from dflash_regen.ui.runs import first_failed

log = logging.getLogger(__name__)
PREFIX = "/dflash"
DAG_ID = "dflash_regen"
RUNS_LISTED = 200
LINES_PER_VIEW = 20  # failed tasks whose log a page view may read (each once: a finished try's log does not change)


def _ts(value: datetime | None) -> float | None:
    return value.timestamp() if value else None


def _run(row) -> dict:
    """A run as the pages take it; `output_root` is the root its conf named (None: the deployment's default)."""
    return {"run_id": row[0], "state": row[1], "start": _ts(row[2]), "end": _ts(row[3]), "run_after": _ts(row[4]),
            "output_root": (row[5] or {}).get("output_root")}


def _earliest(*stamps: float | None) -> float | None:
    return min((t for t in stamps if t is not None), default=None)


def _stopped(row) -> dict | None:
    """Who marked the run failed and when, from Airflow's audit log (the UI's "Mark run as failed" and the REST
    API's PATCH of the run both log a patch_dag_run event); None if the last change of its state was not that."""
    if row is None:
        return None
    try:
        state = json.loads(row[3] or "{}").get("state")
    except ValueError:
        return None
    return {"by": row[0] or row[1], "at": _ts(row[2])} if state == "failed" else None


def _error_line(messages) -> str:
    """The first line of the exception a task's log records (Airflow's error_detail), else of the line
    `tasks.log_reason` ends a failed task's log with ("<task> failed: <first line>")."""
    reason = ""
    for message in messages:
        entry = message if isinstance(message, dict) else message.model_dump()
        for error in entry.get("error_detail") or []:
            value = (str(error.get("exc_value") or "").strip().splitlines() or [""])[0]
            kind = str(error.get("exc_type") or "")
            # fail_fast re-raises the library's error as AirflowFailException("<Type>: <message>")
            return value if kind.startswith("Airflow") or not value else f"{kind}: {value}"
        event = str(entry.get("event") or "")
        if " failed: " in event and entry.get("level") == "error":
            reason = event.split(" failed: ", 1)[1]
    return reason


class AirflowRuns:
    """The DAG's runs and task instances as plain dicts (what `ui/app.py` expects of `airflow`)."""

    dag_id = DAG_ID

    def __init__(self):
        self._lines: dict[tuple, str] = {}  # (run_id, task_id, map_index, try) -> a failed try's first error line

    def error_line(self, session, run_id: str, task: dict, budget: list[int]) -> str:
        """A failed task's first error line from its log ('' if none or past this view's `budget`)."""
        key = (run_id, task["task_id"], task["map_index"], task["try_number"])
        if key in self._lines or budget[0] <= 0:
            return self._lines.get(key, "")
        budget[0] -= 1
        try:
            ti = session.scalar(select(TaskInstance).where(
                TaskInstance.dag_id == DAG_ID, TaskInstance.run_id == run_id, TaskInstance.task_id == key[1],
                TaskInstance.map_index == key[2], TaskInstance.try_number == key[3])
                .options(joinedload(TaskInstance.dag_run)))
            metadata: Any = {"download_logs": True}  # the whole log, as the REST API's full_content reads it
            line = _error_line(TaskLogReader().read_log_chunks(ti, key[3], metadata)[0]) if ti else ""
        except Exception as exc:  # noqa: BLE001 - a log that cannot be read must not break the page
            log.warning("no first error line for %s: %s: %s", key, type(exc).__name__, exc)
            return ""
        if line:  # kept once found; a log still being written is read again next time
            if len(self._lines) > 5000:
                self._lines.clear()
            self._lines[key] = line
        return line

    def runs(self) -> list[dict]:
        with create_session() as session:
            rows = session.execute(select(DagRun.run_id, DagRun._state, DagRun.start_date, DagRun.end_date,
                                          DagRun.run_after, DagRun.conf).where(DagRun.dag_id == DAG_ID)
                                   .order_by(DagRun.run_after.desc()).limit(RUNS_LISTED)).all()
            first: dict[str, datetime] = {}  # per run, its first try's start: a clear resets the run's own start date
            for model in (TaskInstance, TaskInstanceHistory):
                for run_id, start in session.execute(select(model.run_id, func.min(model.start_date))
                                                     .where(model.dag_id == DAG_ID).group_by(model.run_id)):
                    if start is not None:
                        first[run_id] = min(start, first.get(run_id, start))
            failed: dict[str, list[dict]] = {}
            for t in session.execute(select(TaskInstance.run_id, TaskInstance.task_id, TaskInstance.map_index,
                                            TaskInstance.try_number).where(TaskInstance.dag_id == DAG_ID,
                                                                           TaskInstance.state == "failed")):
                failed.setdefault(t[0], []).append({"task_id": t[1], "map_index": t[2], "try_number": t[3]})
            runs, budget = [], [LINES_PER_VIEW]
            for run in map(_run, rows):
                where = first_failed(failed.get(run["run_id"], []))  # where it stopped, with its first line
                runs.append({**run, "start": _earliest(run["start"], _ts(first.get(run["run_id"]))),
                             "failed_at": where and where["task"],
                             "error": where and self.error_line(session, run["run_id"], where, budget)})
        return runs

    def run(self, run_id: str) -> dict | None:
        with create_session() as session:
            run = session.execute(select(DagRun.run_id, DagRun._state, DagRun.start_date, DagRun.end_date,
                                         DagRun.run_after, DagRun.conf)
                                  .where(DagRun.dag_id == DAG_ID, DagRun.run_id == run_id)).first()
            if run is None:
                return None
            tis = session.execute(select(TaskInstance.task_id, TaskInstance.map_index, TaskInstance.state,
                                         TaskInstance.try_number, TaskInstance.start_date, TaskInstance.end_date)
                                  .where(TaskInstance.dag_id == DAG_ID, TaskInstance.run_id == run_id)).all()
            stop = session.execute(select(Log.owner_display_name, Log.owner, Log.dttm, Log.extra)
                                   .where(Log.dag_id == DAG_ID, Log.run_id == run_id, Log.event == "patch_dag_run")
                                   .order_by(Log.dttm.desc()).limit(1)).first()
            # A clear resets the run's start date; its first try's start is in the task instance history.
            first_try = session.execute(select(func.min(TaskInstanceHistory.start_date))
                                        .where(TaskInstanceHistory.dag_id == DAG_ID,
                                               TaskInstanceHistory.run_id == run_id)).scalar()
            tasks: list[dict] = [{"task_id": t[0], "map_index": t[1], "state": t[2], "try_number": t[3],
                                  "start": _ts(t[4]), "end": _ts(t[5])} for t in tis]
            budget = [LINES_PER_VIEW]
            for t in tasks:
                # a shard's status file holds its error: its (long) generate log is not read for it
                if t["state"] == "failed" and not t["task_id"].endswith("generate"):
                    t["error"] = self.error_line(session, run_id, t, budget)
        found = _run(run)
        start = _earliest(found["start"], _ts(first_try), *(t["start"] for t in tasks))
        return {**found, "start": start, "stopped": _stopped(stop), "tasks": tasks}


def _icon(path: str) -> str:
    """A 24 px line icon as a data: URL (the tab bar shows it with <img>; no request, works offline)."""
    svg = (f"<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 24 24' fill='none' stroke='#758195' "
           f"stroke-width='2' stroke-linecap='round' stroke-linejoin='round'>{path}</svg>")
    return "data:image/svg+xml;utf8," + quote(svg, safe="")


QUALITY_ICON = _icon("<path d='M9 11l3 3 8-8'/><path d='M20 12v7a2 2 0 0 1-2 2H6a2 2 0 0 1-2-2V5a2 2 0 0 1 2-2h9'/>")
FLEET_ICON = _icon("<rect x='3' y='4' width='18' height='6' rx='1'/><rect x='3' y='14' width='18' height='6' rx='1'/>"
                   "<path d='M7 7h.01M7 17h.01'/>")
RUNS_ICON = _icon("<path d='M8 6h13M8 12h13M8 18h13M3 6h.01M3 12h.01M3 18h.01'/>")


class DflashRegenUI(AirflowPlugin):
    name = "dflash_regen_ui"
    # Draining a run changes it: the user needs Airflow's permission to edit this DAG's runs.
    may_drain = requires_access_dag("PUT", DagAccessEntity.RUN, param_dag_id=DAG_ID)
    fastapi_apps = [{"app": build_app(deployment().report_roots(), get_user, AirflowRuns(), may_drain),
                     "url_prefix": PREFIX,
                     "name": "dflash-regen reports"},
                    # its own app: Prometheus sends DFLASH_METRICS_TOKEN, not an Airflow login (ui/metrics.py)
                    {"app": build_metrics_app(deployment().report_roots(), deployment().metrics_token, AirflowRuns()),
                     "url_prefix": METRICS_PREFIX, "name": "dflash-regen metrics"}]
    # With url_route the UI shows the page inside Airflow (an iframe); {RUN_ID} is filled in on run pages.
    external_views = [
        {"name": "dflash-regen runs", "href": f"{PREFIX}/", "destination": "nav", "category": "browse",
         "url_route": "dflash-runs", "icon": RUNS_ICON},
        {"name": "Data quality", "href": f"{PREFIX}/runs/{{RUN_ID}}/quality", "destination": "dag_run",
         "url_route": "dflash-quality", "icon": QUALITY_ICON},
        {"name": "Fleet", "href": f"{PREFIX}/runs/{{RUN_ID}}/fleet", "destination": "dag_run",
         "url_route": "dflash-fleet", "icon": FLEET_ICON},
    ]
