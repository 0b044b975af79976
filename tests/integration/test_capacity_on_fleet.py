"""The capacity planner against real emulator processes with a known throughput curve."""

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from dflash_regen import capacity
from dflash_regen.capacity.health import health_gate
from dflash_regen.demo.prompts import demo_rows, write_demo_prompts
from dflash_regen.fleet.servers import lease, load_servers
from dflash_regen.generate.shard import ShardPaths, generate_shard
from dflash_regen.layout import RunLayout
from dflash_regen.prompts.planning import plan_shards

# Per-request decode 400 tok/s alone, 3,000 tok/s aggregate ceiling: 16 running requests make ~2,100 tok/s
# per server, each request ~133 tok/s, so a 300-token answer takes ~2.3 s. Few enough tokens per second that
# the client and the emulators stay far from CPU-bound on a loaded 2-core box, so the emulated decode time,
# not scheduling noise, makes the wall time; prefill fast enough not to dominate.
KNOWN_CURVE = {"decode_tokens_per_s": 400, "saturation_tokens_per_s": 3000, "mean_output_tokens": 300,
               "prefill_tokens_per_s": 100000, "startup_s": 0.1}


def ids(shards):
    import pyarrow.parquet as pq

    return [i for s in shards for i in pq.read_table(s["path"], columns=["sample_id"]).column("sample_id").to_pylist()]


def planned(cfg, tmp_path, n, shard_size):
    src = write_demo_prompts(tmp_path / "prompts.jsonl", n)
    settings = type(cfg.plan)(prompt_format="auto", shard_size=shard_size, sampling=cfg.plan.sampling,
                              context_length=cfg.plan.context_length, max_bad_row_share=1.0)
    return plan_shards(src, cfg.layout, settings)


def test_calibration_finds_the_emulators_known_curve_and_predicts_a_run_it_never_saw(launch, tmp_path):
    cfg, servers, key = launch(num_servers=2, emulator_profile=KNOWN_CURVE)
    plan = planned(cfg, tmp_path, 192, shard_size=48)  # 4 shards (the 2 malformed demo rows are dropped)
    health = health_gate(servers, key, cfg.fleet)
    shape = capacity.RunShape(prompts=plan["accepted"], servers=2, shard_size=48)
    # Calibrate on other prompts (other ids, so other per-sample seeds) and another run seed than the run's, so
    # the prediction is not the measured run's own output lengths played back.
    other = tmp_path / "calibration"
    source = other / "prompts.jsonl"
    source.parent.mkdir()
    source.write_text("".join(json.dumps({**r, "id": f"cal-{r['id']}"}) + "\n" for r in demo_rows(96, seed=1)))
    settings = type(cfg.plan)(prompt_format="auto", shard_size=96, sampling=cfg.plan.sampling,
                              context_length=cfg.plan.context_length, max_bad_row_share=1.0)
    calibration_shards = plan_shards(source, RunLayout(other), settings)["shards"]
    assert not set(ids(calibration_shards)) & set(ids(plan["shards"]))
    report = capacity.calibrate(servers[0], key, health, calibration_shards, replace(cfg.generation, seed=1), shape,
                                prompts=96)
    print(capacity.format_table(report))

    # The emulator's known curve: 400 tok/s alone, a 3,000 tok/s ceiling.
    assert abs(report["curve"]["single_request_tok_s"] - 400) / 400 < 0.15, report["curve"]
    assert abs(report["curve"]["saturation_tok_s"] - 3000) / 3000 < 0.15, report["curve"]

    # The seed's allocation on the emulator: 80 Mamba slots // 5 = 16, the KV cache holds hundreds.
    assert report["binding"]["resource"] == "Mamba slots"
    assert report["advice"]["server_flags"] == "--max-mamba-cache-size 160 --max-running-requests 32"
    levels = report["calibration"]["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 4, 8, 16]
    per_request = [lv["tok_s"] / lv["running"] for lv in levels]
    assert per_request == sorted(per_request, reverse=True)  # each request slows as the batch grows
    assert report["curve"]["saturation_tok_s"] is not None

    # The run, as Airflow runs it: two shard tasks at a time, each leasing a free server.
    def run(shard):
        with lease(cfg.fleet_dir, load_servers(cfg.fleet_dir), shard["shard"], wait_s=30) as server:
            paths = ShardPaths.of(cfg.layout, shard["shard"], Path(shard["path"]))
            return generate_shard(paths, server, key, cfg.generation, fleet_dir=cfg.fleet_dir)

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, plan["shards"]))
    measured = time.monotonic() - started
    assert sum(r["completed"] for r in results) == plan["accepted"]
    predicted = report["scenarios"][0]["wall_s"]
    print(f"predicted {predicted:.1f} s (80% interval {report['scenarios'][0]['wall_s_interval']}), "
          f"measured {measured:.1f} s")
    # The calibration's 96 output lengths are a sample, not the run's own: its bootstrap is in the 80% interval.
    low, high = report["scenarios"][0]["wall_s_interval"]
    assert 0.9 * low <= measured <= 1.1 * high, (predicted, (low, high), measured)


