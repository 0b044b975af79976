"""Publish a validated run atomically: `published/<name>/<version>/` appears complete or not at all.

The version is built in a hidden temporary directory beside the target and renamed into place at the end (a
rename within one filesystem is atomic). A tokenized shard with nothing to leave out is hard-linked in (copied
only when the run folder is on another filesystem, which the log says), so the dataset is not stored twice;
only the shards that hold samples the quality gate quarantined are rewritten. A version that already exists is
left alone, so a rerun of `publish` after a crash publishes once. Contents:
- `conversations.jsonl`: SpecForge's online-training format (`{"id", "conversations": [...], "tools"}`; `tools`
  and each turn's `tool_calls` as JSON text, see `conversation.specforge_record`);
- `tokenized/part-XXXXX.parquet`: `sample_id`, `input_ids` list<int32>, `loss_mask` list<int8>, `n_tokens`,
  `loss_mask_sum` (loadable with `datasets.load_dataset("parquet", data_dir=...)`);
- `manifest.json` (counts, token totals, quality summary, input fingerprint, config, storage estimate)
  and `README.md` (the dataset card).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_regen import atomic
from dflash_regen.errors import GateFailed, PublishRefused
from dflash_regen.generate import store
from dflash_regen.generate.shard import drain_request
from dflash_regen.layout import COMPLETIONS, FAILURES, RunLayout, shard_of
from dflash_regen.layout import manifest as manifest_file
from dflash_regen.payloads import Published, Validated, Verdict
from dflash_regen.settings import nodes
from dflash_regen.settings.run_config import RunConfig

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


@dataclass(frozen=True)
class Part:
    """One tokenized shard of the run: its parquet, its SpecForge conversations, the sample ids to leave out."""

    tokens: Path
    conversations: Path
    drop: frozenset[str] = frozenset()


def publish(dest: Path, parts: list[Part], manifest: dict, card: str) -> Path:
    """Build the version from the run's tokenized shards and rename it into `dest`; returns `dest` (existing
    versions are kept)."""
    if dest.exists():
        log.info("%s is already published: leaving it as it is", dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir()
    try:
        with open(tmp / "conversations.jsonl", "wb") as out:
            for part in parts:
                _append_conversations(out, part)
            out.flush()
            os.fsync(out.fileno())
        (tmp / "tokenized").mkdir()
        rows, how = 0, {"hard-linked": 0, "rewritten": 0, "copied": 0}
        for i, part in enumerate(parts):
            target = tmp / "tokenized" / f"part-{i:05d}.parquet"
            how[_place_tokens(part, target)] += 1
            rows += pq.read_metadata(target).num_rows
        if how["copied"]:
            log.warning("%d tokenized shards copied, not hard-linked: %s is on another filesystem than %s, so the "
                        "dataset is stored twice there", how["copied"], dest.parent, parts[0].tokens.parent)
        if rows != manifest["counts"]["published"]:
            raise PublishRefused(f"tokenized files hold {rows} rows but the manifest says "
                             f"{manifest['counts']['published']}: refusing to publish an inconsistent version")
        manifest_file(tmp).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        (tmp / "README.md").write_text(card)
        _fsync_dir(tmp)
        os.rename(tmp, dest)
        _fsync_dir(dest.parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if atomic.is_disk_full(exc):  # what the version needs beyond hard links: its conversations, rewritten shards
            needed = sum(p.conversations.stat().st_size + (p.tokens.stat().st_size if p.drop else 0) for p in parts)
            raise atomic.disk_full(dest, needed) from exc
        raise
    log.info("published %s (%d samples; tokenized shards: %s)", dest, manifest["counts"]["published"],
             ", ".join(f"{n} {k}" for k, n in how.items() if n))
    return dest


def _place_tokens(part: Part, target: Path) -> str:
    """The shard's parquet as the version's part: filtered when it holds samples to leave out, else the run's
    own file hard-linked (tokenize writes it as this would rewrite it, byte for byte), copied across filesystems."""
    if part.drop:
        import pyarrow.compute as pc

        table = pq.read_table(part.tokens)
        keep = pc.invert(pc.is_in(table.column("sample_id"), pa.array(sorted(part.drop), pa.string())))
        pq.write_table(table.filter(keep), target)
        return "rewritten"
    try:
        os.link(part.tokens, target)
        return "hard-linked"
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
    shutil.copyfile(part.tokens, target)
    return "copied"


def _append_conversations(out, part: Part) -> None:
    """The shard's conversation lines as they are, those of left-out samples dropped (only their ids are read)."""
    with open(part.conversations, "rb") as f:
        if not part.drop:
            shutil.copyfileobj(f, out)
            return
        for line in f:
            if _record_id(line) not in part.drop:
                out.write(line)


