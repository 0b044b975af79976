"""The tokenize stage for one shard: completions in, tokenized rows + quality summary + conversations out.

Reads the shard's prompts and completions, builds each sample's training conversation, tokenizes it with
the model's own chat template (`tokenize.tokenize_sample`), and writes, each atomically:
`tokenized/shard-XXXXX.parquet` (ids and mask), `tokenized/summary-XXXXX.parquet` (one quality row per
sample, `quality.SUMMARY_COLUMNS`) and `tokenized/conversations-XXXXX.jsonl` (SpecForge records).
A shard whose three files exist is not redone.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_regen import atomic, conversation
from dflash_regen.quality import repetition_score
from dflash_regen.tokenize import summarize_mask, tokenize_sample

log = logging.getLogger(__name__)

# List items named as a parquet round trip names them ("element"): publish hard-links these files into the
# dataset, byte for byte what it wrote when it rewrote them.
TOKENIZED_SCHEMA = pa.schema([("sample_id", pa.string()), ("input_ids", pa.list_(pa.field("element", pa.int32()))),
                              ("loss_mask", pa.list_(pa.field("element", pa.int8()))), ("n_tokens", pa.int32()),
                              ("loss_mask_sum", pa.int32())])
SUMMARY_SCHEMA = pa.schema([("sample_id", pa.string()), ("n_tokens", pa.int32()), ("mask_len", pa.int32()),
                            ("loss_mask_sum", pa.int32()), ("finish_reason", pa.string()),
                            ("content_chars", pa.int32()), ("reasoning_tokens", pa.int32()),
                            ("content_tokens", pa.int32()), ("think_marker_leak", pa.bool_()),
                            ("tool_call_expected", pa.bool_()), ("tool_call_present", pa.bool_()),
                            ("repetition_score", pa.float32()), ("enable_thinking", pa.bool_()),
                            ("history_from_input", pa.bool_()), ("truncated_at_train_length", pa.bool_())])


def outputs(out_dir: Path, shard: int) -> tuple[Path, Path, Path]:
    name = f"{shard:05d}"
    return (out_dir / f"shard-{name}.parquet", out_dir / f"summary-{name}.parquet",
            out_dir / f"conversations-{name}.jsonl")


def tokenize_shard(prompts_path: Path, completions_path: Path, out_dir: Path, shard: int, tokenizer, *,
                   include_reasoning: bool) -> dict:
    tokens_path, summary_path, conv_path = outputs(out_dir, shard)
    if tokens_path.is_file() and summary_path.is_file() and conv_path.is_file():
        return {"shard": shard, "samples": pq.read_metadata(tokens_path).num_rows, "skipped": True}
    started = time.monotonic()
    prompts = {r["sample_id"]: r for r in pq.read_table(prompts_path).to_pylist()}
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    tokenized, summary, records = [], [], []
    for row in pq.read_table(completions_path).to_pylist():
        prompt = prompts[row["sample_id"]]
        turns, tools = conversation.from_rows(prompt, row)
        ids, mask = tokenize_sample(tokenizer, turns, tools, include_reasoning=include_reasoning)
        counts = summarize_mask(ids, mask, think_end)
        tokenized.append({"sample_id": row["sample_id"], "input_ids": ids, "loss_mask": mask,
                          "n_tokens": len(ids), "loss_mask_sum": counts.loss_mask_sum})
        summary.append({
            "sample_id": row["sample_id"], "n_tokens": counts.n_tokens, "mask_len": len(mask),
            "loss_mask_sum": counts.loss_mask_sum, "finish_reason": row["finish_reason"],
            "content_chars": len((row["content"] or "").strip()), "reasoning_tokens": counts.reasoning_tokens,
            "content_tokens": counts.content_tokens, "think_marker_leak": bool(row["think_marker_leak"]),
            "tool_call_expected": bool(prompt["tools"]), "tool_call_present": bool(row["tool_calls"]),
            "repetition_score": repetition_score(row["reasoning_content"]),
            "enable_thinking": bool(row["enable_thinking"]),
            # SpecForge also trains assistant turns after the last user turn; flag when those come from the input.
            "history_from_input": _input_turns_after_last_user(json.loads(prompt["messages"])),
            "truncated_at_train_length": bool(row.get("truncated_at_train_length")),
        })
        records.append(json.dumps(conversation.specforge_record(row["sample_id"], turns, tools), ensure_ascii=False))
    atomic.write_table(pa.Table.from_pylist(tokenized, schema=TOKENIZED_SCHEMA), tokens_path)
    atomic.write_table(pa.Table.from_pylist(summary, schema=SUMMARY_SCHEMA), summary_path)
    atomic.write_lines(conv_path, records)
    n_tokens = sum(r["n_tokens"] for r in tokenized)
    seconds = time.monotonic() - started
    log.info("shard %d: tokenized %d samples, %d tokens in %.1f s (%.0f tok/s)", shard, len(tokenized), n_tokens,
             seconds, n_tokens / max(seconds, 1e-9))
    return {"shard": shard, "samples": len(tokenized), "tokens": n_tokens, "skipped": False}


def _input_turns_after_last_user(messages: list[dict]) -> bool:
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return any(m["role"] == "assistant" for m in messages[last_user + 1:])
