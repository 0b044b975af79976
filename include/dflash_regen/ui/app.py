"""The web pages behind the Airflow UI links: a run's data-quality report, its GX Data Docs, and the fleet.

`build_app(roots, auth, airflow)` returns a FastAPI app; the Airflow plugin (plugins/dflash_regen_ui.py)
mounts it and passes Airflow's own `get_user` as `auth`, because a mounted plugin app gets no authentication
by itself, and `airflow`, a read-only view of the DAG's runs and task instances as plain dicts (None: the pages
show what the run folders alone say). Every route depends on `auth`. Pages read only `<root>/runs/<run_id>/`
of the output roots they are given (through `ui.runs` and `ui.files`), and never serve a file outside the run's
Data Docs.
Nothing here imports Airflow.

Pages are plain server-rendered HTML with inline CSS and SVG: they stay legible without network access, and
narrow (Airflow shows them in a ~370 px side panel: tables scroll sideways with their first column kept).
GX Data Docs pull Bootstrap and friends from public CDNs; they are served with those tags removed, the same
inline stylesheet, and the parts that only work online (filters, the JavaScript-built index, the newsletter
footer) hidden.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from html import escape
from pathlib import Path
from typing import Protocol
from urllib.parse import quote

import jinja2
from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse
from markupsafe import Markup

from dflash_regen.errors import RunNotFound
from dflash_regen.generate.shard import request_drain
from dflash_regen.layout import RunLayout
from dflash_regen.ui import charts
from dflash_regen.ui.fleet_page import fleet_report, short_name
from dflash_regen.ui.progress import SLOW_SHARE
from dflash_regen.ui.quality_page import quality_report
from dflash_regen.ui.runs import RUNNING_STATES, list_runs, resolve_run, run_root, run_state

TEMPLATES = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
                               autoescape=True, undefined=jinja2.StrictUndefined)
# Markup: autoescape would turn the stylesheet's quotes into &#34; and the browser would drop those rules.
STYLE = Markup((Path(__file__).parent / "templates" / "report.css").read_text())
# <link>, <img> and <script src=...> tags that point off-site: offline they only hang or fail.
_REMOTE_TAG = re.compile(r"""<(?:link|img)\b[^>]*(?:href|src)=["']?(?:https?:)?//[^>]*>|"""
                         r"""<script\b[^>]*src=["']?(?:https?:)?//[^>]*>\s*</script>""", re.IGNORECASE)


# GX parts that need its CDN scripts or say nothing here: the "Clear Filters" toolbars, the index's tables
# (built by JavaScript, so empty offline: our own list replaces them), the validation filter and "Show more
# info" toggles (jQuery/Bootstrap; the details show anyway), the fixed newsletter footer.
_GX_NOISE = (".gx-docs [id$=-table-toolbar],.gx-docs .ge-index-page-tabs-container,.gx-docs footer,"
             ".gx-docs #ge-cta-footer,.gx-docs .card:has(.btn-group-toggle),.gx-docs a[data-toggle=collapse]"
             "{display:none!important}")
# "Data asset: None": our suite validates an in-memory dataframe, which has no data asset to name.
_DATA_ASSET_NONE = re.compile(r"Data asset:\s*None\s*<br\s*/?>", re.IGNORECASE)


def offline_html(html: str, pages: Sequence[tuple[str, str]] = (), back: str = "") -> str:
    """GX Data Docs HTML without its CDN tags, with the report stylesheet inlined instead.

    `pages` ((href, label), relative to the Data Docs root) are listed at the top of the index: GX builds its
    index tables with JavaScript from a CDN, so offline it would otherwise show no links at all. `back` is a
    link to the run's data-quality page shown above them.
    """
    html = _REMOTE_TAG.sub("", html)
    html = _DATA_ASSET_NONE.sub("", html)
    html = html.replace("</head>", f"<style>{STYLE}{_GX_NOISE}</style></head>", 1)
    html = re.sub(r"<body([^>]*)>", r'<body\1 class="gx-docs">', html, count=1)
    block = f'<nav><a href="{escape(back)}" target="_self">&larr; data-quality page</a></nav>' if back else ""
    if pages:
        items = "".join(f'<li><a href="{escape(href)}">{escape(label)}</a></li>' for href, label in pages)
        block += f'<div class="offline-pages"><b>Great Expectations Data Docs</b><ul>{items}</ul></div>'
    if block:
        html = re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + block, html, count=1)
    return html


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h {m:02d}m" if h else (f"{m}m {s:02d}s" if m else f"{s}s")


