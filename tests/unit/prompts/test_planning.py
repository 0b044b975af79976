import json
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dflash_regen.errors import PlanFailed
from dflash_regen.layout import RunLayout
from dflash_regen.prompts.formats import Prompt, parse_row
from dflash_regen.prompts.planning import PlanSettings, TokenCounter, plan_shards, shard_label, token_bound
from dflash_regen.settings.run_config import SamplingConfig

SAMPLING = SamplingConfig(max_tokens=1000, temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=0.0,
                          enable_thinking=True)
SETTINGS = PlanSettings(prompt_format="auto", shard_size=3, sampling=SAMPLING, context_length=4096,
                        max_bad_row_share=0.5)


def write_rows(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def user(text, **extra):
    return {"messages": [{"role": "user", "content": text}], **extra}


def test_shards_hold_rows_in_input_order_and_replanning_gives_the_same_shards(tmp_path):
    src = write_rows(tmp_path / "p.jsonl", [user(f"q{i}") for i in range(7)])
    plan = plan_shards(src, RunLayout(tmp_path), SETTINGS)
    assert [s["prompts"] for s in plan["shards"]] == [3, 3, 1]
    assert plan["shards"][0]["label"] == "shard 0000 (3 prompts)"
    first = pq.read_table(plan["shards"][0]["path"]).to_pylist()
    assert [json.loads(r["messages"])[0]["content"] for r in first] == ["q0", "q1", "q2"]
    again = plan_shards(src, RunLayout(tmp_path / "again"), SETTINGS)
    for a, b in zip(plan["shards"], again["shards"], strict=True):
        assert pq.read_table(a["path"]).equals(pq.read_table(b["path"]))


def test_unchanged_input_reuses_the_recorded_plan(tmp_path):
    src = write_rows(tmp_path / "p.jsonl", [user("a"), user("b")])
    plan = plan_shards(src, RunLayout(tmp_path), SETTINGS)
    mtime = RunLayout(tmp_path).shard(0).stat().st_mtime_ns
    assert plan_shards(src, RunLayout(tmp_path), SETTINGS) == plan
    assert RunLayout(tmp_path).shard(0).stat().st_mtime_ns == mtime


def test_a_new_run_on_the_same_input_links_the_earlier_runs_shards_instead_of_planning_again(tmp_path):
    src = write_rows(tmp_path / "p.jsonl", [user(f"q{i}") for i in range(7)] + ["not json"])
    first, second = RunLayout.of(tmp_path, "first"), RunLayout.of(tmp_path, "second")
    plan = plan_shards(src, first, SETTINGS)
    again = plan_shards(src, second, SETTINGS)
    assert again["linked_from"] == "first" and again["accepted"] == plan["accepted"] == 7
    for a, b in zip(plan["shards"], again["shards"], strict=True):
        assert Path(b["path"]).parent == second.shards_dir and Path(a["path"]).samefile(b["path"])
    assert first.planning_quarantine.samefile(second.planning_quarantine)
    assert json.loads(second.plan.read_text())["linked_from"] == "first"
    other = plan_shards(src, RunLayout.of(tmp_path, "third"), replace(SETTINGS, shard_size=2))  # other settings
    assert "linked_from" not in other and [s["prompts"] for s in other["shards"]] == [2, 2, 2, 1]


def test_bad_duplicate_and_over_long_rows_are_quarantined_and_counts_reconcile(tmp_path):
    long_text = " ".join(f"w{i}" for i in range(4000))
    rows = [user("ok", id="a"), user("dup", id="a"), "{broken", user(long_text, id="long"), user("fine")]
    src = write_rows(tmp_path / "p.jsonl", rows)
    lenient = PlanSettings(prompt_format="auto", shard_size=3, sampling=SAMPLING, context_length=4096,
                           max_bad_row_share=0.9)
    plan = plan_shards(src, RunLayout(tmp_path), lenient)
    q = pq.read_table(RunLayout(tmp_path).planning_quarantine).to_pylist()
    assert {r["reason"] for r in q} == {"duplicate_id", "not_json", "too_long"}
    assert [r["location"] for r in q] == ["p.jsonl:2", "p.jsonl:3", "p.jsonl:4"]
    assert plan["rows"] == 5 == plan["accepted"] + plan["quarantined"]
    assert "exceed context_length 4,096" in next(r["detail"] for r in q if r["reason"] == "too_long")


def test_too_many_bad_rows_fail_planning_with_the_reasons(tmp_path):
    src = write_rows(tmp_path / "p.jsonl", ["{", "{", user("ok")])
    with pytest.raises(PlanFailed, match=r"2 of 3 rows \(66.7%\) are unusable.*max_bad_row_share=50.0%"):
        plan_shards(src, RunLayout(tmp_path), SETTINGS)
    assert RunLayout(tmp_path).planning_quarantine.is_file()  # the bad rows are kept for the user to look at


def test_label_format():
    assert shard_label(42, 1000) == "shard 0042 (1,000 prompts)"


def test_every_supported_input_format_plans_with_its_rows_ids_repairs_and_quarantine_reasons(tmp_path):
    import datasets
    import pyarrow as pa

    src = tmp_path / "prompts"
    src.mkdir()
    (src / "README.md").write_text("# a dataset card, not rows")
    py_tool = {"name": "book", "parameters": {"type": "dict", "properties": {
        "city": {"type": "str"}, "nights": {"type": "int"}, "opts": {"type": "any"}}, "required": ["city", "zip"]}}
    bad_tool = {"name": "when", "parameters": {"type": "dict", "properties": {"at": {"type": "datetime"}}}}
    (src / "a-openai.jsonl").write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in [
        {"id": "o1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                  {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]},
        {"id": "o2", "messages": [{"role": "user", "content": "Book Rome"}], "tools": [py_tool]},
        {"id": "o3", "messages": [{"role": "user", "content": "When?"}], "tools": [bad_tool]},
    ]).encode())
    sharegpt = [{"id": "s1", "system": "Be brief.", "tools": json.dumps([py_tool]), "conversations": [
                    {"from": "human", "value": "Book Oslo"},
                    {"from": "function_call", "value": json.dumps({"name": "book", "arguments": {"city": "Oslo"}})},
                    {"from": "observation", "value": "booked"}, {"from": "gpt", "value": "Done."}]},
                {"id": "s2", "system": None, "tools": None, "conversations": [{"from": "narrator", "value": "x"}]}]
    pq.write_table(pa.Table.from_pylist(sharegpt), src / "b-sharegpt.parquet")
    (src / "c-specforge.json").write_text(json.dumps([{"id": "p1", "tools": [], "conversations": [
        {"role": "user", "content": "again", "reasoning_content": "", "tool_calls": [], "tool_call_id": ""},
        {"role": "assistant", "content": "a", "reasoning_content": "r", "tool_calls": [], "tool_call_id": ""}]}]))
    (src / "d-prompt.csv").write_text("id,prompt\nc1,Write a haiku.\nc2,\n")
    datasets.Dataset.from_list([{"id": "h1", "conversations": [{"from": "human", "value": "From HF"},
                                                               {"from": "gpt", "value": "old"}]},
                                {"id": "h1", "conversations": [{"from": "human", "value": "dup"}]}],
                               ).save_to_disk(str(src / "e-hf"))

    plan = plan_shards(src, RunLayout(tmp_path), SETTINGS)

    assert plan["formats"] == {"openai": 2, "sharegpt": 2, "specforge": 1, "prompt": 1}
    # Counted on the planned rows: o2 and s1 carry the Python-style tool (dict, str, int, any, a missing zip);
    # o1, s1, p1 and h1 end with the answer that gets regenerated.
    assert plan["repairs"] == {"bare_function": 2, "final_answer_dropped": 4, "required_absent": 2, "type_any": 2,
                               "type_name": 6}
    assert plan["skipped_files"] == [str(src / "README.md")]
    q = {r["location"]: r for r in pq.read_table(RunLayout(tmp_path).planning_quarantine).to_pylist()}
    assert {loc: r["reason"] for loc, r in q.items()} == {
        "a-openai.jsonl:3": "bad_tool", "b-sharegpt.parquet#2": "bad_role", "d-prompt.csv:3": "empty",
        "e-hf/data-00000-of-00001.arrow#2": "duplicate_id"}
    assert q["a-openai.jsonl:3"]["detail"] == (
        "tools[0].function.parameters.properties.at.type is 'datetime': not a JSON schema type; use one of array, "
        "boolean, integer, null, number, object, string, or leave 'type' out to accept any value")
    rows = [r for s in plan["shards"] for r in pq.read_table(s["path"]).to_pylist()]
    assert [r["sample_id"] for r in rows] == ["o1", "o2", "s1", "p1", "c1", "h1"]
    messages = {r["sample_id"]: json.loads(r["messages"]) for r in rows}
    assert messages["o1"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                              {"role": "user", "content": "bye"}]
    assert [m["role"] for m in messages["s1"]] == ["system", "user", "assistant", "tool"]
    assert messages["s1"][3]["tool_call_id"] == messages["s1"][2]["tool_calls"][0]["id"]
    assert messages["p1"] == [{"role": "user", "content": "again"}] and messages["h1"][-1]["content"] == "From HF"
    tools = json.loads(next(r["tools"] for r in rows if r["sample_id"] == "o2"))
    assert tools[0]["function"]["parameters"] == {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "nights": {"type": "integer"}, "opts": {}}}


