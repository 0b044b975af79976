"""What a run says, as plain dicts: the data behind the UI's runs list, data-quality and fleet pages.

Two sources. The run folder `<output_root>/runs/<run_id>/` (reports/*.json, each shard's status file, the
shard, completion and failure parquet files) says what the pipeline did and works while the run is going and
long after it ended. Airflow's view of the run (`airflow_run`: its id, state, dates and task instances, passed
in by the plugin as a plain dict; None outside Airflow) says what the folder cannot: a run marked failed, a
task killed before it wrote anything, where the run stopped.

At scale (902 shards, 902K completions) a page view must not re-read the run: parquet reads are cached per
file (path, mtime, size), so a refresh reads only the checkpoint parts written since the last one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from dflash_regen import shard_status
from dflash_regen.config import safe_run_id
from dflash_regen.errors import RunNotFound

HISTOGRAM_BINS = 40
THROUGHPUT_POINTS = 60
# Tasks in pipeline order: where a failed run stopped, what never ran.
PIPELINE = ("stage_weights", "launch_fleet", "health_check", "smoke_test", "plan_shards", "calibrate", "generate",
            "tokenize", "validate", "publish", "stop_fleet")
RUNNING_STATES = {"running", "queued", "scheduled", "up_for_retry", "up_for_reschedule", "restarting", "deferred"}
SHARDS_LISTED = 50  # beyond this, finished shards are left out of the page's table (fleet.json has them all)
ADVICE_MIN_GAIN = 0.02  # advise a relaunch only when it is predicted at least this much faster


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


# ----------------------------------------------------------------------------------------------- file cache
_CACHE: dict[tuple[str, str], tuple[tuple[int, int], object]] = {}


def _cached(path: Path, kind: str, load):
    """`load(path)`, remembered until the file changes; None for a file that vanished or is half written."""
    try:
        st = path.stat()
    except OSError:
        return None
    key, stamp = (kind, str(path)), (st.st_mtime_ns, st.st_size)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    try:
        value = load(path)
    except (OSError, KeyError, ValueError):
        return None  # a part being written, or an older file without the column
    _CACHE[key] = (stamp, value)
    return value


def _forget_missing(folder: Path) -> None:
    """Drop cache entries of merged-away checkpoint parts under `folder`, so the cache does not grow forever."""
    prefix = str(folder) + "/"
    for key in [k for k in _CACHE if k[1].startswith(prefix)]:
        if not Path(key[1]).exists():
            del _CACHE[key]


def _rows(path: Path) -> int:
    return _cached(path, "rows", lambda p: pq.read_metadata(p).num_rows) or 0  # the footer only


def _columns(paths: list[Path], *names: str) -> list[list]:
    """The named columns over all files, read together so they stay row-aligned."""
    values: list[list] = [[] for _ in names]
    for path in paths:
        table = _cached(path, "cols:" + ",".join(names), lambda p: pq.read_table(p, columns=list(names)))
        if table is None:
            continue
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


def _shard_of(path: Path) -> int:
    name = path.stem if path.stem.startswith("shard-") else path.parent.name
    return int(name.split("-")[1])


# --------------------------------------------------------------------------------------------- run state
def _ti_label(t: dict) -> str:
    return t["task_id"] + (f"[{t['map_index']}]" if t["map_index"] >= 0 else "")


def _first_line(text) -> str:
    return (str(text or "").strip().splitlines() or [""])[0]


def run_state(run: Path, airflow_run: dict | None) -> dict:
    """The run's state, dates, failed tasks with their first error line where the folder has it, and where it
    stopped; from Airflow when it knows the run, else what the folder alone can tell."""
    reports = run / "reports"
    errors = {"health_check": _first_line((_json(reports / "health.json") or {}).get("error")),
              "smoke_test": _first_line((_json(reports / "smoke.json") or {}).get("error"))}
    quality = _json(reports / "quality.json")
    if quality is not None and not quality.get("success"):
        failed = [f"{e['expectation']} {e.get('kwargs', {}).get('column', '')}: observed {e.get('observed')}"
                  for e in quality.get("expectations", []) if not e.get("success")]
        errors["validate"] = "quality gate failed: " + "; ".join(failed)
    statuses = _statuses(run)
    if airflow_run is None:
        return {"known": False, "state": None, "start": None, "end": None, "duration_s": None, "failed": [],
                "stopped_at": None, "not_run": [], "running": []}
    tasks = sorted(airflow_run.get("tasks", []), key=lambda t: (PIPELINE.index(t["task_id"])
                                                                if t["task_id"] in PIPELINE else 99, t["map_index"]))
    failed = []
    for t in tasks:
        if t["state"] != "failed":
            continue
        error = errors.get(t["task_id"], "")
        if t["task_id"] == "generate" or t["task_id"].endswith(".generate"):
            shard = next((n for n, ti in _generate_tis(run, airflow_run).items() if ti is t), t["map_index"])
            attempts = (statuses.get(shard) or {}).get("attempts", [])
            error = next((a.get("error", "") for a in reversed(attempts) if a.get("state") == "failed"), "")
        failed.append({"task": _ti_label(t), "task_id": t["task_id"], "map_index": t["map_index"],
                       "try_number": t["try_number"], "error": error})
    not_run = []
    for name in PIPELINE:
        states = {t["state"] for t in tasks if t["task_id"] == name}
        if states and states <= {"upstream_failed", "skipped", "removed", None}:
            not_run.append(name)
    start, end = airflow_run.get("start"), airflow_run.get("end")
    state = airflow_run.get("state")
    return {"known": True, "run_id": airflow_run["run_id"], "state": state, "start": start, "end": end,
            "duration_s": None if start is None else (end or time.time()) - start,
            "failed": failed, "stopped_at": failed[0]["task"] if failed else None, "not_run": not_run,
            "running": [_ti_label(t) for t in tasks if t["state"] in {"running", "queued", "up_for_retry"}]}


def list_runs(output_root: Path, airflow_runs: list[dict] | None = None) -> dict:
    """Airflow's runs of the DAG with their folder's counts, and folders no Airflow run matches."""
    folders = {p.name: p for p in (output_root / "runs").glob("*") if p.is_dir()}
    rows = []
    for r in airflow_runs or []:
        folder = folders.pop(safe_run_id(r["run_id"]), None)
        rows.append({**r, "duration_s": None if r.get("start") is None else (r.get("end") or time.time()) - r["start"],
                     "folder": folder is not None, **(_run_counts(folder) if folder else {})})
    orphans = [{"run_id": name, "modified": p.stat().st_mtime, **_run_counts(p)}
               for name, p in sorted(folders.items(), key=lambda kv: kv[1].stat().st_mtime, reverse=True)]
    return {"airflow": airflow_runs is not None, "runs": rows, "folders": orphans}


def _run_counts(run: Path) -> dict:
    plan = _json(run / "reports" / "plan.json") or {}
    quality = _json(run / "reports" / "quality.json")
    return {"prompts": plan.get("rows"), "published": (quality or {}).get("kept"),
            "quarantined": None if quality is None else plan.get("rows", 0) - quality.get("kept", 0),
            "quality": None if quality is None else bool(quality.get("success")),
            "data_docs": (run / "reports" / "data_docs" / "index.html").is_file()}


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


def quality_report(run: Path, airflow_run: dict | None = None) -> dict:
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
    state = run_state(run, airflow_run)
    if quality is not None:
        status = "passed" if quality.get("success") else "failed"
    elif state["state"] == "failed":
        status = "not validated: the run failed"
    elif state["state"] == "success":
        status = "not validated"
    else:
        status = "not validated yet"
    return {
        "run": run.name, "run_state": state, "status": status,
        "prompts": plan.get("rows"), "samples": (quality or {}).get("samples"), "kept": (quality or {}).get("kept"),
        "quarantined": sum(n for reasons in by_stage.values() for n in reasons.values()),
        "quarantined_by_stage": by_stage,
        "expectations": expectations, "statistics": (quality or {}).get("statistics", {}),
        "loss_mask": {"samples": len(masks), "empty_at_or_below": empty_at,
                      "empty": sum(1 for m in masks if m <= empty_at),
                      "histogram": histogram(masks, split_at=empty_at)},
        "data_docs": (run / "reports" / "data_docs" / "index.html").is_file(),
    }


# ------------------------------------------------------------------------------------------------ shards
def _statuses(run: Path) -> dict[int, dict]:
    out = {}
    for path in sorted((run / "status").glob("shard-*.json")):
        status = _cached(path, "status", shard_status.read)  # a finished shard's file never changes again
        if status is not None:
            out[int(status["shard"])] = status
    return out


def _planned_shards(run: Path) -> list[dict]:
    plan = _cached(run / "shards" / "plan.json", "json", lambda p: json.loads(p.read_text())) or {}
    return plan.get("shards", [])


def _checkpointed(run: Path) -> dict[int, int]:
    """Rows on disk per shard: completions and prompts a server refused, merged or still in parts."""
    out: dict[int, int] = {}
    for sub in ("completions", "failures"):
        for path in _result_files(run / sub):
            out[_shard_of(path)] = out.get(_shard_of(path), 0) + _rows(path)
        _forget_missing(run / sub)
    return out


def _assignment(run: Path) -> dict:
    """Several nodes: {node: {"shards": [...], ...}} from reports/assignment.json; {} for a one-node run."""
    return (_json(run / "reports" / "assignment.json") or {}).get("nodes", {})


def _generate_tis(run: Path, airflow_run: dict | None) -> dict[int, dict]:
    """The generate task instance of each shard: `generate[i]` is shard i; with several nodes,
    `<node>.generate[i]` is the node's i-th assigned shard."""
    assignment, out = _assignment(run), {}
    for t in (airflow_run or {}).get("tasks", []):
        if t["task_id"] == "generate":
            out[t["map_index"]] = t
        elif t["task_id"].endswith(".generate") and t["map_index"] >= 0:
            mine = assignment.get(t["task_id"].split(".")[0], {}).get("shards", [])
            if t["map_index"] < len(mine):
                out[mine[t["map_index"]]] = t
    return out


