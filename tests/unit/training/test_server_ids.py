"""Samples held against their server's token ids (issue 37): the prompt check per sample, the token-exact last turn
and the re-render drift by cause, through the real tokenize stage on crafted completions; then the gate's bound."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_regen.layout import RunLayout
from dflash_regen.quality import QualitySettings, run_suite, server_ids_counts
from dflash_regen.settings.params import defaults
from dflash_regen.training.tokenize import tokenize_shard

USER = [{"role": "user", "content": "What is 2+2?"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "number"}}}}}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from dflash_regen.chat.template import load_tokenizer
    from dflash_regen.demo.model import default_tokenizer_cache, write_demo_model

    return load_tokenizer(write_demo_model(tmp_path_factory.mktemp("model"), shards=1, shard_bytes=1024,
                                           with_tokenizer=True, tokenizer_cache=default_tokenizer_cache()))


def encode(tok, text: str) -> list[int]:
    return tok.backend_tokenizer.encode(text, add_special_tokens=False).ids


def sample(tok, sid: str, raw: str, turn: dict, *, tools=None, prompt_ids: str = "right", output: bool = True):
    """A prompt row and a completion row whose server generated `raw` (after the prompt's `<think>\\n`), parsed into
    `turn` as SGLang's parsers would."""
    prompt = tok.apply_chat_template(USER, tools=tools, tokenize=False, add_generation_prompt=True,
                                     enable_thinking=True)
    ids = encode(tok, prompt)
    if prompt_ids == "wrong":
        ids = ids[:3] + encode(tok, " ") + ids[3:]
    out = encode(tok, raw) + [tok.convert_tokens_to_ids("<|im_end|>")]
    prompt_row = {"sample_id": sid, "messages": json.dumps(USER), "tools": json.dumps(tools) if tools else None,
                  "location": sid, "prompt_tokens": len(ids)}
    row = {"sample_id": sid, "finish_reason": "tool_calls" if turn.get("tool_calls") else "stop",
           "content": turn.get("content"), "reasoning_content": turn.get("reasoning_content"),
           "tool_calls": json.dumps(turn["tool_calls"]) if turn.get("tool_calls") else None,
           "think_marker_leak": False, "enable_thinking": True, "completion_tokens": len(out),
           "assistant_turns": json.dumps([{"role": "assistant", **turn}]),
           "server_prompt_ids": ids if prompt_ids != "none" else None, "server_output_ids": out if output else None}
    return prompt_row, row, out


def call(x: str) -> str:
    return f"<tool_call>\n<function=f>\n<parameter=x>\n{x}\n</parameter>\n</function>\n</tool_call>"


def tokenize(tok, tmp_path, samples):
    layout = RunLayout(tmp_path / "run")
    prompts, rows = tmp_path / "prompts.parquet", tmp_path / "completions.parquet"
    pq.write_table(pa.Table.from_pylist([p for p, _, _ in samples]), prompts)
    pq.write_table(pa.Table.from_pylist([r for _, r, _ in samples]), rows)
    for path in (layout.tokenized(0), layout.summary(0), layout.conversations(0)):
        path.parent.mkdir(parents=True, exist_ok=True)
    tokenize_shard(prompts, rows, layout, 0, tok, include_reasoning=True)
    tokens = {r["sample_id"]: r for r in pq.read_table(layout.tokenized(0)).to_pylist()}
    summary = {r["sample_id"]: r for r in pq.read_table(layout.summary(0)).to_pylist()}
    return tokens, summary


def test_each_sample_is_held_against_its_servers_ids_and_published_token_exact(tok, tmp_path):
    samples = {
        "form": sample(tok, "form", "I think.\n</think>\n\nFour.", {"reasoning_content": "I think.",
                                                                     "content": "Four."}),
        "space": sample(tok, "space", "I think.</think>\n\nFour. ", {"reasoning_content": "I think.",
                                                                       "content": "Four."}),
        "float": sample(tok, "float", "I call.\n</think>\n\n" + call("1.50"), {
            "reasoning_content": "I call.", "content": "", "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": "f", "arguments": '{"x": 1.5}'}}]},
            tools=TOOLS),
        "empty": sample(tok, "empty", "\n</think>\n\nFour.", {"reasoning_content": "", "content": "Four."}),
        "wrong": sample(tok, "wrong", "I think.\n</think>\n\nFour.", {"reasoning_content": "I think.",
                                                                       "content": "Four."}, prompt_ids="wrong"),
        "none": sample(tok, "none", "I think.\n</think>\n\nFour.", {"reasoning_content": "I think.",
                                                                     "content": "Four."}, prompt_ids="none",
                       output=False),
    }
    tokens, summary = tokenize(tok, tmp_path, list(samples.values()))
    # (an empty reasoning: the prompt's last "\n" merges with the answer's first in the re-render; the same prompt)
    assert {sid: summary[sid]["prompt_ids_match"] for sid in samples} == {
        "form": True, "space": True, "float": True, "empty": True, "wrong": False, "none": None}
    assert {sid: summary[sid]["rerender_drift"] for sid in samples} == {
        "form": "none", "space": "whitespace", "float": "tool_value", "empty": "whitespace", "wrong": None,
        "none": None}
    # The published record re-renders to the published ids, a tool value re-typed by the parser included (its
    # raw tool-call text is published); whitespace the template normalizes cannot be.
    assert {sid: summary[sid]["record_exact"] for sid in samples} == {
        "form": True, "space": False, "float": True, "empty": False, "wrong": None, "none": None}
    records = {r["id"]: r for r in map(json.loads, RunLayout(tmp_path / "run").conversations(0).read_text()
                                        .splitlines())}
    last = records["float"]["conversations"][-1]
    assert "<parameter=x>\n1.50\n</parameter>" in last["content"] and last["tool_calls"] == "[]"
    assert json.loads(records["space"]["conversations"][-1]["tool_calls"] or "[]") == []  # parsed fields kept
    from dflash_regen.chat.template import tokenize_batch

    for sid in ("form", "float"):  # what SpecForge's online path renders from the record: the published ids
        turns = [{k: json.loads(v) if k == "tool_calls" else v for k, v in t.items() if v and v != "[]"}
                 for t in records[sid]["conversations"]]
        [(again, _)] = tokenize_batch(tok, [(turns, json.loads(records[sid]["tools"]) or None)])
        assert again.tolist() == tokens[sid]["input_ids"], sid
    newline = encode(tok, "\n")
    for sid in ("form", "space", "float", "empty"):
        prompt_row, row, out = samples[sid]
        ids, mask = tokens[sid]["input_ids"], tokens[sid]["loss_mask"]
        n = len(row["server_prompt_ids"])
        assert summary[sid]["token_exact"] and ids == row["server_prompt_ids"] + out + newline  # the model's own
        assert mask == [0] * n + [1] * (len(out) + 1)  # qwen3.5: after `<think>\n` through `<|im_end|>\n`
        assert summary[sid]["n_tokens"] == len(ids) == summary[sid]["mask_len"]
        assert summary[sid]["loss_mask_sum"] == len(out) + 1
    # Where the prompt is not the server's (or no ids came), the re-render is kept, and marked.
    assert not summary["wrong"]["token_exact"] and not summary["none"]["token_exact"]
    # (the template-form answer re-renders to the model's ids: the same conversation, the same ids either way)
    assert tokens["wrong"]["input_ids"] == tokens["none"]["input_ids"] == tokens["form"]["input_ids"]
    counts = server_ids_counts(list(summary.values()))
    assert counts["prompt_ids_compared"] == 5 and counts["prompt_ids_mismatch"] == 1
    assert counts["prompt_ids_mismatch_samples"] == ["wrong"] and counts["token_exact"] == 4
    assert counts["rerender_drift"] == {"compared": 4, "whitespace": 2, "tool_value": 1, "other": 0}
    assert counts["record_exact"] == 2