def test_an_empty_source_says_the_file_is_empty(tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text("")
    with pytest.raises(PlanFailed, match=r"p.jsonl has no rows: the file is empty"):
        plan_shards(src, RunLayout(tmp_path), SETTINGS)


def test_a_datasetdict_with_several_splits_asks_which_one(tmp_path):
    import datasets

    from dflash_regen.prompts.sources import PromptSourceError

    part = datasets.Dataset.from_list([{"prompt": "x"}])
    datasets.DatasetDict({"train": part, "test": part}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(PromptSourceError, match=r"DatasetDict with splits \['train', 'test'\]; set Param "
                                                r"prompt_source to the split to regenerate, e.g. .*dd/train"):
        plan_shards(tmp_path / "dd", RunLayout(tmp_path), SETTINGS)
    datasets.DatasetDict({"train": part}).save_to_disk(str(tmp_path / "one"))
    assert plan_shards(tmp_path / "one", RunLayout(tmp_path), SETTINGS)["accepted"] == 1


def test_more_shards_than_airflow_can_map_are_refused_with_the_count_and_the_shard_size_that_fits(tmp_path):
    src = write_rows(tmp_path / "p.jsonl", [user(f"q{i}") for i in range(25)])
    capped = PlanSettings(prompt_format="auto", shard_size=1, sampling=SAMPLING, context_length=4096,
                          max_bad_row_share=0.5, max_shards=10)
    with pytest.raises(PlanFailed) as info:
        plan_shards(src, RunLayout(tmp_path), capped)
    message = str(info.value)
    assert message.startswith("25 prompts in shards of 1 make 25 shards, more than the 10 mapped tasks Airflow "
                              "allows ([core] max_map_length); set Param shard_size to at least 3"), message
    assert len(RunLayout(tmp_path).shard_files()) <= 10  # stopped writing at the cap
    assert not RunLayout(tmp_path).plan.exists()
    fits = PlanSettings(prompt_format="auto", shard_size=3, sampling=SAMPLING, context_length=4096,
                        max_bad_row_share=0.5, max_shards=10)
    assert len(plan_shards(src, RunLayout(tmp_path), fits)["shards"]) == 9


def test_prompts_past_train_max_length_are_counted_quarantined_and_bounded(tmp_path):
    # The audit's 200K-token prompt was accepted and published against train_max_length 4,096.
    long_text = " ".join(f"w{i}" for i in range(3000))  # ~6,000 tokens: fits the context, not the training length
    src = write_rows(tmp_path / "p.jsonl", [user(long_text, id="long")] + [user(f"q{i}") for i in range(19)])
    settings = PlanSettings(prompt_format="auto", shard_size=10, sampling=SAMPLING, context_length=262144,
                            max_bad_row_share=0.5,
                            train_max_length=4096, max_overlong_share=0.1)
    plan = plan_shards(src, RunLayout(tmp_path), settings)
    assert plan["accepted"] == 19 and plan["quarantined_by_reason"] == {"over_train_max_length": 1}
    (row,) = pq.read_table(RunLayout(tmp_path).planning_quarantine).to_pylist()
    assert row["sample_id"] == "long" and "prompt tokens, past Param train_max_length=4,096" in row["detail"]
    strict = PlanSettings(**{**settings.__dict__, "max_overlong_share": 0.01})
    with pytest.raises(PlanFailed, match=r"^1 of 20 prompts \(5.0%\) are longer than Param train_max_length=4,096 "
                                         r"tokens by themselves, above Param max_overlong_share=1.0%"):
        plan_shards(src, RunLayout(tmp_path / "again"), strict)


WRITE_FILE = {"type": "function", "function": {"name": "write_file", "description": "Write a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["path", "content"]}}}


def tool_call_history(content: str) -> dict:
    """A prompt whose length is almost all in one tool call's arguments, in the history."""
    call = {"id": "c1", "type": "function",
            "function": {"name": "write_file", "arguments": json.dumps({"path": "big.py", "content": content})}}
    return {"id": "in-a-tool-call", "tools": [WRITE_FILE], "messages": [
        {"role": "user", "content": "Write the table to big.py."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "written"},
        {"role": "user", "content": "Now explain it."}]}


def test_a_prompt_long_only_in_its_tool_call_arguments_is_caught(tmp_path):
    # Issue 26: a 37,410-token prompt, almost all in one tool call, passed train_max_length 4,096.
    long = " ".join(f"row{i}" for i in range(12000))  # ~36,000 tokens inside the arguments
    rows = [tool_call_history(long)] + [user(f"q{i}") for i in range(9)]
    src = write_rows(tmp_path / "p.jsonl", rows)
    settings = PlanSettings(prompt_format="auto", shard_size=10, sampling=SAMPLING, context_length=262144,
                            max_bad_row_share=0.5,
                            train_max_length=4096, max_overlong_share=0.0)
    with pytest.raises(PlanFailed, match=r"^1 of 10 prompts \(10.0%\) are longer than Param train_max_length=4,096"):
        plan_shards(src, RunLayout(tmp_path), settings)
    (row,) = pq.read_table(RunLayout(tmp_path).planning_quarantine).to_pylist()
    assert row["sample_id"] == "in-a-tool-call" and row["reason"] == "over_train_max_length"
    assert int(row["detail"].split()[0].replace(",", "")) > 30_000


def test_the_tools_preamble_counts_toward_the_length(tmp_path):
    # Text that is one token per byte, with a tool: the template's ~200-token tools preamble tips it over.
    row = user("z\n" * 1500, tools=[{"type": "function", "function": {"name": "f"}}], id="preamble")
    prompt = parse_row("x", row)
    tokens = TokenCounter().count(prompt)
    assert prompt.text_bytes + 64 < tokens  # what the 64-byte slack once missed
    src = write_rows(tmp_path / "p.jsonl", [row, user("q")])
    settings = PlanSettings(prompt_format="auto", shard_size=10, sampling=SAMPLING, context_length=262144,
                            max_bad_row_share=0.9,
                            train_max_length=tokens, max_overlong_share=1.0)
    plan = plan_shards(src, RunLayout(tmp_path), settings)
    assert plan["quarantined_by_reason"] == {"over_train_max_length": 1}


def test_the_length_bound_is_never_below_the_templates_count(tmp_path):
    """Planning counts only prompts whose cheap bound reaches the limit: the bound must hold for every shape."""
    from dflash_regen.demo.prompts import write_demo_prompts

    src = write_demo_prompts(tmp_path / "demo.jsonl", 200)
    prompts = [parse_row("x", line) for line in src.read_text().splitlines()]
    args = {f"a{i}": i for i in range(300)}  # many tiny arguments: the template's framing outweighs their JSON
    many = tool_call_history("x")
    many["messages"][1]["tool_calls"][0]["function"]["arguments"] = json.dumps(args)
    tools = [{**WRITE_FILE, "function": {**WRITE_FILE["function"], "name": f"t{i}"}} for i in range(40)]
    digits = " ".join(str(i % 10) for i in range(3000))  # one token per byte, nothing for JSON to escape
    prompts += [parse_row("x", r) for r in (many, user("z\n" * 500, tools=tools), user("😀\n" * 300),
                                            user(digits, tools=[{"type": "function", "function": {"name": "f"}}]),
                                            tool_call_history('<>&"\\\n' * 200))]
    counter = TokenCounter()
    assert sum(1 for p in prompts if isinstance(p, Prompt) and p.tools) > 20
    for p in prompts:
        if isinstance(p, Prompt):
            assert token_bound(p.messages, p.tools) >= counter.count(p), p.messages