def _fleet_dirs(run: Path) -> list[Path]:
    """fleet/, or fleet/<node>/ for each node of a run on several nodes."""
    nodes = sorted(p for p in (run / "fleet").glob("*") if p.is_dir())
    return nodes or [run / "fleet"]


def _attempt_outcome(attempt: dict, later: bool, ti_state: str | None) -> str:
    """What became of an attempt; one left 'running' ended without a word if anything came after it."""
    if attempt.get("state") != "running":
        return attempt["state"]
    if later or (ti_state is not None and ti_state not in RUNNING_STATES):
        return "lost"  # its task process was killed before it could say so
    return "running"


def shards(run: Path, airflow_run: dict | None = None, now: float | None = None) -> list[dict]:
    """One row per planned shard: state, server, attempts, done/total, output tok/s of its latest attempt."""
    now = time.time() if now is None else now
    statuses = _statuses(run)
    on_disk = _checkpointed(run)
    tis = _generate_tis(run, airflow_run)
    rows = []
    planned_by_shard = {s["shard"]: s for s in _planned_shards(run)}
    for n in sorted(set(planned_by_shard) | set(statuses) | set(on_disk)):
        planned = planned_by_shard.get(n, {})
        status = statuses.get(n) or {}
        attempts = status.get("attempts", [])
        ti = tis.get(n)
        outcomes = [_attempt_outcome(a, i + 1 < len(attempts), ti and ti["state"]) for i, a in enumerate(attempts)]
        last = attempts[-1] if attempts else {}
        state = (ti or {}).get("state") or (outcomes[-1] if outcomes else None)
        if state is None:
            state = "done" if (run / "completions" / f"shard-{n:05d}.parquet").is_file() else "waiting"
        seconds = (last.get("updated_at") or 0) - (last.get("started_at") or 0)
        done = max(on_disk.get(n, 0), status.get("done", 0) + status.get("quarantined", 0))
        rows.append({"shard": n, "state": state, "server": last.get("server"), "attempts": len(attempts),
                     "done": done, "total": planned.get("prompts") or status.get("total"),
                     "tok_s": last.get("output_tokens", 0) / seconds if seconds > 0 else None,
                     "last_heard_s": now - last["updated_at"] if last.get("updated_at") else None,
                     "history": [{**a, "outcome": o} for a, o in zip(attempts, outcomes, strict=True)]})
    return rows


