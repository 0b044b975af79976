"""Param budget = train_length: answers stop where the trainer stops reading, are kept, marked and counted apart."""

import json
from dataclasses import replace

import pyarrow.parquet as pq
import pytest

from dflash_regen import quality, tasks
from dflash_regen.chat.template import load_tokenizer
from dflash_regen.demo.model import write_demo_model
from dflash_regen.demo.prompts import write_demo_prompts
from dflash_regen.prompts.formats import Prompt
from dflash_regen.prompts.planning import TokenCounter, plan_shards
from dflash_regen.training.tokenize import tokenize_shard

TRAIN_MAX_LENGTH = 1200  # below most answers (mean ~1,820 tokens): most samples are cut


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(write_demo_model(tmp_path_factory.mktemp("model"), with_tokenizer=True))


def test_samples_cut_at_the_training_length_are_kept_marked_and_not_counted_as_truncation(launch, tmp_path,
                                                                                            tokenizer):
    cfg, servers, key = launch(num_servers=1, budget="train_length", train_max_length=TRAIN_MAX_LENGTH,
                               max_overlong_share=0.0)
    source = write_demo_prompts(tmp_path / "prompts.jsonl", 30)
    settings = replace(cfg.plan, shard_size=40, max_bad_row_share=1.0, max_overlong_share=1.0)
    assert settings.count_tokens  # the budget has planning count every prompt
    plan = plan_shards(source, cfg.layout, settings)
    shard = plan["shards"][0]
    done = tasks.generate(launch.params, "test_run", {**shard, "run_prompts": plan["accepted"]})
    counter = TokenCounter()  # planning's count of a prompt's tokens, stored in the shard
    prompts = {r["sample_id"]: r["prompt_tokens"] for r in pq.read_table(shard["path"]).to_pylist()}
    assert all(n == counter.count(Prompt(r["sample_id"], json.loads(r["messages"]),
                                         json.loads(r["tools"]) if r["tools"] else None, "", 0))
               for r in pq.read_table(shard["path"]).to_pylist() for n in [prompts[r["sample_id"]]])
    rows = pq.read_table(done["path"]).to_pylist()
    cut = [r for r in rows if r["truncated_at_train_length"]]
    assert 0 < len(cut) < len(rows), (len(cut), len(rows))  # long answers cut, short ones finished
    for r in rows:  # every request asked for what the trainer reads, no more
        assert r["max_tokens"] == TRAIN_MAX_LENGTH - prompts[r["sample_id"]] - 8
        assert r["truncated_at_train_length"] == (r["finish_reason"] == "length")
    assert any(not r["content"] for r in cut)  # some were cut inside their thinking: reasoning only

    run = cfg.layout
    tokenize_shard(run.shard(shard["shard"]), done["path"], run, shard["shard"], tokenizer,
                             include_reasoning=True)
    summary = pq.read_table(run.summary(shard["shard"])).to_pylist()
    assert max(r["n_tokens"] for r in summary) <= TRAIN_MAX_LENGTH  # nothing past what the trainer reads
    report = quality.validate_run(run, len(rows), cfg.quality, run.run_dir / "docs")
    assert report["success"], [e for e in report["expectations"] if not e["success"]]
    assert report["truncated_at_train_length"] == len(cut)
    assert "truncated" not in report["quarantined_by_reason"]
    assert report["kept"] == len(rows)
