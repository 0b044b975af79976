"""Figure 8: emulated whole-run wall time at the cookbook settings, autotuned, and autotuned + train-length budget.

One emulated server with the `qwen3.6-27b-b200-mtp` preset (SGLang's published Qwen3.6-27B B200 figures, MTP on;
the emulator derives the MTP-off curve and the memory per setting, see `dflash_regen.emulator.faults`), sped up
SPEEDUP times so a run takes a minute (every rate scales alike, so the ratios do not move). The same prompts run
three times, each a fresh run directory and a fresh fleet, through the pipeline's own task bodies:

1. cookbook: launch, generate every shard.
2. autotuned: launch, `autotune` (Param apply: tries the default candidates, relaunches with the fastest),
   generate every shard.
3. autotuned + budget: launched with the second run's winning flags (no second tuning: its fingerprint holds
   the budget, so a stored report would not apply), Param budget train_length at train_max_length 4096, generate
   every shard.

The ratios are generation wall times over the cookbook's; the tuning time is beside them (on a real run it is
~18 min against ~40 h of generation; here it is as long as the runs themselves).

    .venv/bin/python bench/autotune_budget.py [--quick]
"""

from __future__ import annotations

import time

from benchlib import emulated_fleet, figure, parser, plan, work_dir, write_prompts, write_result

SPEEDUP = 4  # --quick: 20 (it only checks that the benchmark runs)
PRESET = {"decode_tokens_per_s": 218.0, "saturation_tokens_per_s": 2414.0}  # faults.PRESETS' B200 rates


def profile(speedup: float) -> dict:
    return {"preset": "qwen3.6-27b-b200-mtp", "prefill_tokens_per_s": 60_000.0 * speedup, "startup_s": 0.1,
            **{k: v * speedup for k, v in PRESET.items()}}


def phase(work, source, run_id: str, speedup: float, **params) -> dict:
    from dflash_regen import tasks
    from dflash_regen.capacity import autotune
    from dflash_regen.capacity.health import health_gate
    from dflash_regen.fleet.servers import fleet_value

    with emulated_fleet(work, 1, profile(speedup), run_id=run_id, min_kv_tokens=0, min_running_requests=1,
                        shard_size=params.pop("shard_size"), **params) as fl:
        planned = plan(fl.params, run_id, source)
        fl.cfg.layout.write_report("health", health_gate(fl.servers, fl.key, fl.cfg.fleet))
        tuned = {}
        if fl.params["autotune"] != "off":
            started = time.monotonic()
            launched = fleet_value(fl.cfg.fleet_dir, fl.servers)
            tuned = tasks.autotune_fleet(fl.params, run_id, str(work / "model"), launched, planned["shards"])
            tuned["autotune_task_s"] = round(time.monotonic() - started, 1)
            report = autotune.read_report(fl.cfg.reports_dir)
            chosen = next((r for r in report["candidates"] if r.get("chosen")), {})
            tuned["predicted_wall_s"] = chosen.get("wall_s")
        started = time.monotonic()
        for shard in planned["shards"]:
            tasks.generate(fl.params, run_id, {**shard, "run_prompts": planned["accepted"]})
        wall = time.monotonic() - started
    return {"wall_s": round(wall, 1), "prompts": planned["accepted"], **tuned}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--prompts", type=int, default=240)
    args = ap.parse_args()
    prompts, candidate_s, budget_s, speedup = (args.prompts, 30.0, 600.0, SPEEDUP) if not args.quick \
        else (40, 2.0, 4.0, 20)  # --quick: the current settings are measured, the other candidates over budget
    work = work_dir("autotune")
    source = write_prompts(work / "prompts.jsonl", prompts)
    common = {"speedup": speedup, "shard_size": max(prompts // 2, 1), "calibration_prompts": 64,
              "autotune_candidate_s": candidate_s, "autotune_budget_s": budget_s}
    cookbook = phase(work, source, "cookbook", **common, autotune="off")
    tuned = phase(work, source, "autotuned", **common, autotune="apply")
    budget = phase(work, source, "budget", **common, autotune="off", server_flags=tuned.get("applied_flags", ""),
                   budget="train_length")
    figures = [
        figure(8, "Whole-run generation wall time, autotuned / cookbook (emulated B200)",
               tuned["wall_s"] / cookbook["wall_s"], "autotuned wall / cookbook wall (same prompts)", "< 1",
               cookbook_s=cookbook["wall_s"], autotuned_s=tuned["wall_s"], chosen=tuned.get("chosen"),
               tuning_s=tuned.get("tuning_s"), predicted_s=tuned.get("predicted_wall_s"), prompts=cookbook["prompts"]),
        figure(8, "Whole-run generation wall time, autotuned + train-length budget / cookbook (emulated B200)",
               budget["wall_s"] / cookbook["wall_s"], "autotuned + budget wall / cookbook wall (same prompts)", "< 1",
               cookbook_s=cookbook["wall_s"], budget_s=budget["wall_s"], autotuned_s=tuned["wall_s"],
               budget_over_autotuned=round(budget["wall_s"] / tuned["wall_s"], 3)),
    ]
    write_result(args.out, "autotune_budget", figures, {"cookbook": cookbook, "autotuned": tuned,
                                                        "autotuned_budget": budget, "speedup": speedup,
                                                        "profile": profile(speedup)})


if __name__ == "__main__":
    main()
