import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_regen.errors import PromptSourceError
from dflash_regen.prompts.formats import Rejection, canonical_id, parse_row
from dflash_regen.prompts.sources import iter_raw

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


# A function-calling benchmark's style of schema: Python type names, nested, `any`, no type on parameters,
# `required` naming a property that does not exist and draft-3 `required: true` on a property.
PY_TOOL = {"name": "book", "description": "Book a trip.", "parameters": {
    "properties": {"city": {"type": "str"}, "nights": {"type": "int", "required": True},
                   "budget": {"type": "float"}, "pets": {"type": "bool"}, "dates": {"type": "tuple", "items": {
                       "type": "str"}},
                   "extra": {"type": "any"}, "guests": {"type": "list", "items": {"type": "dict", "properties": {
                       "name": {"type": "String"}}, "required": ["name", "age"]}}},
    "required": ["city", "country"]}}


def test_python_style_tool_schemas_are_repaired_and_each_repair_is_counted_by_kind():
    got = parse({"messages": [USER], "tools": [PY_TOOL]})
    params = got.tools[0]["function"]["parameters"]
    assert params["type"] == "object" and params["required"] == ["city", "nights"]
    props = params["properties"]
    assert [props[k].get("type") for k in ("city", "nights", "budget", "pets", "dates", "extra")] == [
        "string", "integer", "number", "boolean", "array", None]
    assert props["dates"]["items"] == {"type": "string"} and "required" not in props["nights"]
    assert props["guests"]["items"] == {"type": "object", "properties": {"name": {"type": "string"}},
                                        "required": ["name"]}
    kinds = sorted(got.repairs)
    assert kinds == sorted(["bare_function", "object_type_missing", "required_on_property", "required_absent",
                            "required_absent", "type_any"] + ["type_name"] * 9)


@pytest.mark.parametrize(("parameters", "path", "shown"), [
    ({"type": "dict", "properties": {"when": {"type": "datetime"}}}, "properties.when.type", "'datetime'"),
    ({"type": "array"}, "type", "'array'"),
    ({"properties": ["a", "b"]}, "properties", '["a", "b"]'),
    ({"properties": {"a": {"type": "object", "properties": {"b": "string"}}}}, "properties.a.properties.b",
     "'string'"),
    ({"properties": {"a": {}}, "required": "a"}, "required", "'a'"),
])
def test_unrepairable_tool_schemas_are_quarantined_with_the_path_the_value_and_the_fix(parameters, path, shown):
    got = parse({"messages": [USER], "tools": [{"type": "function", "function": {"name": "f",
                                                                                  "parameters": parameters}}]})
    assert isinstance(got, Rejection) and got.reason == "bad_tool"
    assert got.detail.startswith(f"tools[0].function.parameters.{path} is {shown}: ")
    assert "must" in got.detail or "use one of" in got.detail


def test_a_final_assistant_answer_is_dropped_for_regeneration_and_history_is_kept():
    got = parse({"messages": [USER, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nhello"},
                              {"role": "user", "content": "more"}, {"role": "assistant", "content": "old"}]})
    assert got.messages == [USER, {"role": "assistant", "content": "hello", "reasoning_content": "hmm"},
                            {"role": "user", "content": "more"}]
    assert sorted(got.repairs) == ["final_answer_dropped", "think_in_content"]


def test_sharegpt_turns_become_chat_turns_with_tool_calls_linked_to_their_results():
    row = {"id": "s1", "system": "Be brief.", "tools": json.dumps([{"name": "w", "parameters": {
               "type": "object", "properties": {"city": {"type": "string"}}}}]),
           "conversations": [{"from": "human", "value": "Weather in Paris?"},
                             {"from": "function_call", "value": '{"name": "w", "arguments": {"city": "Paris"}}'},
                             {"from": "observation", "value": '{"temp": 20}'},
                             {"from": "gpt", "value": "20 degrees."}]}
    got = parse(row)
    assert got.format == "sharegpt" and got.sample_id == "s1" and got.repairs == ("final_answer_dropped",
                                                                                   "bare_function")
    assert got.messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1_0", "type": "function", "function": {
            "name": "w", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": '{"temp": 20}', "tool_call_id": "call_1_0"}]
    assert parse({"conversations": [{"from": "narrator", "value": "x"}]}).reason == "bad_role"
    bad_call = parse({"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "w()"},
                                        {"from": "observation", "value": "1"}]})
    assert bad_call.reason == "bad_tool_call"


