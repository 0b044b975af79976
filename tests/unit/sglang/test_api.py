"""The SGLang adapter's version rules, log and metric readers (the contract tests check them against SGLang)."""

import pytest
from conftest import free_port_block

from dflash_regen.errors import VersionRefused
from dflash_regen.settings.run_config import COOKBOOK_ENV, COOKBOOK_FLAGS, merge_flags
from dflash_regen.sglang.api import (
    NEWEST_CHECKED,
    OLDEST,
    RECOMMENDED,
    Dialect,
    parse_metrics,
    parse_startup_log,
    reasoning_tokens,
)

COOKBOOK = merge_flags(COOKBOOK_FLAGS, [])


def test_flags_and_env_follow_the_version():
    old, new = Dialect("0.5.10"), Dialect("0.5.23")
    assert "--mamba-scheduler-strategy" in old.launch_flags(COOKBOOK)
    assert "--mamba-radix-cache-strategy" in new.launch_flags(COOKBOOK)
    assert "--mamba-scheduler-strategy" not in new.launch_flags(COOKBOOK)
    assert old.launch_env(COOKBOOK_ENV) == {"SGLANG_ENABLE_SPEC_V2": "1"}
    assert new.launch_env(COOKBOOK_ENV) == {}
    assert new.launch_flags(["--cuda-graph-max-bs=32"]) == ["--cuda-graph-max-bs-decode=32"]


@pytest.mark.parametrize("version", ["0.5.13", "0.5.14", "0.5.13.post1"])
def test_known_bad_versions_are_refused_with_mtp_on_a_hybrid_model(version):
    with pytest.raises(VersionRefused, match=r"crashes with MTP .*SGLANG_VERSION=0.5.16"):
        Dialect(version).refuse(COOKBOOK, hybrid=True)
    Dialect(version).refuse([f for f in COOKBOOK if "speculative" not in f], hybrid=True)  # no MTP: allowed


def test_too_old_is_refused_and_newer_than_checked_is_tried_with_a_warning(caplog):
    with pytest.raises(VersionRefused, match="older than 0.5.10"):
        Dialect("0.5.9").refuse(COOKBOOK)
    Dialect("0.5.99").refuse(COOKBOOK)
    assert "newer than 0.5.23" in caplog.text


def test_kv_line_of_both_forms_and_the_mamba_cap_line():
    old = "[t] KV Cache is allocated. #tokens: 1144000, K size: 17.50 GB, V size: 17.50 GB"
    new = "[t] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 1144000, K size: 17.50 GB, V size: 17.50 GB"
    assert parse_startup_log(old) == parse_startup_log(new) == {"kv_tokens": 1_144_000, "kv_cache_gb": 35.0}
    capped = ("[t] max_running_requests is capped to 16 by the mamba state cache (max_mamba_cache_size=80, 5 state "
              "slots per request). To raise it: ...")
    assert parse_startup_log(capped) == {"mamba_ratio": 5}


def test_metrics_are_summed_over_label_sets_in_both_name_forms():
    text = """# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="m",is_streaming="true"} 1000.0
sglang:generation_tokens_total{model_name="m",is_streaming="false"} 8.0
sglang_num_running_reqs{engine_type="unified",model_name="m"} 16.0
"""
    assert parse_metrics(text) == {"generation_tokens_total": 1008.0, "num_running_reqs": 16.0}


def test_reasoning_tokens_from_either_usage_field():
    assert reasoning_tokens({"reasoning_tokens": 7}) == 7
    assert reasoning_tokens({"completion_tokens_details": {"reasoning_tokens": 9}}) == 9
    assert reasoning_tokens({}) == 0


def test_the_emulator_default_is_the_venv_builders_default_and_the_recommended_version():
    from pathlib import Path

    from dflash_regen.emulator.versions import DEFAULT_VERSION, SUPPORTED

    script = (Path(__file__).parents[3] / "scripts" / "build-sglang-venv.sh").read_text()
    assert f'SGLANG_VERSION="${{SGLANG_VERSION:-{DEFAULT_VERSION}}}"' in script
    assert DEFAULT_VERSION == RECOMMENDED
    assert SUPPORTED == (OLDEST, NEWEST_CHECKED)


def test_launch_refuses_a_known_bad_sglang_before_starting_anything(tmp_path, monkeypatch):
    """Pre-flight asks the server interpreter for `sglang.__version__`: 0.5.13 + MTP on Qwen3.6 is refused as a
    configuration error (Airflow does not retry it) and no process is started."""
    import json
    import sys

    from dflash_regen.errors import ConfigError
    from dflash_regen.fleet.servers import launch_fleet
    from dflash_regen.settings.run_config import DEFAULTS, RunConfig

    fake = tmp_path / "site" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "0.5.13"\n')
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"]}))
    params = {**DEFAULTS, "server_command": f"{sys.executable} -m sglang.launch_server", "num_servers": 1,
              "base_port": free_port_block(1), "output_root": str(tmp_path / "out")}
    cfg = RunConfig.from_params(params, "bad-version")
    with pytest.raises(VersionRefused, match="SGLang 0.5.13 crashes with MTP") as info:
        launch_fleet(cfg.fleet, model, cfg.fleet_dir)
    assert isinstance(info.value, ConfigError)
    assert not cfg.layout.fleet.server_specs()  # nothing was launched
