"""The capacity report (`<run>/reports/capacity.json`): a measurement and health_check's figures planned into
scenarios (current, advised, train-length budget), and the table the task logs and the Fleet page shows."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from dflash_regen.capacity.measure import measure_server, sample_prompts
from dflash_regen.capacity.model import (
    Curve,
    Memory,
    RunShape,
    advise,
    memories,
    predict,
    running_batch,
    train_length_budget,
)
from dflash_regen.errors import CapacityError, TooFewPrompts
from dflash_regen.fleet import servers as fleet_servers
from dflash_regen.fleet.servers import Server
from dflash_regen.layout import report_file
from dflash_regen.prompts.planning import to_generate
from dflash_regen.settings.nodes import READY
from dflash_regen.settings.run_config import GenerationSettings, RunConfig
from dflash_regen.tables import markdown_table

log = logging.getLogger(__name__)

REPORT = report_file("capacity")
SCHEMA_VERSION = 1


def plan_report(calibration: dict, mems: list[Memory], shape: RunShape, *, server_flags: str = "",
                seed: int = 0, train_max_length: int = 0) -> dict:
    """The full capacity report (`capacity.json`) from a measurement and health_check's figures."""
    curve = Curve.fit(calibration["levels"])
    lengths = np.array([x for x in calibration["output_tokens"] if x > 0], float)
    if not lengths.size:
        raise CapacityError("the calibration produced no finished answers; nothing to size the run with")
    scale = shape.mean_output_tokens / lengths.mean() if shape.mean_output_tokens else 1.0
    lengths = lengths * scale
    prompt_mean = float(np.mean(calibration["prompt_tokens"])) if calibration["prompt_tokens"] else 0.0
    request_tokens = prompt_mean + float(lengths.mean())
    measured = mems
    mems = (mems * shape.servers)[:shape.servers]  # planning a bigger fleet: more of the same servers
    advice = advise(curve, mems, shape, request_tokens)
    fill_s = calibration.get("fill_s", 0.0)
    current = predict(curve, lengths, shape, [running_batch(m, shape, request_tokens)[0] for m in mems],
                      fill_s=fill_s, seed=seed)
    scenarios = [{"name": "current", "server_flags": server_flags,
                  "concurrency_per_server": shape.concurrency_per_server or mems[0].running_slots, **current}]
    if advice["server_flags"] or advice["running_advised"] != advice["running_now"]:
        n = advice["running_advised"]
        advised = predict(curve, lengths, shape, [n] * len(mems), fill_s=fill_s * n / advice["running_now"],
                          seed=seed)
        flags = " ".join(x for x in (server_flags, advice["server_flags"]) if x)
        scenarios.append({"name": "advised", "server_flags": flags,
                          "concurrency_per_server": advice["concurrency_per_server_advised"], **advised})
    budget = train_length_budget(calibration, train_max_length, scale)
    if budget:
        clipped = budget.pop("lengths")
        at_budget = predict(curve, clipped, shape, [running_batch(m, shape, prompt_mean + float(clipped.mean()))[0]
                                                    for m in mems], fill_s=fill_s, seed=seed)
        scenarios.append({"name": "train-length budget", "server_flags": server_flags,
                          "concurrency_per_server": scenarios[0]["concurrency_per_server"], **at_budget})
        budget["saving_share"] = round(1 - at_budget["wall_s"] / current["wall_s"], 4)
    return {"version": SCHEMA_VERSION, "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "calibration": calibration, "curve": curve.to_dict(),
            "allocation": [m.to_dict() for m in measured],
            "run": {**asdict(shape), "mean_output_tokens": round(float(lengths.mean()), 1),
                    "mean_prompt_tokens": round(prompt_mean, 1),
                    "output_tokens_total": int(shape.prompts * lengths.mean())},
            "binding": {"resource": advice["resource"], "detail": advice["detail"]},
            "advice": advice, "scenarios": scenarios, "table": table_rows(scenarios), "budget": budget}


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:,.1f} h" if seconds >= 3600 else f"{seconds:,.1f} s"


