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

import pyarrow.parquet as pq

log = logging.getLogger(__name__)

# Offline hidden-state extraction stores, per token, the target layers the drafter reads (Qwen3.6-27B
# DFlash: 5 layers of hidden size 5120, bf16). The seed found ~90 TB for its run, hence online training.
HIDDEN_SIZE, TARGET_LAYERS, BYTES_PER_VALUE = 5120, 5, 2


def hidden_state_bytes(total_tokens: int) -> int:
    return total_tokens * HIDDEN_SIZE * TARGET_LAYERS * BYTES_PER_VALUE


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
            raise ValueError(f"tokenized files hold {rows} rows but the manifest says "
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
    c, t = manifest["counts"], manifest["tokens"]
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

Files: `conversations.jsonl` (SpecForge online-training format), `tokenized/` (input_ids, loss_mask; loss
mask = the generated assistant turn incl. reasoning, SpecForge `qwen3.5` convention). Offline hidden states
for this set would need about {manifest['storage']['offline_hidden_states_tb']:.1f} TB.
"""
