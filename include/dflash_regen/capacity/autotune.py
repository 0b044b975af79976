"""Autotune: try server settings on one GPU, measure each with the capacity planner, launch the fleet with the fastest.

The levers that decide a run's GPU time are server settings — the running batch bounded by Mamba state
(`--max-mamba-cache-size`, the radix-cache strategy, MTP's draft state), radix cache on or off, MTP on or off,
FP8 KV — and only a measurement on the node can choose among them. So, after the fleet gates:

1. The fleet is stopped (the other GPUs would idle during tuning anyway; their hours are counted).
2. One server at a time on the first GPU (its port, the fleet's launcher code) with each candidate's flags on
   top of the run's: it must start, pass the health and smoke gates (a faster setting that breaks answers is
   never chosen), and its KV cache must hold its running batch; then `capacity.measure_server` measures it for
   at most `candidate_s`, and `capacity.plan_report` predicts the whole run at that setting. A candidate that
   fails is skipped with its reason.
3. The candidate with the shortest predicted generation wall time wins if it beats the current settings by
   more than `MIN_GAIN`. `advise` relaunches the fleet as it was; `apply` relaunches it with the winner's
   flags. Either way the health and smoke gates run again on every server.

Every prediction uses the same output lengths (the current settings' sample), so the ranking compares the
settings, not samples. The report is `reports/autotune.json` (+ `.md`); a rerun of the setup (a cleared shard)
reuses it instead of measuring again.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from dflash_regen import atomic, capacity
from dflash_regen.capacity.health import health_gate
from dflash_regen.errors import DflashError, GateFailed
from dflash_regen.fleet import servers as fleet_servers
from dflash_regen.fleet import smoke
from dflash_regen.layout import FleetFiles, report_file
from dflash_regen.prompts.planning import accepted, to_generate
from dflash_regen.settings.run_config import RunConfig
from dflash_regen.tables import markdown_table

log = logging.getLogger(__name__)

REPORT = report_file("autotune")
MODES = ("off", "advise", "apply")
MIN_GAIN = 0.02  # a winner must beat the current settings by more than this (measurement noise)
BATCH_MULTIPLES = (2, 4)  # Mamba pools for these multiples of the current running batch
MTP_OFF = "--speculative-algorithm off --speculative-num-steps off --speculative-eagle-topk off " \
          "--speculative-num-draft-tokens off"


@dataclass(frozen=True)
class Candidate:
    name: str
    flags: str  # on top of the run's server_flags ('off' drops a cookbook flag)
    why: str = ""


def _mamba_flags(n: int, ratio: int) -> str:
    return f"--max-mamba-cache-size {n * ratio} --max-running-requests {n}"


def _room(mem: capacity.Memory, request_tokens: float, most: int, speculative: bool = True) -> int:
    """The largest batch (up to `most`, a CUDA-graph batch size) whose Mamba slots and speculative reserve still
    leave KV for KV_HEADROOM x its requests in the same memory; the current batch if none is larger."""
    fits = max((n for n in range(1, most + 1)
                if (mem.kv_tokens_at(n, speculative) or 0) >= capacity.KV_HEADROOM * n * request_tokens), default=0)
    return max(fits // capacity.GRAPH_BATCH * capacity.GRAPH_BATCH or fits, mem.running_slots)


def default_candidates(mem: capacity.Memory, request_tokens: float) -> list[Candidate]:
    """Derived from the measured allocation of the current settings (`mem`) and the measured request size."""
    running, ratio = mem.running_slots, mem.mamba_ratio or 1
    most = max(BATCH_MULTIPLES) * running
    room = _room(mem, request_tokens, most)
    out = [Candidate("current", "", "the run's own flags")]
    batches = sorted({min(k * running, room) for k in BATCH_MULTIPLES} - {running})
    for n in batches:
        out.append(Candidate(f"mamba pool x{n / running:g}", _mamba_flags(n, ratio),
                             f"Mamba slots for {n} running requests ({n} x {ratio} slots per request)"))
    # Radix cache off: 1 Mamba slot per request (SGLang sizes the pool to --max-running-requests).
    n = _room(replace(mem, mamba_ratio=1), request_tokens, most) if mem.knows_pools else room
    out.append(Candidate(f"radix cache off at {n}", "--disable-radix-cache --mamba-scheduler-strategy no_buffer"
                         + (f" --max-running-requests {n}" if n > running else ""),
                         "1 Mamba slot per request instead of 3-5; a regeneration run reuses few prefixes"))
    # Without MTP the speculative reserve is freed; with FP8 KV each token takes half the bytes: more room.
    n = _room(mem, request_tokens, most, speculative=False) if mem.knows_pools else room
    out.append(Candidate(f"MTP off at {n}", f"{MTP_OFF} {_mamba_flags(n, ratio)}" if n > running else MTP_OFF,
                         "draft + verify stops paying once the GPU is compute-bound; frees the draft state"))
    n = _room(replace(mem, kv_tokens=2 * mem.kv_tokens), request_tokens, most) if mem.knows_pools else room
    out.append(Candidate("FP8 KV cache" + (f" at {n}" if n > running else ""),
                         "--kv-cache-dtype fp8_e4m3" + (f" {_mamba_flags(n, ratio)}" if n > running else ""),
                         "half the bytes per KV token: twice the room for the batch"))
    return out


def extra_candidates(flag_sets: list[str]) -> list[Candidate]:
    return [Candidate(f"custom {i + 1}", flags, "Param autotune_candidates") for i, flags in enumerate(flag_sets)]


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def run_shape(cfg: RunConfig, run_prompts: int) -> capacity.RunShape:
    """The run every candidate's prediction is for."""
    return capacity.RunShape(prompts=run_prompts, servers=cfg.fleet.num_servers, shard_size=cfg.plan.shard_size,
                             concurrency_per_server=cfg.generation.concurrency_per_server)


