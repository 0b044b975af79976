"""The tokenize stage for one shard: completions in, tokenized rows + quality summary + conversations out.

Reads the shard's prompts and completions, builds each sample's training conversation, tokenizes it with
the model's own chat template (`tokenize.tokenize_batch`: the whole shard through the Rust tokenizer in
batches), and writes, each atomically:
`tokenized/shard-XXXXX.parquet` (ids and mask), `tokenized/summary-XXXXX.parquet` (one quality row per
sample, `schemas.SUMMARY`) and `tokenized/conversations-XXXXX.jsonl` (SpecForge records).
A shard whose three files exist is not redone.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_regen import atomic
from dflash_regen.chat import conversation
from dflash_regen.chat.template import TokenizeError, load_tokenizer, summarize_mask, tokenize_batch
from dflash_regen.errors import Drained, NotRetryable
from dflash_regen.generate.shard import drain_request
from dflash_regen.layout import COMPLETIONS, RunLayout
from dflash_regen.payloads import Tokenized
from dflash_regen.schemas import SUMMARY, TOKENIZED
from dflash_regen.settings.run_config import RunConfig
from dflash_regen.sglang.api import Dialect
from dflash_regen.training import reuse

log = logging.getLogger(__name__)


def repetition_score(text: str | None, n: int = 8) -> float:
    """Share of word n-grams that repeat an earlier one: ~0 for prose, -> 1 for a loop."""
    words = (text or "").split()
    if len(words) < 2 * n:
        return 0.0
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams)


def tokenize_shard(prompts_path: Path, completions_path: Path, layout: RunLayout, shard: int, tokenizer, *,
                   include_reasoning: bool, dialect: Dialect | None = None) -> Tokenized:
    """`dialect`: the SGLang version that generated the shard; its server's tools block (`template_tools`) is the
    one rendered and published, so the trainer's prompt is the one the model answered."""
    tokens_path, summary_path, conv_path = layout.tokenized(shard), layout.summary(shard), layout.conversations(shard)
    if tokens_path.is_file() and summary_path.is_file() and conv_path.is_file():
        return {"shard": shard, "samples": pq.read_metadata(tokens_path).num_rows, "skipped": True}
    started = time.monotonic()
    prompts = {r["sample_id"]: r for r in pq.read_table(prompts_path).to_pylist()}
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    think_start, im_end = tokenizer.convert_tokens_to_ids("<think>"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = pq.read_table(completions_path).to_pylist()  # files written before the id columns lack them: .get()
    conversations = training_conversations(prompts, rows, dialect)
    rerendered = tokenize_batch(tokenizer, conversations, include_reasoning=include_reasoning)
    summary, records, tokenized = [], [], []
    for row, (turns, tools), (again, again_mask) in zip(rows, conversations, rerendered, strict=True):
        prompt = prompts[row["sample_id"]]
        check = server_ids_check(again, again_mask, row, im_end, include_reasoning)
        ids, mask = (check.ids, check.mask) if check.ids is not None and check.mask is not None else (again, again_mask)
        record_exact = None if check.drift is None else check.drift == "none"
        if check.drift not in (None, "none"):
            check.drift = drift_cause(tokenizer, check.model_tail, check.rerendered_tail)
            if check.drift == "tool_value" and (raw := raw_tool_call_turns(tokenizer, turns, tools, row, ids,
                                                                           include_reasoning)):
                turns, record_exact = raw, True
            else:
                record_exact = False
        tokenized.append((ids, mask))
        counts = summarize_mask(ids, mask, think_end)
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
            "rerender_token_delta": rerender_token_delta(again, row, think_start, im_end),
            "prompt_ids_match": check.prompt_ids_match, "token_exact": check.ids is not None,
            "rerender_drift": check.drift, "record_exact": record_exact,
        })
        records.append(json.dumps(conversation.specforge_record(row["sample_id"], turns, tools), ensure_ascii=False))
    atomic.write_table(_tokens_table([row["sample_id"] for row in rows], summary, tokenized), tokens_path)
    atomic.write_table(pa.Table.from_pylist(summary, schema=SUMMARY), summary_path)
    atomic.write_lines(conv_path, records)
    n_tokens = sum(r["n_tokens"] for r in summary)
    seconds = time.monotonic() - started
    log.info("shard %d: tokenized %d samples, %d tokens in %.1f s (%.0f tok/s)", shard, len(tokenized), n_tokens,
             seconds, n_tokens / max(seconds, 1e-9))
    return {"shard": shard, "samples": len(tokenized), "tokens": n_tokens, "skipped": False}


