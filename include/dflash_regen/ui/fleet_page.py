"""The fleet page's data: incidents, the servers with their gates and marks, KV headroom, the capacity plan's
advice, the nodes of a multi-node run, and the shard table; the shard rows, progress, ETA and throughput come from
the progress model (ui/progress.py)."""

from __future__ import annotations

import time
from pathlib import Path

from dflash_regen.fleet.servers import unhealthy_history
from dflash_regen.generate.shard import drain_request
from dflash_regen.layout import FleetFiles, RunLayout
from dflash_regen.ui.files import node_assignment, read_json
from dflash_regen.ui.progress import answers_by_server, progress, shards, throughput_series
from dflash_regen.ui.runs import first_line, run_state

SHARDS_LISTED = 50  # rows in the page's shard table at most (fleet.json has them all): 903 rows are unreadable
# The order shards take a row in: what needs the operator first, then what is going on, then what went well.
LISTING_ORDER = {"failed": 0, "upstream_failed": 0, "lost": 0, "up_for_retry": 1, "running": 2}
ADVICE_MIN_GAIN = 0.02  # advise a relaunch only when it is predicted at least this much faster


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
            reason, at = first_line(marker.read_text()), marker.stat().st_mtime
        except OSError:
            continue
        if (reason, round(at)) not in logged:
            out.append({"at": at, "kind": "server unhealthy", "text": reason})
    specs = (read_json(p) for f in fleets for p in f.server_specs())
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
    assignment = node_assignment(run)
    rows_by_shard = {r["shard"]: r for r in shard_rows}
    out = []
    for name in names:
        health = read_json(layout.node_report("health", name)) or {}
        smoke = read_json(layout.node_report("smoke", name)) or {}
        assigned = assignment.get(name, {})
        mine = [rows_by_shard[n] for n in assigned.get("shards", []) if n in rows_by_shard]
        attempts = [a for r in mine for a in r["history"]]
        start = min((a["started_at"] for a in attempts), default=None)
        end = max((a.get("ended_at") or a["updated_at"] for a in attempts), default=None)
        left_out = (read_json(layout.node_report("left_out", name)) or {}).get("error")
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
    health = read_json(layout.report("health")) or {}
    smoke = read_json(layout.report("smoke")) or {}
    capacity = read_json(layout.report("capacity"))
    servers = _servers(health, smoke)
    state = run_state(run, airflow_run)
    shard_rows = shards(run, airflow_run, now)
    nodes = nodes_report(run, shard_rows)
    for node in nodes:  # several nodes: every node's servers, the gates passed only if every node's did
        health_file, smoke_file = layout.node_report("health", node["node"]), layout.node_report("smoke", node["node"])
        servers += _servers(read_json(health_file) or {}, read_json(smoke_file) or {}, node["node"])
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
    merged = answers_by_server(run)
    listed, unlisted = listed_shards(shard_rows)
    return {"run": run.name, "run_state": state, "drain": drain_request(layout.drain_request),
            "health_passed": health.get("passed"), "health_error": health.get("error"),
            "smoke_passed": smoke.get("passed"), "smoke_error": smoke.get("error"),
            "smoke_max_tokens": smoke.get("max_tokens"), "servers": servers, "nodes": nodes,
            "progress": progress(run, shard_rows, state, capacity, merged, now),
            "shards": shard_rows, "shards_listed": listed, "shards_unlisted": unlisted, "incidents": events,
            "throughput": throughput_series(merged, events),
            "kv": kv_headroom(health, capacity), "advice": capacity_advice(capacity), "capacity": capacity,
            "autotune": read_json(layout.report("autotune"))}