def table_rows(scenarios: list[dict]) -> list[dict]:
    """One row per scenario, columns named for people (the table the task logs and the fleet page shows)."""
    rows = []
    for sc in scenarios:
        lo, hi = sc["wall_s_interval"]
        glo, ghi = sc["gpu_hours_interval"]
        rows.append({"settings": f"{sc['name']}: {sc['server_flags'] or 'cookbook flags'}",
                     "running / server": f"{sc['running_per_server']}{' *' if sc['extrapolated'] else ''}",
                     "in flight / server": str(sc["concurrency_per_server"]),
                     "tok/s / server": f"{sc['tok_s_per_server']:,.0f}", "fleet tok/s": f"{sc['fleet_tok_s']:,.0f}",
                     "generation wall time (80% interval)": f"{_hours(sc['wall_s'])} ({_hours(lo)} - {_hours(hi)})",
                     "GPU-hours (80% interval)": f"{sc['gpu_hours']:,.1f} ({glo:,.1f} - {ghi:,.1f})"})
    return rows


def format_table(report: dict) -> str:
    """The planner's answer as a few lines and a markdown table (logged by the task, printed by the CLI)."""
    run, cal, curve, advice = report["run"], report["calibration"], report["curve"], report["advice"]
    levels = ", ".join(f"{lv['tok_s']:,.0f} at {lv['running']:g}" for lv in cal["levels"])
    ceiling = f"{curve['saturation_tok_s']:,.0f} tok/s" if curve["saturation_tok_s"] else "none measurable"
    lines = [
        f"run: {run['prompts']:,} prompts x {run['mean_output_tokens']:,.0f} mean output tokens "
        f"({run['output_tokens_total'] / 1e6:,.1f}M tokens) on {run['servers']} servers, shards of "
        f"{run['shard_size']:,}",
        f"measured on {cal['server']}, {cal['prompts']} prompts from the run's shards, {cal['seconds']:.0f} s: "
        f"output tok/s {levels} running; fit: {curve['single_request_tok_s']:,.0f} tok/s alone, ceiling {ceiling}",
        f"binding: {advice['resource']}: {advice['detail']}",
    ]
    if advice["server_flags"]:
        lines.append(f"advice: relaunch with server_flags '{advice['server_flags']}' and concurrency_per_server "
                     f"{advice['concurrency_per_server_advised']}")
    lines.append(f"client: concurrency_per_server {advice['concurrency_per_server']} suits the current servers "
                 "(Param apply_advised_concurrency applies it)")
    lines += [f"note: {n}" for n in advice["notes"]]
    if b := report.get("budget"):
        lines.append(f"train-length budget (max_tokens = {b['train_max_length']:,} - prompt tokens, what the trainer "
                     f"reads): {b['tokens_past_share']:.1%} of output tokens lie past it; it saves "
                     f"{b['saving_share']:.1%} of the generation time and cuts {b['samples_cut_share']:.1%} of the "
                     f"samples ({b['reasoning_only_share']:.1%} left reasoning-only); Param budget = train_length")
    lines += ["", markdown_table(list(report["table"][0]), [list(row.values()) for row in report["table"]])]
    if any(sc["extrapolated"] for sc in report["scenarios"]):
        lines.append(f"\\* beyond the largest measured batch ({curve['measured_up_to']}): the fitted curve is "
                     "extrapolated")
    return "\n".join(lines)


def read_report(reports_dir: Path) -> dict | None:
    path = reports_dir / REPORT
    return json.loads(path.read_text()) if path.is_file() else None


