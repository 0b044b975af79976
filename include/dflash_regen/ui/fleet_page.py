"""The fleet page's data: each shard's attempts and incidents, throughput per server, progress and ETA, KV headroom,
the capacity plan's advice, and the nodes of a multi-node run."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_regen.fleet.servers import unhealthy_history
from dflash_regen.generate.shard import drain_request
from dflash_regen.layout import COMPLETIONS, FAILURES, FleetFiles, RunLayout, shard_of
from dflash_regen.ui.files import _assignment, _cached, _forget_missing, _json, _rows, _statuses
from dflash_regen.ui.runs import RUNNING_STATES, _first_line, _generate_tis, run_state

THROUGHPUT_POINTS = 60
SHARDS_LISTED = 50  # rows in the page's shard table at most (fleet.json has them all): 903 rows are unreadable
# The order shards take a row in: what needs the operator first, then what is going on, then what went well.
LISTING_ORDER = {"failed": 0, "upstream_failed": 0, "lost": 0, "up_for_retry": 1, "running": 2}
ADVICE_MIN_GAIN = 0.02  # advise a relaunch only when it is predicted at least this much faster
SLOW_SHARE = 0.75  # a server below this share of the median server's output tok/s is marked slow


def _planned_shards(run: Path) -> list[dict]:
    plan = _cached(RunLayout(run).plan, "json", lambda p: json.loads(p.read_text())) or {}
    return plan.get("shards", [])


def _checkpointed(run: Path) -> dict[int, int]:
    """Rows on disk per shard: completions and prompts a server refused, merged or still in parts."""
    out: dict[int, int] = {}
    layout = RunLayout(run)
    for kind in (COMPLETIONS, FAILURES):
        for path in layout.result_files(kind):
            out[shard_of(path)] = out.get(shard_of(path), 0) + _rows(path)
        _forget_missing(layout.results_dir(kind))
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
    fleets = [FleetFiles(d) for d in RunLayout(run).fleet_dirs()]
    logged = {(h["reason"], round(h["at"])) for h in _unhealthy(run)}
    out += [{"at": h["at"], "kind": "server unhealthy", "text": h["reason"]} for h in _unhealthy(run)]
    for marker in sorted(m for fleet in fleets for m in fleet.unhealthy_markers()):  # run folders before the log
        try:
            reason, at = _first_line(marker.read_text()), marker.stat().st_mtime
        except OSError:
            continue
        if (reason, round(at)) not in logged:
            out.append({"at": at, "kind": "server unhealthy", "text": reason})
    specs = (_json(p) for f in fleets for p in f.server_specs())
    launches = [r["launched_at"] for r in specs if r and r.get("launched_at")]
    first_attempt = min((a["started_at"] for row in shard_rows for a in row["history"]), default=None)
    if launches and first_attempt is not None and min(launches) > first_attempt:
        out.append({"at": min(launches), "kind": "relaunch",
                    "text": f"fleet relaunched ({len(launches)} servers) after shard work had started"})
    return sorted(out, key=lambda i: i["at"])


def short_name(server: str | None) -> str:
    """'server 2 (GPU 2, 127.0.0.1:30002)' -> 'server 2' ('-' for none): narrow tables show the rest on hover."""
    return "-" if not server else server.split(" (", 1)[0]


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _unhealthy(run: Path) -> list[dict]:
    """Every server marked unhealthy in this run, relaunches included, each with its fleet dir's node."""
    layout = RunLayout(run)
    return [{**h, "node": d.name if d != layout.fleet_dir else ""}
            for d in layout.fleet_dirs() for h in unhealthy_history(d)]


def _completion_arrays(path: Path, run: str):
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


def throughput_series(by_server: dict[str, tuple[np.ndarray, np.ndarray]], marks: Sequence[dict] = (),
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
             by_server: dict[str, tuple[np.ndarray, np.ndarray]] | None = None, now: float | None = None) -> dict:
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
    plan = _json(RunLayout(run).report("plan")) or {}
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


