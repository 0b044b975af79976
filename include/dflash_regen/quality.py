"""The quality gate: row rules quarantine bad samples, then a Great Expectations suite decides publish.

Input is the per-sample summary table of the whole run (one row per tokenized sample). Row rules
(datatrove-style keep-or-reason) name each sample that must not be trained on; the dataset-level
expectations then bound the *share* of such samples, so a few bad answers are quarantined while a run like
the seed's (87% empty answers with a 6-token loss mask) fails and publishes nothing.

GX is imported inside `run_suite` (it costs ~3 s and logs 200 lines at import), never at DAG parse time.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

from dflash_regen import atomic, schemas
from dflash_regen.errors import GateFailed
from dflash_regen.layout import FAILURES, RunLayout
from dflash_regen.prompts.planning import accepted
from dflash_regen.settings.run_config import QualitySettings, RunConfig
from dflash_regen.tables import Column, text_table

log = logging.getLogger(__name__)


def row_problem(row: dict, s: QualitySettings) -> str:
    """'' to keep the sample, else the reason it must not be trained on."""
    if row["mask_len"] != row["n_tokens"]:
        return "mask_length_mismatch"
    if row.get("truncated_at_train_length"):  # cut where the trainer stops reading: its text is still good to train
        return "degenerate_repetition" if row["repetition_score"] > s.max_repetition_score else ""
    if row["finish_reason"] == "length":
        return "truncated"
    if row["loss_mask_sum"] <= s.empty_mask_tokens:
        return "empty_answer_mask"
    if row["content_chars"] == 0 and not row["tool_call_present"]:
        return "empty_content"
    if row["think_marker_leak"]:
        return "think_marker_in_content"
    if row["enable_thinking"] and row["reasoning_tokens"] == 0:
        return "no_reasoning"
    if row["tool_call_expected"] and not row["tool_call_present"] and row["content_chars"] == 0:
        return "missing_tool_call"
    if row["repetition_score"] > s.max_repetition_score:
        return "degenerate_repetition"
    return ""


def problem_detail(row: dict, reason: str, s: QualitySettings) -> str:
    """The measured value behind a row rule's reason, against its limit."""
    if reason == "mask_length_mismatch":
        return f"loss_mask has {row['mask_len']} entries for {row['n_tokens']} input_ids"
    if reason == "truncated":
        return f"finish_reason 'length' after {row['reasoning_tokens']} reasoning tokens ({row['n_tokens']} in all)"
    if reason == "empty_answer_mask":
        return (f"loss mask covers {row['loss_mask_sum']} tokens, at or below Param "
                f"empty_mask_tokens={s.empty_mask_tokens}")
    if reason == "degenerate_repetition":
        return (f"repetition score {row['repetition_score']:.3f} above Param max_repetition_score="
                f"{s.max_repetition_score:g}")
    return {"empty_content": "content has 0 characters and there is no tool call",
            "think_marker_in_content": "the answer content holds <think> or </think>",
            "no_reasoning": "thinking on, but 0 reasoning tokens",
            "missing_tool_call": "tools were offered; neither a tool call nor content came back"}[reason]


def apply_row_rules(rows: list[dict], s: QualitySettings) -> tuple[list[dict], list[dict]]:
    """(kept rows, quarantined rows with a `reason` and the measured value in `detail`)."""
    kept, quarantined = [], []
    for row in rows:
        problem = row_problem(row, s)
        if problem:
            quarantined.append({"sample_id": row["sample_id"], "reason": problem,
                                "detail": problem_detail(row, problem, s)})
        else:
            kept.append(row)
    return kept, quarantined


