"""Autotune against real emulator processes whose speed curve has a known best setting."""

import json
import re
import time

from dflash_regen import tasks
from dflash_regen.capacity import autotune
from dflash_regen.capacity.health import health_gate
from dflash_regen.demo.prompts import write_demo_prompts
from dflash_regen.emulator.faults import PRESETS, Profile
from dflash_regen.fleet.servers import fleet_value, load_servers
from dflash_regen.layout import FleetFiles
from dflash_regen.prompts.planning import plan_shards
from dflash_regen.settings.run_config import RunConfig

# The synthetic preset: MTP pays alone and loses at 16 running, so "MTP off at 16" is the known optimum.
PROFILE = {"preset": "synthetic-known-optimum"}
# A small Mamba pool (20 slots // 5 per request = 4 running) keeps every candidate's batch small and cheap to measure:
# x2 -> 8, then 16 (4x, the most tried) for x4, radix cache off, MTP off and FP8 KV.
RUN_FLAGS = "--max-mamba-cache-size 20"


def aggregate(batch: int, speculative: bool = True) -> float:
    decode, saturation = Profile(**PRESETS["synthetic-known-optimum"]).decode_curve(speculative)
    return batch / (1 / decode + (batch - 1) / saturation)


def prepared(launch, tmp_path, prompts: int, shard_size: int, **params):
    cfg, servers, key = launch(num_servers=1, emulator_profile=PROFILE, server_flags=RUN_FLAGS, min_kv_tokens=0,
                               min_running_requests=1, calibration_prompts=32, shard_size=shard_size, **params)
    source = write_demo_prompts(tmp_path / "prompts.jsonl", prompts)
    settings = type(cfg.plan)(prompt_format="auto", shard_size=shard_size, sampling=cfg.plan.sampling,
                              context_length=cfg.plan.context_length, max_bad_row_share=1.0)
    plan = plan_shards(source, cfg.layout, settings)
    cfg.layout.write_report("health", health_gate(servers, key, cfg.fleet))
    return cfg, plan, fleet_value(cfg.fleet_dir, servers)


def test_apply_picks_the_known_optimum_relaunches_the_fleet_with_it_and_the_run_matches_the_prediction(
        launch, tmp_path):
    # Two shards of ~200 prompts: long enough that per-shard start-up (which the prediction leaves out) stays small.
    cfg, plan, launched = prepared(launch, tmp_path, 402, 201, autotune="apply", autotune_candidate_s=5.0)
    # The known optimum: the candidate whose batch and MTP setting the curves make fastest (MTP off at 16 running).
    expected = {"current": aggregate(4), "mamba pool x2": aggregate(8), "mamba pool x4": aggregate(16),
                "radix cache off at 16": aggregate(16), "MTP off at 16": aggregate(16, speculative=False),
                "FP8 KV cache at 16": aggregate(16)}
    best = max(expected, key=expected.get)
    assert best == "MTP off at 16" and expected[best] > 1.1 * aggregate(16)
    assert aggregate(4) > aggregate(4, speculative=False)  # MTP still pays at the current batch

    result = tasks.autotune_fleet(launch.params, "test_run", str(tmp_path / "model"), launched, plan["shards"])
    report = autotune.read_report(cfg.reports_dir)
    print(autotune.format_table(report))
    rows = {r["candidate"]: r for r in report["candidates"]}
    assert set(rows) == set(expected)
    assert not [r for r in rows.values() if r.get("skipped")]
    assert {name: r["running"] for name, r in rows.items()} == {
        "current": 4, "mamba pool x2": 8, "mamba pool x4": 16, "radix cache off at 16": 16, "MTP off at 16": 16,
        "FP8 KV cache at 16": 16}
    assert result["chosen"] == report["chosen"] == "MTP off at 16"
    for name, row in rows.items():  # the measured rates follow the known curve
        assert abs(row["tok_s"] - expected[name]) / expected[name] < 0.2, (name, row["tok_s"], expected[name])
    assert rows["FP8 KV cache at 16"]["kv_tokens"] > 1.9 * rows["mamba pool x4"]["kv_tokens"]  # FP8 doubles the room
    winner = rows["MTP off at 16"]
    assert winner["wall_with_tuning_s"] == round(report["tuning_s"] + winner["wall_s"], 1)
    assert "MTP off at 16" in (cfg.reports_dir / "autotune.md").read_text()

    # apply: the whole fleet runs the winner, gated again (health.json and smoke.json rewritten).
    health = json.loads(cfg.layout.node_report("health").read_text())
    assert health["servers"][0]["allocation"]["running_slots"] == 16
    assert json.loads(cfg.layout.node_report("smoke").read_text())["passed"]
    argv = json.loads(cfg.layout.fleet.server_spec(0).read_text())["argv"]
    assert "--speculative-algorithm" not in argv and argv[argv.index("--max-running-requests") + 1] == "16"
    # it returns the fleet it leaves (the relaunched servers), the one calibrate and the shards then use
    assert result["fleet_dir"] == launched["fleet_dir"] and result["applied_flags"] == winner["flags"]
    assert [s["pid"] for s in result["servers"]] == [s.pid for s in load_servers(cfg.fleet_dir)]
    assert result["servers"][0]["pid"] != launched["servers"][0]["pid"]

    started = time.monotonic()
    for shard in plan["shards"]:
        done = tasks.generate(launch.params, "test_run", {**shard, "run_prompts": plan["accepted"]})
        assert done["completed"] == shard["prompts"]
    measured = time.monotonic() - started
    print(f"predicted {winner['wall_s']:.1f} s ({winner['wall_s_interval']}), measured {measured:.1f} s")
    assert abs(measured - winner["wall_s"]) / winner["wall_s"] <= 0.10, (winner["wall_s"], measured)