class Tuner:
    """Runs the candidates one by one on the first GPU and keeps what each one measured or why it was skipped."""

    def __init__(self, cfg: RunConfig, model_path: Path, shards: list[dict], run_prompts: int):
        self.cfg, self.model_path, self.shards = cfg, model_path, shards
        self.shape = run_shape(cfg, run_prompts)
        self.lengths: dict | None = None  # the current settings' sample: every prediction uses it

    def candidate_cfg(self, cand: Candidate) -> RunConfig:
        return self.cfg.with_extra_flags(cand.flags)

    def try_one(self, index: int, cand: Candidate, sample: list[dict], budget_s: float) -> dict:
        started = time.monotonic()
        row: dict = {"candidate": cand.name, "flags": cand.flags, "why": cand.why}
        try:
            ccfg = self.candidate_cfg(cand)
        except DflashError as exc:
            return {**row, "skipped": f"bad flags: {_first_line(exc)}"}
        one = replace(ccfg.fleet, num_servers=1, gpu_ids=ccfg.fleet.gpu_ids[:1])  # the first GPU, its port
        where = self.cfg.layout.autotune_candidate(index)
        with ExitStack() as stack:  # the candidate's server is stopped however this ends
            try:
                servers = stack.enter_context(fleet_servers.running(one, self.model_path, where))
            except DflashError as exc:
                return {**row, "skipped": f"fails to start: {_first_line(exc)}",
                        "log": str(FleetFiles(where).server_log(0))}
            key = fleet_servers.read_api_key(where)
            try:
                health = health_gate(servers, key, one)
            except GateFailed as exc:
                return {**row, "skipped": f"fails the health gate: {exc.args[0].splitlines()[-1].lstrip('- ')}"}
            try:
                smoke.smoke_gate(servers, key, ccfg.sampling, one)
            except GateFailed as exc:
                return {**row, "skipped": f"fails smoke: {str(exc).splitlines()[-1].lstrip('- ')}"}
            mem = capacity.Memory.from_health(health["servers"][0])
            row.update(running_slots=mem.running_slots, kv_tokens=mem.kv_tokens)
            # Its KV pool must hold its running batch at the measured request size, else SGLang would retract.
            if self.lengths:
                request = self.lengths["request_tokens"]
                if mem.kv_tokens < mem.running_slots * request:
                    return {**row, "skipped": f"runs out of KV: {mem.kv_tokens:,} KV tokens hold "
                                              f"{mem.kv_tokens // max(int(request), 1)} requests of ~{request:,.0f} "
                                              f"tokens, fewer than its {mem.running_slots} running slots"}
            try:
                calibration = capacity.measure_server(servers[0], key, self.cfg.generation, sample,
                                                      mem.running_slots, budget_s=budget_s)
            except capacity.CapacityError as exc:
                return {**row, "skipped": f"fails under load: {_first_line(exc)}"}
            if self.lengths is None:
                done = [x for x in calibration["output_tokens"] if x > 0]
                if not done:
                    return {**row, "skipped": "no answer finished within the time per candidate; raise Param "
                                              "autotune_candidate_s"}
                self.lengths = {"output_tokens": calibration["output_tokens"],
                                "prompt_tokens": calibration["prompt_tokens"],
                                "request_tokens": float(np.mean(done) + np.mean(calibration["prompt_tokens"]))}
            calibration = {**calibration, "output_tokens": self.lengths["output_tokens"],
                           "prompt_tokens": self.lengths["prompt_tokens"]}
            plan = capacity.plan_report(calibration, capacity.memories(health, servers[0].url), self.shape,
                                        server_flags=cand.flags, seed=self.cfg.generation.seed)
            sc = plan["scenarios"][0]
            return {**row, "running": sc["running_per_server"], "tok_s": sc["tok_s_per_server"],
                    "wall_s": sc["wall_s"], "wall_s_interval": sc["wall_s_interval"], "gpu_hours": sc["gpu_hours"],
                    "gpu_hours_interval": sc["gpu_hours_interval"], "curve": plan["curve"],
                    "measure_s": round(time.monotonic() - started, 1), "_mem": mem, "_health": health}


