"""The plan_shards stage: the prompts planned into shards (prompts/planning.py), then every completion the
completion store (generate/store.py) holds for them placed into this run's checkpoints, and reports/plan.json.

A stored completion is placed as generate would have left it: a whole shard from one store file as a hard link of
that file, else one checkpoint part; a shard with nothing left to send is merged, complete as generate would
leave it."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash_regen import atomic
from dflash_regen.generate import store
from dflash_regen.generate.checkpoints import merge_parts, read_done, write_part
from dflash_regen.layout import COMPLETIONS, FAILURES, RunLayout
from dflash_regen.prompts import inputs, planning
from dflash_regen.prompts.formats import prompt_digest
from dflash_regen.schemas import COMPLETION, QUARANTINE
from dflash_regen.settings.run_config import RunConfig

log = logging.getLogger(__name__)


def plan_run(cfg: RunConfig, source: Path, model_dir: Path, max_shards: int) -> list[dict]:
    """The plan_shards task: the prompts planned into shards (at most `max_shards`), every completion the store
    holds for them placed (Param reuse), reports/plan.json. Returns the shard descriptors for the mapped tasks:
    small dicts, never the prompts themselves."""
    inputs.check_output_root(cfg.output_root)  # runs beside stage_weights: fail as clearly, not retried
    plan = planning.plan_shards(source, cfg.layout, replace(cfg.plan, max_shards=max_shards))
    shards = [dict(s) for s in plan["shards"]]
    reuse = plan_reuse(cfg, shards, model_dir)  # sets each shard's to_generate
    log.info("completion store (Param reuse = %s): %d of %d prompts reused, %d to generate%s%s", cfg.reuse,
             reuse["reused"], reuse["prompts"], reuse["to_generate"],
             f"; nothing reused: {reuse['why_none']}" if reuse.get("why_none") else "",
             f"; {reuse['problems_line']}" if reuse.get("problems_line") else "")
    cfg.layout.write_report("plan", {k: v for k, v in plan.items() if k != "shards"} | {"shards": len(shards),
                                                                                       "reuse": reuse})
    return [{**s, "run_prompts": reuse["to_generate"]} for s in shards]


def _rows_of(hits: dict[str, Path], shard: int) -> pa.Table:
    """The reused completions, read from their store files, as this run's shard rows."""
    tables = []
    by_file: dict[Path, list[str]] = {}
    for sid, path in hits.items():
        by_file.setdefault(path, []).append(sid)
    for path, ids in by_file.items():
        table = pq.read_table(path, schema=COMPLETION)
        tables.append(table.filter(pc.is_in(table.column("sample_id"), pa.array(ids, pa.string()))))
    table = pa.concat_tables(tables)
    return table.set_column(table.schema.get_field_index("shard"), "shard",
                            pa.array([shard] * table.num_rows, pa.int32()))


def _reuse_shard(layout: RunLayout, shard: dict, found: dict[str, tuple[Path, str]]) -> dict:
    """Place the store's completions of one shard into this run's checkpoints (a whole shard from one file: a hard
    link; else one part), merging the shard when nothing is left; returns its counts."""
    n = shard["shard"]
    ids = pq.read_table(shard["path"], columns=["sample_id"]).column("sample_id").to_pylist()
    merged, parts = layout.merged(COMPLETIONS, n), layout.parts(COMPLETIONS, n)
    done = read_done(parts, merged) | read_done(layout.parts(FAILURES, n), layout.merged(FAILURES, n))
    hits, other_text = {}, 0
    if any(sid in found and sid not in done for sid in ids):  # the prompts' text is read only when it can matter
        for row in pq.read_table(shard["path"], columns=["sample_id", "messages", "tools"]).to_pylist():
            sid = row["sample_id"]
            if sid in done or sid not in found:
                continue
            if found[sid][1] == prompt_digest(row["messages"], row["tools"]):
                hits[sid] = found[sid][0]
            else:
                other_text += 1
    linked = False
    if hits:
        sources = set(hits.values())
        whole = not done and len(hits) == len(ids) and len(sources) == 1
        source = next(iter(sources))
        if whole and pq.read_metadata(source).num_rows == len(ids) and \
                set(pq.read_table(source, columns=["shard"]).column("shard").to_pylist()) == {n}:
            atomic.link(source, merged)
            linked = True
        else:
            write_part(parts, _rows_of(hits, n).to_pylist(), COMPLETION)
    left = len(ids) - len(done) - len(hits)
    if hits and not left:  # nothing to send: the shard is complete as generate would leave it
        if not linked:
            merge_parts(parts, merged, COMPLETION)
        merge_parts(layout.parts(FAILURES, n), layout.merged(FAILURES, n), QUARANTINE)
    return {"reused": len(hits), "linked": linked, "done_before": len(done), "to_generate": left,
            "other_prompt_text": other_text}


def plan_reuse(cfg: RunConfig, shards: list[dict], model_dir: Path) -> dict:
    """Declare this run's fingerprint, index the store and, with Param reuse = same_settings, place every stored
    completion of this run's prompts into its checkpoints. Sets each shard's `to_generate`; returns the report
    (the plan report's `reuse`)."""
    layout, root = cfg.layout, cfg.output_root
    if cfg.reuse == "off" and not (model_dir / "config.json").is_file():  # nothing to look up; nothing to key by
        for shard in shards:
            shard["to_generate"] = shard["prompts"]
        prompts = sum(s["prompts"] for s in shards)
        return {"mode": "off", "reused": 0, "prompts": prompts, "to_generate": prompts, "problems": [],
                "why_none": f"Param reuse is off (and model dir {model_dir} is not readable here: this run's "
                            "completions are not indexed)"}
    fields, recorded = store.generation_fields(cfg, model_dir)
    print_ = store.fingerprint(fields)
    atomic.write_json(layout.generation_record, {"fingerprint": print_, "fields": fields, "recorded": recorded,
                                                 "run": cfg.run_id})
    newly = store.sync(root)
    prompts = sum(s["prompts"] for s in shards)
    report = {"mode": cfg.reuse, "fingerprint": print_, "fields": fields, "recorded": recorded, "prompts": prompts,
              "linked_into_store": newly, "problems": []}
    if cfg.reuse == "off":
        for shard in shards:
            shard["to_generate"] = shard["prompts"]
        return report | {"reused": 0, "to_generate": prompts, "why_none": "Param reuse is off"}
    found, problems = store.lookup(root, print_, fields)
    per_shard = {}
    for shard in shards:
        counts = _reuse_shard(layout, shard, found)
        shard["to_generate"] = counts["to_generate"]
        per_shard[shard["shard"]] = counts
    reused = sum(c["reused"] for c in per_shard.values())
    sources = store.by_source_run(layout)  # who made the completions this run now holds
    report |= {"reused": reused, "to_generate": sum(c["to_generate"] for c in per_shard.values()),
               "whole_shards_linked": sum(c["linked"] for c in per_shard.values()),
               "other_prompt_text": sum(c["other_prompt_text"] for c in per_shard.values()),
               "by_source_run": sources, "problems": problems}
    if problems:
        report["problems_line"] = (f"{len(problems)} store file(s) not reused, their samples generated again: "
                                   + "; ".join(f"{p['file']}: {p['problem']}" for p in problems[:3]))
    if not reused and prompts:
        report["why_none"] = store.why_nothing_reused(root, print_, fields, prompts)
    return report