def test_candidates_that_crash_at_start_fail_smoke_or_run_out_of_kv_are_skipped_with_their_reason(launch, tmp_path):
    cfg, plan, _ = prepared(launch, tmp_path, 60, 60, autotune="advise", autotune_candidate_s=3.0)
    from dflash_regen.fleet.servers import stop_fleet

    stop_fleet(cfg.fleet_dir)  # as tune() does: the first GPU's port is the candidates'
    tuner = autotune.Tuner(cfg, tmp_path / "model", plan["shards"], plan["accepted"])
    from dflash_regen import capacity

    sample = capacity.sample_prompts(plan["shards"], 32, cfg.generation.seed)
    current = tuner.try_one(0, autotune.Candidate("current", ""), sample, 3.0)
    assert current["running"] == 4 and "wall_s" in current and tuner.lengths
    bad = autotune.extra_candidates([
        "--disable-radix-cache --mamba-scheduler-strategy extra_buffer",  # SGLang refuses it: exits at start
        "--tool-call-parser off",  # answers, but tool calls come back as text: a broken setting
        "--max-total-tokens 2000",  # a KV pool too small for its 4 running requests of ~780 tokens
    ])
    rows = [tuner.try_one(i + 1, cand, sample, 3.0) for i, cand in enumerate(bad)]
    for row in rows:
        print(row["candidate"], row["flags"], "->", row.get("skipped"))
    assert rows[0]["skipped"].startswith("fails to start: server 0") and "exited with code 1" in rows[0]["skipped"]
    assert rows[1]["skipped"].startswith("fails smoke:") and "no parsed tool call" in rows[1]["skipped"]
    assert re.fullmatch(r"runs out of KV: 1,984 KV tokens hold [0-3] requests of ~\d+ tokens, fewer than its 4 "
                        r"running slots", rows[2]["skipped"]), rows[2]["skipped"]
    assert all("wall_s" not in r for r in rows)
    assert autotune.choose([current, *rows]) is current
    assert not [m for d in cfg.layout.autotune_dir.glob("*") for m in FleetFiles(d).unhealthy_markers()]
    assert RunConfig.from_params(launch.params, "test_run").autotune.mode == "advise"