def test_a_kv_bound_server_is_named_kv_bound_with_flags_that_free_kv(launch, tmp_path):
    # 8,000 KV tokens hold under 16 requests of the demo's ~900 tokens (prompt + answer): fewer than the slots.
    cfg, servers, key = launch(num_servers=1, emulator_profile=KNOWN_CURVE, min_kv_tokens=0,
                               emulator_faults={"*": {"kv_tokens": 8000}})
    plan = planned(cfg, tmp_path, 32, shard_size=32)
    health = health_gate(servers, key, cfg.fleet)
    shape = capacity.RunShape(prompts=plan["accepted"], servers=1, shard_size=32)
    report = capacity.calibrate(servers[0], key, health, plan["shards"], cfg.generation, shape, prompts=32)
    print(capacity.format_table(report))
    assert report["binding"]["resource"] == "KV tokens"
    assert "8,000 tokens" in report["binding"]["detail"]
    # The speculative reserve is sized by --max-running-requests (48 by default): naming 16 frees it for KV.
    assert "--max-running-requests 16" in report["advice"]["server_flags"]
    assert report["advice"]["kv_tokens_advised"] > 8000
    current = report["scenarios"][0]
    assert current["running_per_server"] < 16


def test_a_run_can_apply_the_advised_client_concurrency_and_its_eta_uses_the_calibrated_rate(launch, tmp_path,
                                                                                              caplog):
    from dflash_regen import tasks
    from dflash_regen.settings.run_config import RunConfig

    cfg, servers, key = launch(num_servers=1)  # the fast test profile: no saturation, 16 slots
    plan = planned(cfg, tmp_path, 40, shard_size=20)
    health = health_gate(servers, key, cfg.fleet)
    shape = capacity.RunShape(prompts=plan["accepted"], servers=1, shard_size=20)
    report = capacity.calibrate(servers[0], key, health, plan["shards"], cfg.generation, shape, prompts=32)
    cfg.layout.write_report("capacity", report)
    assert report["advice"]["concurrency_per_server"] == 18
    params = {**launch.params, "apply_advised_concurrency": True}
    assert RunConfig.from_params(params, "test_run").capacity.apply_advised_concurrency
    gen_log = logging.getLogger("dflash_regen.generate")
    gen_log.addHandler(caplog.handler)  # importing Airflow stops this logger's records reaching the root
    try:
        with caplog.at_level("INFO", logger="dflash_regen.generate"):
            result = tasks.generate(params, "test_run", {**plan["shards"][0], "run_prompts": plan["accepted"]})
    finally:
        gen_log.removeHandler(caplog.handler)
    assert result["completed"] == 20
    assert "18 in flight" in caplog.text  # not the server's 16 slots
    assert "(calibrated rate)" in caplog.text  # 20 results < two batches of 18: the shard's own rate is too young


