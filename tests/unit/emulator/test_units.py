"""The emulator's pure parts, called directly: allocation arithmetic, ServerArgs rules, the emulated
model, SGLang's parsers and the fault/profile configuration."""

import json
import statistics

import pytest

from dflash_regen.emulator import allocation, cli, model, parsers
from dflash_regen.emulator.faults import PRESETS, EmulatorConfigError, Faults, Profile, load_faults, load_profile
from dflash_regen.emulator.scheduler import Pace
from dflash_regen.emulator.versions import Forms

COOKBOOK = ["--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder", "--speculative-algorithm", "EAGLE",
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
            "--mamba-scheduler-strategy", "extra_buffer", "--mem-fraction-static", "0.8"]
SPEC_V2 = {"SGLANG_ENABLE_SPEC_V2": "1"}
PRIME = [{"role": "user", "content": "Write a Python function to check if a number is prime."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from dflash_regen.demo.model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("model"), shards=1, shard_bytes=1024)


def resolve(model_dir, *flags, env=None):
    forms = Forms("0.5.10")  # the rules below are 0.5.10's (SGLANG_ENABLE_SPEC_V2 still read)
    ns = cli.build_parser(forms).parse_args(["--model-path", str(model_dir), *flags])
    return cli.resolve(ns, env or {}, forms=forms)


def allocate(model_dir, *flags, env=None, **overrides):
    args, config = resolve(model_dir, *flags, env=env)
    return args, allocation.compute(cli.allocation_inputs(args, config, allocation.DEFAULT_GPU_MEMORY_GB),
                                    mamba_full_memory_ratio=args.mamba_full_memory_ratio, **overrides)


# ------------------------------------------------------------------------------------------ allocation
def test_cookbook_flags_reproduce_the_seed_nodes_allocation(model_dir):
    args, alloc = allocate(model_dir, *COOKBOOK, env=SPEC_V2)
    assert abs(alloc.max_total_num_tokens - 1_140_000) / 1_140_000 < 0.02
    assert alloc.mamba_slots == 80 and alloc.mamba_ratio == 5
    assert alloc.effective_max_running_requests == 16
    assert 33 <= alloc.kv_cache_gb <= 37
    assert args.max_running_requests == 48  # the ServerArgs value stays 48; the scheduler runs 16


def test_more_mamba_slots_raise_running_requests_at_the_cost_of_kv_tokens(model_dir):
    _, seed = allocate(model_dir, *COOKBOOK, env=SPEC_V2)
    _, bigger = allocate(model_dir, *COOKBOOK, "--max-mamba-cache-size", "160", env=SPEC_V2)
    assert bigger.mamba_slots == 160 and bigger.effective_max_running_requests == 32
    assert bigger.max_total_num_tokens < seed.max_total_num_tokens
    _, capped = allocate(model_dir, *COOKBOOK, "--max-mamba-cache-size", "160", "--max-running-requests", "24",
                         env=SPEC_V2)
    assert capped.effective_max_running_requests == 24


def test_mamba_ratio_follows_sglangs_constants():
    assert allocation.mamba_ratio(disable_radix_cache=True, extra_buffer=False, overlap_schedule=False) == 1
    assert allocation.mamba_ratio(disable_radix_cache=False, extra_buffer=False, overlap_schedule=True) == 3
    assert allocation.mamba_ratio(disable_radix_cache=False, extra_buffer=True, overlap_schedule=True) == 5
    assert allocation.mamba_ratio(disable_radix_cache=False, extra_buffer=True, overlap_schedule=False) == 4
    assert allocation.estimated_max_num_reqs(10_000, 262144) == 2048
    assert allocation.estimated_max_num_reqs(10**9, 262144) == 4096


def test_spec_without_v2_turns_overlap_off_and_uses_the_smaller_ratio(model_dir):
    args, alloc = allocate(model_dir, *COOKBOOK)
    assert args.disable_overlap_schedule and alloc.mamba_ratio == 4
    assert alloc.effective_max_running_requests == alloc.mamba_slots // 4


def test_fault_overrides_and_max_total_tokens_shrink_the_pools(model_dir):
    _, low = allocate(model_dir, *COOKBOOK, env=SPEC_V2, kv_tokens_override=200_000, mamba_slots_override=40)
    assert low.max_total_num_tokens == 200_000 and low.mamba_slots == 40
    assert low.effective_max_running_requests == 8
    assert low.kv_cache_gb == pytest.approx(200_000 * allocation.KV_BYTES_PER_TOKEN / allocation.GIB)
    _, capped = allocate(model_dir, *COOKBOOK, "--max-total-tokens", "500000", env=SPEC_V2)
    assert capped.max_total_num_tokens == 500_000 // 64 * 64  # trtllm_mha pages of 64
    _, over = allocate(model_dir, *COOKBOOK, "--max-total-tokens", "9000000", env=SPEC_V2)
    assert over.max_total_num_tokens == over.profiled_num_tokens // 64 * 64
    assert "is larger than the profiled value" in over.warnings[0]


def test_disabling_radix_cache_sizes_mamba_slots_to_max_running_requests(model_dir):
    _, alloc = allocate(model_dir, "--max-running-requests", "2", "--disable-radix-cache")
    assert alloc.mamba_slots == 2 and alloc.mamba_ratio == 1 and alloc.effective_max_running_requests == 2


# ------------------------------------------------------------------------------------------ ServerArgs
def test_nextn_is_eagle_and_speculative_decoding_defaults_to_48_requests_and_3_1_4(model_dir):
    args, _ = resolve(model_dir, "--speculative-algorithm", "NEXTN", "--disable-radix-cache")
    assert args.speculative_algorithm == "EAGLE" and args.max_running_requests == 48
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (3, 1, 4)
    assert args.served_model_name == str(model_dir)


def test_topk_one_forces_draft_tokens_to_steps_plus_one(model_dir, caplog):
    args, _ = resolve(model_dir, "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "5",
                      "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3", "--disable-radix-cache")
    assert args.speculative_num_draft_tokens == 6
    assert "adjusted to speculative_num_steps + 1" in caplog.text


@pytest.mark.parametrize(("flags", "env", "message"), [
    (["--speculative-algorithm", "EAGLE"], {},
     "Speculative decoding for Qwen3_5ForConditionalGeneration is not compatible with radix cache when using "
     "--mamba-scheduler-strategy no_buffer.To use radix cache"),
    (["--mamba-scheduler-strategy", "extra_buffer", "--disable-radix-cache"], {},
     "mamba extra_buffer is not compatible with --disable-radix-cache"),
    (["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "2", "--speculative-num-steps", "3",
      "--speculative-num-draft-tokens", "6", "--mamba-scheduler-strategy", "extra_buffer"], SPEC_V2,
     "Spec v2 currently only supports topk = 1"),
])
def test_incompatible_flags_raise_sglangs_value_errors(model_dir, flags, env, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(".", r"\.")[:60]):
        resolve(model_dir, *flags, env=env)


def test_model_dir_without_config_json_fails_like_transformers(tmp_path):
    with pytest.raises(OSError, match="correct path to a directory containing a config.json file"):
        resolve(tmp_path)


def test_context_length_comes_from_config_json_text_config(model_dir):
    args, config = resolve(model_dir)
    assert cli.context_len(args, config) == 262144 and config.hybrid
    args, config = resolve(model_dir, "--context-length", "32k")
    assert cli.context_len(args, config) == 32000


# --------------------------------------------------------------------------------------------- model
def test_the_seeds_prime_prompt_at_512_tokens_is_all_reasoning():
    gen = model.generate(model.ModelInput(messages=PRIME), Profile(), limit=512)
    assert len(gen.token_ids) == 512
    assert model.THINK_END not in gen.token_ids and gen.think_end_index is None
    text = model.decode(gen.token_ids)
    assert text.startswith("Okay") and "write a Python function to check if a number is prime" in text
    assert 1200 <= len(text) <= 1900


def test_output_is_deterministic_and_depends_on_the_seed():
    a = model.generate(model.ModelInput(messages=PRIME, seed=1), Profile(), limit=100_000)
    b = model.generate(model.ModelInput(messages=PRIME, seed=1), Profile(), limit=100_000)
    c = model.generate(model.ModelInput(messages=PRIME, seed=2), Profile(), limit=100_000)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_a_full_answer_is_reasoning_think_end_newlines_content_im_end():
    gen = model.generate(model.ModelInput(messages=PRIME), Profile(), limit=100_000)
    ids, end = gen.token_ids, gen.think_end_index
    assert ids[end] == model.THINK_END and ids[end + 1] == model.encode("\n\n")[0] and ids[-1] == model.IM_END
    assert "```python" in model.decode(ids[end + 2:-1])
    assert gen.kind == "answer"


def test_length_distribution_matches_the_seed():
    profile = Profile()
    totals, reasoning = [], []
    for i in range(300):
        gen = model.generate(model.ModelInput(messages=[{"role": "user", "content": f"Tell me about item {i}."}]),
                             profile, limit=100_000)
        totals.append(len(gen.token_ids))
        reasoning.append(gen.think_end_index + 1)
    assert 1700 <= statistics.mean(totals) <= 1950
    assert 0.80 <= sum(reasoning) / sum(totals) <= 0.90
    assert min(reasoning) >= 600 and max(totals) < 6000


def test_thinking_off_emits_no_think_tokens():
    gen = model.generate(model.ModelInput(messages=PRIME, enable_thinking=False), Profile(), limit=100_000)
    assert model.THINK_END not in gen.token_ids and gen.think_end_index is None and gen.token_ids[-1] == model.IM_END


def test_tools_yield_one_qwen3_coder_call_and_a_tool_result_yields_content():
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}}}
    ask = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
    gen = model.generate(model.ModelInput(messages=ask, tools=[tool]), Profile(), limit=100_000)
    answer = model.decode(gen.token_ids[gen.think_end_index + 1:-1]).strip()
    assert answer == "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n" \
                     "<parameter=days>\n1\n</parameter>\n</function>\n</tool_call>"
    after = ask + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18 C, sunny"}]
    gen = model.generate(model.ModelInput(messages=after, tools=[tool]), Profile(), limit=100_000)
    assert gen.kind == "answer" and "18 C, sunny" in model.decode(gen.token_ids)