def incidents(run: Path, shard_rows: list[dict]) -> list[dict]:
    """Server deaths, shard failures and retries, fleet relaunches, in time order ({at, kind, text})."""
    out = []
    for row in shard_rows:
        history = row["history"]
        for i, a in enumerate(history):
            if i:
                out.append({"at": a["started_at"], "kind": "retry",
                            "text": f"shard {row['shard']} retried on {a['server']} ({a['done_before']:,} done "
                                    "before, sends only the rest)"})
            if a["outcome"] == "failed":
                error = a.get("error") or f"failed on {a['server']} (no message)"
                prefix = "" if error.startswith(f"shard {row['shard']} ") else f"shard {row['shard']}: "
                out.append({"at": a.get("ended_at") or a["updated_at"], "kind": "shard failed",
                            "text": prefix + error})
            elif a["outcome"] == "lost":
                out.append({"at": a["updated_at"], "kind": "shard failed",
                            "text": f"shard {row['shard']} on {a['server']} stopped without a word after "
                                    f"{a['done']:,} done (its task process was killed?)"})
    fleets = _fleet_dirs(run)
    for marker in sorted(m for fleet in fleets for m in fleet.glob("unhealthy-*")):
        try:
            reason, at = _first_line(marker.read_text()), marker.stat().st_mtime
        except OSError:
            continue
        out.append({"at": at, "kind": "server unhealthy", "text": reason})
    launches = [r.get("launched_at") for r in (_json(p) for f in fleets for p in f.glob("server-*.json")) if r]
    first_attempt = min((a["started_at"] for row in shard_rows for a in row["history"]), default=None)
    launches = [t for t in launches if t]
    if launches and first_attempt is not None and min(launches) > first_attempt:
        out.append({"at": min(launches), "kind": "relaunch",
                    "text": f"fleet relaunched ({len(launches)} servers) after shard work had started"})
    return sorted(out, key=lambda i: i["at"])


