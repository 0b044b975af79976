"""The planner's arithmetic: curve fit, shard simulation, memory model, binding resource and advice."""

import numpy as np
import pytest

from dflash_regen import atomic, capacity
from dflash_regen.capacity import Curve, Memory, RunShape
from dflash_regen.capacity.__main__ import main as capacity_cli
from dflash_regen.emulator import allocation

B200 = Curve(a=1 / 300 - 1 / 2000, k=1 / 2000, measured_up_to=16)  # the emulator's B200 preset


def health_entry(reserve_gb: float = 27.9, **alloc_changes) -> dict:
    """health_check's entry for the seed's B200 server (figures as the emulator's startup log prints them)."""
    alloc = dict(kv_tokens=1_139_584, running_slots=16, max_running_requests=48, mamba_slots=80, kv_cache_gb=34.78,
                 radix_cache=True, mamba_strategy="extra_buffer")
    return {"server": "server 0", "url": "http://127.0.0.1:30000", "healthy": True,
            "allocation": {**alloc, **alloc_changes},
            "log_figures": {"mamba_gb": 30.94, "mamba_reserve_gb": reserve_gb}}


def seed_memory(**changes) -> Memory:
    return Memory.from_health(health_entry(**changes))


def levels_on(curve: Curve, batches=(1, 4, 8, 16)) -> list[dict]:
    return [{"concurrency": b, "running": b, "tok_s": curve.aggregate(b)} for b in batches]


def test_the_fit_recovers_a_known_curve_and_a_flat_one_has_no_ceiling():
    fitted = Curve.fit(levels_on(B200))
    assert fitted.per_request(1) == pytest.approx(300) and fitted.saturation == pytest.approx(2000)
    assert fitted.measured_up_to == 16
    flat = Curve.fit([{"running": b, "tok_s": 150.0 * b} for b in (1, 4, 8, 16)])
    assert flat.saturation is None and flat.aggregate(64) == pytest.approx(64 * 150)


def test_a_shard_simulation_counts_the_batch_rate_and_the_drain():
    lengths = np.array([1000.0, 1000.0, 3000.0])
    linear = Curve(a=1 / 100, k=0.0)
    assert capacity.simulate_shard(lengths, 1, linear) == pytest.approx(50.0)  # one at a time, 100 tok/s
    # All three at once: 1000 tokens at the batch-of-3 rate, then the last 2000 alone (faster).
    expected = 1000 / B200.per_request(3) + 2000 / B200.per_request(1)
    assert capacity.simulate_shard(lengths, 3, B200) == pytest.approx(expected)


def test_shards_go_to_the_server_that_frees_up_first():
    assert capacity.makespan([10, 10, 10], [1.0, 1.0]) == 20
    assert capacity.makespan([10, 1, 1, 1], [1.0, 1.0]) == 10
    assert capacity.makespan([10, 10], [1.0, 2.0]) == 20  # the slower server takes twice as long


def test_the_memory_model_matches_sglangs_arithmetic_for_other_mamba_settings():
    mem = seed_memory()
    assert mem.mamba_ratio == 5 and mem.knows_pools
    for running in (16, 24, 32):  # --max-mamba-cache-size 5n --max-running-requests n, cookbook flags otherwise
        expected = allocation.compute(allocation.AllocationInputs(
            mem_fraction_static=0.8, speculative=True, speculative_num_draft_tokens=4, max_running_requests=running,
            max_mamba_cache_size=5 * running, max_total_tokens=None, disable_radix_cache=False, extra_buffer=True,
            overlap_schedule=True, context_len=262144))
        assert mem.kv_tokens_at(running) == pytest.approx(expected.max_total_num_tokens, rel=0.01)


def test_the_seeds_node_is_mamba_bound_and_the_advice_names_160_and_32():
    advice = capacity.advise(B200, [seed_memory()], RunShape(902_087, 7, 1000), request_tokens=2420)
    assert advice["resource"] == "Mamba slots"
    assert "80 Mamba slots // 5 = 16" in advice["detail"]
    assert advice["server_flags"] == "--max-mamba-cache-size 160 --max-running-requests 32"
    assert advice["running_advised"] == 32 and advice["concurrency_per_server_advised"] == 36
    assert advice["concurrency_per_server"] == 18  # 16 slots and a small queue


def test_a_small_kv_pool_is_kv_bound_and_naming_the_running_requests_frees_the_speculative_reserve():
    mem = seed_memory(kv_tokens=20_000, kv_cache_gb=0.61)
    advice = capacity.advise(B200, [mem], RunShape(1000, 1, 100), request_tokens=2420)
    assert advice["resource"] == "KV tokens" and "holds 8 requests" in advice["detail"]
    assert advice["server_flags"] == "--max-running-requests 16"  # 48 -> 16 shrinks the reserve by ~19 GB
    assert advice["kv_tokens_advised"] > 16 * 2420 * capacity.KV_HEADROOM
    assert capacity.running_batch(mem, RunShape(1000, 1, 100), 2420) == (8, "KV tokens")