def test_a_rerun_of_calibrate_reuses_its_measurement_and_measures_again_when_a_setting_changed(launch, tmp_path):
    """A cleared shard re-runs the setups: calibrate must not spend the GPU's minutes measuring the same again."""
    from dflash_regen import tasks
    from dflash_regen.sglang.api import Api

    cfg, servers, key = launch(num_servers=1, calibration_prompts=32)
    plan = planned(cfg, tmp_path, 40, shard_size=20)
    cfg.layout.write_report("health", health_gate(servers, key, cfg.fleet))
    launched = {"fleet_dir": str(cfg.fleet_dir)}

    def tokens_served() -> float:
        return capacity.read_metrics(Api(servers[0].url, key))[0]

    first = tasks.calibrate(launch.params, "test_run", launched, plan["shards"])
    served = tokens_served()
    assert first["calibrated"] and served > 0
    assert tasks.calibrate(launch.params, "test_run", launched, plan["shards"]) == first
    assert tokens_served() == served, "the rerun measured again"
    again = tasks.calibrate({**launch.params, "calibration_prompts": 40}, "test_run", launched, plan["shards"])
    assert again["calibrated"] and tokens_served() > served, "a rerun with another sample size reused the old one"
    served = tokens_served()  # other sampling, another curve (each Param: tests/unit/capacity/test_fingerprints.py)
    tasks.calibrate({**launch.params, "calibration_prompts": 40, "temperature": 0.9}, "test_run", launched,
                        plan["shards"])
    assert tokens_served() > served, "a rerun with another temperature reused the old measurement"
    # the prediction is for what is left to generate: the completion store supplied the rest (issue 24)
    assert capacity.read_report(cfg.node_reports_dir)["run"]["prompts"] == 40
    left = [{**s, "to_generate": 5} for s in plan["shards"]]
    tasks.calibrate({**launch.params, "calibration_prompts": 40}, "test_run", launched, left)
    assert capacity.read_report(cfg.node_reports_dir)["run"]["prompts"] == 10
    # the fleet autotune left runs its applied flags on top: calibrate measures it as such, and again
    served = tokens_served()
    tuned = {**launched, "applied_flags": "--max-running-requests 16"}
    tasks.calibrate({**launch.params, "calibration_prompts": 40}, "test_run", tuned, left)
    assert tokens_served() > served, "the fleet autotune relaunched with other flags reused the old measurement"
    assert capacity.read_report(cfg.node_reports_dir)["scenarios"][0]["server_flags"].endswith(
        "--max-running-requests 16")


def test_the_planner_cli_emulates_a_gated_server_calibrates_it_and_replans_from_its_report(tmp_path,
                                                                                         no_leftover_servers):
    """`python -m dflash_regen.capacity emulate` (docs/capacity.md's command): one emulated server launched and gated
    by the DAG's code, calibrated on the demo prompts; `plan` re-plans a bigger run from the stored report."""
    import subprocess
    import sys

    from conftest import FAST_PROFILE, free_port_block

    report_path = tmp_path / "capacity.json"
    done = subprocess.run([sys.executable, "-m", "dflash_regen.capacity", "emulate", "--profile",
                           json.dumps(FAST_PROFILE), "--port", str(free_port_block(1)), "--prompts", "1000",
                           "--servers", "2", "--json", str(report_path)], capture_output=True, text=True,
                          timeout=300, check=False,
                          env={**os.environ, "TMPDIR": str(tmp_path)})  # no_leftover_servers sees its server
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(report_path.read_text())
    assert report["run"]["prompts"] == 1000 and report["run"]["servers"] == 2
    assert report["calibration"]["levels"] and report["binding"]
    assert "current: cookbook flags" in done.stdout
    replanned = subprocess.run([sys.executable, "-m", "dflash_regen.capacity", "plan", str(report_path),
                                "--prompts", "902087", "--servers", "7"], capture_output=True, text=True,
                               timeout=120, check=False)
    assert replanned.returncode == 0, replanned.stderr[-2000:]
    assert replanned.stdout.startswith("run: 902,087 prompts") and "on 7 servers" in replanned.stdout, \
        replanned.stdout[-2000:]