def _work_time(by_server: dict[str, tuple[np.ndarray, np.ndarray]], started: float | None,
               until: float | None) -> tuple[float | None, dict[str, tuple[np.ndarray, np.ndarray]]]:
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
    layout = RunLayout(run)
    names = layout.report_nodes()
    assignment = _assignment(run)
    rows_by_shard = {r["shard"]: r for r in shard_rows}
    out = []
    for name in names:
        health, smoke = _json(layout.node_report("health", name)) or {}, _json(layout.node_report("smoke", name)) or {}
        assigned = assignment.get(name, {})
        mine = [rows_by_shard[n] for n in assigned.get("shards", []) if n in rows_by_shard]
        attempts = [a for r in mine for a in r["history"]]
        start = min((a["started_at"] for a in attempts), default=None)
        end = max((a.get("ended_at") or a["updated_at"] for a in attempts), default=None)
        left_out = (_json(layout.node_report("left_out", name)) or {}).get("error")
        out.append({"node": name, "health_passed": health.get("passed"), "smoke_passed": smoke.get("passed"),
                    "left_out": left_out, "servers": len(health.get("servers", [])),
                    "shards": len(assigned.get("shards", [])), "prompts": assigned.get("prompts"),
                    "rate_share": assigned.get("rate_share"), "predicted_s": assigned.get("predicted_s"),
                    "done": sum(r["done"] for r in mine),
                    "running_shards": sum(r["state"] == "running" for r in mine),
                    "measured_s": (end - start) if start is not None else None})
    return out


def listed_shards(shard_rows: list[dict], limit: int = SHARDS_LISTED) -> tuple[list[dict], dict[str, int]]:
    """The shard table's rows, at most `limit`: failed first, then up for retry, running, retried, the rest; the
    slowest first within each (by tok/s of the latest attempt). Returns them in that order and how many of each
    state are left out."""
    def rank(row: dict) -> tuple:
        group = LISTING_ORDER.get(row["state"], 3 if row["attempts"] > 1 else 4)
        return group, row["tok_s"] if row["tok_s"] is not None else float("inf"), row["shard"]

    ordered = sorted(shard_rows, key=rank)
    unlisted: dict[str, int] = {}
    for row in ordered[limit:]:
        unlisted[row["state"]] = unlisted.get(row["state"], 0) + 1
    return ordered[:limit], unlisted


def fleet_report(run: Path, airflow_run: dict | None = None, now: float | None = None) -> dict:
    now = time.time() if now is None else now
    layout = RunLayout(run)
    health = _json(layout.report("health")) or {}
    smoke = _json(layout.report("smoke")) or {}
    capacity = _json(layout.report("capacity"))
    servers = _servers(health, smoke)
    state = run_state(run, airflow_run)
    shard_rows = shards(run, airflow_run, now)
    nodes = nodes_report(run, shard_rows)
    for node in nodes:  # several nodes: every node's servers, the gates passed only if every node's did
        health_file, smoke_file = layout.node_report("health", node["node"]), layout.node_report("smoke", node["node"])
        servers += _servers(_json(health_file) or {}, _json(smoke_file) or {}, node["node"])
    if nodes:
        health = {"passed": all(n["health_passed"] for n in nodes) if all(n["health_passed"] is not None
                                                                          for n in nodes) else None}
        smoke = {"passed": all(n["smoke_passed"] for n in nodes) if all(n["smoke_passed"] is not None
                                                                         for n in nodes) else None}
    marked = _unhealthy(run)
    for server in servers:  # a GPU that died stays marked after a relaunch, beside any later health check
        index = short_name(server["server"])
        server["marked"] = [h for h in marked if h["node"] == server["node"] and f"server {h['server']}" == index]
        checked = layout.node_report("health", server["node"]) if server["node"] else layout.report("health")
        server["checked_at"] = _mtime(checked)
    events = incidents(run, shard_rows)
    by_server: dict[str, list] = {}
    for path in layout.result_files(COMPLETIONS):
        own = _cached(path, "throughput", lambda p: _completion_arrays(p, run.name)) or {}
        for name, arrays in own.items():
            by_server.setdefault(name, []).append(arrays)
    merged = {name: (np.concatenate([f for f, _ in parts]), np.concatenate([t for _, t in parts]))
              for name, parts in by_server.items()}
    listed, unlisted = listed_shards(shard_rows)
    return {"run": run.name, "run_state": state, "drain": drain_request(layout.drain_request),
            "health_passed": health.get("passed"), "health_error": health.get("error"),
            "smoke_passed": smoke.get("passed"), "smoke_error": smoke.get("error"),
            "smoke_max_tokens": smoke.get("max_tokens"), "servers": servers, "nodes": nodes,
            "progress": progress(run, shard_rows, state, capacity, merged, now),
            "shards": shard_rows, "shards_listed": listed, "shards_unlisted": unlisted, "incidents": events,
            "throughput": throughput_series(merged, events),
            "kv": kv_headroom(health, capacity), "advice": capacity_advice(capacity), "capacity": capacity,
            "autotune": _json(layout.report("autotune"))}
