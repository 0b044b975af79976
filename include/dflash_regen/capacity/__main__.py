"""`python -m dflash_regen.capacity emulate|plan|autotune`: measure one emulated server and plan a run, re-plan a
stored report for another run size or fleet (no server), or tune one emulated server's settings."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from dflash_regen import atomic, capacity
from dflash_regen.capacity import autotune
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
    from dflash_regen.demo.fleet import emulated_run

    with emulated_run(ns, "capacity") as run:
        shape = _shape(ns, RunShape(run.plan["accepted"], 1, run.cfg.plan.shard_size,
                                    run.cfg.generation.concurrency_per_server))
        return calibrate(run.servers[0], run.key, run.health, run.plan["shards"], run.cfg.generation, shape,
                         prompts=ns.calibration_prompts, server_flags=ns.server_flags,
                         train_max_length=ns.train_max_length)


def _autotune(ns) -> dict:
    """Launch one emulated server with the DAG's launcher and gates, plan the prompts, tune; stop everything."""
    from dflash_regen.demo.fleet import emulated_run

    with emulated_run(ns, "autotune", ns.demo_prompts, calibration_prompts=ns.calibration_prompts) as run:
        atomic.write_json(run.cfg.layout.node_report("health"), run.health)
        shape = RunShape(ns.prompts or run.plan["accepted"], ns.servers, ns.shard_size, 0, ns.mean_output_tokens)
        return autotune.tune(run.cfg, run.model, run.plan["shards"], run.plan["accepted"], candidate_s=ns.candidate_s,
                             budget_s=ns.budget_s, extra=ns.candidate or [], shape=shape)


def _autotune_args(at: argparse.ArgumentParser) -> None:
    at.add_argument("--profile", default='{"preset": "qwen3.6-27b-b200-mtp"}', help="emulator profile (JSON)")
    at.add_argument("--server-flags", default="", help="SGLang flags on top of the cookbook's")
    at.add_argument("--candidate", action="append", help="an extra candidate's flags (repeatable)")
    at.add_argument("--prompt-source", default="demo", help="prompts to sample from (file, directory or 'demo')")
    at.add_argument("--demo-prompts", type=int, default=240, help="how many demo prompts to generate")
    at.add_argument("--calibration-prompts", type=int, default=64)
    at.add_argument("--candidate-s", type=float, default=180.0)
    at.add_argument("--budget-s", type=float, default=7200.0)
    at.add_argument("--port", type=int, default=31100)
    at.add_argument("--prompts", type=int, help="prompts in the run to predict (default: the planned ones)")
    at.add_argument("--servers", type=int, default=7)
    at.add_argument("--shard-size", type=int, default=1000)
    at.add_argument("--mean-output-tokens", type=float, help="rescale the measured output lengths to this mean")
    at.add_argument("--json", type=Path, help="also write the report here")


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
    _autotune_args(sub.add_parser("autotune", help="tune one emulated SGLang server on the prompts, predict the run "
                                                   "per setting"))
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)  # the measurement's progress; the table is printed below
    if ns.command == "autotune":
        report = _autotune(ns)
        print(autotune.format_table(report))
        if ns.json:
            atomic.write_json(ns.json, report)
        return 0
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
