"""Resume (figure 7): wall time to finish a shard after a kill at 50% vs an uninterrupted run of it.

One emulated server (16 slots) and one shard, run as the shard task (`tasks.generate`) in its own
process, twice on the same server with the same prompts (so the same answer lengths):
- uninterrupted: the task body's wall time (`generate` call to return);
- interrupted: SIGKILL (as an OOM kill or a lost worker) once the checkpoints hold half the shard, then a
  fresh task process on the same shard: its task body's wall time is the resume time.
The interpreter start and imports (~5 s here, the same in every run) are left out of the ratio because
they are a fixed cost that is large next to a scaled-down shard but small next to a 10-minute one; the
raw numbers keep the process wall times too.
Time is scaled down: the decode rate is --decode tok/s per request (B200-like: ~150), and the checkpoint
period is scaled with it, so a checkpoint covers the same share of the shard as in production (50 results
or 30 s of a 1,000-prompt shard).

    .venv/bin/python bench/resume.py [--prompts 160] [--decode 1500] [--quick]
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from benchlib import (
    cli_argv,
    emulated_fleet,
    figure,
    parser,
    plan,
    reap,
    run_measured,
    share_fleet,
    spawn,
    work_dir,
    write_prompts,
    write_result,
)

from dflash_regen.generate import checkpoints
from dflash_regen.generate.shard import ShardPaths
from dflash_regen.settings.run_config import RunConfig


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--prompts", type=int, default=160)
    ap.add_argument("--decode", type=float, default=1500.0)
    ap.add_argument("--mean-tokens", type=float, default=1820.0)
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.decode, args.mean_tokens = 32, 2000.0, 300.0
    work = work_dir("resume")
    scale = args.decode / 150.0  # how much faster than a B200 request the emulated one decodes
    profile = {"decode_tokens_per_s": args.decode, "mean_output_tokens": args.mean_tokens, "startup_s": 0.1}
    source = write_prompts(work / "prompts.jsonl", args.prompts)
    with emulated_fleet(work, 1, profile, shard_size=args.prompts,
                        checkpoint_every=max(1, args.prompts * 50 // 1000), checkpoint_s=30.0 / scale) as fl:
        shards = {}
        for run_id in ("uninterrupted", "interrupted"):
            share_fleet(fl, run_id)
            shards[run_id] = {**plan(fl.params, run_id, source)["shards"][0], "run_prompts": args.prompts}
        full = run_measured(cli_argv("shard", fl.params, "uninterrupted", json.dumps(shards["uninterrupted"]),
                                     folder=work), work / "uninterrupted.log")

        paths = ShardPaths.of(RunConfig.from_params(fl.params, "interrupted").layout, 0,
                                         Path(shards["interrupted"]["path"]))
        argv = cli_argv("shard", fl.params, "interrupted", json.dumps(shards["interrupted"]), folder=work)
        started = time.monotonic()
        proc = spawn(argv, work / "killed.log")
        while (done := len(checkpoints.read_done(paths.parts, paths.output))) < args.prompts / 2:
            if proc.poll() is not None:
                raise RuntimeError(f"the shard task ended before half the shard was checkpointed; see {work}")
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        killed = reap(proc, started, work / "killed.log", check=False)
        resumed = run_measured(argv, work / "resumed.log")

    resumed_s, full_s = resumed["output"]["work_wall_s"], full["output"]["work_wall_s"]
    figures = [figure(7, "Resume: finish a shard after a kill at 50%", resumed_s / full_s,
                      "resumed task's wall / uninterrupted task's wall", "~0.5", resumed_s=resumed_s,
                      uninterrupted_s=full_s, checkpointed_at_kill=done, prompts=args.prompts,
                      resent=resumed["output"]["result"]["generated_now"],
                      process_wall_resumed_s=resumed["wall_s"], process_wall_uninterrupted_s=full["wall_s"],
                      process_wall_killed_s=killed["wall_s"])]
    write_result(args.out, "resume", figures, {"uninterrupted": full, "killed": killed, "resumed": resumed,
                                               "decode_tok_per_s": args.decode, "time_scale": round(scale, 2)})


if __name__ == "__main__":
    main()