def test_loop_fills_the_limit_and_empty_content_closes_thinking_without_an_answer():
    loop = model.generate(model.ModelInput(messages=PRIME, loop=True), Profile(), limit=3000)
    assert len(loop.token_ids) == 3000 and model.decode(loop.token_ids).count(model.LOOP_SENTENCE) > 100
    empty = model.generate(model.ModelInput(messages=PRIME, empty_content=True), Profile(), limit=100_000)
    assert empty.token_ids[-2:] == [model.THINK_END, model.IM_END]


def test_prompt_tokens_count_the_chatml_rendering():
    rendered = model.render_prompt(PRIME, None, True)
    assert rendered == ("<|im_start|>user\nWrite a Python function to check if a number is prime.<|im_end|>\n"
                        "<|im_start|>assistant\n<think>\n")
    ids = model.encode(rendered)
    assert ids[0] == model.IM_START and ids[-2:] == [model.THINK_START, model.encode("\n")[0]]
    parts = [{"role": "user", "content": [{"type": "text", "text": PRIME[0]["content"]}]}]
    assert model.count_prompt_tokens(parts, None, True) == len(ids)


# ------------------------------------------------------------------------------------------- parsers
def test_reasoning_split_follows_sglangs_qwen3_detector():
    assert parsers.split_reasoning("thinking...", True) == ("thinking...", "")
    assert parsers.split_reasoning("a\n</think>\n\nb ", True) == ("a\n", "b")
    assert parsers.split_reasoning("plain", False) == (None, "plain")
    assert parsers.split_reasoning("<think>x</think>y", False) == ("x", "y")
    assert parsers.force_reasoning("qwen3", None) and parsers.force_reasoning("qwen3", {"enable_thinking": True})
    assert not parsers.force_reasoning("qwen3", {"enable_thinking": False})


