"""What a run folder says, as plain dicts: the data behind the UI's data-quality and fleet pages.

Reads only files the pipeline wrote under `<output_root>/runs/<run_id>/` (reports/*.json, the shard, completion,
failure and summary parquet files), so it works while the run is still going and long after it ended.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq

from dflash_regen.config import safe_run_id

HISTOGRAM_BINS = 40
THROUGHPUT_POINTS = 60


class RunNotFound(LookupError):
    """No run folder of that id under the output root (or the id tries to leave it)."""


def resolve_run(output_root: Path, run_id: str) -> Path:
    """The run folder for an Airflow run id; never a path outside `<output_root>/runs/`."""
    runs = (output_root / "runs").resolve()
    try:
        name = safe_run_id(run_id)
    except ValueError as exc:
        raise RunNotFound(str(exc)) from exc
    candidate = (runs / name).resolve()
    if candidate.parent != runs or not candidate.is_dir():
        raise RunNotFound(f"no run {run_id!r} under {runs}")
    return candidate


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # not written yet, or being replaced right now


def _columns(paths: list[Path], *names: str) -> list[list]:
    """The named columns over all files, read together so they stay row-aligned."""
    values: list[list] = [[] for _ in names]
    for path in paths:
        try:
            table = pq.read_table(path, columns=list(names))
        except (OSError, KeyError, ValueError):
            continue  # a part being written, or an older file without the column
        for out, name in zip(values, names, strict=True):
            out.extend(table.column(name).to_pylist())
    return values


def _column(paths: list[Path], column: str) -> list:
    return _columns(paths, column)[0]


def _result_files(folder: Path) -> list[Path]:
    """Merged shard files plus checkpoint parts of shards not merged yet (a merged shard's parts repeat it)."""
    merged = sorted(folder.glob("shard-*.parquet"))
    done = {p.stem for p in merged}
    return merged + sorted(p for d in folder.glob("shard-*") if d.is_dir() and d.name not in done
                           for p in d.glob("*.parquet"))


def _rows(paths: list[Path]) -> int:
    total = 0
    for path in paths:
        try:
            total += pq.read_metadata(path).num_rows  # the footer only: cheap for a 902K-sample run
        except (OSError, ValueError):
            continue  # a part being written
    return total


def list_runs(output_root: Path) -> list[dict]:
    runs = [p for p in (output_root / "runs").glob("*") if p.is_dir()]
    out = []
    for run in sorted(runs, key=lambda p: p.stat().st_mtime, reverse=True):
        quality = _json(run / "reports" / "quality.json")
        out.append({"run": run.name, "modified": run.stat().st_mtime,
                    "quality": None if quality is None else bool(quality.get("success"))})
    return out


# ------------------------------------------------------------------------------------------ data quality
def _g(v) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def threshold(expectation: str, kwargs: dict) -> str:
    """An expectation's rule in a few words, e.g. '>= 7 for >= 98% of rows'."""
    lo, hi = kwargs.get("min_value"), kwargs.get("max_value")
    parts = []
    if lo is not None and hi is not None:
        parts.append(f"{_g(lo)} .. {_g(hi)}")
    elif lo is not None:
        parts.append(f">= {_g(lo)}")
    elif hi is not None:
        parts.append(f"<= {_g(hi)}")
    if "value" in kwargs:
        parts.append(f"= {_g(kwargs['value'])}")
    if "value_set" in kwargs:
        values = ", ".join(_g(v) for v in kwargs["value_set"])
        parts.append(f"{'not in' if '_not_be_in_set' in expectation else 'in'} {{{values}}}")
    if "column_B" in kwargs:
        parts.append(f"= {kwargs['column_B']}")
    if "mostly" in kwargs:
        parts.append(f"for >= {kwargs['mostly']:.0%} of rows")
    condition = kwargs.get("row_condition")
    if isinstance(condition, dict) and condition.get("pass_through_filter"):
        parts.append(f"where {condition['pass_through_filter']}")
    return " ".join(parts) or "-"


def quarantine_by_stage(run: Path) -> dict[str, dict[str, int]]:
    """Quarantined rows per stage (planning, generation, quality gate) and reason."""
    stages = {"planning": [run / "failures" / "plan.parquet"],
              "generation": sorted((run / "failures").glob("shard-*.parquet")),
              "quality gate": [run / "quality" / "quarantine.parquet"]}
    out = {}
    for stage, paths in stages.items():
        counts: dict[str, int] = {}
        for reason in _column([p for p in paths if p.is_file()], "reason"):
            counts[reason] = counts.get(reason, 0) + 1
        out[stage] = dict(sorted(counts.items(), key=lambda kv: -kv[1]))
    return out


def histogram(values: list[int], bins: int = HISTOGRAM_BINS, split_at: int | None = None) -> list[dict]:
    """Integer-aligned equal-width bins; values at or below `split_at` get a bin of their own, so the
    empty-answer spike (loss masks of <= 6 tokens) is one bar, never blended with real answers."""
    out = []
    if split_at is not None:
        low = [v for v in values if v <= split_at]
        values = [v for v in values if v > split_at]
        if low:
            out.append({"start": min(low), "end": split_at, "count": len(low)})
    if not values:
        return out
    lo, hi = min(values), max(values)
    width = max(1, -(-(hi - lo + 1) // bins))
    counts: dict[int, int] = {}
    for v in values:
        start = lo + (v - lo) // width * width
        counts[start] = counts.get(start, 0) + 1
    return out + [{"start": s, "end": s + width - 1, "count": counts.get(s, 0)} for s in range(lo, hi + 1, width)]


def quality_report(run: Path) -> dict:
    quality = _json(run / "reports" / "quality.json")
    plan = _json(run / "reports" / "plan.json") or {}
    masks = _column(sorted((run / "tokenized").glob("summary-*.parquet")), "loss_mask_sum")
    empty_at = (quality or {}).get("settings", {}).get("empty_mask_tokens", 6)
    expectations = []
    for e in (quality or {}).get("expectations", []):
        kwargs = e.get("kwargs", {})
        expectations.append({"expectation": e["expectation"],
                             "column": kwargs.get("column") or kwargs.get("column_A") or "(table)",
                             "threshold": threshold(e["expectation"], kwargs), "observed": e.get("observed"),
                             "success": bool(e.get("success")), "error": e.get("error")})
    by_stage = quarantine_by_stage(run)
    docs = run / "reports" / "data_docs" / "index.html"
    return {
        "run": run.name,
        "status": "not validated yet" if quality is None else ("passed" if quality.get("success") else "failed"),
        "prompts": plan.get("rows"), "samples": (quality or {}).get("samples"), "kept": (quality or {}).get("kept"),
        "quarantined": sum(n for reasons in by_stage.values() for n in reasons.values()),
        "quarantined_by_stage": by_stage,
        "expectations": expectations, "statistics": (quality or {}).get("statistics", {}),
        "loss_mask": {"samples": len(masks), "empty_at_or_below": empty_at,
                      "empty": sum(1 for m in masks if m <= empty_at),
                      "histogram": histogram(masks, split_at=empty_at)},
        "data_docs": docs.is_file(),
    }


# ------------------------------------------------------------------------------------------------ fleet
def throughput_series(finished: list[float], tokens: list[int], servers: list[str],
                      points: int = THROUGHPUT_POINTS) -> dict:
    """Output tok/s per server over time, from each completion's finish time and token count."""
    rows = [(f, t or 0, s) for f, t, s in zip(finished, tokens, servers, strict=True) if f is not None]
    if not rows:
        return {"start": None, "bin_s": 0, "servers": {}}
    start, end = min(r[0] for r in rows), max(r[0] for r in rows)
    bin_s = max((end - start) / points, 1.0)
    n = int((end - start) // bin_s) + 1
    series: dict[str, list[float]] = {}
    for f, t, s in rows:
        series.setdefault(s, [0.0] * n)[int((f - start) // bin_s)] += t / bin_s
    return {"start": start, "bin_s": bin_s, "servers": dict(sorted(series.items()))}


def progress(run: Path, now: float | None = None) -> dict:
    """Prompts done (completed or quarantined by a server) of those planned, the recent rate, and the ETA."""
    plan = _json(run / "reports" / "plan.json") or {}
    files = _result_files(run / "completions")
    finished, tokens, servers = _columns(files, "finished_at", "completion_tokens", "server")
    done = _rows(files) + _rows(_result_files(run / "failures"))
    total = plan.get("accepted")
    now = time.time() if now is None else now
    stamps = sorted(f for f in finished if f is not None)
    rate = None
    if len(stamps) >= 2:
        window = [f for f in stamps if f >= stamps[-1] - 300] or stamps  # the last five minutes
        span = window[-1] - window[0]
        rate = (len(window) - 1) / span if span > 0 else None
    left = None if total is None else max(total - done, 0)
    eta = None if not left or not rate else left / rate
    return {"planned": total, "done": done, "left": left, "share": (done / total) if total else None,
            "rate_per_s": rate, "eta_s": 0.0 if left == 0 else eta,
            "throughput": throughput_series(finished, tokens, servers)}


def fleet_report(run: Path) -> dict:
    health = _json(run / "reports" / "health.json") or {}
    smoke = _json(run / "reports" / "smoke.json") or {}
    smoke_by_server = {s["server"]: s for s in smoke.get("servers", [])}
    servers = []
    for h in health.get("servers", []):
        s = smoke_by_server.get(h["server"], {})
        servers.append({"server": h["server"], "healthy": h.get("healthy"), "allocation": h.get("allocation", {}),
                        "binding": h.get("binding"), "advice": h.get("advice"), "problems": h.get("problems", []),
                        "smoke_ok": s.get("ok"), "smoke": s.get("results", [])})
    return {"run": run.name, "health_passed": health.get("passed"), "smoke_passed": smoke.get("passed"),
            "smoke_max_tokens": smoke.get("max_tokens"), "servers": servers, "progress": progress(run),
            "capacity": _json(run / "reports" / "capacity.json")}
