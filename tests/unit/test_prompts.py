import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_regen.prompt_sources import PromptSourceError, iter_raw
from dflash_regen.prompts import Rejection, canonical_id, parse_row

USER = {"role": "user", "content": "hi"}


def parse(obj):
    return parse_row("f.jsonl:1", json.dumps(obj) if not isinstance(obj, str) else obj)


def test_a_good_row_keeps_its_id_and_normalises_content_parts():
    p = parse({"id": 7, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]}]})
    assert p.sample_id == "7" and p.messages == [{"role": "user", "content": "ab"}]


def test_without_id_the_sample_id_is_a_stable_hash_of_messages_and_tools():
    a = parse({"messages": [USER]})
    b = parse_row("other.jsonl:9", json.dumps({"messages": [USER]}, indent=2).replace("\n", " "))
    assert a.sample_id == b.sample_id == canonical_id([USER], None)
    assert parse({"messages": [USER], "tools": [{"name": "f"}]}).sample_id != a.sample_id


@pytest.mark.parametrize(("row", "reason"), [
    ("{not json", "not_json"),
    ("   ", "empty"),
    ("[1, 2]", "bad_shape"),
    ({"messages": []}, "empty"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "bad_role"),
    ({"messages": [{"role": "user", "content": ""}]}, "empty"),
    ({"messages": [{"role": "system", "content": "s"}]}, "no_user_turn"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}, "no_user_turn"),
    ({"instruction": "x", "output": "y"}, "unknown_format"),
    ({"messages": [USER, {"role": "tool", "content": "r"}]}, "bad_tool_turn"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "bad_content"),
    ({"messages": [USER], "tools": [{"type": "function", "function": {"description": "no name"}}]}, "bad_tool"),
    ({"messages": [USER], "tools": {"name": "f"}}, "bad_tool"),
    ({"messages": [USER], "tools": [{"name": "f", "parameters": {"type": "array"}}]}, "bad_tool"),
    ({"id": [1], "messages": [USER]}, "bad_id"),
])
def test_bad_rows_are_rejected_with_distinct_reasons(row, reason):
    got = parse(row)
    assert isinstance(got, Rejection) and got.reason == reason and got.detail and got.location == "f.jsonl:1"


def test_non_standard_tool_schemas_are_repaired():
    got = parse({"messages": [USER], "tools": [{"name": "f", "parameters": '{"properties": {"x": {}}}'}]})
    assert got.tools == [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {}}}}}]


def test_assistant_tool_calls_and_tool_results_are_kept():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    got = parse({"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                              {"role": "tool", "tool_call_id": "c1", "content": "42"}]})
    assert got.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'
    assert got.messages[2]["tool_call_id"] == "c1"


def test_sources_stream_jsonl_gz_and_parquet_with_locations(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"messages": []}\n{"x": 1}\n')
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write('{"messages": [{"role": "user", "content": "z"}]}\n')
    pq.write_table(pa.table({"id": ["p1"], "messages": [json.dumps([USER])]}), tmp_path / "c.parquet")
    got = list(iter_raw(tmp_path))
    assert [loc for loc, _ in got] == ["a.jsonl:1", "a.jsonl:2", "b.jsonl.gz:1", "c.parquet#1"]
    assert parse_row(*got[3]).sample_id == "p1"


def test_parquet_messages_as_json_strings_are_accepted(tmp_path):
    got = parse_row("c.parquet#1", {"messages": json.dumps([USER]), "tools": ""})
    assert got.messages == [USER] and got.tools is None
    assert parse_row("c.parquet#2", {"messages": "[{"}).reason == "not_json"


def test_missing_or_unreadable_sources_say_what_to_do(tmp_path):
    with pytest.raises(PromptSourceError, match="does not exist"):
        list(iter_raw(tmp_path / "nope"))
    (tmp_path / "README.md").write_text("a dataset card is not rows")
    with pytest.raises(PromptSourceError, match="no readable files"):
        list(iter_raw(tmp_path))