def test_streaming_reasoning_split_joins_to_the_same_text():
    stream = parsers.ReasoningStream(True)
    pieces = [stream.feed(t) for t in ["Let me ", "think.\n", "</think>", "\n\nThe answer", " is 4."]]
    reasoning = "".join(r for r, _ in pieces)
    content = "".join(c for _, c in pieces)
    assert reasoning.strip() == "Let me think." and content.strip() == "The answer is 4."


def test_qwen3_coder_tool_calls_are_parsed_with_schema_types():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {
        "n": {"type": "integer"}, "s": {"type": "string"}}}}}]
    text = "Sure.\n\n<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n<parameter=s>\n007\n</parameter>\n" \
           "</function>\n</tool_call>"
    rest, calls = parsers.parse_tool_calls(text, tools)
    assert rest == "Sure." and len(calls) == 1
    assert calls[0].as_json()["id"].startswith("call_") and len(calls[0].id) == 29
    assert json.loads(calls[0].arguments) == {"n": 3, "s": "007"}
    stream = parsers.ToolCallStream(tools)
    out = [stream.feed(text[i:i + 7]) for i in range(0, len(text), 7)]
    assert "".join(c for c, _ in out) == "Sure.\n\n"
    deltas = [d for _, ds in out for d in ds]
    assert deltas[0]["function"] == {"name": "f", "arguments": ""} and json.loads(
        deltas[1]["function"]["arguments"]) == {"n": 3, "s": "007"}


