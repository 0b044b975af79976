import json

from dflash_regen.chat.conversation import build, specforge_record

U1 = {"role": "user", "content": "q1"}
A1 = {"role": "assistant", "content": "original"}
U2 = {"role": "user", "content": "q2"}
GEN = {"role": "assistant", "content": "answer", "reasoning_content": "thought"}


def test_the_generated_turn_is_appended_after_the_given_history():
    assert build([U1, A1, U2], [GEN], regenerated_history=False) == [U1, A1, U2, GEN]


def test_regenerated_history_replaces_earlier_assistant_turns_in_order():
    regen = {"role": "assistant", "content": "mine", "reasoning_content": "r1"}
    got = build([U1, A1, U2], [regen, GEN], regenerated_history=True)
    assert got == [U1, regen, U2, GEN]


def test_specforge_record_keeps_tool_calls_and_tools():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turn = {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [call]}
    rec = specforge_record("id1", build([U1], [turn], False), [{"type": "function", "function": {"name": "f"}}])
    assert rec["id"] == "id1" and json.loads(rec["conversations"][-1]["tool_calls"]) == [call]
    assert json.loads(rec["tools"]) == [{"type": "function", "function": {"name": "f"}}]
    assert rec["conversations"][0]["tool_calls"] == "[]" and specforge_record("p", [U1], None)["tools"] == "[]"
