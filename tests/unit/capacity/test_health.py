from dflash_regen import capacity
from dflash_regen.capacity.health import Allocation, binding_advice, parse_startup_log

SEED_LOG = """\
[2026-05-01 12:00:01] Load weight end. elapsed=20.11 s, type=Qwen3_5ForConditionalGeneration, avail mem=120.00 GB
[2026-05-01 12:00:02] Mamba Cache is allocated. max_mamba_cache_size: 80, conv_state size: 0.40GB, ssm_state size: 40GB
[2026-05-01 12:00:02] KV Cache is allocated. #tokens: 1144000, K size: 17.50 GB, V size: 17.50 GB
[2026-05-01 12:00:02] KV Cache is allocated. #tokens: 1144000, K size: 1.09 GB, V size: 1.09 GB
[2026-05-01 12:00:03] max_total_num_tokens=1144000, chunked_prefill_size=8192, max_prefill_tokens=16384, \
max_running_requests=16, context_len=262144, available_gpu_mem=20.00 GB
"""


def seed_allocation(**changes):
    base = dict(kv_tokens=1_144_000, running_slots=16, max_running_requests=48, mamba_slots=80, kv_cache_gb=35.0,
                radix_cache=True, mamba_strategy="extra_buffer")
    return Allocation(**{**base, **changes})


def test_startup_log_figures_take_the_target_models_kv_pool():
    figures = parse_startup_log(SEED_LOG)
    assert figures == {"kv_tokens": 1_144_000, "kv_cache_gb": 35.0, "mamba_slots": 80, "running_slots": 16,
                       "context_len": 262144, "mamba_gb": 40.4, "mamba_reserve_gb": 0.0}


def test_startup_log_gives_the_mamba_memory_and_the_speculative_reserve():
    line = ("[2026-05-01 12:00:02] Mamba Cache is allocated. max_mamba_cache_size: 80, conv_state size: 1.60GB, "
            "ssm_state size: 29.34GB intermediate_ssm_state_cache size: 27.00GB intermediate_conv_window_cache size: "
            "0.90GB ")
    assert parse_startup_log(line) == {"mamba_slots": 80, "mamba_gb": 30.94, "mamba_reserve_gb": 27.9}


def test_log_prefix_with_rank_tags_still_parses():
    line = "[2026-05-01 12:00:02 TP0] KV Cache is allocated. #tokens: 5000, KV size: 1.50 GB"
    assert parse_startup_log(line) == {"kv_tokens": 5000, "kv_cache_gb": 1.5}


def test_seed_node_is_mamba_bound_and_the_advice_names_the_flags():
    capacity, binding, advice = binding_advice(seed_allocation(), request_tokens=2420)
    assert capacity == 472
    assert binding == "Mamba slots (80 // 5 = 16)"
    assert "--max-mamba-cache-size 160 --max-running-requests 32" in advice


def test_small_kv_cache_binds_before_slots():
    capacity, binding, advice = binding_advice(seed_allocation(kv_tokens=20_000), request_tokens=2420)
    assert (capacity, binding) == (8, "KV tokens")
    assert "--mem-fraction-static" in advice


def test_running_request_cap_binds_when_mamba_slots_are_plentiful():
    _, binding, advice = binding_advice(seed_allocation(running_slots=48, mamba_slots=400), request_tokens=2420)
    assert binding == "--max-running-requests=48"
    assert "raise --max-running-requests" in advice


def test_at_equality_the_slots_bind_in_the_health_table_and_in_the_plan_alike():
    # The KV cache holds exactly the 16 slots' requests: the server runs all 16, so the Mamba cap binds; one token
    # less and it holds 15, so KV binds. The health table and the capacity plan give the same verdict either way.
    for kv_tokens, expected in ((16 * 2420, "Mamba slots"), (16 * 2420 - 1, "KV tokens")):
        alloc = seed_allocation(kv_tokens=kv_tokens)
        kv_fit, binding, _ = binding_advice(alloc, request_tokens=2420)
        assert binding.startswith(expected), (kv_tokens, binding)
        mem = capacity.Memory.from_health({"allocation": alloc.__dict__})
        assert capacity.running_batch(mem, capacity.RunShape(1000, 1, 100), 2420)[1] == expected
        assert kv_fit == kv_tokens // 2420


def test_allocation_reads_the_computed_values_not_the_cli_echo():
    # Real SGLang: top-level fields echo the command line (max_mamba_cache_size null unless passed); the
    # scheduler's resolved args, with the sized Mamba pool, are internal_states[0].
    state = {"effective_max_running_requests_per_dp": 16, "memory_usage": {"kvcache": 35.0},
             "max_running_requests": 48, "max_mamba_cache_size": 80, "disable_radix_cache": False}
    v0510 = {"max_total_num_tokens": 1_144_000, "max_running_requests": 48, "max_mamba_cache_size": None,
             "mamba_scheduler_strategy": "extra_buffer",
             "internal_states": [{**state, "mamba_scheduler_strategy": "extra_buffer"}]}
    v0523 = {"max_total_num_tokens": 1_144_000, "max_running_requests": 48, "max_mamba_cache_size": None,
             "internal_states": [{**state, "mamba_radix_cache_strategy": "extra_buffer"}]}
    assert Allocation.from_server_info(v0510) == seed_allocation()
    assert Allocation.from_server_info(v0523) == seed_allocation()


def test_allocation_takes_mamba_slots_from_the_startup_log_when_the_state_lacks_them():
    info = {"max_total_num_tokens": 1_144_000, "max_mamba_cache_size": None,
            "internal_states": [{"effective_max_running_requests_per_dp": 16, "max_running_requests": 48,
                                 "memory_usage": {"kvcache": 35.0}, "mamba_scheduler_strategy": "extra_buffer"}]}
    assert Allocation.from_server_info(info, parse_startup_log(SEED_LOG)) == seed_allocation()
