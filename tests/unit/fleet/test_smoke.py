import pytest

from dflash_regen.fleet.smoke import PROMPTS, judge
from dflash_regen.settings.run_config import SamplingConfig

SAMPLING = SamplingConfig(max_tokens=512, temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=0.0,
                          enable_thinking=True)


def body(content=None, reasoning=None, finish="stop", tool_calls=None, completion=100, reasoning_tokens=80):
    return {"choices": [{"message": {"role": "assistant", "content": content, "reasoning_content": reasoning,
                                     "tool_calls": tool_calls}, "finish_reason": finish}],
            "usage": {"completion_tokens": completion, "reasoning_tokens": reasoning_tokens}}


def test_the_seeds_512_token_answer_fails_with_the_raise_max_tokens_hint():
    problem = judge(PROMPTS["coding"], body(reasoning="x" * 1508, finish="length", completion=512,
                                            reasoning_tokens=512), SAMPLING)
    assert "inside its reasoning" in problem
    assert "512 reasoning, 0 chars of content" in problem
    assert "raise Param max_tokens" in problem


@pytest.mark.parametrize(("answer", "expected"), [
    (body(content="ok", reasoning="thought"), ""),
    (body(reasoning="thought"), "reasoning only"),
    (body(), "empty answer"),
    (body(content="answer"), "no reasoning_content although thinking is on"),
    (body(content="   ", reasoning="r"), "reasoning only"),
])
def test_answers_are_judged(answer, expected):
    problem = judge(PROMPTS["coding"], answer, SAMPLING)
    assert (expected in problem) if expected else problem == ""


def test_tool_prompt_needs_a_parsed_tool_call():
    raw = body(content="<tool_call>\n<function=get_weather>...", reasoning="r")
    assert "--tool-call-parser qwen3_coder" in judge(PROMPTS["tool_call"], raw, SAMPLING)
    call = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]
    assert judge(PROMPTS["tool_call"], body(reasoning="r", tool_calls=call, finish="tool_calls"), SAMPLING) == ""


def test_reasoning_under_the_alternative_field_name_counts():
    answer = body(content="ok")
    answer["choices"][0]["message"]["reasoning"] = "thought"
    assert judge(PROMPTS["coding"], answer, SAMPLING) == ""
