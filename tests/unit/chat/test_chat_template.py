"""The demo model dir's chat template renders what Qwen3.6's own template renders."""

import json

import pytest

from dflash_regen.chat.conversation import specforge_record
from dflash_regen.chat.template import load_tokenizer, render
from dflash_regen.demo.model import default_tokenizer_cache, write_demo_model

USER = {"role": "user", "content": "q"}
CALL = {"role": "assistant", "content": "", "reasoning_content": "need the weather",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": (
            '{"city": "Paris", "metric": true, "note": null, "days": 3, "ratio": 1.5, "span": [1, 2], '
            '"opts": {"a": "b"}}')}}]}
RESULT = {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
ANSWER = {"role": "assistant", "content": "Sunny.", "reasoning_content": "easy"}
TOOLS = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(write_demo_model(tmp_path_factory.mktemp("model"), shards=1, shard_bytes=1024,
                                           with_tokenizer=True, tokenizer_cache=default_tokenizer_cache()))


def test_tool_call_arguments_are_written_raw_if_strings_else_as_json(tok):
    text = render(tok, [USER, CALL, RESULT, ANSWER], TOOLS)
    params = {"city": "Paris", "metric": "true", "note": "null", "days": "3", "ratio": "1.5", "span": "[1, 2]",
              "opts": '{"a": "b"}'}
    for name, value in params.items():
        assert f"<parameter={name}>\n{value}\n</parameter>\n" in text
    assert "True" not in text and "None" not in text


def test_preserve_thinking_keeps_the_reasoning_of_earlier_turns(tok):
    turns = [USER, ANSWER, {"role": "user", "content": "again"}]
    kept = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, preserve_thinking=True)
    dropped = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert "<think>\neasy\n</think>\n\nSunny." in kept and "easy" not in dropped


def test_a_published_record_renders_as_the_conversation_it_was_made_from(tok):
    turns = [{"role": "system", "content": "s"}, USER, CALL, RESULT, ANSWER]
    def as_trainer_reads(record):  # `tools` and `tool_calls` are JSON text; SpecForge decodes them
        turns = [{**t, "tool_calls": json.loads(t["tool_calls"])} for t in record["conversations"]]
        return turns, json.loads(record["tools"])

    assert render(tok, *as_trainer_reads(specforge_record("x", turns, TOOLS))) == render(tok, turns, TOOLS)
    plain = specforge_record("y", [USER, ANSWER], None)
    assert render(tok, *as_trainer_reads(plain)) == render(tok, [USER, ANSWER], None)