def test_an_unfinished_tool_call_stays_text():
    rest, calls = parsers.parse_tool_calls("<tool_call>\n<function=f>\n<parameter=n>\n3", None)
    assert calls == [] and rest.startswith("<tool_call>")


# -------------------------------------------------------------------------------------- faults config
def test_faults_merge_star_with_the_gpus_own_entry():
    env = {"DFLASH_EMU_FAULTS": json.dumps({"*": {"hang_rate": 0.1, "kv_tokens": 5}, "3": {"kv_tokens": 7}}),
           "CUDA_VISIBLE_DEVICES": "3"}
    assert load_faults(env) == Faults(hang_rate=0.1, kv_tokens=7)
    assert load_faults({**env, "CUDA_VISIBLE_DEVICES": "1"}) == Faults(hang_rate=0.1, kv_tokens=5)
    assert load_faults({}) == Faults()


@pytest.mark.parametrize(("var", "value", "message"), [
    ("DFLASH_EMU_FAULTS", "{not json", "DFLASH_EMU_FAULTS is not valid JSON"),
    ("DFLASH_EMU_FAULTS", '{"0": {"kv_tokenz": 1}}', "DFLASH_EMU_FAULTS: unknown key 'kv_tokenz' (GPU '0')"),
    ("DFLASH_EMU_FAULTS", '{"9": {"hang_rate": 2}}', "key 'hang_rate' (GPU '9') = 2 is invalid: must be between 0"),
    ("DFLASH_EMU_FAULTS", '{"0": {"empty_content": 1}}', "must be true or false"),
    ("DFLASH_EMU_FAULTS", '{"*": {"error_status": 200}}', "key 'error_status' (GPU '*') = 200 is invalid: must be "
                                                          "an HTTP error status"),
    ("DFLASH_EMU_PROFILE", '{"decode_tokens_per_s": 0}', "key 'decode_tokens_per_s' = 0 is invalid: must be > 0"),
    ("DFLASH_EMU_PROFILE", '{"speed": 1}', "DFLASH_EMU_PROFILE: unknown key 'speed'; known keys: decode_tokens"),
    ("DFLASH_EMU_PROFILE", "[1]", "DFLASH_EMU_PROFILE must be a JSON object"),
])
def test_bad_fault_or_profile_values_name_the_variable_and_key(var, value, message):
    with pytest.raises(EmulatorConfigError) as info:
        (load_faults if var == "DFLASH_EMU_FAULTS" else load_profile)({var: value})
    assert message in str(info.value)