def _number(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def _when(epoch: float | None) -> str:
    return "-" if epoch is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch))


def _detail(server: str | None) -> str:
    """'server 2 (GPU 2, 127.0.0.1:30002)' -> 'GPU 2, 127.0.0.1:30002'."""
    return (server or "").partition(" (")[2].removesuffix(")")


def _breakable(name: str) -> Markup:
    """'expect_column_values_to_be_between' may wrap after an underscore, never inside a word."""
    return Markup("_<wbr>").join(escape(part) for part in str(name).split("_"))


TEMPLATES.filters.update(duration=_duration, number=_number, when=_when, short=short_name, detail=_detail,
                         breakable=_breakable, urlpart=lambda s: quote(str(s), safe=""))


def _page(template: str, status_code: int = 200, **context) -> HTMLResponse:
    return HTMLResponse(TEMPLATES.get_template(template).render(style=STYLE, **context), status_code=status_code)


class AirflowView(Protocol):
    """What the pages need from Airflow (the plugin reads its metadata DB, read-only)."""

    def runs(self) -> list[dict]:
        """The DAG's runs, newest first: {run_id, state, start, end} (epoch seconds or None)."""

    def run(self, run_id: str) -> dict | None:
        """One run as above plus `tasks`: [{task_id, map_index, state, try_number, start, end}]."""


def _data_docs_pages(docs: Path) -> list[tuple[str, str]]:
    """Validation results newest first, then the suites, each with a readable label."""
    out = []
    for p in sorted((docs / "validations").rglob("*.html"), reverse=True):
        rel = p.relative_to(docs)
        # validations/<suite>/<run name>/<run time>/<batch>.html
        suite, when = (rel.parts[1], rel.parts[3]) if len(rel.parts) >= 5 else (rel.stem, "")
        stamp = re.fullmatch(r"(\d{4})(\d\d)(\d\d)T(\d\d)(\d\d)(\d\d)(?:\.\d+)?Z", when)
        if stamp:
            when = "{}-{}-{} {}:{}:{} UTC".format(*stamp.groups())
        out.append((str(rel), f"validation of {suite}" + (f" at {when}" if when else "")))
    out += [(str(p.relative_to(docs)), f"expectation suite {p.stem}")
            for p in sorted((docs / "expectations").rglob("*.html"))]
    return out