def fingerprint(cfg: RunConfig, server_flags: str, shape: RunShape) -> str:
    """What a calibration was measured for (the fleet as launched, its extra flags, the sampling, the sample size,
    the run's shape), hashed: a rerun of the setup with the same reuses the stored report, any other measures."""
    what = {"fleet": asdict(cfg.fleet), "server_flags": server_flags, "generation": asdict(cfg.generation),
            "capacity": asdict(cfg.capacity), "shape": asdict(shape), "train_max_length": cfg.plan.train_max_length}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def calibrate(server: Server, api_key: str, health: dict, shards: list[dict], settings: GenerationSettings,
              shape: RunShape, *, prompts: int, server_flags: str = "", train_max_length: int = 0) -> dict:
    """Measure `server` with `prompts` prompts of the run's shards and plan the run: the capacity report."""
    entry = next((s for s in health["servers"] if s.get("url") == server.url and s.get("allocation")), None)
    if entry is None:
        raise CapacityError(f"health report has no allocation for {server.name}; run health_check first")
    slots = entry["allocation"]["running_slots"]
    sample = sample_prompts(shards, max(prompts, 2 * slots), settings.seed)
    if len(sample) < 2 * slots:
        raise TooFewPrompts(f"calibration needs at least {2 * slots} prompts (twice the {slots} slots) to reach a "
                            f"steady state, the run has {len(sample)}; set Param calibration_prompts to 0 to skip it")
    calibration = measure_server(server, api_key, settings, sample, slots)
    return plan_report(calibration, memories(health, server.url), shape, server_flags=server_flags,
                       seed=settings.seed, train_max_length=train_max_length)


def calibrate_fleet(cfg: RunConfig, fleet: dict, shards: list[dict]) -> dict:
    """The calibrate task: measure one healthy server of `fleet` (the fleet value autotune left, with the flags it
    applied) on the run's prompts, advise, predict; `reports/capacity.json`. A rerun of the setup with the same
    fleet settings and run (a cleared shard) reuses the stored report: no GPU minutes again."""
    if not cfg.capacity.calibration_prompts:
        log.info("calibration skipped (Param calibration_prompts = 0)")
        return {"calibrated": False}
    servers, key = fleet_servers.servers_of(fleet, cfg.fleet.num_servers)
    fleet_dir = Path(fleet["fleet_dir"])
    healthy = fleet_servers.healthy_servers(fleet_dir, servers)
    shape = RunShape(prompts=to_generate(shards), servers=len(healthy), shard_size=cfg.plan.shard_size,
                     concurrency_per_server=cfg.generation.concurrency_per_server)
    flags = " ".join(x for x in (cfg.fleet.server_flags, fleet.get("applied_flags") or "") if x)
    print_ = fingerprint(cfg, flags, shape)
    report = read_report(cfg.node_reports_dir)
    if report and report.get("fingerprint") == print_:
        log.info("calibrate: reusing reports/capacity.json from an earlier attempt (same fleet settings and run)")
        return _calibrated(report)
    health = json.loads(cfg.layout.node_report("health").read_text())
    with fleet_servers.lease(fleet_dir, healthy, 0, wait_s=cfg.fleet.ready_timeout_s) as server:
        try:
            report = calibrate(server, key, health, shards, cfg.generation, shape,
                               prompts=cfg.capacity.calibration_prompts, server_flags=flags,
                               train_max_length=cfg.plan.train_max_length)
        except TooFewPrompts as exc:  # a run this small is over before a prediction would help
            log.warning("calibration skipped: %s", exc)
            return {"calibrated": False}
        except CapacityError as exc:
            if not fleet_servers.is_alive(server):  # so the retry measures another server, as a shard's would
                fleet_servers.mark_unhealthy(fleet_dir, server, str(exc))
            raise
    report["fingerprint"] = print_
    cfg.layout.write_report("capacity", report)
    log.info("capacity plan (reports/capacity.json):\n%s", format_table(report))
    return _calibrated(report)


def _calibrated(report: dict) -> dict:
    return {"calibrated": True, "binding": report["binding"]["resource"], "wall_s": report["scenarios"][0]["wall_s"],
            "advised_flags": report["advice"]["server_flags"]}


def node_ready(cfg: RunConfig, calibrated: dict) -> dict:
    """Several nodes: this node passed every gate; its rate (prompts/s of its healthy servers, measured by
    calibrate) decides its share of the shards (`reports/nodes/<node>/ready.json`)."""
    healthy = fleet_servers.healthy_servers(cfg.fleet_dir, fleet_servers.load_servers(cfg.fleet_dir))
    report = read_report(cfg.node_reports_dir) if calibrated.get("calibrated") else None
    rps = report["scenarios"][0]["requests_per_s_per_server"] * len(healthy) if report else None
    ready = {"node": cfg.node, "servers": len(healthy), "prompts_per_s": rps}
    cfg.layout.write_report(READY, ready)
    return ready
