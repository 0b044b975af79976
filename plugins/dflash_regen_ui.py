"""Airflow UI pages for dflash-regen: a run's data-quality report (with its GX Data Docs) and its fleet.

The pages are the library's FastAPI app (`dflash_regen.ui.app`), mounted at /dflash. A mounted plugin
app gets no authentication from Airflow, so every route requires Airflow's own `get_user` (the UI's `_token`
cookie or a Bearer token): anonymous requests get 401. Runs are read from the output root each run's conf
named, among the roots the api-server serves (env DFLASH_OUTPUT_ROOT, the form's default, and DFLASH_SERVED_ROOTS);
a run naming any other root is refused, so a conf cannot open arbitrary paths to the UI.

Run and task states come from Airflow's public REST API (`dflash_regen.ui.airflow_api`), asked over HTTP at the
api-server's own address with a read-only token this process mints through Airflow's auth manager (a VIEWER of
the simple auth manager the deployment runs): the metrics scrape has no Airflow login to forward, and the pages
show every run of the DAG to anyone logged in, as before. No Airflow model, session or private name is used
(tests/architecture/test_airflow_interface.py holds that), so an upgrade that moves Airflow's internals leaves
the pages working; tests/contract/test_airflow_contract.py runs them against Airflow 3.3 and the newest 3.4.

The pipeline's progress in Prometheus' format (`dflash_regen.ui.metrics`) is a second app at /dflash-metrics: it
answers only the bearer token DFLASH_METRICS_TOKEN, as Prometheus cannot keep an Airflow login.
"""

import time
from urllib.parse import quote, urlsplit

import httpx
from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.core_api.security import get_user, requires_access_dag
from airflow.configuration import conf
from airflow.plugins_manager import AirflowPlugin

from dflash_regen.settings.deployment import deployment
from dflash_regen.ui.airflow_api import AirflowApi
from dflash_regen.ui.app import build_app
from dflash_regen.ui.metrics import URL_PREFIX as METRICS_PREFIX
from dflash_regen.ui.metrics import build_metrics_app

PREFIX = "/dflash"
DAG_ID = "dflash_regen"
READER = {"sub": "dflash-regen-ui", "role": "VIEWER"}  # the token's claims: read-only, for the simple auth manager
TOKEN_S = 600  # a minted token's lifetime; a new one is minted a minute before it ends


class ReaderToken(httpx.Auth):
    """A Bearer token for READER, minted by this api-server's auth manager when the last one nears its end."""

    def __init__(self):
        self._token, self._until = "", 0.0

    def auth_flow(self, request):
        if time.time() > self._until:
            manager = get_auth_manager()
            self._token = manager.generate_jwt(manager.deserialize_user(READER), expiration_time_in_seconds=TOKEN_S)
            self._until = time.time() + TOKEN_S - 60
        request.headers["Authorization"] = f"Bearer {self._token}"
        yield request


def api_url() -> str:
    """This api-server's own address: loopback unless it listens on one host only, and base_url's path."""
    host = conf.get("api", "host", fallback="") or "127.0.0.1"
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host  # noqa: S104 - a wildcard is reached on loopback
    path = urlsplit(conf.get("api", "base_url", fallback="") or "").path.rstrip("/")
    return f"http://{host}:{conf.getint('api', 'port', fallback=8080)}{path}"


# One reader for the pages and the metrics: they share its cache of task instances and error lines.
AIRFLOW = AirflowApi(httpx.Client(base_url=api_url(), auth=ReaderToken(), timeout=30.0), DAG_ID)


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
    fastapi_apps = [{"app": build_app(deployment().report_roots(), get_user, AIRFLOW, may_drain),
                     "url_prefix": PREFIX,
                     "name": "dflash-regen reports"},
                    # its own app: Prometheus sends DFLASH_METRICS_TOKEN, not an Airflow login (ui/metrics.py)
                    {"app": build_metrics_app(deployment().report_roots(), deployment().metrics_token, AIRFLOW),
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
