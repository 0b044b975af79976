"""One emulated server for the planner CLIs (`capacity emulate`, `autotune emulate`): the demo model, the
prompts planned as the DAG plans them, and the server launched and health-gated by the DAG's own code."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from dflash_regen.capacity.health import health_gate
from dflash_regen.demo.model import write_demo_model
from dflash_regen.demo.prompts import write_demo_prompts
from dflash_regen.fleet.servers import read_api_key, running
from dflash_regen.prompts import planning
from dflash_regen.settings.run_config import DEFAULTS, DEMO_PROMPTS, RunConfig


@dataclass
class EmulatedRun:
    cfg: RunConfig
    model: Path
    plan: dict
    servers: list
    key: str
    health: dict


@contextlib.contextmanager
def emulated_run(ns, run_id: str, demo_prompts: int = 120, **params) -> Iterator[EmulatedRun]:
    """`ns`: the CLI's server_flags, profile, port and prompt_source; `params`: more Params. Everything lives in a
    temporary folder and the server is stopped on leaving."""
    with tempfile.TemporaryDirectory(prefix=f"dflash-{run_id}-") as tmp:
        root = Path(tmp)
        cfg = RunConfig.from_params({
            **DEFAULTS, "server_command": "emulator", "num_servers": 1, "output_root": str(root),
            "server_flags": ns.server_flags, "emulator_profile": json.loads(ns.profile), "base_port": ns.port,
            "prompt_source": ns.prompt_source, "min_kv_tokens": 0, "min_running_requests": 1,
            "staging_dir": str(root / "model"), **params}, run_id)
        model = write_demo_model(root / "model")
        source = Path(ns.prompt_source) if ns.prompt_source != DEMO_PROMPTS else write_demo_prompts(
            root / "prompts.jsonl", demo_prompts)
        plan = planning.plan_shards(source, cfg.layout, replace(cfg.plan, max_bad_row_share=1.0))
        with running(cfg.fleet, model, cfg.fleet_dir) as servers:
            key = read_api_key(cfg.fleet_dir)
            yield EmulatedRun(cfg, model, plan, servers, key, health_gate(servers, key, cfg.fleet))