# ------------------------------------------------------------------------------------------------ fleet
def _completion_arrays(path: Path):
    table = pq.read_table(path, columns=["finished_at", "completion_tokens", "server"])
    finished = table.column("finished_at").to_numpy(zero_copy_only=False).astype(float)
    tokens = table.column("completion_tokens").fill_null(0).to_numpy(zero_copy_only=False).astype(float)
    servers = table.column("server").dictionary_encode().combine_chunks()
    names = servers.dictionary.to_pylist()
    codes = servers.indices.to_numpy(zero_copy_only=False)
    return {name: (finished[codes == i], tokens[codes == i]) for i, name in enumerate(names)}


def _segments(stamps: np.ndarray, cells: int = 4000) -> list[tuple[float, float]]:
    """Stretches of work: a pause of more than 5% of the run (and 10 s) between two answers splits them.

    Found on a grid of `cells` over the run, not by sorting every answer (902K of them at full scale); each
    stretch's ends are then the exact first and last answer in it.
    """
    lo, hi = float(stamps.min()), float(stamps.max())
    gap = max(0.05 * (hi - lo), 10.0)
    width = max((hi - lo) / cells, 1e-9)
    occupied = np.nonzero(np.bincount(((stamps - lo) / width).astype(int).clip(0, cells - 1), minlength=cells))[0]
    cuts = np.nonzero((np.diff(occupied) + 1) * width > gap)[0]  # candidates; the exact gap is checked below
    bounds = [lo] + [lo + occupied[c + 1] * width for c in cuts] + [hi + width]
    out: list[tuple[float, float]] = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        inside = stamps[(stamps >= a) & (stamps < b)]
        if not inside.size:
            continue
        first, last = float(inside.min()), float(inside.max())
        if out and first - out[-1][1] <= gap:
            out[-1] = (out[-1][0], last)
        else:
            out.append((first, last))
    return out


