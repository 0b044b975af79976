"""Publish a validated run atomically: `published/<name>/<version>/` appears complete or not at all.

Everything is written into a hidden temporary directory beside the target and renamed into place at the
end (a rename within one filesystem is atomic). A version that already exists is left alone, so a rerun
of `publish` after a crash publishes once. Contents:
- `conversations.jsonl`: SpecForge's online-training format (`{"id", "conversations": [...]}`);
- `tokenized/part-XXXXX.parquet`: `sample_id`, `input_ids` list<int32>, `loss_mask` list<int8>, `n_tokens`,
  `loss_mask_sum` (loadable with `datasets.load_dataset("parquet", data_dir=...)`);
- `manifest.json` (counts, token totals, quality summary, input fingerprint, config, storage estimate)
  and `README.md` (the dataset card).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_regen import atomic
from dflash_regen.errors import PublishRefused
from dflash_regen.layout import COMPLETIONS, FAILURES, RunLayout, shard_of

log = logging.getLogger(__name__)

# Offline hidden-state extraction stores, per token, the target layers the drafter reads: 5 for the
# Qwen3.6-27B DFlash drafter (target_layer_ids [1, 16, 31, 46, 61]), in bf16. The seed found ~90 TB for its
# run, hence online training.
TARGET_LAYERS, BYTES_PER_VALUE = 5, 2
DEFAULT_HIDDEN_SIZE = 5120


def hidden_size(model_dir: Path) -> int:
    """The model's hidden size from its config.json (Qwen3.5/3.6 keep it under text_config)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return DEFAULT_HIDDEN_SIZE
    return int((config.get("text_config") or config).get("hidden_size", DEFAULT_HIDDEN_SIZE))