def test_kv_binds_only_when_it_holds_fewer_requests_than_the_slots():
    exactly = capacity.binding_resource(seed_memory(kv_tokens=16 * 2420), 2420)
    assert (exactly.resource, exactly.running, exactly.kv_fit) == ("Mamba slots", 16, 16)
    short = capacity.binding_resource(seed_memory(kv_tokens=16 * 2420 - 1), 2420)
    assert (short.resource, short.running, short.kv_fit) == ("KV tokens", 15, 15)
    advice = capacity.advise(B200, [seed_memory(kv_tokens=16 * 2420)], RunShape(1000, 1, 100), 2420)
    assert advice["resource"] == "Mamba slots"


def test_a_saturated_gpu_is_compute_bound_and_no_flag_is_advised():
    saturated = Curve(a=1 / 1900 - 1 / 2000, k=1 / 2000)  # alone nearly as fast as the whole GPU
    advice = capacity.advise(saturated, [seed_memory()], RunShape(1000, 1, 100), request_tokens=2420)
    assert advice["resource"] == "compute" and advice["server_flags"] == ""


def test_the_client_and_the_running_request_cap_are_named_when_they_bind():
    client = capacity.advise(B200, [seed_memory()], RunShape(1000, 1, 100, concurrency_per_server=8), 2420)
    assert client["resource"] == "client concurrency" and client["running_now"] == 8
    capped = seed_memory(running_slots=12, max_running_requests=12, reserve_gb=27.9 * 12 / 48)  # Mamba allows 16
    advice = capacity.advise(B200, [capped], RunShape(1000, 1, 100), 2420)
    assert advice["resource"] == "running requests" and advice["running_advised"] > 12
    assert advice["server_flags"].endswith(f"--max-running-requests {advice['running_advised']}")


def test_the_prediction_is_tokens_over_fleet_rate_plus_the_drains_with_an_interval():
    lengths = np.random.default_rng(1).lognormal(np.log(1800), 0.33, 64)
    curve = Curve(a=B200.a, k=B200.k, cov=((1e-10, 0.0), (0.0, 1e-12)), measured_up_to=16)
    shape = RunShape(prompts=70_000, servers=7, shard_size=1000)
    got = capacity.predict(curve, lengths, shape, [16] * 7)
    steady = 70_000 * lengths.mean() / (7 * curve.aggregate(16))
    assert steady < got["wall_s"] < 1.05 * steady  # ten shards per server: the drains cost a few percent
    lo, hi = got["wall_s_interval"]
    assert lo < got["wall_s"] < hi
    assert got["gpu_hours"] == pytest.approx(got["wall_s"] * 7 / 3600, rel=1e-3)


def test_the_report_and_its_table_name_the_binding_the_flags_and_both_scenarios():
    calibration = {"server": "server 0", "url": "http://127.0.0.1:30000", "slots": 16, "prompts": 64, "seconds": 120,
                   "fill_s": 0.5, "levels": levels_on(B200), "output_tokens": [1820] * 64,
                   "prompt_tokens": [600] * 64, "finish_reasons": {"stop": 64}, "max_tokens": 16384}
    report = capacity.plan_report(calibration, [seed_memory()], RunShape(902_087, 7, 1000))
    assert [s["name"] for s in report["scenarios"]] == ["current", "advised"]
    current, advised = report["scenarios"]
    assert advised["extrapolated"] and not current["extrapolated"]
    assert advised["wall_s"] < current["wall_s"]
    table = capacity.format_table(report)
    assert "binding: Mamba slots" in table and "--max-mamba-cache-size 160 --max-running-requests 32" in table
    assert "902,087 prompts" in table


def test_the_cli_re_plans_a_stored_report_for_another_run_size(tmp_path, capsys):
    calibration = {"server": "server 0", "url": "http://127.0.0.1:30000", "slots": 16, "prompts": 64, "seconds": 120,
                   "fill_s": 0.5, "levels": levels_on(B200), "output_tokens": [1820] * 64,
                   "prompt_tokens": [600] * 64, "finish_reasons": {"stop": 64}, "max_tokens": 16384}
    stored = tmp_path / "capacity.json"
    atomic.write_json(stored, capacity.plan_report(calibration, [seed_memory()], RunShape(902_087, 7, 1000)))
    assert capacity_cli(["plan", str(stored), "--prompts", "7000", "--servers", "7"]) == 0
    out = capsys.readouterr().out
    assert "7,000 prompts x 1,820 mean output tokens" in out and "| advised: --max-mamba-cache-size 160" in out


def test_a_run_smaller_than_one_calibration_is_not_calibrated(tmp_path):
    from types import SimpleNamespace

    import pyarrow as pa
    import pyarrow.parquet as pq

    shard = tmp_path / "shard-00000.parquet"
    pq.write_table(pa.table({"sample_id": ["a", "b"], "messages": ['[]', '[]'], "tools": [None, None]}), shard)
    server = SimpleNamespace(url="http://127.0.0.1:1", name="server 0")  # never contacted
    health = {"servers": [{"url": server.url, "allocation": {"running_slots": 16}}]}
    with pytest.raises(capacity.TooFewPrompts, match="at least 32 prompts"):
        capacity.calibrate(server, "key", health, [{"path": str(shard), "prompts": 2}], SimpleNamespace(seed=0),
                           None, prompts=64)