def training_conversations(prompts: dict[str, dict], rows: list[dict], dialect: Dialect | None
                           ) -> list[tuple[list[dict], list[dict] | None]]:
    """(conversation, tools) of each completion row: its prompt row's turns plus the generated ones, and the tools
    as `dialect`'s server handed them to the chat template (as sent when the version is unknown)."""
    conversations = [conversation.from_rows(prompts[row["sample_id"]], row) for row in rows]
    if dialect is None:
        return conversations
    return [(turns, dialect.template_tools(tools)) for turns, tools in conversations]


class IdsCheck:
    """One sample held against the ids its server reported (`server_ids_check`)."""

    def __init__(self) -> None:
        self.prompt_ids_match: bool | None = None  # None: the server reported no prompt ids
        self.ids: np.ndarray | None = None  # the token-exact input_ids and loss_mask, when they replace the re-render
        self.mask: np.ndarray | None = None
        self.drift: str | None = None  # None: no output ids to compare; "none": the re-render is the model's ids
        self.model_tail: list[int] = []
        self.rerendered_tail: list[int] = []


def server_ids_check(ids: np.ndarray, mask: np.ndarray, row: dict, im_end: int,
                     include_reasoning: bool = True) -> IdsCheck:
    """The sample's re-rendered `ids`/`mask` against its server's ids (`server_prompt_ids`, `server_output_ids`).

    - The prompt: our `input_ids` start with the server's prompt ids, or `prompt_ids_match` is False. Only the
      prompt's last token may differ, merged in the re-render with the answer's first (an empty reasoning's "\n"
      and the prompt's `<think>\n` re-render as one "\n\n"): the same text, cut into other tokens at the boundary.
    - The last turn, where the server gave the output's ids ending with `<|im_end|>` and the prompt matched: the
      published ids are the server's prompt ids, the model's own output ids, then what the template writes after
      `<|im_end|>` (its "\n"); the mask keeps the re-render's over the prompt part and supervises every output id
      and that "\n" (SpecForge's `qwen3.5` span runs from after `<|im_start|>assistant\n<think>\n`, where the
      prompt ends, through `<|im_end|>\n`). `drift` says whether the re-render's last turn was those ids. With
      `include_reasoning` off (Param mask_reasoning) the re-render is kept: its answer-only mask is drawn on the
      re-rendered text."""
    check = IdsCheck()
    prompt, output = row.get("server_prompt_ids"), row.get("server_output_ids")
    if prompt is None:
        return check
    n, server = len(prompt), np.asarray(prompt, dtype=ids.dtype)
    exact = len(ids) > n and bool(np.array_equal(ids[:n], server))
    merged = not exact and n > 0 and len(ids) > n and bool(np.array_equal(ids[:n - 1], server[:-1]))
    check.prompt_ids_match = exact or merged
    if not check.prompt_ids_match or not output or output[-1] != im_end or not include_reasoning:
        return check  # a cut answer (no `<|im_end|>`) keeps the re-render: the template closes it
    start = n if exact else n - 1  # where the re-render's own tokens of the last turn begin
    ends = np.flatnonzero(ids == im_end)
    last = int(ends[-1]) if len(ends) else len(ids) - 1
    if last < start:
        return check
    suffix = ids[last + 1:]
    check.rerendered_tail = ids[start:last + 1].tolist()
    check.model_tail = prompt[start:] + list(output)
    check.drift = "none" if exact and check.rerendered_tail == check.model_tail else "differs"
    check.ids = np.concatenate([server, np.asarray(output, dtype=ids.dtype), suffix])
    check.mask = np.concatenate([mask[:start], np.zeros(n - start, dtype=mask.dtype),
                                 np.ones(len(output) + len(suffix), dtype=mask.dtype)])
    return check


