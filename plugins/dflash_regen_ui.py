"""Airflow UI pages for dflash-regen: a run's data-quality report (with its GX Data Docs) and its fleet.

The pages are the library's FastAPI app (`dflash_regen.report_pages`), mounted at /dflash. A mounted plugin
app gets no authentication from Airflow, so every route requires Airflow's own `get_user` (the UI's `_token`
cookie or a Bearer token): anonymous requests get 401. Runs are read from the api-server's output root
(env DFLASH_OUTPUT_ROOT, the form's default) and nothing outside it is served.
"""

from pathlib import Path

from airflow.api_fastapi.core_api.security import get_user
from airflow.plugins_manager import AirflowPlugin

from dflash_regen.config import DEFAULTS
from dflash_regen.report_pages import build_app

PREFIX = "/dflash"


class DflashRegenUI(AirflowPlugin):
    name = "dflash_regen_ui"
    fastapi_apps = [{"app": build_app(Path(DEFAULTS["output_root"]), get_user), "url_prefix": PREFIX,
                     "name": "dflash-regen reports"}]
    # With url_route the UI shows the page inside Airflow (an iframe); {RUN_ID} is filled in on run pages.
    external_views = [
        {"name": "dflash-regen runs", "href": f"{PREFIX}/", "destination": "nav", "category": "browse",
         "url_route": "dflash-runs"},
        {"name": "Data quality", "href": f"{PREFIX}/runs/{{RUN_ID}}/quality", "destination": "dag_run",
         "url_route": "dflash-quality"},
        {"name": "Fleet", "href": f"{PREFIX}/runs/{{RUN_ID}}/fleet", "destination": "dag_run",
         "url_route": "dflash-fleet"},
    ]
