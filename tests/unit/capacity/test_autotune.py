"""Autotune's candidates and choice, without servers (measured: tests/integration/test_autotune_on_fleet.py)."""

import pytest

from dflash_regen import capacity
from dflash_regen.capacity import autotune
from dflash_regen.errors import ConfigError
from dflash_regen.settings.run_config import DEFAULTS, RunConfig

SEED_NODE = capacity.Memory(server="s", kv_tokens=1_140_000, running_slots=16, max_running_requests=48,
                            mamba_slots=80, mamba_ratio=5, kv_gb=34.8, mamba_gb=30.9, reserve_gb=27.9)


def test_candidates_follow_each_settings_own_memory_room():
    names = {c.name: c.flags for c in autotune.default_candidates(SEED_NODE, 2400)}
    # x4 (64) does not fit with 5 Mamba slots and MTP's draft state per request, so only x2 is tried;
    # without the draft state 40 fit, with 1 slot per request (radix cache off) the 4x cap.
    assert names["mamba pool x2"] == "--max-mamba-cache-size 160 --max-running-requests 32"
    assert "mamba pool x4" not in names
    assert names["radix cache off at 64"].endswith("--max-running-requests 64")
    assert names["MTP off at 40"].startswith(autotune.MTP_OFF)
    # Requests of 20K tokens: KV binds too, so the pool grows less (24) and FP8's doubled room lets 32 in.
    kv_bound = [c.name for c in autotune.default_candidates(SEED_NODE, 20_000)]
    assert kv_bound == ["current", "mamba pool x1.5", "radix cache off at 48", "MTP off at 32", "FP8 KV cache at 32"]


def test_without_pool_figures_the_candidates_keep_the_measured_batch():
    blind = capacity.Memory(server="s", kv_tokens=1_000_000, running_slots=16, max_running_requests=None,
                            mamba_slots=None, mamba_ratio=None, kv_gb=None, mamba_gb=None, reserve_gb=None)
    names = [c.name for c in autotune.default_candidates(blind, 2400)]
    assert names == ["current", "radix cache off at 16", "MTP off at 16", "FP8 KV cache"]


def test_the_winner_must_beat_the_current_settings_by_more_than_noise():
    current = {"candidate": "current", "wall_s": 100.0}
    close = {"candidate": "a", "wall_s": 99.0}
    far = {"candidate": "b", "wall_s": 90.0}
    skipped = {"candidate": "c", "skipped": "fails smoke: empty answer"}
    assert autotune.choose([current, close, skipped]) is current
    assert autotune.choose([current, close, far, skipped]) is far
    assert autotune.choose([skipped]) is None


def test_extra_candidates_are_validated_as_params():
    params = {**DEFAULTS, "output_root": "/tmp/x", "autotune_candidates": ["--max-running-requests 24"]}
    assert RunConfig.from_params(params, "r").autotune.extra == ("--max-running-requests 24",)
    with pytest.raises(ConfigError, match="autotune_candidates.*--port is set by the launcher"):
        RunConfig.from_params({**params, "autotune_candidates": ["--port 1"]}, "r")
    with pytest.raises(ConfigError, match="'autotune' = 'sometimes' is invalid: must be one of off, advise, apply"):
        RunConfig.from_params({**params, "autotune": "sometimes"}, "r")


def report_with(winner_flags: str | None) -> dict:
    rows = [{"candidate": "current", "flags": "", "chosen": winner_flags is None}]
    if winner_flags is not None:
        rows.append({"candidate": "MTP off", "flags": winner_flags, "chosen": True})
    return {"candidates": rows}


def test_apply_relaunches_with_the_winners_flags_and_advise_only_says_how():
    report = report_with("--speculative-algorithm off")
    assert autotune._decide(report, "apply") == "--speculative-algorithm off"
    assert report["applied_flags"] == "--speculative-algorithm off"
    assert report["action"] == "fleet relaunched with MTP off: --speculative-algorithm off"
    report = report_with("--speculative-algorithm off")
    assert autotune._decide(report, "advise") == "" and report["mode"] == "advise"
    assert report["action"] == ("fleet relaunched with the run's own flags; to use MTP off, add "
                                "'--speculative-algorithm off' to server_flags or set Param autotune to apply")
    report = report_with(None)  # the current settings won: nothing to advise
    assert autotune._decide(report, "apply") == ""
    assert report["action"] == "fleet relaunched with the run's own flags"
