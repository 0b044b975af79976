"""Tokenized shards reused across runs: a shard with the same prompts, the same completions and the same
tokenizing settings as a shard an earlier run tokenized gets that run's files as hard links, not a second pass.

A rerun after a failed gate (one gate Param changed) reuses every completion through the completion store; without
this, its tokenize tasks would still re-render and re-tokenize every sample, the longest part of the rerun at the
seed's size (docs/benchmarks.md). The key (`tokenized/inputs-XXXXX.json`, `layout.RunLayout.tokenized_inputs`):
- the prompts' sample ids, turns and tools (not their locations: another copy of the input file still matches);
- the completions file's bytes (the store links the same file into every run that reuses it);
- the tokenizer and chat template files of the staged model, `mask_reasoning`, the SGLang version whose tools
  block is rendered, and the code that turns them into ids (a change to it re-tokenizes).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pyarrow.parquet as pq

from dflash_regen import atomic
from dflash_regen.layout import RunLayout
from dflash_regen.sglang.api import Dialect

log = logging.getLogger(__name__)

_PACKAGE = Path(__file__).resolve().parents[1]
# The code whose output the tokenized files are: a change to any of it makes every key new.
CODE = ("training/tokenize.py", "chat/template.py", "chat/conversation.py", "schemas.py")
MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _update_file(h, path: Path) -> None:
    with path.open("rb") as f:
        while chunk := f.read(16 * 1024 * 1024):
            h.update(chunk)


def settings_key(model_dir: Path, include_reasoning: bool, dialect: Dialect | None) -> str:
    h = hashlib.sha256(json.dumps({"include_reasoning": include_reasoning,
                                   "dialect": dialect.version if dialect else None}).encode())
    for name in (*MODEL_FILES, *CODE):
        path = model_dir / name if name in MODEL_FILES else _PACKAGE / name
        h.update(f"\n{name}\n".encode())
        if path.is_file():
            _update_file(h, path)
    return h.hexdigest()


def inputs_key(prompts: Path, completions: Path, settings: str) -> str:
    h = hashlib.sha256(settings.encode())
    # ParquetFile, not read_table: read_table imports pyarrow.dataset and pandas, ~2 s of a linked task's ~3
    table = pq.ParquetFile(prompts).read(columns=["sample_id", "messages", "tools"])
    for column in table.column_names:
        h.update(json.dumps(table.column(column).to_pylist(), ensure_ascii=False).encode())
    _update_file(h, completions)
    return h.hexdigest()


def _files(layout: RunLayout, shard: int) -> tuple[Path, Path, Path]:
    return layout.tokenized(shard), layout.summary(shard), layout.conversations(shard)


def link_earlier(layout: RunLayout, shard: int, key: str) -> str | None:
    """Link the tokenized files of the latest earlier run whose shard `shard` had this key; its run id, or None."""
    mine = layout.tokenized_inputs(shard)
    for record in sorted(layout.run_dir.parent.glob(f"*/{mine.relative_to(layout.run_dir)}"),
                         key=lambda p: p.stat().st_mtime, reverse=True):
        if record == mine:
            continue
        try:
            if json.loads(record.read_text()).get("key") != key:
                continue
        except (OSError, ValueError):
            continue
        earlier = RunLayout(record.parent.parent)
        sources = _files(earlier, shard)
        if not all(p.is_file() for p in sources):
            continue  # its run folder is being pruned: tokenize anew
        for source, target in zip(sources, _files(layout, shard), strict=True):
            atomic.link(source, target)
        record_key(layout, shard, key, linked_from=earlier.run_dir.name)
        log.info("shard %d: prompts, completions and tokenizing settings as run %s had them: its tokenized files "
                 "linked, not tokenized again", shard, earlier.run_dir.name)
        return earlier.run_dir.name
    return None


def record_key(layout: RunLayout, shard: int, key: str, linked_from: str | None = None) -> None:
    """Written after the shard's three tokenized files: a later run may link them."""
    atomic.write_json(layout.tokenized_inputs(shard), {"key": key, "linked_from": linked_from})