def choose(rows: list[dict]) -> dict | None:
    """The measured row with the shortest predicted wall time, if it beats the current settings by MIN_GAIN."""
    measured = [r for r in rows if "wall_s" in r]
    if not measured:
        return None
    best = min(measured, key=lambda r: r["wall_s"])
    current = next((r for r in measured if r["candidate"] == "current"), None)
    if current and best is not current and best["wall_s"] > (1 - MIN_GAIN) * current["wall_s"]:
        return current
    return best


def tune(cfg: RunConfig, model_path: Path, shards: list[dict], run_prompts: int, *, candidate_s: float,
         budget_s: float, extra: list[str], shape: capacity.RunShape | None = None) -> dict:
    """Measure the candidates (current first); returns the report (without relaunching the fleet). `shape`
    predicts another run than this one (the CLI's)."""
    started = time.monotonic()
    # The sample must fill the largest batch tried twice over (a steady state), so draw it for 4x the slots.
    health = json.loads(cfg.layout.node_report("health").read_text())
    slots = min(s["allocation"]["running_slots"] for s in health["servers"] if s.get("allocation"))
    sample = capacity.sample_prompts(shards, max(cfg.capacity.calibration_prompts,
                                                 2 * max(BATCH_MULTIPLES) * slots), cfg.generation.seed)
    if len(sample) < 2 * slots:
        raise capacity.TooFewPrompts(f"autotune needs at least {2 * slots} prompts (twice the {slots} slots), the "
                                     f"run has {len(sample)}")
    fleet_servers.stop_fleet(cfg.fleet_dir)  # frees the first GPU (and the port) for the candidates
    tuner = Tuner(cfg, model_path, shards, run_prompts)
    if shape:
        tuner.shape = shape
    rows: list[dict] = []
    # Current first: its allocation and answers decide the other candidates (and every prediction's lengths).
    queue = [Candidate("current", "", "the run's own flags")]
    derived = False
    for i in range(64):
        if not queue:
            break
        cand = queue.pop(0)
        elapsed = time.monotonic() - started
        if elapsed + candidate_s > budget_s:
            rows.append({"candidate": cand.name, "flags": cand.flags, "why": cand.why,
                         "skipped": f"over the total budget ({elapsed:.0f} s used of {budget_s:.0f} s; Param "
                                    "autotune_budget_s)"})
        else:
            log.info("autotune: candidate %d, %s: %s", i, cand.name, cand.flags or "(the run's flags)")
            row = tuner.try_one(i, cand, sample, candidate_s)
            log.info("autotune: %s: %s", cand.name, row.get("skipped") or
                     f"{row['running']} running, {row['tok_s']:,.0f} tok/s, predicted {row['wall_s']:,.1f} s")
            rows.append(row)
        if not derived:
            derived = True
            current = rows[0]
            if "_mem" in current and tuner.lengths:
                queue += default_candidates(current["_mem"], tuner.lengths["request_tokens"])[1:]
            queue += extra_candidates(extra)
    tuning_s = time.monotonic() - started
    winner = choose(rows)
    for r in rows:
        r.pop("_mem", None)
        r.pop("_health", None)
        r["chosen"] = r is winner
        if "wall_s" in r:  # what the run would take from the start of tuning: tuning counts
            r["wall_with_tuning_s"] = round(tuning_s + r["wall_s"], 1)
            r["gpu_hours_with_tuning"] = round(r["gpu_hours"] + tuning_s * cfg.fleet.num_servers / 3600, 2)
    return {"version": 1, "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "tuning_s": round(tuning_s, 1),
            "candidate_s": candidate_s, "budget_s": budget_s, "run": asdict(tuner.shape),
            "sample_prompts": len(sample), "candidates": rows,
            "chosen": winner["candidate"] if winner else None, "chosen_flags": winner["flags"] if winner else ""}


