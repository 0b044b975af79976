"""The seed's failure, rebuilt through the real tokenize stage, is refused by the quality gate."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_regen import quality, schemas
from dflash_regen.chat.template import load_tokenizer
from dflash_regen.demo.model import write_demo_model
from dflash_regen.layout import RunLayout
from dflash_regen.settings.params import defaults
from dflash_regen.training.tokenize import tokenize_shard


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(write_demo_model(tmp_path_factory.mktemp("model"), with_tokenizer=True))


def completion(sid, reasoning, content):
    turn = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    row = dict.fromkeys(schemas.COMPLETION.names)
    row.update({"sample_id": sid, "shard": 0, "reasoning_content": reasoning or None, "content": content,
                "finish_reason": "stop", "completion_tokens": 10, "think_marker_leak": False,
                "enable_thinking": True, "assistant_turns": json.dumps([turn])})
    return row


def test_a_dataset_of_87_percent_empty_answers_is_refused_naming_the_expectation(tmp_path, tokenizer):
    ids = [f"s{i:03d}" for i in range(100)]
    prompts = [{"sample_id": sid, "messages": json.dumps([{"role": "user", "content": f"Question {sid}?"}]),
                "tools": None, "location": f"p.jsonl:{i + 1}", "prompt_tokens": None} for i, sid in enumerate(ids)]
    pq.write_table(pa.Table.from_pylist(prompts, schema=schemas.PROMPT_SHARD), tmp_path / "shard.parquet")
    rows = [completion(sid, "", "OK.") for sid in ids[:87]]
    thought = " ".join(f"Step {k}: check case {k * 7} against the rule." for k in range(12))
    rows += [completion(sid, thought, "A real answer with detail.") for sid in ids[87:]]
    pq.write_table(pa.Table.from_pylist(rows, schema=schemas.COMPLETION), tmp_path / "done.parquet")
    run = RunLayout(tmp_path / "run")
    tokenize_shard(tmp_path / "shard.parquet", tmp_path / "done.parquet", run, 0, tokenizer,
                             include_reasoning=True)
    summary = pq.read_table(run.summary(0)).to_pylist()
    assert sum(r["loss_mask_sum"] == 6 for r in summary) == 87  # the seed's exact signature

    report = quality.validate_run(run, 100, quality.QualitySettings.from_params(defaults()), run.data_docs)
    assert report["success"] is False
    assert report["quarantined_by_reason"] == {"empty_answer_mask": 87}
    failed = [e for e in report["expectations"] if not e["success"]]
    assert any(e["kwargs"].get("column") == "loss_mask_sum" and "87 unexpected" in e["observed"] for e in failed)
    assert run.data_docs_index.is_file()
    assert pq.read_schema(run.gate_quarantine) == schemas.GATE_QUARANTINE
    assert pq.read_table(run.gate_quarantine).num_rows == 87