def test_per_request_decode_rate_falls_with_the_batch_and_the_aggregate_saturates():
    from dflash_regen.emulator.scheduler import Pace

    pace = Pace(decode_tokens_per_s=300, prefill_tokens_per_s=1, num_draft_tokens=4, accept_length=3.1,
                saturation_tokens_per_s=2000)
    rates = [pace.per_request_rate(b) for b in (1, 2, 16, 64, 1024)]
    assert rates[0] == pytest.approx(300) and rates == sorted(rates, reverse=True)
    aggregates = [b * r for b, r in zip((1, 2, 16, 64, 1024), rates, strict=True)]
    assert aggregates == sorted(aggregates) and 1900 < aggregates[-1] < 2000
    assert 16 / 0.0108 == pytest.approx(aggregates[2], rel=0.01)  # the cookbook's B200 c16 TPOT, 10.8 ms
    linear = Pace(decode_tokens_per_s=300, prefill_tokens_per_s=1, num_draft_tokens=None, accept_length=1)
    assert linear.per_request_rate(64) == 300  # no saturation: the old profile, every request at full speed


def test_a_preset_profile_loads_and_other_keys_override_it():
    profile = load_profile({"DFLASH_EMU_PROFILE": '{"preset": "qwen3.6-27b-b200-mtp", "startup_s": 0.1}'})
    assert profile.saturation_tokens_per_s == 2414 and profile.decode_tokens_per_s == 218
    assert profile.startup_s == 0.1 and profile.preset == "qwen3.6-27b-b200-mtp"
    with pytest.raises(EmulatorConfigError, match="known presets are qwen3.6-27b-b200-mtp"):
        load_profile({"DFLASH_EMU_PROFILE": '{"preset": "a100"}'})
    with pytest.raises(EmulatorConfigError, match="a batch cannot be slower than one request"):
        load_profile({"DFLASH_EMU_PROFILE": '{"decode_tokens_per_s": 300, "saturation_tokens_per_s": 100}'})


# Prompt text that breaks naive string handling: format fields and specs, %-formatting, regex and markup
# metacharacters, the model's own control tokens, odd Unicode (RTL, zero-width, combining, emoji, lone surrogates).
NASTY = ["{", "}", "{}", "{0}", "{topic}", "{echo!r:>{width}}", "{:%Y-%m-%d}", "{{}}", "}{", "{a[0].b}",
         "%s %d %(x)s %", "\\", "\\u0000", "\x00\x01\x7f", "$1 \\1 (?P<x>", "<think>", "</think>", "<|im_end|>",
         "<tool_call><function=x><parameter=y>", "</parameter></function></tool_call>", "```", "\u202e\u200b\ufeff",
         "e\u0301\u0301\u0301", "\U0001F600\U0001F9D1\u200d\U0001F4BB", "\ud800", "\udfff", "日本語の文章？", "",
         " ", "\n\n\n", "a" * 5000, "{" * 300, 'Explain {"type": "object", "properties": {"x": {"type": "int"}}}.']
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "n": {"type": "integer"}}, "required": ["query"]}}}


def _fuzz_texts() -> list[str]:
    import random

    rng = random.Random(15)
    alphabet = "{}[]()%:!<>=/\\\"'`$#?.,\n\t xyz01" + "\u0301\u200b\u202e\U0001F600\ud83d日é"
    made = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(150)]
    return NASTY + [f"Write a Python function to {t} please" for t in NASTY] + made