def expectations(s: QualitySettings, expected_rows: int):
    import great_expectations.expectations as gxe

    keep = 1.0 - s.max_bad_sample_share
    return [
        gxe.ExpectColumnValuesToNotBeNull(column="sample_id"),
        gxe.ExpectColumnValuesToBeUnique(column="sample_id"),
        gxe.ExpectTableRowCountToEqual(value=expected_rows),
        gxe.ExpectColumnPairValuesToBeEqual(column_A="n_tokens", column_B="mask_len"),
        gxe.ExpectColumnValuesToBeBetween(column="loss_mask_sum", min_value=s.empty_mask_tokens + 1, mostly=keep),
        gxe.ExpectColumnValuesToBeInSet(column="has_answer", value_set=[True], mostly=keep),
        # A cut at the training length (Param budget train_length) is no failure: counted apart in the report.
        gxe.ExpectColumnValuesToNotBeInSet(column="finish_reason", value_set=["length"],
                                           mostly=1.0 - s.max_truncated_share, condition_parser="pandas",
                                           row_condition="truncated_at_train_length==False"),
        gxe.ExpectColumnValuesToBeInSet(column="think_marker_leak", value_set=[False], mostly=keep),
        gxe.ExpectColumnValuesToBeBetween(column="repetition_score", max_value=s.max_repetition_score, mostly=keep),
        gxe.ExpectColumnValuesToBeBetween(column="n_tokens", max_value=s.train_max_length,
                                          mostly=1.0 - s.max_overlong_share),
        gxe.ExpectColumnValuesToBeBetween(column="reasoning_tokens", min_value=1, mostly=keep,
                                          condition_parser="pandas", row_condition="enable_thinking==True"),
        # The re-rendered answer is the server's own output (nulls, where no comparison holds, are not counted).
        gxe.ExpectColumnValuesToBeInSet(column="rerender_token_delta", value_set=[0],
                                        mostly=1.0 - s.max_rerender_drift_share),
        # Where the server reported ids: its prompt is ours (null: none reported), and the published record's
        # re-render (what a trainer re-rendering `conversations` gets) is the model's own ids.
        gxe.ExpectColumnValuesToBeInSet(column="prompt_ids_match", value_set=[True],
                                        mostly=1.0 - s.max_prompt_ids_mismatch_share),
        gxe.ExpectColumnValuesToBeInSet(column="record_exact", value_set=[True],
                                        mostly=1.0 - s.max_rerender_drift_share),
    ]