def build_app(roots: Path | Sequence[Path], auth: Callable, airflow: AirflowView | None = None,
              may_drain: Callable | None = None) -> FastAPI:
    """All routes require `auth` (a FastAPI dependency that raises 401/403 for an anonymous request and returns
    the user). `roots`: the output roots whose runs may be shown, the default one first; a run Airflow knows is read
    under the root its conf named, and refused when that root is not one of them. `may_drain`: a dependency that
    raises 403 unless the user may change the DAG's runs (the plugin passes Airflow's own check); without it no
    run can be drained from the pages."""
    roots = [Path(roots)] if isinstance(roots, str | Path) else [Path(r) for r in roots]
    app = FastAPI(title="dflash-regen reports", dependencies=[Depends(auth)], docs_url=None, redoc_url=None,
                  openapi_url=None)

    def airflow_run(run_id: str) -> dict | None:
        return airflow.run(run_id) if airflow is not None else None

    def locate(run_id: str) -> tuple[Path | None, dict | None]:
        """The run's folder (None if it has none yet) and Airflow's record of the run (None if unknown)."""
        known = airflow_run(run_id)
        candidates = roots
        if known is not None:
            if (root := run_root(roots, known)) is None:
                raise HTTPException(403, f"run {run_id!r} writes to output_root {known['output_root']}, which "
                                         f"these pages do not serve ({', '.join(map(str, roots))}); to show it, add "
                                         "that root to DFLASH_SERVED_ROOTS of the api-server")
            candidates = [root]
        for candidate in candidates:
            try:
                return resolve_run(candidate, run_id), known
            except RunNotFound:
                continue
        return None, known

    def run_dir(run_id: str) -> tuple[Path, dict | None]:
        run, known = locate(run_id)
        if run is None:
            raise HTTPException(404, f"no run {run_id!r} under {', '.join(str(r / 'runs') for r in roots)} "
                                     "(the output roots these pages serve: env DFLASH_OUTPUT_ROOT and "
                                     "DFLASH_SERVED_ROOTS of the api-server)")
        return run, known

    def tab(run_id: str, page: str, render: Callable[[str, Path, dict | None], HTMLResponse]) -> HTMLResponse:
        """A run's tab; for a run with no folder yet (queued, or failed before writing one), Airflow's state and
        failed tasks instead of a bare 404."""
        run, known = locate(run_id)
        if run is not None:
            return render(run_id, run, known)
        if known is None:
            run_dir(run_id)  # the 404 that says where runs are read from
        return _page("no_run_folder.html", run_id=run_id, state=run_state(None, known), page=page,
                     roots=", ".join(map(str, roots)))

    @app.get("/", response_class=HTMLResponse)
    def index():
        runs = list_runs(roots, airflow.runs() if airflow is not None else None)
        return _page("index.html", root=", ".join(map(str, roots)), r=runs)

    @app.get("/runs/{run_id}/quality.json")
    def quality_json(run_id: str):
        return JSONResponse(quality_report(*run_dir(run_id)))

    def quality_page(run_id: str, run: Path, known: dict | None) -> HTMLResponse:
        report = quality_report(run, known)
        mask = report["loss_mask"]
        chart = charts.histogram(mask["histogram"], highlight_at_or_below=mask["empty_at_or_below"],
                                 x_title="loss_mask.sum() (tokens)")
        return _page("quality.html", run_id=run_id, r=report, state=report["run_state"], chart=chart,
                     page="quality")

    @app.get("/runs/{run_id}/quality", response_class=HTMLResponse)
    def quality(run_id: str):
        return tab(run_id, "quality", quality_page)

    @app.get("/runs/{run_id}/fleet.json")
    def fleet_json(run_id: str):
        return JSONResponse(fleet_report(*run_dir(run_id)))

    def fleet_page(run_id: str, run: Path, known: dict | None) -> HTMLResponse:
        report = fleet_report(run, known)
        tp = report["throughput"]
        servers = {short_name(name): values for name, values in tp["servers"].items()}
        chart = charts.time_series(servers, bin_s=tp["bin_s"], x_title="time since the first answer (pauses cut out)",
                                   y_title="output tok/s", ticks=tp["ticks"], breaks=tp["breaks"], marks=tp["marks"])
        return _page("fleet.html", run_id=run_id, r=report, state=report["run_state"], chart=chart,
                     page="fleet", slow_share=SLOW_SHARE, may_drain=may_drain is not None)

    @app.get("/runs/{run_id}/fleet", response_class=HTMLResponse)
    def fleet(run_id: str):
        return tab(run_id, "fleet", fleet_page)

    def refuse_drain():
        raise HTTPException(403, "draining from these pages needs the api-server's permission check "
                                 "(plugins/dflash_regen_ui.py passes it)")

    @app.post("/runs/{run_id}/drain", dependencies=[Depends(may_drain or refuse_drain)])
    def drain(run_id: str, user=Depends(auth)):  # noqa: B008 - a default: annotations cannot name this closure's auth
        run, known = run_dir(run_id)
        if known is None or known.get("state") not in RUNNING_STATES:
            raise HTTPException(409, f"run {run_id!r} is {(known or {}).get('state', 'unknown to Airflow')}: only a "
                                     "running run can be drained")
        name = user.get_name() if hasattr(user, "get_name") else str(user or "an unnamed user")
        request_drain(RunLayout(run), name)
        return RedirectResponse("fleet", status_code=303)

    @app.get("/runs/{run_id}/data-docs")
    def data_docs_root(run_id: str):
        return RedirectResponse("data-docs/index.html")

    @app.get("/runs/{run_id}/data-docs/{path:path}")
    def data_docs(run_id: str, path: str):
        run, known = run_dir(run_id)
        docs = RunLayout(run).data_docs.resolve()
        target = (docs / (path or "index.html")).resolve()
        if target.is_dir():
            target = (target / "index.html").resolve()
        if docs not in target.parents or not target.is_file():
            state = run_state(run, known)
            return _page("no_data_docs.html", status_code=404, run_id=run_id, path=path, state=state,
                         validated=(docs / "index.html").is_file(), page="data-docs",
                         up="../" * (path.count("/") + 1))
        if target.suffix == ".html":
            depth = len(target.relative_to(docs).parts) - 1
            pages = _data_docs_pages(docs) if target == docs / "index.html" else []
            return HTMLResponse(offline_html(target.read_text(errors="replace"), pages,
                                             back="../" * (depth + 1) + "quality"))
        return FileResponse(target)

    return app