def autotune_fleet(cfg: RunConfig, model_path: Path, fleet: dict, shards: list[dict]) -> dict:
    """The autotune task: try server settings on the first GPU, report (`reports/autotune.json`), and relaunch the
    fleet (with the fastest's flags under `apply`) and re-gate it (health + smoke), since tuning took its first
    GPU. Returns the fleet it leaves (a fleet value, `fleet` itself when nothing was stopped) with the outcome."""
    settings = cfg.autotune
    if settings.mode == "off":
        log.info("autotune off (Param autotune)")
        return {**fleet, "mode": "off"}
    if not cfg.capacity.calibration_prompts:
        log.info("autotune skipped: it measures with calibration's sample and Param calibration_prompts is 0")
        return {**fleet, "mode": settings.mode, "skipped": "calibration_prompts is 0"}
    print_ = fingerprint(cfg, accepted(shards))
    report = read_report(cfg.node_reports_dir)
    reused = report is not None and report.get("fingerprint") == print_ and bool(report.get("candidates"))
    if report is not None and reused:
        log.info("autotune: reusing reports/autotune.json from an earlier attempt (same settings)")
    else:
        try:
            report = tune(cfg, model_path, shards, to_generate(shards), candidate_s=settings.candidate_s,
                          budget_s=settings.budget_s, extra=list(settings.extra))
        except capacity.TooFewPrompts as exc:  # the fleet still runs: nothing was stopped
            log.warning("autotune skipped: %s", exc)
            return {**fleet, "mode": settings.mode, "skipped": str(exc)}
        report["fingerprint"] = print_
    flags = _decide(report, settings.mode)
    write_report(cfg.node_reports_dir, report)
    log.info("autotune (reports/autotune.json):\n%s", format_table(report))
    if reused and not flags:  # nothing was stopped: the fleet the setups launched and gated stays
        return {**fleet, "mode": settings.mode, "chosen": report["chosen"], "applied_flags": "", "reused": True}
    left = relaunch(cfg, model_path, flags, report)
    return {**left, "mode": settings.mode, "chosen": report["chosen"], "applied_flags": flags,
            "tuning_s": report["tuning_s"]}


def _decide(report: dict, mode: str) -> str:
    """The flags the fleet relaunches with ('' = the run's own), recorded in the report with what was done."""
    winner = next((r for r in report["candidates"] if r.get("chosen")), None)
    flags = winner["flags"] if mode == "apply" and winner else ""
    advice = (f"; to use {winner['candidate']}, add '{winner['flags']}' to server_flags or set Param autotune to "
              "apply" if winner and winner["flags"] else "")
    report.update(mode=mode, applied_flags=flags,
                  action=(f"fleet relaunched with {winner['candidate']}: {flags}" if flags and winner else
                          "fleet relaunched with the run's own flags" + advice))
    return flags


