"""Fleet utilisation: output tok/s achieved vs the emulated fleet's capacity, ours vs a plain client.

Seven emulated servers (16 running-request slots each, the seed's allocation), a fixed per-request decode
rate, the demo prompt mix (mean ~1,820 output tokens). Both clients run in this one process, side by side
on the same fleet, with the same prompts:
- ours: one `generate_shard` per server (lease, streaming, checkpoints), in threads as Airflow would run
  seven shard tasks (here in one process, so its client cost is, if anything, overstated);
- plain: what a hand-written script does: one `requests` session per server, a 16-thread pool each,
  non-streaming requests.
Capacity = servers x slots x decode rate. The emulator's /metrics gauges give slot occupancy over time.

    .venv/bin/python bench/fleet_utilisation.py [--per-server 48] [--decode 150] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from dflash_regen import fleet, generation
from dflash_regen.config import DEFAULTS, RunConfig
from dflash_regen.demo_model import write_demo_model
from dflash_regen.demo_prompts import demo_rows
from dflash_regen.planning import plan_shards

SLOTS = 16
METRIC = re.compile(r"^sglang:(num_running_reqs|generation_tokens_total)\{[^}]*\} ([\d.e+]+)$", re.M)


def sample_metrics(servers, stop: threading.Event, out: list) -> None:
    while not stop.is_set():
        t = time.monotonic()
        row = {"t": t, "running": 0, "tokens": 0.0}
        for s in servers:
            text = requests.get(f"{s.url}/metrics", timeout=5).text
            for name, value in METRIC.findall(text):
                row["running" if name == "num_running_reqs" else "tokens"] += float(value)
        out.append(row)
        stop.wait(0.5)


def measure(name, servers, work, capacity) -> dict:
    samples: list = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_metrics, args=(servers, stop, samples))
    sampler.start()
    started = time.monotonic()
    output_tokens = work()
    wall = time.monotonic() - started
    stop.set()
    sampler.join()
    full = len(servers) * SLOTS
    occupancy = sum(s["running"] for s in samples) / (full * len(samples)) if samples else 0.0
    # Steady state: from when every slot is first busy until the first slot goes idle (the drain tail).
    busy = [i for i, s in enumerate(samples) if s["running"] >= full]
    steady = None
    if busy:
        first = busy[0]
        last = next((i for i in range(first, len(samples)) if samples[i]["running"] < full), len(samples)) - 1
        if last > first:
            span = samples[last]["t"] - samples[first]["t"]
            steady = (samples[last]["tokens"] - samples[first]["tokens"]) / span / capacity
    return {"client": name, "wall_s": round(wall, 2), "output_tokens": output_tokens,
            "tok_per_s": round(output_tokens / wall, 1), "utilisation": round(output_tokens / wall / capacity, 4),
            "steady_utilisation": round(steady, 4) if steady is not None else None,
            "slot_occupancy": round(occupancy, 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-server", type=int, default=48, help="prompts per server (3 rounds of 16 slots)")
    ap.add_argument("--decode", type=float, default=150.0, help="emulated decode tok/s per running request")
    ap.add_argument("--servers", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import free_port_block  # the tests' free-port finder

    work_dir = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    params = {**DEFAULTS, "output_root": str(work_dir / "out"), "num_servers": args.servers,
              "base_port": free_port_block(args.servers), "shard_size": args.per_server,
              "emulator_profile": {"decode_tokens_per_s": args.decode, "startup_s": 0.1}, "ready_timeout_s": 120.0}
    cfg = RunConfig.from_params(params, "bench")
    servers = fleet.launch_fleet(cfg.fleet, write_demo_model(work_dir / "model"), cfg.fleet_dir)
    key = fleet.read_api_key(cfg.fleet_dir)
    capacity = args.servers * SLOTS * args.decode
    try:
        src = work_dir / "prompts.jsonl"
        n = args.servers * args.per_server
        rows = demo_rows(n)[:n]  # without the two malformed demo rows
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        plan = plan_shards(src, cfg.run_dir / "shards", cfg.run_dir / "failures" / "plan.parquet", cfg.plan)

        def ours() -> int:
            def one(shard):
                paths = generation.ShardPaths.of(cfg.run_dir, shard["shard"], Path(shard["path"]))
                lease = generation.lease_server(cfg.fleet_dir, servers, shard["shard"], wait_s=60)
                try:
                    return generation.generate_shard(paths, lease, key, cfg.generation, fleet_dir=cfg.fleet_dir)
                finally:
                    lease.release()

            with ThreadPoolExecutor(len(plan["shards"])) as pool:
                return sum(r["output_tokens"] for r in pool.map(one, plan["shards"]))

        def plain() -> int:
            # The same prompts per server as ours: shard i (consecutive rows) on server i.
            per_server = [rows[i * args.per_server : (i + 1) * args.per_server] for i in range(args.servers)]

            def server_job(server, prompts):
                session = requests.Session()

                def send(row):  # the same request ours sends (seed included), so lengths match
                    seed = generation.sample_seed(row["id"], cfg.generation.seed)
                    body = generation.chat_payload(row["messages"], row.get("tools"), cfg.generation, seed,
                                               cfg.generation.max_tokens)
                    resp = session.post(f"{server.url}/v1/chat/completions", json=body, timeout=3600,
                                        headers={"Authorization": f"Bearer {key}"})
                    return resp.json()["usage"]["completion_tokens"]

                with ThreadPoolExecutor(SLOTS) as pool:
                    return sum(pool.map(send, prompts))

            with ThreadPoolExecutor(args.servers) as pool:
                return sum(pool.map(server_job, servers, per_server))

        results = [measure("ours", servers, ours, capacity), measure("plain", servers, plain, capacity)]
    finally:
        fleet.stop_fleet(cfg.fleet_dir)
    report = {"benchmark": "fleet_utilisation", "servers": args.servers, "slots_per_server": SLOTS,
              "decode_tok_per_s_per_request": args.decode, "capacity_tok_per_s": capacity,
              "prompts": args.servers * args.per_server, "machine": f"{platform.machine()}, {platform.node()}",
              "results": results,
              "ours_over_plain": round(results[0]["tok_per_s"] / results[1]["tok_per_s"], 3)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fleet_utilisation.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