def raw_tool_call_turns(tokenizer, turns: list[dict], tools: list[dict] | None, row: dict, ids: np.ndarray,
                        include_reasoning: bool) -> list[dict] | None:
    """The conversation with its last turn's answer as the model wrote it (tool calls as their raw text in `content`,
    no parsed `tool_calls`), when that re-renders to the published token-exact `ids`: a trainer re-rendering
    `conversations` (SpecForge's online path) then gets the model's tokens where the tool-call parser re-typed a
    value. None when it does not (whitespace the template normalizes is in it too)."""
    text = tokenizer.decode(row["server_output_ids"][:-1], skip_special_tokens=False)
    answer = text.split("</think>", 1)[1] if "</think>" in text else text
    last = {**turns[-1], "content": answer, "tool_calls": None}
    candidate = [*turns[:-1], last]
    try:
        [(again, _)] = tokenize_batch(tokenizer, [(candidate, tools)], include_reasoning=include_reasoning)
    except TokenizeError:
        return None
    return candidate if np.array_equal(again, ids) else None


DRIFT_CAUSES = ("whitespace", "tool_value", "other")


def drift_cause(tokenizer, model_ids: list[int], rerendered_ids: list[int]) -> str:
    """Why the re-rendered last turn is not the model's ids: `tool_value` when the text from the first
    `<tool_call>` on differs (the tool-call parser re-typed or re-serialized a value: `1.50` -> `1.5`,
    `{"a":1}` -> `{"a": 1}`, `True` -> `true`); else `whitespace` when the texts differ only in whitespace (around
    `</think>`, at the turn's ends, or the same text split into other tokens); else `other`."""
    model = tokenizer.decode(model_ids, skip_special_tokens=False)
    again = tokenizer.decode(rerendered_ids, skip_special_tokens=False)
    tail = "<tool_call>"
    if (tail in model or tail in again) and model[model.find(tail):] != again[again.find(tail):]:
        return "tool_value"
    if "".join(model.split()) == "".join(again.split()):
        return "whitespace"
    return "other"


def rerender_token_delta(ids: np.ndarray, row: dict, think_start: int, im_end: int) -> int | None:
    """Tokens of the last generated turn as the trainer renders it from the parsed fields, minus the tokens the
    server generated for it (`completion_tokens`, through its `<|im_end|>`): not 0 means the re-rendered text is not
    the model's own (the template normalizes whitespace around `</think>` and trims the answer; tool-call values
    come back re-serialized, e.g. `1.50` as `1.5`: tests/contract/test_sglang_contract.py). A count, not a text
    comparison: the server's text is not returned. None where no comparison holds: thinking off (the prompt held
    the empty think block), an answer cut by length (no `<|im_end|>` generated), no usage reported."""
    if not row["enable_thinking"] or row["finish_reason"] == "length" or row.get("completion_tokens") is None:
        return None
    starts, ends = np.flatnonzero(ids == think_start), np.flatnonzero(ids == im_end)
    if not len(starts) or not len(ends) or ends[-1] < starts[-1]:
        return None
    # The prompt ends with `<think>` and its "\n"; the server generated the rest through `<|im_end|>`.
    return int(ends[-1] - starts[-1] - 1) - int(row["completion_tokens"])


