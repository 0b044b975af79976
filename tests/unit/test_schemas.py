"""Each writer's file has exactly its schema from `schemas`, and the quality gate reads only the summary contract."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_regen import quality, schemas
from dflash_regen.chat.template import load_tokenizer
from dflash_regen.demo.model import write_demo_model
from dflash_regen.layout import COMPLETIONS, RunLayout
from dflash_regen.prompts.planning import PlanSettings, plan_shards
from dflash_regen.settings.params import defaults
from dflash_regen.settings.run_config import SamplingConfig
from dflash_regen.training.tokenize import tokenize_shard

SAMPLING = SamplingConfig(max_tokens=100, temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=0.0,
                          enable_thinking=True)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(write_demo_model(tmp_path_factory.mktemp("model"), with_tokenizer=True))


def planned(tmp_path) -> RunLayout:
    run = RunLayout(tmp_path / "run")
    source = tmp_path / "p.jsonl"
    lines = [{"id": "a", "messages": [{"role": "user", "content": "What is 2 + 2?"}]},
             {"id": "b", "messages": [{"role": "user", "content": "Weather?"}],
              "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]},
             {"id": "a", "messages": [{"role": "user", "content": "a duplicate id"}]}]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    plan_shards(source, run, PlanSettings(prompt_format="auto", shard_size=10, sampling=SAMPLING, context_length=4096,
                                          max_bad_row_share=0.5))
    return run


def test_planning_writes_prompt_shards_and_its_quarantine_with_their_schemas(tmp_path):
    run = planned(tmp_path)
    assert pq.read_schema(run.shard(0)) == schemas.PROMPT_SHARD
    assert pq.read_schema(run.planning_quarantine) == schemas.QUARANTINE
    assert pq.read_table(run.planning_quarantine).column("reason").to_pylist() == ["duplicate_id"]


def test_a_tokenized_shard_and_its_summary_read_back_with_their_schemas(tmp_path, tokenizer):
    run = planned(tmp_path)
    answers = {"a": ("Add the two.", "4", None), "b": ("", None, '[{"id": "c1", "type": "function", "function": '
                                                                  '{"name": "weather", "arguments": "{}"}}]')}
    rows = []
    for sid, (reasoning, content, calls) in answers.items():
        row = dict.fromkeys(schemas.COMPLETION.names)
        turn = {"role": "assistant", "content": content or "", "reasoning_content": reasoning}
        if calls:
            turn["tool_calls"] = json.loads(calls)
        row.update(sample_id=sid, shard=0, reasoning_content=reasoning or None, content=content, tool_calls=calls,
                   finish_reason="tool_calls" if calls else "stop", think_marker_leak=False, enable_thinking=True,
                   assistant_turns=json.dumps([turn]))
        rows.append(row)
    completions = run.merged(COMPLETIONS, 0)
    completions.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schemas.COMPLETION), completions)
    result = tokenize_shard(run.shard(0), completions, run, 0, tokenizer, include_reasoning=True)
    assert result["samples"] == 2
    assert pq.read_schema(run.tokenized(0)) == schemas.TOKENIZED
    assert pq.read_schema(run.summary(0)) == schemas.SUMMARY
    records = [json.loads(line) for line in run.conversations(0).read_text().splitlines()]
    assert [r["id"] for r in records] == ["a", "b"]


def test_the_row_rules_read_only_the_summary_contract():
    row = {name: None for name in schemas.SUMMARY.names}
    row.update(sample_id="s", n_tokens=40, mask_len=40, loss_mask_sum=20, finish_reason="stop", content_chars=12,
               reasoning_tokens=8, content_tokens=12, think_marker_leak=False, tool_call_expected=False,
               tool_call_present=False, repetition_score=0.0, enable_thinking=True, history_from_input=False,
               truncated_at_train_length=False)
    settings = quality.QualitySettings.from_params(defaults())
    assert quality.row_problem(row, settings) == ""  # a KeyError if a rule read another column
    assert quality.row_problem({**row, "loss_mask_sum": 6}, settings) == "empty_answer_mask"


def test_every_column_the_gx_suite_checks_is_in_the_summary_contract():
    derived = {"has_answer"}  # computed by run_suite from content_chars, tool_call_present, truncated_at_train_length
    checked = set()
    for expectation in quality.expectations(quality.QualitySettings.from_params(defaults()), expected_rows=10):
        checked |= {getattr(expectation, k) for k in ("column", "column_A", "column_B") if hasattr(expectation, k)}
    assert checked - derived <= set(schemas.SUMMARY.names), checked - derived - set(schemas.SUMMARY.names)
    assert "loss_mask_sum" in checked and "finish_reason" in checked