def throughput_series(by_server: dict[str, tuple[np.ndarray, np.ndarray]], marks: list[dict] = (),
                      points: int = THROUGHPUT_POINTS) -> dict:
    """Output tok/s per server over the time the fleet worked, pauses cut out (a break marks each, with its
    length), and `marks` ({at, kind, text}) placed on the same axis. Positions are in bins."""
    stamps = np.concatenate([f for f, _ in by_server.values()]) if by_server else np.array([])
    if not stamps.size:
        return {"start": None, "bin_s": 0, "bins": 0, "servers": {}, "breaks": [], "marks": [], "ticks": []}
    segments = _segments(stamps)
    start = segments[0][0]
    bin_s = max(sum(e - s for s, e in segments) / points, 1.0)
    offsets, n = [], 0
    for s, e in segments:
        offsets.append(n)
        n += int((e - s) // bin_s) + 1

    starts = np.array([s for s, _ in segments])
    lengths = np.array([e - s for s, e in segments])

    def position(t: np.ndarray) -> np.ndarray:
        """Bin position on the cut axis; a time inside a pause lands at the cut, before the start at 0."""
        k = (np.searchsorted(starts, t, side="right") - 1).clip(0)
        return np.where(t < start, 0.0, np.array(offsets)[k] + np.minimum(t - starts[k], lengths[k] + bin_s) / bin_s)

    series = {}
    for name, (finished, tokens) in sorted(by_server.items()):
        values = np.bincount(position(finished).astype(int).clip(0, n - 1), weights=tokens / bin_s, minlength=n)
        series[name] = [round(float(v), 1) for v in values]
    breaks = [{"at": off, "idle_s": s - prev_e}
              for (s, _), (_, prev_e), off in zip(segments[1:], segments[:-1], offsets[1:], strict=True)]
    ticks = [{"at": off, "elapsed_s": s - start} for (s, _), off in zip(segments, offsets, strict=True)]
    placed = [{**m, "at_bin": float(position(np.array([m["at"]]))[0])} for m in marks]
    return {"start": start, "bin_s": bin_s, "bins": n, "servers": series, "breaks": breaks, "ticks": ticks,
            "marks": placed, "segments": [{"start": s, "end": e} for s, e in segments]}


def progress(run: Path, shard_rows: list[dict], state: dict, capacity: dict | None, now: float | None = None) -> dict:
    """Prompts done of those planned (checkpointed, plus what running shards report from memory), the rate
    since the first shard started, and the ETA (the capacity plan's until the fleet has finished anything)."""
    now = time.time() if now is None else now
    plan = _json(run / "reports" / "plan.json") or {}
    total = plan.get("accepted")
    done = sum(r["done"] for r in shard_rows)
    first = [r["history"][0] for r in shard_rows if r["history"]]
    started = min((a["started_at"] for a in first), default=None)
    resumed = sum(a["done_before"] for a in first)  # done before this run's first attempt: not this run's work
    left = None if total is None else max(total - done, 0)
    running = [r["shard"] for r in shard_rows if r["state"] in {"running"}]
    rate = eta = None
    eta_source = None
    stopped = state.get("state") in {"failed", "success"}
    if started is not None and done > resumed:
        rate = (done - resumed) / max(now - started, 1e-9)
        eta, eta_source = (left / rate if left else 0.0), "rate since the first shard started"
    elif started is not None and capacity:
        wall = capacity["scenarios"][0]["wall_s"]
        eta, eta_source = max(wall - (now - started), 0.0), "capacity plan (nothing finished yet)"
    if stopped:
        eta, eta_source = (0.0 if left == 0 else None), ("run finished" if left == 0 else f"run {state['state']}")
    return {"planned": total, "done": done, "left": left, "share": (done / total) if total else None,
            "running_shards": running, "rate_per_s": rate, "eta_s": eta, "eta_source": eta_source,
            "started_at": started}


def kv_headroom(health: dict, capacity: dict | None) -> dict | None:
    """One figure for how many requests the KV cache holds: the capacity plan's (measured request lengths)
    when calibrate ran, else health_check's (the Params' expected lengths)."""
    if capacity:
        alloc = (capacity.get("allocation") or [{}])[0]
        run = capacity.get("run", {})
        tokens = run.get("mean_prompt_tokens", 0) + run.get("mean_output_tokens", 0)
        if alloc.get("kv_tokens") and tokens:
            return {"requests": int(alloc["kv_tokens"] // tokens), "request_tokens": round(tokens),
                    "kv_tokens": alloc["kv_tokens"], "source": "request sizes measured by calibrate"}
    for s in health.get("servers", []):
        if s.get("kv_request_capacity") and s.get("allocation"):
            kv = s["allocation"]["kv_tokens"]
            return {"requests": s["kv_request_capacity"], "kv_tokens": kv,
                    "request_tokens": round(kv / s["kv_request_capacity"]),
                    "source": "the Params' expected prompt and output tokens (calibrate has not measured them)"}
    return None


def capacity_advice(capacity: dict | None) -> dict | None:
    """Advise a relaunch only when the plan predicts it faster, with the numbers that say by how much."""
    if not capacity:
        return None
    scenarios = {s["name"]: s for s in capacity.get("scenarios", [])}
    current, advised = scenarios.get("current"), scenarios.get("advised")
    flags = (capacity.get("advice") or {}).get("server_flags")
    if not current or not advised or not flags:
        return {"relaunch": False, "reason": "the current settings are the best the planner knows for this fleet"}
    gain = 1 - advised["wall_s"] / current["wall_s"]
    common = {"flags": flags, "concurrency": capacity["advice"].get("concurrency_per_server_advised"),
              "current_wall_s": current["wall_s"], "advised_wall_s": advised["wall_s"], "gain": gain,
              "gpu_hours_saved": current["gpu_hours"] - advised["gpu_hours"]}
    if gain < ADVICE_MIN_GAIN:
        return {**common, "relaunch": False,
                "reason": f"the planner's alternative ({flags}) is not predicted to be faster, so keep the "
                          "current settings"}
    return {**common, "relaunch": True}


def _servers(health: dict, smoke: dict, node: str = "") -> list[dict]:
    smoke_by_server = {s["server"]: s for s in smoke.get("servers", [])}
    servers = []
    for h in health.get("servers", []):
        s = smoke_by_server.get(h["server"], {})
        servers.append({"server": h["server"], "node": node, "healthy": h.get("healthy"),
                        "allocation": h.get("allocation", {}), "binding": h.get("binding"),
                        "problems": h.get("problems", []), "smoke_ok": s.get("ok"), "smoke": s.get("results", [])})
    return servers


def nodes_report(run: Path, shard_rows: list[dict]) -> list[dict]:
    """Several nodes: per node its gates, share of the run (assigned, predicted) and progress (done, measured:
    first shard started to last shard ended or now); [] for a one-node run."""
    folder = run / "reports" / "nodes"
    names = sorted(p.name for p in folder.glob("*") if p.is_dir())
    assignment = _assignment(run)
    rows_by_shard = {r["shard"]: r for r in shard_rows}
    out = []
    for name in names:
        health, smoke = _json(folder / name / "health.json") or {}, _json(folder / name / "smoke.json") or {}
        assigned = assignment.get(name, {})
        mine = [rows_by_shard[n] for n in assigned.get("shards", []) if n in rows_by_shard]
        attempts = [a for r in mine for a in r["history"]]
        start = min((a["started_at"] for a in attempts), default=None)
        end = max((a.get("ended_at") or a["updated_at"] for a in attempts), default=None)
        left_out = (_json(folder / name / "left_out.json") or {}).get("error")
        out.append({"node": name, "health_passed": health.get("passed"), "smoke_passed": smoke.get("passed"),
                    "left_out": left_out, "servers": len(health.get("servers", [])),
                    "shards": len(assigned.get("shards", [])), "prompts": assigned.get("prompts"),
                    "rate_share": assigned.get("rate_share"), "predicted_s": assigned.get("predicted_s"),
                    "done": sum(r["done"] for r in mine),
                    "running_shards": sum(r["state"] == "running" for r in mine),
                    "measured_s": (end - start) if start is not None else None})
    return out


def fleet_report(run: Path, airflow_run: dict | None = None, now: float | None = None) -> dict:
    now = time.time() if now is None else now
    reports = run / "reports"
    health = _json(reports / "health.json") or {}
    smoke = _json(reports / "smoke.json") or {}
    capacity = _json(reports / "capacity.json")
    servers = _servers(health, smoke)
    state = run_state(run, airflow_run)
    shard_rows = shards(run, airflow_run, now)
    nodes = nodes_report(run, shard_rows)
    for node in nodes:  # several nodes: every node's servers, the gates passed only if every node's did
        folder = reports / "nodes" / node["node"]
        servers += _servers(_json(folder / "health.json") or {}, _json(folder / "smoke.json") or {}, node["node"])
    if nodes:
        health = {"passed": all(n["health_passed"] for n in nodes) if all(n["health_passed"] is not None
                                                                          for n in nodes) else None}
        smoke = {"passed": all(n["smoke_passed"] for n in nodes) if all(n["smoke_passed"] is not None
                                                                         for n in nodes) else None}
    events = incidents(run, shard_rows)
    by_server: dict[str, list] = {}
    for path in _result_files(run / "completions"):
        for name, arrays in (_cached(path, "throughput", _completion_arrays) or {}).items():
            by_server.setdefault(name, []).append(arrays)
    merged = {name: (np.concatenate([f for f, _ in parts]), np.concatenate([t for _, t in parts]))
              for name, parts in by_server.items()}
    listed = shard_rows
    if len(shard_rows) > SHARDS_LISTED:
        listed = [r for r in shard_rows if r["state"] not in {"success", "done"} or r["attempts"] > 1]
    return {"run": run.name, "run_state": state,
            "health_passed": health.get("passed"), "health_error": health.get("error"),
            "smoke_passed": smoke.get("passed"), "smoke_error": smoke.get("error"),
            "smoke_max_tokens": smoke.get("max_tokens"), "servers": servers, "nodes": nodes,
            "progress": progress(run, shard_rows, state, capacity, now),
            "shards": shard_rows, "shards_listed": listed, "incidents": events,
            "throughput": throughput_series(merged, events),
            "kv": kv_headroom(health, capacity), "advice": capacity_advice(capacity), "capacity": capacity,
            "autotune": _json(reports / "autotune.json")}