def _tokens_table(sample_ids: list[str], summary: list[dict], tokenized: list[tuple[np.ndarray, np.ndarray]]
                  ) -> pa.Table:
    """`schemas.TOKENIZED` rows, the id and mask lists built from the flat arrays (no Python list per token)."""
    lengths = np.array([len(ids) for ids, _ in tokenized], dtype=np.int32)
    offsets = pa.array(np.concatenate(([0], np.cumsum(lengths))).astype(np.int32))

    def column(values: list[np.ndarray], name: str, dtype: type[np.integer]) -> pa.ListArray:
        flat = np.concatenate(values) if values else np.array([], dtype=dtype)
        return pa.ListArray.from_arrays(offsets, pa.array(flat.astype(dtype, copy=False)),
                                        type=TOKENIZED.field(name).type)

    return pa.Table.from_arrays([
        pa.array(sample_ids, pa.string()), column([ids for ids, _ in tokenized], "input_ids", np.int32),
        column([mask for _, mask in tokenized], "loss_mask", np.int8), pa.array(lengths, pa.int32()),
        pa.array([r["loss_mask_sum"] for r in summary], pa.int32()),
    ], schema=TOKENIZED)


def _input_turns_after_last_user(messages: list[dict]) -> bool:
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return any(m["role"] == "assistant" for m in messages[last_user + 1:])


def tokenize_completions(cfg: RunConfig, shard: int, completions: Path | None, model_dir: Path) -> Tokenized:
    """The tokenize task: shard `shard`'s completions (at `completions`, its generate's result; None when generate
    was skipped, the store having supplied the shard) tokenized with the chat template of the model in
    `model_dir`, its tools rendered as the SGLang version that served them did. `Drained` when the run was drained
    before the shard's generation finished."""
    completions = completions or cfg.layout.merged(COMPLETIONS, shard)
    if not completions.is_file() and (request := drain_request(cfg.layout.drain_request)):
        raise Drained(f"shard {shard} is not tokenized: the run was drained by {request['by']} before its generation "
                      "finished")
    if not completions.is_file():
        raise NotRetryable(f"shard {shard} has no completions at {completions} and its generate did not run "
                           "(skipped); clear plan_shards with Downstream to plan and generate the run again")
    dialect = served_dialect(cfg, completions)
    key = reuse.inputs_key(cfg.layout.shard(shard), completions,
                           reuse.settings_key(model_dir, cfg.mask_reasoning, dialect))
    done = all(p.is_file() for p in (cfg.layout.tokenized(shard), cfg.layout.summary(shard),
                                      cfg.layout.conversations(shard)))
    if not done and (earlier := reuse.link_earlier(cfg.layout, shard, key)):
        return {"shard": shard, "samples": pq.read_metadata(cfg.layout.tokenized(shard)).num_rows, "skipped": True,
                "linked_from": earlier}
    result = tokenize_shard(cfg.layout.shard(shard), completions, cfg.layout, shard, load_tokenizer(model_dir),
                            include_reasoning=cfg.mask_reasoning, dialect=dialect)
    if not cfg.layout.tokenized_inputs(shard).is_file():
        reuse.record_key(cfg.layout, shard, key)
    return result


def served_dialect(cfg: RunConfig, completions: Path | None = None) -> Dialect | None:
    """The SGLang version the node's fleet ran (its health report): how it handed the tools to the template. A run
    whose fleet was skipped (the store supplied it) asks the runs that generated its completions."""
    path = cfg.layout.node_report("health")
    paths = [path]
    if not path.is_file() and completions is not None and completions.is_file():
        sources = set(pq.ParquetFile(completions).read(columns=["source_run"]).column("source_run").to_pylist())
        paths = [RunLayout.of(cfg.output_root, run, cfg.node).node_report("health") for run in sorted(sources) if run]
    servers = [s for p in paths if p.is_file() for s in json.loads(p.read_text())["servers"]]
    versions = sorted({s["version"] for s in servers if s.get("version")})
    if len(versions) > 1:
        raise TokenizeError(f"the fleet in {path} ran SGLang {', '.join(versions)}: one version per node renders one "
                            "tools block; relaunch the fleet with one server_command")
    if not versions:
        log.warning("no SGLang version in %s: tools are rendered as sent, which may differ from the server's "
                    "<tools> block", path)
    return Dialect(versions[0]) if versions else None
