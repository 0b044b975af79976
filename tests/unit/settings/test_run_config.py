import sys

import pytest

from dflash_regen import quality
from dflash_regen.errors import ConfigError
from dflash_regen.settings.run_config import (
    COOKBOOK_FLAGS,
    DEFAULTS,
    QualitySettings,
    RunConfig,
    merge_flags,
    parse_flags,
    safe_run_id,
)


def params(**overrides):
    return {**DEFAULTS, "output_root": "/tmp/dflash-out", **overrides}


def test_defaults_build_a_seven_server_cookbook_fleet():
    cfg = RunConfig.from_params(params(), "manual__2026-12-02T10:00:00+00:00")
    assert cfg.fleet.num_servers == 7
    assert cfg.fleet.gpu_ids == tuple("0123456")
    assert [cfg.fleet.port(i) for i in range(7)] == list(range(30000, 30007))
    flags = list(cfg.fleet.flags)
    assert flags[flags.index("--reasoning-parser") + 1] == "qwen3"
    assert flags[flags.index("--mamba-scheduler-strategy") + 1] == "extra_buffer"
    assert dict(cfg.fleet.env)["SGLANG_ENABLE_SPEC_V2"] == "1"
    assert cfg.run_id == "manual__2026-12-02T10_00_00_00_00"
    assert cfg.staging_dir.as_posix() == "/dev/shm/dflash-demo-model"


def test_emulator_command_is_this_interpreter_and_a_real_command_is_split_without_a_shell():
    emu = RunConfig.from_params(params(server_command="emulator"), "r")
    assert emu.fleet.server_argv == (sys.executable, "-m", "dflash_regen.emulator")
    real = RunConfig.from_params(params(server_command="/opt/sgl venv/bin/python -m sglang.launch_server".replace(
        "sgl venv", "'sgl venv'")), "r")
    assert real.fleet.server_argv == ("/opt/sgl venv/bin/python", "-m", "sglang.launch_server")
    assert not real.fleet.is_emulator


@pytest.mark.parametrize("command", ["python -m sglang.launch_server; rm -rf /", "python $(whoami)",
                                     "python -m x | tee log", "python `id`"])
def test_shell_syntax_in_the_server_command_is_refused(command):
    with pytest.raises(ConfigError, match="shell syntax"):
        RunConfig.from_params(params(server_command=command), "r")


def test_flags_override_and_drop_cookbook_defaults():
    argv = merge_flags(COOKBOOK_FLAGS, parse_flags("--mem-fraction-static 0.7 --enable-metrics off --page-size=64"))
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.7"
    assert "--enable-metrics" not in argv
    assert argv[-2:] == ["--page-size", "64"]


def test_launcher_owned_flags_cannot_be_overridden():
    with pytest.raises(ConfigError, match="--port.*set by the launcher"):
        RunConfig.from_params(params(server_flags="--port 1234"), "r")


@pytest.mark.parametrize(("name", "value", "message"), [
    ("num_servers", 0, "between 1 and 64"),
    ("num_servers", "7", "must be an integer"),
    ("max_tokens", 8, "between 16"),
    ("top_p", 1.5, "must be above 0 and at most 1"),
    ("top_p", 0, "must be above 0 and at most 1"),
    ("top_k", 0, "must be -1 (off) or between 1 and 1,000,000"),
    ("gpu_ids", "0, 1", "GPU numbers separated by commas (no spaces)"),
    ("server_flags", "--port 1234", "--port is set by the launcher"),
    ("autotune", "sometimes", "must be one of off, advise, apply"),
    ("gpu_ids", "0,1", "must list 7 comma-separated GPU numbers"),
    ("output_root", "relative/out", "absolute path"),
    ("staging_dir", "/dev/shm/../etc", "without '..'"),
    ("model_source_dir", "models/qwen", "absolute path or 'demo'"),
    ("enable_thinking", "yes", "true or false"),
    ("prompt_format", "alpaca", "must be one of auto, openai, sharegpt, specforge, prompt"),
    ("emulator_faults", [1], "JSON object"),
    ("dataset_name", "../../etc", "no '/' or '..'"),
    ("dataset_name", "a/b", "no '/' or '..'"),
])
def test_bad_params_name_the_field_the_value_and_the_rule(name, value, message):
    with pytest.raises(ConfigError) as info:
        RunConfig.from_params(params(**{name: value}), "r")
    assert f"Param {name!r}" in str(info.value)
    assert message in str(info.value)


