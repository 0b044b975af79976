"""The web pages behind the Airflow UI links: a run's data-quality report, its GX Data Docs, and the fleet.

`build_app(output_root, auth)` returns a FastAPI app; the Airflow plugin (plugins/dflash_regen_ui.py) mounts
it and passes Airflow's own `get_user` as `auth`, because a mounted plugin app gets no authentication by
itself. Every route depends on `auth`. Pages read only `<output_root>/runs/<run_id>/` through `run_report`
and never serve a file outside the run's Data Docs folder. Nothing here imports Airflow.

Pages are plain server-rendered HTML with inline CSS and SVG: they stay legible without network access.
GX Data Docs pull Bootstrap and friends from public CDNs; they are served with those tags replaced by the
same inline stylesheet.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from html import escape
from pathlib import Path
from urllib.parse import quote

import jinja2
from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse

from dflash_regen import charts, run_report

TEMPLATES = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
                               autoescape=True, undefined=jinja2.StrictUndefined)
STYLE = (Path(__file__).parent / "templates" / "report.css").read_text()
# <link>, <img> and <script src=...> tags that point off-site: offline they only hang or fail.
_REMOTE_TAG = re.compile(r"""<(?:link|img)\b[^>]*(?:href|src)=["']?(?:https?:)?//[^>]*>|"""
                         r"""<script\b[^>]*src=["']?(?:https?:)?//[^>]*>\s*</script>""", re.IGNORECASE)


def offline_html(html: str, pages: list[str] = ()) -> str:
    """GX Data Docs HTML without its CDN tags, with the report stylesheet inlined instead.

    `pages` (paths relative to the Data Docs root) are listed at the top: the index builds its own tables
    with JavaScript from a CDN, so offline it would otherwise show no links at all.
    """
    html = _REMOTE_TAG.sub("", html)
    html = html.replace("</head>", f"<style>{STYLE}</style></head>", 1)
    if pages:
        items = "".join(f'<li><a href="{escape(p)}">{escape(p)}</a></li>' for p in pages)
        block = f'<div class="offline-pages"><b>Pages</b><ul>{items}</ul></div>'
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


TEMPLATES.filters.update(duration=_duration, number=_number, urlpart=lambda s: quote(str(s), safe=""))


def _page(template: str, **context) -> HTMLResponse:
    return HTMLResponse(TEMPLATES.get_template(template).render(style=STYLE, **context))


def build_app(output_root: Path, auth: Callable) -> FastAPI:
    """All routes require `auth` (a FastAPI dependency that raises 401/403 for an anonymous request)."""
    root = Path(output_root)
    app = FastAPI(title="dflash-regen reports", dependencies=[Depends(auth)], docs_url=None, redoc_url=None,
                  openapi_url=None)

    def run_dir(run_id: str) -> Path:
        try:
            return run_report.resolve_run(root, run_id)
        except run_report.RunNotFound as exc:
            raise HTTPException(404, f"{exc}. Runs are read from the output root {root} "
                                     "(env DFLASH_OUTPUT_ROOT of the api-server).") from exc

    @app.get("/", response_class=HTMLResponse)
    def index():
        return _page("index.html", root=str(root), runs=run_report.list_runs(root))

    @app.get("/runs/{run_id}/quality.json")
    def quality_json(run_id: str):
        return JSONResponse(run_report.quality_report(run_dir(run_id)))

    @app.get("/runs/{run_id}/quality", response_class=HTMLResponse)
    def quality(run_id: str):
        report = run_report.quality_report(run_dir(run_id))
        mask = report["loss_mask"]
        chart = charts.histogram(mask["histogram"], highlight_at_or_below=mask["empty_at_or_below"],
                                 x_title="loss_mask.sum() (tokens)")
        return _page("quality.html", run_id=run_id, r=report, chart=chart)

    @app.get("/runs/{run_id}/fleet.json")
    def fleet_json(run_id: str):
        return JSONResponse(run_report.fleet_report(run_dir(run_id)))

    @app.get("/runs/{run_id}/fleet", response_class=HTMLResponse)
    def fleet(run_id: str):
        report = run_report.fleet_report(run_dir(run_id))
        tp = report["progress"]["throughput"]
        chart = charts.time_series(tp["servers"], bin_s=tp["bin_s"], x_title="time since the first answer",
                                   y_title="output tok/s")
        return _page("fleet.html", run_id=run_id, r=report, chart=chart)

    @app.get("/runs/{run_id}/data-docs")
    def data_docs_root(run_id: str):
        return RedirectResponse("data-docs/index.html")

    @app.get("/runs/{run_id}/data-docs/{path:path}")
    def data_docs(run_id: str, path: str):
        docs = (run_dir(run_id) / "reports" / "data_docs").resolve()
        target = (docs / (path or "index.html")).resolve()
        if target.is_dir():
            target = (target / "index.html").resolve()
        if docs not in target.parents or not target.is_file():
            raise HTTPException(404, f"no Data Docs page {path!r} for run {run_id!r} (has validate run yet?)")
        if target.suffix == ".html":
            pages = []
            if target == docs / "index.html":  # newest validation first, then the suites
                pages = sorted((str(p.relative_to(docs)) for p in (docs / "validations").rglob("*.html")),
                               reverse=True) + sorted(str(p.relative_to(docs))
                                                      for p in (docs / "expectations").rglob("*.html"))
            return HTMLResponse(offline_html(target.read_text(errors="replace"), pages))
        return FileResponse(target)

    return app