def relaunch(cfg: RunConfig, model_path: Path, flags: str, report: dict) -> dict:
    """Relaunch the fleet with `flags` on top of the run's and gate it again (stopped if a gate fails); returns
    the fleet value. The report records how long the relaunch took."""
    run_cfg = cfg.with_extra_flags(flags) if flags else cfg
    started = time.monotonic()
    servers = fleet_servers.launch_fleet(run_cfg.fleet, model_path, cfg.fleet_dir)
    key = fleet_servers.read_api_key(cfg.fleet_dir)
    try:
        cfg.layout.write_report("health", health_gate(servers, key, run_cfg.fleet))
        cfg.layout.write_report("smoke", smoke.smoke_gate(servers, key, run_cfg.sampling, run_cfg.fleet))
    except GateFailed:
        fleet_servers.stop_fleet(cfg.fleet_dir)
        raise
    report["relaunch_s"] = round(time.monotonic() - started, 1)
    write_report(cfg.node_reports_dir, report)
    return fleet_servers.fleet_value(cfg.fleet_dir, servers)


# ------------------------------------------------------------------------------------------------ output
def _hours(seconds: float) -> str:
    return f"{seconds / 3600:,.1f} h" if seconds >= 3600 else f"{seconds:,.1f} s"


def table_rows(report: dict) -> list[dict]:
    rows = []
    for r in report["candidates"]:
        if "wall_s" in r:
            lo, hi = r["wall_s_interval"]
            glo, ghi = r["gpu_hours_interval"]
            rows.append({"candidate": r["candidate"], "flags": r["flags"] or "(the run's flags)",
                         "running slots": str(r["running"]), "tok/s": f"{r['tok_s']:,.0f}",
                         "predicted wall (80%)": f"{_hours(r['wall_s'])} ({_hours(lo)} - {_hours(hi)})",
                         "GPU-hours (80%)": f"{r['gpu_hours']:,.1f} ({glo:,.1f} - {ghi:,.1f})",
                         "with tuning": _hours(r["wall_with_tuning_s"]),
                         "chosen": "yes" if r["chosen"] else ""})
        else:
            rows.append({"candidate": r["candidate"], "flags": r["flags"] or "(the run's flags)",
                         "running slots": str(r.get("running_slots", "")), "tok/s": "", "predicted wall (80%)": "",
                         "GPU-hours (80%)": "", "with tuning": "", "chosen": f"skipped: {r['skipped']}"})
    return rows


def format_table(report: dict) -> str:
    rows = table_rows(report)
    head = list(rows[0])
    lines = [f"autotune: {len(report['candidates'])} candidates in {_hours(report['tuning_s'])} (at most "
             f"{report['candidate_s']:g} s each, budget {report['budget_s']:g} s), {report['sample_prompts']} prompts "
             f"of the run; predictions for {report['run']['prompts']:,} prompts on {report['run']['servers']} servers",
             "", markdown_table(head, [[r[h] for h in head] for r in rows], padded=False), ""]
    lines.append(f"chosen: {report['chosen'] or 'none measured'}"
                 + (f" ({report['chosen_flags']})" if report.get("chosen_flags") else "")
                 + (f"; mode {report['mode']}: {report.get('action', '')}" if report.get("mode") else ""))
    return "\n".join(lines)


def write_report(reports_dir: Path, report: dict) -> None:
    report["table"] = table_rows(report)  # as people read it (the Fleet page shows it)
    atomic.write_json(reports_dir / REPORT, report)
    atomic.write_text(reports_dir / report_file("autotune", ".md"), format_table(report) + "\n")


def read_report(reports_dir: Path) -> dict | None:
    path = reports_dir / REPORT
    return json.loads(path.read_text()) if path.is_file() else None


def fingerprint(cfg: RunConfig, run_prompts: int) -> str:
    """What a stored report was measured for: the fleet's settings, the candidates and the tuning budget, the
    sample (its size, seed and sampling: max_tokens and temperature change the curve), the train-length budget
    and the run it predicts (its shape). A rerun with any other measures again."""
    f, a, g = cfg.fleet, cfg.autotune, cfg.generation
    what = {"server_flags": f.server_flags, "server_command": f.server_command, "emulator_profile": f.emulator_profile,
            "emulator_faults": f.emulator_faults, "candidate_s": a.candidate_s, "budget_s": a.budget_s,
            "extra": list(a.extra), "sampling": asdict(cfg.sampling), "seed": g.seed,
            "calibration_prompts": cfg.capacity.calibration_prompts, "train_budget": g.train_budget,
            "train_max_length": cfg.plan.train_max_length, "shape": asdict(run_shape(cfg, run_prompts))}
    return json.dumps(what, sort_keys=True, default=str)