def hidden_state_bytes(total_tokens: int, hidden: int = DEFAULT_HIDDEN_SIZE) -> int:
    return total_tokens * hidden * TARGET_LAYERS * BYTES_PER_VALUE


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(dest: Path, conversations: list[Path], tokenized: list[Path], manifest: dict, card: str) -> Path:
    """Copy the run's final files into `dest` atomically; returns `dest` (existing versions are kept)."""
    if dest.exists():
        log.info("%s is already published: leaving it as it is", dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir()
    try:
        with open(tmp / "conversations.jsonl", "wb") as out:
            for path in conversations:
                with open(path, "rb") as f:
                    shutil.copyfileobj(f, out)
            out.flush()
            os.fsync(out.fileno())
        (tmp / "tokenized").mkdir()
        rows = 0
        for i, path in enumerate(tokenized):
            shutil.copyfile(path, tmp / "tokenized" / f"part-{i:05d}.parquet")
            rows += pq.read_metadata(path).num_rows
        if rows != manifest["counts"]["published"]:
            raise PublishRefused(f"tokenized files hold {rows} rows but the manifest says "
                             f"{manifest['counts']['published']}: refusing to publish an inconsistent version")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
        (tmp / "README.md").write_text(card)
        _fsync_dir(tmp)
        os.rename(tmp, dest)
        _fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("published %s (%d samples)", dest, manifest["counts"]["published"])
    return dest


def clean_stale_tmp(parent: Path) -> list[Path]:
    """Remove half-written versions left by a crashed publish (they were never visible)."""
    stale = list(parent.glob(".*.tmp")) if parent.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def dataset_card(name: str, version: str, manifest: dict) -> str:
    c, t, source = manifest["counts"], manifest["tokens"], manifest.get("input", {})
    return f"""# {name} — {version}

Regenerated with {manifest['config'].get('served_model_name', 'Qwen3.6-27B')} (thinking
{'on' if manifest['config'].get('enable_thinking') else 'off'}, temperature {manifest['config'].get('temperature')},
top_p {manifest['config'].get('top_p')}, max_tokens {manifest['config'].get('max_tokens')}) by dflash-regen.

| | count |
|---|---|
| input prompts | {c['prompts']:,} |
| published samples | {c['published']:,} |
| quarantined (with reasons) | {c['quarantined']:,} |
| output tokens | {t['output']:,} |
| total tokens (prompt + output) | {t['total']:,} |

{_budget_note(manifest)}Input formats: {_counts(source.get('formats'))}. Repairs made to the input (by kind, over the
planned prompts): {_counts(source.get('repairs'))}.

Files: `conversations.jsonl` (SpecForge training format; every row has `id`, `conversations` and `tools`,
`[]` when none, and every turn `role`, `content`, `reasoning_content`, `tool_calls`, `tool_call_id`, empty
when unused), `tokenized/` (input_ids, loss_mask; loss mask = the generated assistant turn incl. reasoning,
SpecForge `qwen3.5` convention). Offline hidden states for this set would need about
{manifest['storage']['offline_hidden_states_tb']:.1f} TB.
"""


def _budget_note(manifest: dict) -> str:
    """The dataset card's line on the train-length budget (empty when the run generated to max_tokens)."""
    if manifest["config"].get("budget") != "train_length":
        return ""
    cut = manifest["counts"].get("truncated_at_train_length", 0)
    return (f"Generated with a train-length budget: each answer was cut at train_max_length "
            f"({manifest['config'].get('train_max_length'):,} tokens) minus its prompt's tokens, what the trainer "
            f"reads. {cut:,} samples end there (column `truncated_at_train_length` in the run's completions; "
            "finish_reason `length`); they are kept as training text, not counted as truncation failures.\n\n")


def _counts(counts: dict | None) -> str:
    return ", ".join(f"{kind} {n:,}" for kind, n in sorted((counts or {}).items())) or "none"


def _ids(path: Path, column: str = "sample_id") -> set[str]:
    return set(pq.read_table(path, columns=[column]).column(column).to_pylist()) if path.is_file() else set()


def _reasons(paths: list[Path]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for path in paths:
        for reason in pq.read_table(path, columns=["reason"]).column("reason").to_pylist():
            counts[reason] = counts.get(reason, 0) + 1
    return counts


def publish_run(layout: RunLayout, dest: Path, plan: dict, quality: dict, config: dict, model_dir: Path,
                nodes: dict | None = None) -> dict:
    """Filter the run's tokenized shards and conversations to the kept samples, then publish atomically."""
    import pyarrow.compute as pc

    dropped = _ids(layout.gate_quarantine)
    layout.final_dir.mkdir(parents=True, exist_ok=True)
    tokenized, conversations = [], []
    published = 0
    for path in layout.tokenized_files():
        shard = shard_of(path)
        table = pq.read_table(path)
        table = table.filter(pc.invert(pc.is_in(table.column("sample_id"), pa.array(sorted(dropped), pa.string()))))
        out = layout.final_tokenized(shard)
        atomic.write_table(table, out)
        tokenized.append(out)
        published += table.num_rows
        lines = layout.conversations(shard).read_text().splitlines()
        kept = [line for line in lines if json.loads(line)["id"] not in dropped]
        conv = layout.final_conversations(shard)
        atomic.write_lines(conv, kept)
        conversations.append(conv)

    failure_files = layout.failure_files()
    by_reason = _reasons(failure_files)
    for reason, n in quality.get("quarantined_by_reason", {}).items():
        by_reason[reason] = by_reason.get(reason, 0) + n
    quarantined = sum(by_reason.values())
    if plan["rows"] != published + quarantined:
        raise PublishRefused(f"counts do not reconcile: {plan['rows']:,} prompts but {published:,} published + "
                         f"{quarantined:,} quarantined; nothing published. Inspect {layout.results_dir(FAILURES)} and "
                             f"{layout.gate_quarantine.parent}")
    completions = pa.concat_tables([pq.read_table(p, columns=["sample_id", "server", "completion_tokens",
                                                               "latency_s"])
                                    for p in layout.merged_files(COMPLETIONS)])
    rows = completions.to_pylist()
    servers: dict[str, dict] = {}
    for r in rows:
        s = servers.setdefault(r["server"], {"samples": 0, "output_tokens": 0, "request_seconds": 0.0})
        s["samples"] += 1
        s["output_tokens"] += r["completion_tokens"] or 0
        s["request_seconds"] += r["latency_s"] or 0.0
    for s in servers.values():
        s["tok_per_s_per_request"] = round(s["output_tokens"] / s["request_seconds"], 1) if s["request_seconds"] else 0
    summary = [r for p in layout.summary_files() for r in pq.read_table(
        p, columns=["sample_id", "n_tokens", "loss_mask_sum", "reasoning_tokens", "content_tokens"]).to_pylist()
        if r["sample_id"] not in dropped]
    total_tokens = sum(r["n_tokens"] for r in summary)
    hidden = hidden_size(model_dir)
    manifest = {
        "name": dest.parent.name, "version": dest.name,
        "counts": {"prompts": plan["rows"], "published": published, "quarantined": quarantined,
                   "quarantined_by_reason": by_reason,
                   # Param budget train_length: published, cut where the trainer stops reading (not failures).
                   "truncated_at_train_length": quality.get("truncated_at_train_length", 0)},
        "tokens": {"total": total_tokens, "supervised": sum(r["loss_mask_sum"] for r in summary),
                   "supervised_reasoning": sum(r["reasoning_tokens"] for r in summary),
                   "supervised_answer": sum(r["content_tokens"] for r in summary),
                   "prompt_and_history": total_tokens - sum(r["loss_mask_sum"] for r in summary),
                   "output": sum(r["completion_tokens"] or 0 for r in rows if r["sample_id"] not in dropped)},
        "servers": servers, "quality": {k: quality[k] for k in ("success", "statistics", "expectations")},
        "input": {"source": plan["source"], "fingerprint": plan["fingerprint"], "formats": plan.get("formats", {}),
                  "repairs": plan.get("repairs", {})},
        "config": config,
        "storage": {"offline_hidden_states_tb": round(hidden_state_bytes(total_tokens, hidden) / 1e12, 3),
                    "formula": f"{total_tokens:,} tokens x hidden {hidden} x {TARGET_LAYERS} layers x "
                               f"{BYTES_PER_VALUE} bytes"},
    }
    if nodes:  # a run on several nodes: shards, prompts, predicted and measured time per node
        manifest["nodes"] = nodes
    publish(dest, conversations, tokenized, manifest, dataset_card(dest.parent.name, dest.name, manifest))
    return manifest