def test_emulator_faults_reach_the_server_environment_only_for_the_emulator():
    faults = {"3": {"kv_tokens": 1000}}
    emu = RunConfig.from_params(params(emulator_faults=faults), "r")
    assert '"kv_tokens": 1000' in dict(emu.fleet.env)["DFLASH_EMU_FAULTS"]
    real = RunConfig.from_params(params(emulator_faults=faults, server_command="python -m sglang.launch_server"), "r")
    assert "DFLASH_EMU_FAULTS" not in dict(real.fleet.env)


def test_run_ids_become_safe_directory_names():
    assert safe_run_id("scheduled__2026-01-01T00:00:00+00:00") == "scheduled__2026-01-01T00_00_00_00_00"
    assert "/" not in safe_run_id("../../etc")
    with pytest.raises(ConfigError):
        safe_run_id("///")


def test_the_last_servers_port_must_exist_and_the_message_names_both_params():
    assert RunConfig.from_params(params(base_port=65529), "r").fleet.port(6) == 65535
    with pytest.raises(ConfigError) as info:
        RunConfig.from_params(params(base_port=65530), "r")
    assert str(info.value) == ("Param 'base_port' = 65530 is invalid: with num_servers = 7 the last server would "
                               "listen on port 65,536, past 65,535; lower base_port or num_servers")


def test_one_sampling_object_is_shared_by_smoke_planning_generation_and_capacity():
    cfg = RunConfig.from_params(params(max_tokens=8192, top_p=0.9), "r")
    assert cfg.generation.sampling is cfg.sampling and cfg.plan.sampling is cfg.sampling
    assert (cfg.sampling.max_tokens, cfg.sampling.top_p) == (8192, 0.9)
    for settings in (cfg.generation, cfg.plan):
        assert "max_tokens" not in settings.__dataclass_fields__


def test_the_plan_record_holds_max_tokens_but_not_the_other_sampling_values():
    """The plan's fingerprint: another max_tokens changes which prompts fit (re-plan), another temperature does not."""
    record = RunConfig.from_params(params(max_tokens=8192), "r").plan.record()
    assert record["max_tokens"] == 8192 and "sampling" not in record and "temperature" not in record
    assert RunConfig.from_params(params(temperature=1.0), "r").plan.record() == RunConfig.from_params(
        params(), "r").plan.record()


def test_extra_flags_give_the_config_server_flags_would_have_given():
    base = RunConfig.from_params(params(server_flags="--mem-fraction-static 0.7"), "r")
    tuned = base.with_extra_flags("--reasoning-parser deepseek-r1 --max-running-requests 24")
    same = RunConfig.from_params(params(server_flags="--mem-fraction-static 0.7 --reasoning-parser deepseek-r1 "
                                                     "--max-running-requests 24"), "r")
    assert tuned == same
    assert tuned.generation.reasoning_parser == "deepseek-r1" and base.generation.reasoning_parser == "qwen3"
    with pytest.raises(ConfigError, match="--api-key is set by the launcher"):
        base.with_extra_flags("--api-key x")


def test_the_config_keeps_the_param_texts_it_is_asked_for_and_not_the_raw_dict():
    cfg = RunConfig.from_params(params(server_flags=" --page-size 64 ", emulator_profile={"startup_s": 1}), "r")
    assert (cfg.fleet.server_flags, cfg.fleet.server_command) == ("--page-size 64", "emulator")
    assert cfg.fleet.emulator_profile == {"startup_s": 1} and cfg.fleet.emulator_faults == {}
    assert "params" not in RunConfig.__dataclass_fields__


def test_quality_settings_live_in_config_and_quality_uses_them():
    assert quality.QualitySettings is QualitySettings
    cfg = RunConfig.from_params(params(empty_mask_tokens=9, max_repetition_score=0.25), "r")
    assert (cfg.quality.empty_mask_tokens, cfg.quality.max_repetition_score) == (9, 0.25)


def test_max_tokens_must_leave_room_for_a_prompt_in_the_context_length():
    """The one check of this rule (planning relies on it: prompts get context_length - max_tokens)."""
    assert RunConfig.from_params(params(max_tokens=4095, context_length=4096), "r").plan.context_length == 4096
    with pytest.raises(ConfigError) as info:
        RunConfig.from_params(params(max_tokens=4096, context_length=4096), "r")
    assert str(info.value) == "Param 'max_tokens' = 4096 is invalid: must be below context_length 4,096"