def test_the_emulated_model_answers_any_prompt_text():
    for i, text in enumerate(_fuzz_texts()):
        messages = [{"role": "system", "content": text}, {"role": "user", "content": text}]
        tools = [TOOL] if i % 3 == 0 else None
        gen = model.generate(model.ModelInput(messages=messages, tools=tools, seed=i), Profile(), limit=2000)
        assert gen.token_ids, repr(text)
        model.decode(gen.token_ids)
        call = {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
        after_tool = messages + [{"role": "assistant", "content": "", "tool_calls": [call]},
                                 {"role": "tool", "content": text}]
        assert model.generate(model.ModelInput(messages=after_tool, tools=[TOOL]), Profile(), limit=500).token_ids
        model.render_prompt(messages, tools, True)


def test_the_b200_preset_reproduces_the_published_figures_it_is_built_from():
    profile = Profile(**PRESETS["qwen3.6-27b-b200-mtp"])
    decode, saturation = profile.decode_curve(speculative=True)
    pace = Pace(decode_tokens_per_s=decode, prefill_tokens_per_s=1, num_draft_tokens=4, accept_length=3.1,
                saturation_tokens_per_s=saturation)
    assert pace.per_request_rate(1) == pytest.approx(218)  # one request alone (cookbook, B200 BF16 MTP)
    assert 1 / pace.per_request_rate(16) == pytest.approx(0.0108, rel=0.01)  # the cookbook's c16 TPOT


def test_mtp_gains_at_small_batch_and_costs_at_large_batch():
    profile = Profile(**PRESETS["qwen3.6-27b-b200-mtp"])

    def aggregate(batch, speculative):
        decode, saturation = profile.decode_curve(speculative)
        return batch / (1 / decode + (batch - 1) / saturation)

    # Alone, MTP's 3.1 accepted tokens per step (less the draft head's and the verification's cost) pay ~2.8x ...
    assert 2.5 < aggregate(1, True) / aggregate(1, False) < 3.1 / 1.05
    # ... compute-bound, verifying 4 tokens to keep 3.1 makes it slower: the ceilings differ by 4/3.1.
    assert profile.decode_curve(False)[1] / profile.decode_curve(True)[1] == pytest.approx(4 / 3.1)
    crossover = next(b for b in range(1, 1024) if aggregate(b, False) > aggregate(b, True))
    assert 64 < crossover < 160
    explicit = Profile(**{**PRESETS["qwen3.6-27b-b200-mtp"], "no_mtp_decode_tokens_per_s": 50,
                          "no_mtp_saturation_tokens_per_s": 900})
    assert explicit.decode_curve(False) == (50, 900)


def test_mamba_slots_per_request_by_radix_strategy_and_fp8_kv_room():
    ratio = allocation.mamba_ratio
    assert ratio(disable_radix_cache=False, extra_buffer=True, overlap_schedule=True) == 5
    assert ratio(disable_radix_cache=False, extra_buffer=True, overlap_schedule=True, lazy=True) == 4
    assert ratio(disable_radix_cache=False, extra_buffer=False, overlap_schedule=False) == 3
    assert ratio(disable_radix_cache=True, extra_buffer=False, overlap_schedule=True) == 1
    base = dict(mem_fraction_static=0.8, speculative=True, speculative_num_draft_tokens=4, max_running_requests=48,
                max_mamba_cache_size=None, max_total_tokens=None, disable_radix_cache=False, extra_buffer=True,
                overlap_schedule=True, context_len=262144)
    bf16 = allocation.compute(allocation.AllocationInputs(**base))
    fp8 = allocation.compute(allocation.AllocationInputs(**base, kv_cache_dtype="fp8_e4m3"))
    assert (bf16.mamba_slots, bf16.effective_max_running_requests) == (80, 16)  # the seed's node
    assert fp8.max_total_num_tokens == pytest.approx(2 * bf16.max_total_num_tokens, rel=0.001)
    assert fp8.kv_cache_gb == pytest.approx(bf16.kv_cache_gb, rel=0.001)  # same memory, twice the tokens
    lazy = allocation.compute(allocation.AllocationInputs(**base, extra_buffer_lazy=True))
    assert lazy.effective_max_running_requests == 80 // 4
