"""The published conversations load without losing a field in a loader whose first record decides the columns."""

import json

import pytest
from trainer_loaders import load_first_record_decides

from dflash_regen.conversation import specforge_record

TOOLS = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {}}}}]
USER = {"role": "user", "content": "q"}
ANSWER = {"role": "assistant", "content": "a", "reasoning_content": "r"}
CALL = {"role": "assistant", "content": "", "reasoning_content": "r",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]}
RESULT = {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("tools_first", [True, False])
def test_published_records_load_whole_whichever_record_comes_first(tmp_path, tools_first):
    plain = specforge_record("p", [USER, ANSWER], None)
    tooled = specforge_record("t", [USER, CALL, RESULT, ANSWER], TOOLS)
    rows = load_first_record_decides(write(tmp_path / "c.jsonl", [tooled, plain] if tools_first else [plain, tooled]))
    loaded = {"t" if json.loads(r["tools"]) else "p": r for r in rows}
    assert json.loads(loaded["t"]["tools"]) == TOOLS and json.loads(loaded["p"]["tools"]) == []
    assert json.loads(loaded["t"]["conversations"][1]["tool_calls"]) == CALL["tool_calls"]
    assert loaded["t"]["conversations"][2]["tool_call_id"] == "c1"


def test_the_loader_check_catches_a_record_without_tools(tmp_path):
    plain = {"id": "p", "conversations": [USER, ANSWER]}  # the shape published before: no tools key, fewer turn keys
    tooled = specforge_record("t", [USER, ANSWER], TOOLS)
    with pytest.raises(AssertionError, match="lose data|fails"):
        load_first_record_decides(write(tmp_path / "a.jsonl", [plain, tooled]))
    with pytest.raises(AssertionError, match="fails"):
        load_first_record_decides(write(tmp_path / "b.jsonl", [tooled, plain]))
