"""One live run per output root, and no servers left behind by runs that are gone.

Two runs on one output root share its fleet ports and, with the same run id (the same logical date triggered
twice with `airflow dags test`), its files: the second once deleted the first's record, the first crashed
inside Airflow before its teardown, and its servers ran on. So the first task takes `<output_root>/run.lock`
(a JSON record: run id, pid and start time of the taking process). A holder is live while that process runs
(`dags test` runs a whole run in one process) or while the scheduler says its run is running or queued (a
scheduler runs each task in its own short-lived process). Otherwise the lock is stale and is taken over, and
`launch_fleet` stops every server recorded under the output root by other runs (pid + start time checked).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from dflash_regen import atomic
from dflash_regen.errors import RunLocked
from dflash_regen.fleet import servers
from dflash_regen.layout import RunLayout, run_lock, runs_dir
from dflash_regen.payloads import Fleet
from dflash_regen.prompts import inputs
from dflash_regen.settings.run_config import DEMO_PROMPTS, RunConfig

log = logging.getLogger(__name__)



def _process_alive(pid: int, start_ticks: int) -> bool:
    return servers.is_alive(servers.Server(0, "", "", 0, [], "", pid=pid, start_ticks=start_ticks))


def read_holder(output_root: Path) -> dict | None:
    path = run_lock(output_root)
    return json.loads(path.read_text()) if path.is_file() else None


def _is_this_process(holder: dict) -> bool:
    return holder["host"] == socket.gethostname() and holder["pid"] == os.getpid() and \
        holder["start_ticks"] == servers.start_ticks(os.getpid())


def acquire(output_root: Path, run_id: str, run_dir: str, run_is_active: Callable[[str], bool]) -> None:
    """Take the output root for `run_id` (its folder `runs/<run_dir>`), or raise `RunLocked` naming the live
    run that holds it. `run_is_active(run_id)` asks the scheduler about a run whose process is gone."""
    output_root.mkdir(parents=True, exist_ok=True)
    lock = run_lock(output_root)
    with open(lock.with_name(f".{lock.name}.guard"), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # two runs starting at once decide one after the other
        holder = read_holder(output_root)
        if holder and not _is_this_process(holder):
            process_alive = holder["host"] == socket.gethostname() and \
                _process_alive(holder["pid"], holder["start_ticks"])
            if process_alive:
                why = f"its process (pid {holder['pid']} on {holder['host']}) is still running"
            elif holder["run_id"] != run_id and run_is_active(holder["run_id"]):
                why = "Airflow reports it running"
            else:
                why = None
            if why:
                raise RunLocked(
                    f"output root {output_root} is held by run {holder['run_id']!r} since "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['taken_at']))} ({why}); two runs on "
                    f"one output root would fight over its server ports and files. Wait for that run to end, or "
                    f"stop it (`kill {holder['pid']}`, or mark the run failed in Airflow; the next launch stops its "
                    "servers), or set Param output_root to another directory")
            log.warning("taking over the lock of run %r on %s: it is no longer running", holder["run_id"],
                        output_root)
        atomic.write_json(lock, {"run_id": run_id, "run_dir": run_dir, "pid": os.getpid(),
                                 "host": socket.gethostname(), "taken_at": time.time(),
                                 "start_ticks": servers.start_ticks(os.getpid())})


def reap_orphans(output_root: Path, run_dir: str) -> list[str]:
    """Stop servers recorded by other runs under this output root; only the run holding the lock may."""
    holder = read_holder(output_root)
    if not holder or holder["run_dir"] != run_dir:
        return []
    stopped = []
    runs = runs_dir(output_root)
    # runs/<run>/fleet, and runs/<run>/fleet/<node> for a run on several nodes (this node's servers are found
    # alive; another node's pids are not this host's processes and are left alone by their start time)
    fleet_dirs = [d for r in runs.glob("*") if r.is_dir() for d in RunLayout(r).fleet_dirs() if d.is_dir()]
    for fleet_dir in sorted(fleet_dirs):
        run = fleet_dir.relative_to(runs).parts[0]
        if run != run_dir:
            for line in servers.stop_fleet(fleet_dir):
                log.warning("stopped %s, left running by run %r, which is no longer running", line, run)
                stopped.append(line)
    return stopped


def open_run(cfg: RunConfig, run_id: str, run_is_active: Callable[[str], bool]) -> None:
    """A run's first task: the output root checked, the run lock taken (`run_id` is the scheduler's run id) and
    the prompt source checked, before any GPU work."""
    inputs.check_output_root(cfg.output_root)
    acquire(cfg.output_root, run_id, cfg.run_id, run_is_active)
    if cfg.prompt_source != DEMO_PROMPTS:
        first = inputs.check_prompt_source(Path(cfg.prompt_source), cfg.plan.prompt_format)
        log.info("prompt source %s: first usable row at %s", cfg.prompt_source, first)


def launch_run(cfg: RunConfig, model_path: Path) -> Fleet:
    """Launch the run's (node's) fleet, after stopping the servers of runs that died before their teardown; a
    (re)launch removes a drain request (after a drain, the clear that resumes the run). The fleet value."""
    reap_orphans(cfg.output_root, cfg.run_id)
    cfg.layout.drain_request.unlink(missing_ok=True)
    return servers.fleet_value(cfg.fleet_dir, servers.launch_fleet(cfg.fleet, model_path, cfg.fleet_dir))
