"""The training conversation of one sample: the prompt's turns plus the model's generated assistant turn(s).

Shared by tokenization and publishing, so the tokenized ids and the published SpecForge conversations are
the same conversation. With `regenerate_history`, the prompt's earlier assistant turns are replaced, in
order, by the model's own regenerated ones (`assistant_turns[:-1]`).
"""

from __future__ import annotations

import json

# Every published turn carries all of these, and every row `id`, `conversations` and `tools`: loaders that take
# their columns from the first record (SpecForge's offline path: `datasets.Dataset.from_generator`) would
# otherwise drop a key the first record lacks, or fail on it. Every value is a string: `tools` and `tool_calls` are
# JSON text (`"[]"` when none), which SpecForge decodes itself. As JSON lists, Arrow (`load_dataset("json")`, the
# online path of `specforge train`) gives the tool schemas of every row the key order of the first row whose keys
# are the same, so the trainer rendered another `<tools>` block than the model was prompted with; and a file read
# in blocks (10 MB each) fails when a block without tool calls comes first (tests/contract/test_specforge_contract.py).
TURN_DEFAULTS = {"role": "", "content": "", "reasoning_content": "", "tool_calls": [], "tool_call_id": ""}


def build(messages: list[dict], assistant_turns: list[dict], regenerated_history: bool) -> list[dict]:
    if not assistant_turns:
        raise ValueError("a completion must hold at least one generated assistant turn")
    history = iter(assistant_turns[:-1]) if regenerated_history else None
    turns = []
    for msg in messages:
        if msg["role"] == "assistant" and history is not None:
            turns.append(_clean(next(history)))
        else:
            turns.append(msg)
    turns.append(_clean(assistant_turns[-1]))
    return turns


def _clean(turn: dict) -> dict:
    out = {"role": "assistant", "content": turn.get("content") or ""}
    if turn.get("reasoning_content"):
        out["reasoning_content"] = turn["reasoning_content"]
    if turn.get("tool_calls"):
        out["tool_calls"] = turn["tool_calls"]
    return out


def from_rows(prompt_row: dict, completion_row: dict) -> tuple[list[dict], list[dict] | None]:
    """(conversation, tools) from a shard row and its completion row (parquet JSON columns)."""
    messages = json.loads(prompt_row["messages"])
    tools = json.loads(prompt_row["tools"]) if prompt_row.get("tools") else None
    turns = json.loads(completion_row["assistant_turns"])
    return build(messages, turns, regenerated_history=len(turns) > 1), tools


def specforge_record(sample_id: str, conversation: list[dict], tools: list[dict] | None) -> dict:
    """SpecForge's training row: {"id", "conversations": [{"role", "content", ...}], "tools"}, every key present,
    `tools` and each turn's `tool_calls` as JSON text."""
    turns = [{k: turn.get(k) or default for k, default in TURN_DEFAULTS.items()} for turn in conversation]
    for turn in turns:
        turn["tool_calls"] = _json_text(turn["tool_calls"])
    return {"id": sample_id, "conversations": turns, "tools": _json_text(tools or [])}


def _json_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
