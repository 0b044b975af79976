"""A run's progress, one model for every reader: each shard's state and rows done, this run's answers per server,
the fleet's output tok/s over the time it worked, prompts done of those planned, the rate and the ETA.

The Fleet page (ui/fleet_page.py), the Prometheus export (ui/metrics.py) and the progress message (notify.py)
read their figures here, from the run folder's small files (ui/files.py's cache, so a refresh reads only what
changed since the last one)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_regen.layout import COMPLETIONS, FAILURES, RunLayout, shard_of
from dflash_regen.ui.files import cached, forget_missing, read_json, row_count, shard_statuses
from dflash_regen.ui.runs import RUNNING_STATES, generate_tis, run_state

THROUGHPUT_POINTS = 60
SLOW_SHARE = 0.75  # a server below this share of the median server's output tok/s is marked slow

Answers = dict[str, tuple[np.ndarray, np.ndarray]]  # per server: finished_at and completion_tokens of each answer


def _planned_shards(run: Path) -> list[dict]:
    plan = cached(RunLayout(run).plan, "json", lambda p: json.loads(p.read_text())) or {}
    return plan.get("shards", [])


def _checkpointed(run: Path) -> dict[int, int]:
    """Rows on disk per shard: completions and prompts a server refused, merged or still in parts."""
    out: dict[int, int] = {}
    layout = RunLayout(run)
    for kind in (COMPLETIONS, FAILURES):
        for path in layout.result_files(kind):
            out[shard_of(path)] = out.get(shard_of(path), 0) + row_count(path)
        forget_missing(layout.results_dir(kind))
    return out


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
    statuses = shard_statuses(run)
    on_disk = _checkpointed(run)
    tis = generate_tis(run, airflow_run)
    rows = []
    planned_by_shard = {s["shard"]: s for s in _planned_shards(run)}
    for n in sorted(set(planned_by_shard) | set(statuses) | set(on_disk)):
        planned = planned_by_shard.get(n, {})
        status = statuses.get(n) or {}
        attempts = status.get("attempts", [])
        ti = tis.get(n)
        ti_state = ti["state"] if ti else None
        outcomes = [_attempt_outcome(a, i + 1 < len(attempts), ti_state) for i, a in enumerate(attempts)]
        last = attempts[-1] if attempts else {}
        state = (ti or {}).get("state") or (outcomes[-1] if outcomes else None)
        if state is None:
            state = "done" if RunLayout(run).merged(COMPLETIONS, n).is_file() else "waiting"
        seconds = (last.get("updated_at") or 0) - (last.get("started_at") or 0)
        done = max(on_disk.get(n, 0), status.get("done", 0) + status.get("quarantined", 0))
        rows.append({"shard": n, "state": state, "server": last.get("server"), "attempts": len(attempts),
                     "done": done, "total": planned.get("prompts") or status.get("total"),
                     "tok_s": last.get("output_tokens", 0) / seconds if seconds > 0 else None,
                     "last_heard_s": now - last["updated_at"] if last.get("updated_at") else None,
                     "history": [{**a, "outcome": o} for a, o in zip(attempts, outcomes, strict=True)]})
    return rows


def completion_arrays(path: Path, run: str):
    """finished_at and completion_tokens per server, of the answers `run` generated itself (a file the store
    linked in holds another run's answers, with their own times)."""
    names = pq.read_schema(path).names
    table = pq.read_table(path, columns=["finished_at", "completion_tokens", "server"] +
                          (["source_run"] if "source_run" in names else []))
    if "source_run" in names:
        source = table.column("source_run")
        table = table.filter(pc.or_kleene(pc.equal(source, run), pc.is_null(source)))
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


def throughput_series(by_server: Answers, marks: Sequence[dict] = (),
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


def progress(run: Path, shard_rows: list[dict], state: dict, capacity: dict | None,
             by_server: Answers | None = None, now: float | None = None) -> dict:
    """Prompts done of those planned (checkpointed, plus what running shards report in their heartbeat), the
    rate and the ETA (the capacity plan's until the fleet has checkpointed anything), and each server's output
    tok/s with the slow ones marked.

    The rate is the prompts done (checkpointed, plus what running shards' heartbeats report from memory) over the
    time the fleet worked since this run's first checkpointed answer (`by_server`: finished_at and tokens per
    server): pauses with no answer cut out, up to now while the run goes on and to its last answer once it has
    ended, so a finished run keeps its final rate. Not from the first shard's start: the requests in flight take
    a while to fill the pipe, and those first seconds put the ETA at twice the final figure. Not from checkpointed
    answers alone: between checkpoints (50 answers or 30 s a shard) their count stands still while time runs, and
    the ETA would saw-tooth by as much. tests/live/test_airflow_ui.py holds the ETA to the final figure."""
    now = time.time() if now is None else now
    plan = read_json(RunLayout(run).report("plan")) or {}
    # Completions the store supplied (generated by earlier runs) are not this run's to generate: counted apart.
    reused = sum(n for source, n in ((plan.get("reuse") or {}).get("by_source_run") or {}).items()
                 if source != run.name)
    total = None if plan.get("accepted") is None else plan["accepted"] - reused
    done = max(sum(r["done"] for r in shard_rows) - reused, 0)
    started = min((r["history"][0]["started_at"] for r in shard_rows if r["history"]), default=None)
    left = None if total is None else max(total - done, 0)
    running = [r["shard"] for r in shard_rows if r["state"] in {"running"}]
    ended = state.get("state") in {"failed", "success"}
    work_s, servers = _work_time(by_server or {}, started, None if ended else now)
    answers = sum(len(f) for f, _ in servers.values())
    rate = done / work_s if answers and done and work_s else None
    eta = eta_source = None
    if rate:
        eta, eta_source = (left / rate if left else 0.0), "prompts done over the time worked since the first answer"
    elif started is not None and capacity:
        wall = capacity["scenarios"][0]["wall_s"]
        eta, eta_source = max(wall - (now - started), 0.0), "capacity plan (nothing checkpointed yet)"
    if ended:
        eta, eta_source = (0.0 if left == 0 else None), ("run finished" if left == 0 else f"run {state['state']}")
    tok_s = {name: float(t.sum()) / work_s for name, (_, t) in servers.items()} if work_s else {}
    median = float(np.median(list(tok_s.values()))) if tok_s else 0.0
    return {"planned": total, "done": done, "left": left, "share": (done / total) if total else None,
            "reused": reused, "running_shards": running, "rate_per_s": rate, "eta_s": eta, "eta_source": eta_source,
            "eta_at": now + eta if eta else None, "started_at": started, "work_s": work_s,
            "servers": [{"server": name, "tok_s": v, "answers": len(servers[name][0]),
                         "slow": len(tok_s) > 1 and v < SLOW_SHARE * median} for name, v in sorted(tok_s.items())]}


def _work_time(by_server: Answers, started: float | None,
               until: float | None) -> tuple[float | None, Answers]:
    """Seconds the fleet worked from its first answer since `started` to `until` (None: to the last answer), pauses
    with no answer cut out, and each server's answers in that time (those before `started` are another run's)."""
    if started is None:
        return None, {}
    servers = {name: (f[f >= started], t[f >= started]) for name, (f, t) in by_server.items()}
    servers = {name: ft for name, ft in servers.items() if len(ft[0])}
    if not servers:
        return None, {}
    segments = _segments(np.concatenate([f for f, _ in servers.values()]))
    idle = sum(b[0] - a[1] for a, b in zip(segments, segments[1:], strict=False))
    end = max(until or 0.0, segments[-1][1])
    return max(end - segments[0][0] - idle, 1e-9), servers




def answers_by_server(run: Path) -> Answers:
    """This run's own answers over all its completion files, merged and parts (each file read again only when it
    changed)."""
    parts: dict[str, list] = {}
    for path in RunLayout(run).result_files(COMPLETIONS):
        for name, arrays in (cached(path, "throughput", lambda p: completion_arrays(p, run.name)) or {}).items():
            parts.setdefault(name, []).append(arrays)
    return {name: (np.concatenate([f for f, _ in ps]), np.concatenate([t for _, t in ps]))
            for name, ps in parts.items()}


def run_progress(run: Path, airflow_run: dict | None = None, now: float | None = None) -> tuple[list[dict], dict]:
    """The shard rows and the progress of a run, as the Fleet page shows them."""
    now = time.time() if now is None else now
    rows = shards(run, airflow_run, now)
    capacity = read_json(RunLayout(run).report("capacity"))
    return rows, progress(run, rows, run_state(run, airflow_run), capacity, answers_by_server(run), now)
