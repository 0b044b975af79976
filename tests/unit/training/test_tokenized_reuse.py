"""Tokenized shards reused across runs (training/reuse.py): the key follows what the ids are made from, and a
match links the earlier run's files. tests/e2e/test_reuse.py checks it on whole runs."""

import json

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_regen.layout import RunLayout
from dflash_regen.schemas import PROMPT_SHARD
from dflash_regen.sglang.api import Dialect
from dflash_regen.training import reuse


def prompts(path, location="a.jsonl:1", text="hi"):
    path.parent.mkdir(parents=True, exist_ok=True)
    row = {"sample_id": "s1", "messages": json.dumps([{"role": "user", "content": text}]), "tools": None,
           "location": location, "prompt_tokens": None}
    pq.write_table(pa.Table.from_pylist([row], schema=PROMPT_SHARD), path)
    return path


def model(path, tokenizer="{}"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tokenizer)
    (path / "chat_template.jinja").write_text("{{ messages }}")
    return path


def test_the_key_follows_prompts_completions_and_settings_not_locations(tmp_path):
    settings = reuse.settings_key(model(tmp_path / "m"), True, Dialect("0.5.16"))
    assert settings != reuse.settings_key(tmp_path / "m", False, Dialect("0.5.16"))
    assert settings != reuse.settings_key(tmp_path / "m", True, Dialect("0.5.23"))
    assert settings != reuse.settings_key(model(tmp_path / "other", tokenizer='{"v": 2}'), True, Dialect("0.5.16"))
    completions = tmp_path / "c.parquet"
    completions.write_bytes(b"answers")
    key = reuse.inputs_key(prompts(tmp_path / "p.parquet"), completions, settings)
    assert key == reuse.inputs_key(prompts(tmp_path / "q.parquet", location="copy.jsonl:1"), completions, settings)
    assert key != reuse.inputs_key(prompts(tmp_path / "r.parquet", text="hello"), completions, settings)
    other = tmp_path / "d.parquet"
    other.write_bytes(b"other answers")
    assert key != reuse.inputs_key(tmp_path / "p.parquet", other, settings)


def test_a_matching_shard_links_the_earlier_runs_files(tmp_path):
    first, second = RunLayout.of(tmp_path, "first"), RunLayout.of(tmp_path, "second")
    for path in (first.tokenized(3), first.summary(3), first.conversations(3)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(path.name)
    reuse.record_key(first, 3, "k")
    assert reuse.link_earlier(second, 3, "other key") is None and not second.tokenized(3).exists()
    assert reuse.link_earlier(second, 4, "k") is None  # another shard
    assert reuse.link_earlier(second, 3, "k") == "first"
    assert all(a.samefile(b) for a, b in zip((first.tokenized(3), first.summary(3), first.conversations(3)),
                                             (second.tokenized(3), second.summary(3), second.conversations(3)),
                                             strict=True))
    assert json.loads(second.tokenized_inputs(3).read_text()) == {"key": "k", "linked_from": "first"}
    first.conversations(3).unlink()  # an earlier run being pruned: tokenize anew
    assert reuse.link_earlier(RunLayout.of(tmp_path, "third"), 3, "k") == "second"