def _record_id(line: bytes) -> str:
    """A SpecForge record's id without parsing the record: `specforge_record` puts `id` first."""
    text = line.decode()
    if text.startswith('{"id": "'):
        # scanstring is the json module's own string decoder; typeshed leaves it out of json.decoder's stub.
        return json.decoder.scanstring(text, len('{"id": "'))[0]  # type: ignore[attr-defined]
    return json.loads(text)["id"]


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

{_budget_note(manifest)}{_rerender_note(manifest)}{_token_ids_note(manifest)}Input formats: \
{_counts(source.get('formats'))}. Repairs made to the input (by kind, over the planned prompts): \
{_counts(source.get('repairs'))}.

Files: `conversations.jsonl` (SpecForge training format; every row has `id`, `conversations` and `tools`,
and every turn `role`, `content`, `reasoning_content`, `tool_calls`, `tool_call_id`, empty when unused; `tools`
and `tool_calls` are JSON text, `"[]"` when none: SpecForge decodes them itself, and every reader keeps them as
written, e.g. `json.loads(row["tools"])`; `tools` as the SGLang server handed them to the chat template, so the
trainer renders the prompt the model answered), `tokenized/` (input_ids, loss_mask; loss mask = the generated
assistant turn incl. reasoning, SpecForge `qwen3.5` convention). Offline hidden states for this set would need about
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


def _rerender_note(manifest: dict) -> str:
    """The dataset card's line on samples the trainer re-renders other than the server generated them."""
    differ = manifest["counts"].get("rerender_differs", 0)
    if not differ:
        return ""
    return (f"{differ:,} samples re-render from their parsed fields to another token count than the server "
            "generated (whitespace around `</think>`, tool-call values re-serialized; the quality summary's "
            "`rerender_token_delta`): trained on, within Param max_rerender_drift_share.\n\n")


def _token_ids_note(manifest: dict) -> str:
    """The dataset card's lines on the samples held against their server's token ids (empty when none reported)."""
    ids = manifest.get("token_ids") or {}
    if not ids.get("prompt_ids_compared"):
        return ""
    drift = ids.get("rerender_drift") or {}
    differ = sum(drift.get(cause, 0) for cause in ("whitespace", "tool_value", "other"))
    return (f"Checked against the servers that answered: {ids['prompt_ids_compared']:,} samples' prompts were "
            f"compared with the server's prompt token ids, {ids.get('prompt_ids_mismatch', 0):,} differ (within Param "
            f"max_prompt_ids_mismatch_share). {ids.get('token_exact', 0):,} last assistant turns in `tokenized/` are "
            "the model's own output ids (through `<|im_end|>`, then the template's `\\n`), not a re-render. A trainer "
            f"re-rendering those turns from their parsed fields gets other ids for {differ:,} of "
            f"{drift.get('compared', 0):,}: {drift.get('whitespace', 0):,} by whitespace, "
            f"{drift.get('tool_value', 0):,} by tool-call values re-typed, {drift.get('other', 0):,} other. "
            "`conversations.jsonl` carries the raw "
            "tool-call text where a value was re-typed, so a trainer re-rendering it (SpecForge's online path) gets "
            f"the model's ids on {ids.get('record_exact', 0):,} of them; whitespace the chat template normalizes "
            "cannot be carried: train from `tokenized/` for the model's own tokens.\n\n")


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
                nodes: dict | None = None, reuse: dict | None = None) -> dict:
    """The run's tokenized shards and conversations, less the samples the quality gate quarantined, published
    atomically with their manifest and card."""
    dropped = _ids(layout.gate_quarantine)
    parts, published = [], 0
    for path in layout.tokenized_files():
        ids = pq.read_table(path, columns=["sample_id"]).column("sample_id").to_pylist()
        drop = frozenset(dropped.intersection(ids))
        parts.append(Part(path, layout.conversations(shard_of(path)), drop))
        published += len(ids) - len(drop)

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
                   "truncated_at_train_length": quality.get("truncated_at_train_length", 0),
                   # Published and marked (rerender_token_delta): the trainer re-renders these other than generated.
                   "rerender_differs": quality.get("rerender_differs", 0)},
        "tokens": {"total": total_tokens, "supervised": sum(r["loss_mask_sum"] for r in summary),
                   "supervised_reasoning": sum(r["reasoning_tokens"] for r in summary),
                   "supervised_answer": sum(r["content_tokens"] for r in summary),
                   "prompt_and_history": total_tokens - sum(r["loss_mask_sum"] for r in summary),
                   "output": sum(r["completion_tokens"] or 0 for r in rows if r["sample_id"] not in dropped)},
        # Held against the servers' own token ids (training/tokenize.py server_ids_check): prompts compared and
        # differing, last turns published token-exact, and the re-render's drift from them by cause.
        "token_ids": {k: quality[k] for k in ("prompt_ids_compared", "prompt_ids_mismatch", "token_exact",
                                              "record_exact", "rerender_drift") if k in quality},
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
    if reuse:  # the generation fingerprint and which run generated the published completions (generate/store.py)
        manifest["generation"] = reuse
    publish(dest, parts, manifest, dataset_card(dest.parent.name, dest.name, manifest))
    return manifest


