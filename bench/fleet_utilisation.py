"""Fleet utilisation: output tok/s achieved vs the emulated fleet's capacity, ours vs a plain client.

Seven emulated servers (16 running-request slots each, the seed's allocation), a fixed per-request decode
rate, the demo prompt mix (mean ~1,820 output tokens). Both clients run in this one process, side by side
on the same fleet, with the same prompts:
- ours: one `generate_shard` per server (lease, streaming, checkpoints), in threads as Airflow would run
  seven shard tasks (here in one process, so its client cost is, if anything, overstated);
- plain: what a hand-written script does: one `requests` session per server, a 16-thread pool each,
  non-streaming requests.
Capacity = servers x slots x decode rate. The emulator's /metrics gauges give slot occupancy over time.

    .venv/bin/python bench/fleet_utilisation.py [--per-server 48] [--decode 150] [--quick]
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
from benchlib import (
    SLOTS,
    emulated_fleet,
    figure,
    parser,
    plain_client,
    plan,
    shard_rows,
    work_dir,
    write_prompts,
    write_result,
)

from dflash_regen.fleet.servers import lease
from dflash_regen.generate.shard import ShardPaths, generate_shard

METRIC = re.compile(r"^sglang:(num_running_reqs|generation_tokens_total)\{[^}]*\} ([\d.e+]+)$", re.M)


def sample_metrics(servers, stop: threading.Event, out: list, every_s: float) -> None:
    while not stop.is_set():
        t = time.monotonic()
        row = {"t": t, "running": 0, "tokens": 0.0}
        for s in servers:
            text = requests.get(f"{s.url}/metrics", timeout=5).text
            for name, value in METRIC.findall(text):
                row["running" if name == "num_running_reqs" else "tokens"] += float(value)
        out.append(row)
        stop.wait(every_s)


def measure(name, servers, work, capacity, every_s: float) -> dict:
    samples: list = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_metrics, args=(servers, stop, samples, every_s))
    sampler.start()
    started, cpu = time.monotonic(), time.process_time()
    output_tokens, requests_sent = work()
    wall, cpu = time.monotonic() - started, time.process_time() - cpu  # the servers are other processes
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
            "slot_occupancy": round(occupancy, 4),
            "client_cpu_s_per_1k_requests": round(cpu / requests_sent * 1000, 2)}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--per-server", type=int, default=48, help="prompts per server (3 rounds of 16 slots)")
    ap.add_argument("--decode", type=float, default=150.0, help="emulated decode tok/s per running request")
    ap.add_argument("--mean-tokens", type=float, default=1820.0, help="emulated mean output tokens")
    ap.add_argument("--servers", type=int, default=7)
    args = ap.parse_args()
    if args.quick:
        args.servers, args.per_server, args.decode, args.mean_tokens = 2, 32, 400.0, 300.0
    every_s = 0.2 if args.quick else 0.5  # /metrics sampling period

    work = work_dir("fleet")
    capacity = args.servers * SLOTS * args.decode
    profile = {"decode_tokens_per_s": args.decode, "mean_output_tokens": args.mean_tokens, "startup_s": 0.1}
    with emulated_fleet(work, args.servers, profile, shard_size=args.per_server) as fl:
        cfg = fl.cfg
        planned = plan(fl.params, "bench", write_prompts(work / "prompts.jsonl", args.servers * args.per_server))

        def ours() -> tuple[int, int]:
            def one(shard):
                paths = ShardPaths.of(cfg.layout, shard["shard"], Path(shard["path"]))
                with lease(cfg.fleet_dir, fl.servers, shard["shard"], wait_s=60) as server:
                    return generate_shard(paths, server, fl.key, cfg.generation, fleet_dir=cfg.fleet_dir)

            with ThreadPoolExecutor(len(planned["shards"])) as pool:
                done = list(pool.map(one, planned["shards"]))
            return sum(r["output_tokens"] for r in done), sum(r["completed"] for r in done)

        def plain() -> tuple[int, int]:
            # The same prompts per server as ours: shard i on server i (ours leases shard i to server i too).
            def server_job(server, shard):
                return plain_client(server.url, fl.key, shard_rows(Path(shard["path"])), cfg.generation)

            with ThreadPoolExecutor(args.servers) as pool:
                done = list(pool.map(server_job, fl.servers, planned["shards"]))
            return sum(r["output_tokens"] for r in done), sum(r["requests"] for r in done)

        ours_run, plain_run = (measure("ours", fl.servers, ours, capacity, every_s),
                               measure("plain", fl.servers, plain, capacity, every_s))

    settings = {"servers": args.servers, "slots_per_server": SLOTS, "decode_tok_per_s_per_request": args.decode,
                "capacity_tok_per_s": capacity, "prompts": args.servers * args.per_server}
    figures = [
        figure(1, "Fleet utilisation, whole run (ours)", ours_run["utilisation"], "output tok/s / fleet capacity",
               "1.0", tok_per_s=ours_run["tok_per_s"], capacity_tok_per_s=capacity, wall_s=ours_run["wall_s"],
               output_tokens=ours_run["output_tokens"], prompts=settings["prompts"]),
        figure(1, "Fleet utilisation, steady state (ours)", ours_run["steady_utilisation"],
               "output tok/s while all slots busy / capacity", "1.0", slot_occupancy=ours_run["slot_occupancy"],
               plain_steady=plain_run["steady_utilisation"]),
        figure(1, "Fleet utilisation, ours / plain client", ours_run["tok_per_s"] / plain_run["tok_per_s"],
               "ours tok/s / plain tok/s (same fleet, same requests)", ">= 1", ours_tok_per_s=ours_run["tok_per_s"],
               plain_tok_per_s=plain_run["tok_per_s"], plain_utilisation=plain_run["utilisation"],
               ours_cpu_s_per_1k=ours_run["client_cpu_s_per_1k_requests"],
               plain_cpu_s_per_1k=plain_run["client_cpu_s_per_1k_requests"]),
    ]
    write_result(args.out, "fleet_utilisation", figures, {**settings, "results": [ours_run, plain_run]})


if __name__ == "__main__":
    main()