def run_suite(rows: list[dict], expected_rows: int, s: QualitySettings, docs_dir: Path) -> dict:
    """Validate the summary table with GX, build Data Docs in `docs_dir`; return a JSON-safe report."""
    logging.getLogger("great_expectations._docs_decorators").setLevel(logging.WARNING)
    import great_expectations as gx
    import pandas as pd
    from great_expectations.data_context.types.base import ProgressBarsConfig

    frame = pd.DataFrame(rows, columns=schemas.SUMMARY.names)
    frame["truncated_at_train_length"] = frame["truncated_at_train_length"].fillna(False).astype(bool)
    # A tool call answers; so does text cut at the training length (the trainer reads no further).
    frame["has_answer"] = (frame["content_chars"] > 0) | frame["tool_call_present"].astype(bool) \
        | frame["truncated_at_train_length"]
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    context.add_data_docs_site(site_name="quality", site_config={
        "class_name": "SiteBuilder", "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(docs_dir)}})
    batch = context.data_sources.add_pandas("run").add_dataframe_asset("summary") \
        .add_batch_definition_whole_dataframe("all")
    suite = context.suites.add(gx.ExpectationSuite(name="dflash_quality", expectations=expectations(s, expected_rows)))
    definition = context.validation_definitions.add(gx.ValidationDefinition(name="quality", data=batch, suite=suite))
    checkpoint = context.checkpoints.add(gx.Checkpoint(
        name="quality", validation_definitions=[definition], result_format={"result_format": "SUMMARY"},
        actions=[gx.checkpoint.UpdateDataDocsAction(name="docs", site_names=["quality"])]))
    result = checkpoint.run(batch_parameters={"dataframe": frame})
    validation = list(result.run_results.values())[0].to_json_dict()
    table = []
    for r in validation["results"]:
        cfg, res = r["expectation_config"], r["result"]
        kwargs = {k: v for k, v in cfg["kwargs"].items() if k not in {"batch_id"}}
        observed = res.get("observed_value")
        if observed is None and res.get("unexpected_percent") is not None:  # None: every value null (none compared)
            observed = f"{res['unexpected_count']} unexpected ({res['unexpected_percent']:.2f}%)"
        table.append({"expectation": cfg["type"], "kwargs": kwargs, "success": r["success"],
                      "observed": observed, "error": (r.get("exception_info") or {}).get("exception_message")})
    report = {"success": bool(result.success), "statistics": validation["statistics"], "expectations": table,
              "data_docs": str(docs_dir / "index.html")}
    log.info("quality gate %s:\n%s", "PASSED" if report["success"] else "FAILED", format_table(table))
    return report


TABLE_COLUMNS = (Column("result", 6), Column("expectation", 60, spec=".60"), Column("threshold", 36, spec=".36"),
                 Column("observed"))


def format_table(table: list[dict]) -> str:
    rows = []
    for row in table:
        kw = row["kwargs"]
        threshold = ", ".join(f"{k}={v}" for k, v in kw.items()
                              if k not in {"column", "column_A", "column_B", "condition_parser"})
        target = kw.get("column") or f"{kw.get('column_A', '')}=={kw.get('column_B', '')}".strip("=")
        name = row["expectation"].removeprefix("expect_") + " " + target
        rows.append(("ok" if row["success"] else "FAIL", name, threshold, row["observed"]))
    return text_table(TABLE_COLUMNS, rows, rule=120)


def quarantine_counts(quarantined: list[dict]) -> dict[str, int]:
    return dict(Counter(q["reason"] for q in quarantined))


def validate_run(layout: RunLayout, expected_rows: int, s: QualitySettings, docs_dir: Path) -> dict:
    """Row rules + suite over every shard's summary; writes `quality/quarantine.parquet`; returns the report."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [r for p in layout.summary_files() for r in pq.read_table(p).to_pylist()]
    if not rows:
        reasons = Counter(r for p in layout.failure_files()
                          for r in pq.read_table(p, columns=["reason"]).column("reason").to_pylist())
        raise GateFailed(f"no samples to validate: every prompt of the run was quarantined before the quality gate "
                         f"(by reason: {dict(reasons.most_common(5)) or 'none recorded'}; rows with the servers' "
                         f"messages in {layout.results_dir(FAILURES)}); nothing will be published. Fix the cause (e.g. "
                         "prompts longer than the servers' context length) and trigger a new run")
    kept, quarantined = apply_row_rules(rows, s)
    atomic.write_table(pa.Table.from_pylist(quarantined, schema=schemas.GATE_QUARANTINE), layout.gate_quarantine)
    report = run_suite(rows, expected_rows, s, docs_dir)
    report.update({"samples": len(rows), "kept": len(kept), "quarantined": len(quarantined),
                   # SpecForge trains these too; they come from the input, not from the model.
                   "input_assistant_turns_after_last_user": sum(bool(r.get("history_from_input")) for r in rows),
                   "quarantined_by_reason": quarantine_counts(quarantined), "settings": s.__dict__,
                   # Param budget train_length: kept, marked, and not counted as truncation failures.
                   "truncated_at_train_length": sum(bool(r.get("truncated_at_train_length")) for r in kept),
                   # Kept and marked: the trainer re-renders these other than the server generated them.
                   "rerender_differs": sum(r.get("rerender_token_delta") not in (0, None) for r in kept),
                   "rerender_compared": sum(r.get("rerender_token_delta") is not None for r in kept),
                   **server_ids_counts(rows)})
    return report


def server_ids_counts(rows: list[dict]) -> dict:
    """The samples held against their server's ids (every tokenized sample, kept or not): prompts compared and
    mismatched, last turns published token-exact, and the re-render drift by cause (`training.tokenize`)."""
    drift = Counter(r.get("rerender_drift") for r in rows if r.get("rerender_drift") is not None)
    return {"prompt_ids_compared": sum(r.get("prompt_ids_match") is not None for r in rows),
            "prompt_ids_mismatch": sum(r.get("prompt_ids_match") is False for r in rows),
            "prompt_ids_mismatch_samples": sorted(r["sample_id"] for r in rows if r.get("prompt_ids_match") is False
                                                  )[:20],
            "token_exact": sum(bool(r.get("token_exact")) for r in rows),
            # Of those, the published `conversations` record re-renders to the same ids (SpecForge's online path).
            "record_exact": sum(r.get("record_exact") is True for r in rows),
            "rerender_drift": {"compared": sum(drift.values()),
                               **{cause: drift.get(cause, 0) for cause in ("whitespace", "tool_value", "other")}}}


def gate_run(cfg: RunConfig, shards: list[dict]) -> dict:
    """The validate task: the quality gate over the run's tokenized shards (every planned shard's prompts less the
    rows generation quarantined are expected), reports/quality.json; raises `GateFailed` naming each failed
    expectation. Returns the counts publish checks the report against."""
    import pyarrow.parquet as pq

    rejected = sum(pq.read_metadata(p).num_rows for p in cfg.layout.merged_files(FAILURES))
    report = validate_run(cfg.layout, accepted(shards) - rejected, cfg.quality, cfg.layout.data_docs)
    cfg.layout.write_report("quality", report)
    if not report["success"]:
        failed = [f"{e['expectation']} {e['kwargs'].get('column', '')}: observed {e['observed']}"
                  for e in report["expectations"] if not e["success"]]
        raise GateFailed(f"quality gate failed, nothing will be published: {'; '.join(failed)}. Data Docs: "
                         f"{report['data_docs']}")
    return {"kept": report["kept"], "quarantined": report["quarantined"]}