def recorded_config(params: dict) -> dict:
    """The run's Params as the manifest records them: not where the run's news goes (the deployment's, and an
    Apprise URL may hold a token), nor the emulator's fault injection."""
    return {k: v for k, v in params.items() if k != "emulator_faults" and not k.startswith("notify_")}


def publish_validated(cfg: RunConfig, validated: Validated, config: dict, model_dir: Path) -> Published:
    """The publish task: the run `validate` passed (`validated`, its counts) published to `cfg.publish_dir`."""
    report = json.loads(cfg.layout.report("quality").read_text())
    # reports/quality.json is what the manifest records: re-checked on disk, so a version is published only with a
    # passing report that is the one validate handed on (a validate re-run since then fails or agrees).
    if not report["success"]:
        raise GateFailed("the quality report says the gate failed; refusing to publish")
    if (report["kept"], report["quarantined"]) != (validated["kept"], validated["quarantined"]):
        raise PublishRefused(f"{cfg.layout.report('quality')} counts {report['kept']:,} kept, "
                             f"{report['quarantined']:,} quarantined but validate passed {validated['kept']:,}, "
                             f"{validated['quarantined']:,}: refusing to publish; clear validate (with Downstream) "
                             "to check the run again")
    clean_stale_tmp(cfg.publish_dir.parent)
    plan = json.loads(cfg.layout.plan.read_text())
    manifest = publish_run(cfg.layout, cfg.publish_dir, plan, report, config, model_dir,
                           nodes=nodes.split_report(cfg.layout),  # several nodes: what each did
                           reuse=store.provenance(cfg.layout))
    return {"path": str(cfg.publish_dir), "samples": manifest["counts"]["published"],
            "quarantined": manifest["counts"]["quarantined"], "tokens": manifest["tokens"]["total"]}


def check_published(cfg: RunConfig) -> Verdict:
    """The run's verdict: a run that published nothing is failed (`PublishRefused` says why and what to clear)."""
    manifest = manifest_file(cfg.publish_dir)
    if not manifest.is_file() and (request := drain_request(cfg.layout.drain_request)):
        raise PublishRefused(f"run {cfg.run_id} was drained by {request['by']} and published nothing: its "
                             "checkpoints are kept; clear the skipped generate tasks (with Downstream), or trigger a "
                             "new run (Param reuse sends only what is left), to finish it")
    if not manifest.is_file():
        raise PublishRefused(f"run {cfg.run_id} published nothing ({manifest} is missing): the tasks that failed or "
                             "were skipped before publish say why; clear them (with Downstream) to finish the run")
    return {"path": str(cfg.publish_dir)}
