"""The tokenize stage's choices: which SGLang version's tools block a shard is rendered with, and a shard with no
completions failing with what to clear."""

import json

import pytest

from dflash_regen.errors import NotRetryable
from dflash_regen.settings.run_config import RunConfig
from dflash_regen.training import tokenize


def test_tokenize_renders_tools_in_the_dialect_of_the_version_each_nodes_fleet_ran(run_params):
    from dflash_regen.errors import TokenizeError

    params = run_params()
    cfg = RunConfig.from_params(params, "r1", node="slow")
    assert tokenize.served_dialect(cfg) is None  # no fleet report: tools as sent
    report = cfg.layout.node_report("health")
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps({"servers": [{"version": "0.5.10"}, {"version": "0.5.10"}]}))
    assert tokenize.served_dialect(cfg).version == "0.5.10"
    assert tokenize.served_dialect(RunConfig.from_params(params, "r1", node="fast")) is None  # its own report
    report.write_text(json.dumps({"servers": [{"version": "0.5.10"}, {"version": "0.5.23"}]}))
    with pytest.raises(TokenizeError, match="ran SGLang 0.5.10, 0.5.23"):
        tokenize.served_dialect(cfg)


def test_a_shard_without_completions_fails_at_once_naming_what_to_clear(run_params, tmp_path):
    cfg = RunConfig.from_params(run_params(), "r1")
    missing = cfg.layout.merged("completions", 3)
    with pytest.raises(NotRetryable, match=r"^shard 3 has no completions at .*clear plan_shards with Downstream"):
        tokenize.tokenize_completions(cfg, 3, missing, tmp_path / "no-model")


def test_a_shard_the_drain_kept_from_its_completions_is_drained_not_failed(run_params, tmp_path):
    from dflash_regen import atomic
    from dflash_regen.errors import Drained

    cfg = RunConfig.from_params(run_params(), "r1")
    atomic.write_json(cfg.layout.drain_request, {"by": "ops", "at": 0})
    with pytest.raises(Drained, match="^shard 2 is not tokenized: the run was drained by ops"):
        tokenize.tokenize_completions(cfg, 2, None, tmp_path / "no-model")  # generate skipped: the merged file