def good(i, **changes):
    row = {"sample_id": f"s{i}", "n_tokens": 900, "mask_len": 900, "loss_mask_sum": 700, "finish_reason": "stop",
           "content_chars": 300, "reasoning_tokens": 500, "think_marker_leak": False, "tool_call_expected": False,
           "tool_call_present": False, "repetition_score": 0.01, "enable_thinking": True}
    return {**row, **changes}


def test_one_prompt_unlike_the_servers_fails_the_gate_at_the_default_bound(tmp_path):
    rows = [good(i, prompt_ids_match=True, record_exact=True) for i in range(50)] + \
        [good(100 + i) for i in range(20)]  # no ids reported: not counted
    strict = QualitySettings.from_params(defaults())
    assert strict.max_prompt_ids_mismatch_share == 0
    assert run_suite(rows, len(rows), strict, tmp_path / "a")["success"]
    rows.append(good(999, prompt_ids_match=False))
    report = run_suite(rows, len(rows), strict, tmp_path / "b")
    check = next(e for e in report["expectations"] if e["kwargs"].get("column") == "prompt_ids_match")
    assert not report["success"] and not check["success"] and "1 unexpected" in check["observed"]
    loose = QualitySettings.from_params({**defaults(), "max_prompt_ids_mismatch_share": 0.05})
    assert run_suite(rows, len(rows), loose, tmp_path / "c")["success"]


def test_records_that_re_render_other_than_published_are_bounded_by_max_rerender_drift_share(tmp_path):
    s = QualitySettings.from_params(defaults())
    rows = [good(i, record_exact=True) for i in range(96)] + [good(200 + i, record_exact=False) for i in range(4)]
    assert run_suite(rows, len(rows), s, tmp_path / "a")["success"]
    rows += [good(300 + i, record_exact=False) for i in range(4)]  # 8 of 104: above 5%
    report = run_suite(rows, len(rows), s, tmp_path / "b")
    check = next(e for e in report["expectations"] if e["kwargs"].get("column") == "record_exact")
    assert not report["success"] and not check["success"]
    assert np.isclose(s.max_rerender_drift_share, 0.05)