def test_a_published_specforge_record_reads_back_as_its_prompt():
    from dflash_regen.chat.conversation import specforge_record

    record = specforge_record("p1", [USER, {"role": "assistant", "content": "a", "reasoning_content": "r"}], None)
    got = parse(record)
    assert got.format == "specforge" and got.sample_id == "p1" and got.messages == [USER] and got.tools is None


def test_prompt_columns_and_legacy_function_calls():
    got = parse({"prompt": "Write a haiku.", "system": "You are a poet."})
    assert got.format == "prompt" and got.messages == [{"role": "system", "content": "You are a poet."},
                                                       {"role": "user", "content": "Write a haiku."}]
    assert parse({"prompt": [USER]}).messages == [USER]
    legacy = parse({"messages": [USER, {"role": "assistant", "content": None,
                                        "function_call": {"name": "f", "arguments": "{}"}},
                                 {"role": "function", "name": "f", "content": "ok"}]})
    assert legacy.messages[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert legacy.messages[2] == {"role": "tool", "content": "ok", "tool_call_id": "f"}


def test_a_forced_format_rejects_rows_written_in_another():
    sharegpt = {"conversations": [{"from": "human", "value": "x"}]}
    assert parse_row("f:1", sharegpt, "sharegpt").format == "sharegpt"
    for fmt in ("openai", "specforge", "prompt"):
        got = parse_row("f:1", sharegpt, fmt)
        assert got.reason == "wrong_format" and f"prompt_format is {fmt!r}" in got.detail


def test_bom_json_arrays_and_csv_are_read(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"messages": [USER]}).encode() + b"\n")
    long = "x" * 200_000  # longer than the reader's window: the window grows to hold it
    (tmp_path / "b.json").write_text(json.dumps([{"id": 1, "prompt": long}, {"id": 2, "prompt": "y"}], indent=1))
    (tmp_path / "c.csv").write_text('id,prompt\nc1,"two\nlines"\nc2,z\n')
    got = list(iter_raw(tmp_path))
    assert [loc for loc, _ in got] == ["a.jsonl:1", "b.json#1", "b.json#2", "c.csv:3", "c.csv:4"]
    assert parse_row(*got[0]).messages == [USER] and parse_row(*got[1]).messages[0]["content"] == long
    assert parse_row(*got[3]).messages == [{"role": "user", "content": "two\nlines"}]


def test_a_truncated_json_array_and_unread_files_beside_read_ones_are_errors(tmp_path):
    (tmp_path / "a.json").write_text('[{"prompt": "x"}, {"prompt": ')
    with pytest.raises(PromptSourceError, match=r"a.json: element 2 of the JSON array cannot be read"):
        list(iter_raw(tmp_path / "a.json"))
    (tmp_path / "a.json").write_text('[{"prompt": "x"}]')
    (tmp_path / "notes.txt").write_text("rows?")
    (tmp_path / ".gitattributes").write_text("")
    with pytest.raises(PromptSourceError, match=r"holds 1 file\(s\) this reader does not read: notes.txt"):
        list(iter_raw(tmp_path))


def test_struct_columns_give_each_row_back_its_own_keys(tmp_path):
    # Arrow unifies the two tools' schemas: each reads back with the other's properties as nulls.
    weather = {"type": "function", "function": {"name": "w", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    flights = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"date": {"type": "string", "format": "date"}}}}}
    pq.write_table(pa.Table.from_pylist([{"messages": [USER], "tools": [weather]},
                                         {"messages": [USER], "tools": [flights]}]), tmp_path / "t.parquet")
    assert [parse_row(*r).tools for r in iter_raw(tmp_path)] == [[weather], [flights]]
