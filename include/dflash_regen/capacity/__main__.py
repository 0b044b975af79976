"""`python -m dflash_regen.capacity emulate|plan`: measure one emulated server and plan a run, or re-plan a stored
report for another run size or fleet (no server)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from dflash_regen import atomic, capacity
from dflash_regen.capacity.model import Memory, RunShape
from dflash_regen.capacity.report import calibrate, format_table, plan_report

log = logging.getLogger("dflash_regen.capacity")  # the package's: the measurement logs under it


def _shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", type=int, help="prompts in the run (default: the planned or measured run)")
    p.add_argument("--servers", type=int, help="servers in the fleet (default: the run's)")
    p.add_argument("--shard-size", type=int, help="prompts per shard (default: the run's)")
    p.add_argument("--mean-output-tokens", type=float, help="rescale the measured output lengths to this mean")
    p.add_argument("--concurrency-per-server", type=int, help="client requests in flight per server (0 = slots)")
    p.add_argument("--train-max-length", type=int, default=4096,
                   help="the trainer's max_length: report what a train-length budget saves (0 = not)")
    p.add_argument("--json", type=Path, help="also write the report here")


def _shape(ns, default: RunShape) -> RunShape:
    return RunShape(prompts=ns.prompts or default.prompts, servers=ns.servers or default.servers,
                    shard_size=ns.shard_size or default.shard_size,
                    concurrency_per_server=(default.concurrency_per_server if ns.concurrency_per_server is None
                                            else ns.concurrency_per_server),
                    mean_output_tokens=ns.mean_output_tokens or default.mean_output_tokens)


def _emulate(ns) -> dict:
    """Launch one emulated server with the DAG's launcher, gate it, plan the prompts, calibrate, stop it."""
    from dflash_regen import fleet, planning, probes
    from dflash_regen.config import DEFAULTS, DEMO_PROMPTS, RunConfig
    from dflash_regen.demo_model import write_demo_model
    from dflash_regen.demo_prompts import write_demo_prompts

    with tempfile.TemporaryDirectory(prefix="dflash-capacity-") as tmp:
        root = Path(tmp)
        params = {**DEFAULTS, "server_command": "emulator", "num_servers": 1, "output_root": str(root),
                  "server_flags": ns.server_flags, "emulator_profile": json.loads(ns.profile),
                  "base_port": ns.port, "prompt_source": ns.prompt_source, "min_kv_tokens": 0,
                  "min_running_requests": 1, "staging_dir": str(root / "model")}
        cfg = RunConfig.from_params(params, "capacity")
        model = write_demo_model(root / "model")
        source = Path(ns.prompt_source) if ns.prompt_source != DEMO_PROMPTS else write_demo_prompts(
            root / "prompts.jsonl")
        plan = planning.plan_shards(source, cfg.layout, replace(cfg.plan, max_bad_share=1.0))
        with fleet.running(cfg.fleet, model, cfg.fleet_dir) as servers:
            key = fleet.read_api_key(cfg.fleet_dir)
            health = probes.health_gate(servers, key, cfg.fleet)
            shape = _shape(ns, RunShape(plan["accepted"], 1, cfg.plan.shard_size, cfg.generation.in_flight))
            return calibrate(servers[0], key, health, plan["shards"], cfg.generation, shape,
                             prompts=ns.calibration_prompts, server_flags=ns.server_flags,
                             train_max_length=ns.train_max_length)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_regen.capacity",
                                     description=capacity.__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    em = sub.add_parser("emulate", help="launch one emulated SGLang server, measure it on the prompts, plan the run")
    em.add_argument("--profile", default='{"preset": "qwen3.6-27b-b200-mtp"}', help="emulator profile (JSON)")
    em.add_argument("--server-flags", default="", help="SGLang flags on top of the cookbook's")
    em.add_argument("--prompt-source", default="demo", help="prompts to sample from (file, directory or 'demo')")
    em.add_argument("--calibration-prompts", type=int, default=64)
    em.add_argument("--port", type=int, default=31000)
    _shape_args(em)
    pl = sub.add_parser("plan", help="re-plan from a stored capacity.json (another run size or fleet)")
    pl.add_argument("report", type=Path)
    _shape_args(pl)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)  # the measurement's progress; the table is printed below
    if ns.command == "emulate":
        report = _emulate(ns)
    else:
        stored = json.loads(ns.report.read_text())
        run = stored["run"]
        default = RunShape(run["prompts"], run["servers"], run["shard_size"], run["concurrency_per_server"],
                           run["mean_output_tokens"])
        report = plan_report(stored["calibration"], [Memory(**m) for m in stored["allocation"]],
                             _shape(ns, default), server_flags=stored["scenarios"][0]["server_flags"],
                             train_max_length=ns.train_max_length)
    print(format_table(report))
    if ns.json:
        atomic.write_json(ns.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
