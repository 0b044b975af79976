"""A rerun of the setups (a cleared shard) reuses calibrate's and autotune's stored measurements only when they were
measured for the same thing. One test per Param that changes what they measure or predict: each must change the
fingerprint, computed as the task computes it (tasks.calibrate, tasks.autotune_fleet)."""

import pytest

from dflash_regen import capacity
from dflash_regen.capacity import autotune
from dflash_regen.settings.run_config import RunConfig

RUN = "manual__2026-12-05T03:00:00+00:00"
PROMPTS = 5000  # the run's accepted prompts (every shard's)

# Param -> another value. Sampling, sample and seed change the measured curve and lengths; the rest the prediction.
SAMPLING = {"max_tokens": 8000, "temperature": 0.9, "top_p": 0.8, "top_k": 40, "min_p": 0.05, "presence_penalty": 0.5,
            "enable_thinking": False, "seed": 7, "calibration_prompts": 128, "budget": "train_length",
            "train_max_length": 8192}
FLEET = {"server_flags": "--max-running-requests 8", "emulator_profile": {"decode_tokens_per_s": 99},
         "emulator_faults": {"*": {"http_error_rate": 0.1}}}
SHAPE = {"shard_size": 500, "concurrency_per_server": 8}
AUTOTUNE = {"autotune_candidate_s": 60.0, "autotune_budget_s": 600.0,
            "autotune_candidates": ["--kv-cache-dtype fp8_e4m3"], "num_servers": 3}


def calibrate_print(params: dict, prompts: int = PROMPTS, healthy: int = 2, tuned: str = "") -> str:
    cfg = RunConfig.from_params(params, RUN)
    shape = capacity.RunShape(prompts=prompts, servers=healthy, shard_size=cfg.plan.shard_size,
                              concurrency_per_server=cfg.generation.concurrency_per_server)
    flags = " ".join(x for x in (cfg.fleet.server_flags, tuned) if x)
    return capacity.fingerprint(cfg, flags, shape)


def autotune_print(params: dict, prompts: int = PROMPTS) -> str:
    return autotune.fingerprint(RunConfig.from_params(params, RUN), prompts)


@pytest.fixture
def base(run_params):
    return run_params(2, autotune="advise")


@pytest.mark.parametrize(("name", "value"), [*SAMPLING.items(), *FLEET.items(), *SHAPE.items()])
def test_calibrate_measures_again_when_a_param_it_depends_on_changes(base, name, value):
    assert calibrate_print(base) == calibrate_print(dict(base))  # the same Params reuse the measurement
    assert calibrate_print({**base, name: value}) != calibrate_print(base), name


@pytest.mark.parametrize("what", ["prompts", "healthy servers", "autotuned flags"])
def test_calibrate_measures_again_for_another_run_shape_or_fleet(base, what):
    changed = {"prompts": {"prompts": 900}, "healthy servers": {"healthy": 1},
               "autotuned flags": {"tuned": "--disable-radix-cache"}}[what]
    assert calibrate_print(base, **changed) != calibrate_print(base)


@pytest.mark.parametrize(("name", "value"), [*SAMPLING.items(), *FLEET.items(), *SHAPE.items(), *AUTOTUNE.items()])
def test_autotune_tunes_again_when_a_param_it_depends_on_changes(base, name, value):
    assert autotune_print(base) == autotune_print(dict(base))
    assert autotune_print({**base, name: value}) != autotune_print(base), name


def test_autotune_tunes_again_for_another_run_size(base):
    assert autotune_print(base, prompts=900) != autotune_print(base)


@pytest.mark.parametrize("name", ["dataset_name", "checkpoint_every", "max_truncated_share"])
def test_params_that_measure_nothing_keep_the_autotune_report(base, name):
    changed = {"dataset_name": "other", "checkpoint_every": 7, "max_truncated_share": 0.5}[name]
    assert autotune_print({**base, name: changed}) == autotune_print(base)
