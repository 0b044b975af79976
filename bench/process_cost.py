"""Client cost and memory (figures 2 and 4): planning and one shard task, each in its own process.

For runs of 10K, 100K and 1M prompt rows (the demo mix, ~1.1 KB a row):
- planning: `plan_shards` over the jsonl, in its own process: peak RSS and seconds;
- one shard task (`tasks.generate`, the `generate` task body) on shard 0 of that plan (1,000 prompts)
  against one zero-latency emulated server (16 slots, realistic answer lengths): peak RSS, CPU seconds,
  requests/s;
- on the first run size only, the plain client (`benchlib.plain_client`) on the same shard and server, also
  in its own process.
CPU and peak RSS are each child's own (`os.wait4`); the work's CPU excludes interpreter start and imports.

    .venv/bin/python bench/process_cost.py [--rows 10000 100000 1000000] [--shard-size 1000] [--quick]
"""

from __future__ import annotations

import json
import sys

from benchlib import (
    ZERO_LATENCY,
    cli_argv,
    emulated_fleet,
    figure,
    parser,
    run_measured,
    share_fleet,
    work_dir,
    write_prompts,
    write_result,
)

FLEET_NEEDS_REQ_S = 20.0  # 7 B200 servers x 16 slots at 15-30K tok/s, ~1,820 output tokens a request


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--shard-size", type=int, default=1000)
    args = ap.parse_args()
    if args.quick:
        args.rows, args.shard_size = [200, 1000], 50
    work = work_dir("cost")
    runs = []
    with emulated_fleet(work, 1, ZERO_LATENCY, shard_size=args.shard_size) as fl:
        imports = {"peak_rss_mb": None} if args.quick else run_measured(
            [sys.executable, "-c", "import dflash_regen.tasks, pyarrow.parquet, requests"], work / "imports.log")
        for rows in args.rows:
            run_id = f"rows-{rows}"
            share_fleet(fl, run_id)
            source = write_prompts(work / f"prompts-{rows}.jsonl", rows)
            planned = run_measured(cli_argv("plan", fl.params, run_id, str(source), folder=work),
                                   work / f"plan-{rows}.log")
            shard = planned["output"]["result"]["first_shard"]
            ours = run_measured(cli_argv("shard", fl.params, run_id, json.dumps(shard), folder=work),
                                work / f"shard-{rows}.log")
            plain = None
            if not runs:
                plain = run_measured(cli_argv("plain", fl.params, run_id, shard["path"], "0", folder=work),
                                     work / f"plain-{rows}.log")
            runs.append({"rows": rows, "source_mb": round(source.stat().st_size / 1e6, 1), "plan": planned,
                         "shard_prompts": shard["prompts"], "ours": ours, "plain": plain})
            source.unlink()

    first, last = runs[0], runs[-1]
    n = first["shard_prompts"]

    def per_1k(run: dict) -> float:
        return run["output"]["work_cpu_s"] / n * 1000

    def req_s(run: dict) -> float:
        return n / run["output"]["work_wall_s"]

    ours_1k = sum(per_1k(r["ours"]) for r in runs) / len(runs)
    mean_tokens = first["ours"]["output"]["result"]["output_tokens"] / n
    figures = [
        figure(2, "Client cost: CPU s per 1,000 requests, zero-latency server", per_1k(first["ours"]) /
               per_1k(first["plain"]), "ours / plain (same shard, same server)", "<= 1",
               ours_cpu_s_per_1k=round(per_1k(first["ours"]), 2), plain_cpu_s_per_1k=round(per_1k(first["plain"]), 2),
               ours_mean_of_runs=round(ours_1k, 2), requests=n, mean_output_tokens=round(mean_tokens)),
        figure(2, "Client cost: requests/s one shard task sustains", req_s(first["ours"]) / req_s(first["plain"]),
               "ours / plain (same shard, same server)", ">= 1",
               ours_req_s=round(req_s(first["ours"]), 1), plain_req_s=round(req_s(first["plain"]), 1),
               ours_cpu_bound_req_s=round(1000 / ours_1k, 1), fleet_needs_req_s=FLEET_NEEDS_REQ_S,
               headroom_vs_need=round(req_s(first["ours"]) / FLEET_NEEDS_REQ_S, 1)),
        figure(4, f"Memory: planning peak RSS, {last['rows']:,} / {first['rows']:,} rows",
               last["plan"]["peak_rss_mb"] / first["plan"]["peak_rss_mb"],
               f"RSS ratio for {last['rows'] // first['rows']}x rows", "~1 (flat)",
               **{f"rss_mb_{r['rows']}": r["plan"]["peak_rss_mb"] for r in runs},
               **{f"seconds_{r['rows']}": r["plan"]["output"]["work_wall_s"] for r in runs},
               import_only_rss_mb=imports["peak_rss_mb"]),
        figure(4, f"Memory: shard task peak RSS ({n:,} prompts), {last['rows']:,}- / {first['rows']:,}-row run",
               last["ours"]["peak_rss_mb"] / first["ours"]["peak_rss_mb"], "RSS ratio", "~1 (flat)",
               **{f"rss_mb_{r['rows']}": r["ours"]["peak_rss_mb"] for r in runs},
               plain_client_rss_mb=first["plain"]["peak_rss_mb"], import_only_rss_mb=imports["peak_rss_mb"]),
    ]
    write_result(args.out, "process_cost", figures, {"runs": runs, "imports": imports})


if __name__ == "__main__":
    main()
