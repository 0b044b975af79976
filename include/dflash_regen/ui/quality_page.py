"""The data-quality page's data: the gate's expectations with their thresholds, quarantines by stage, length
histograms."""

from __future__ import annotations

from pathlib import Path

from dflash_regen.layout import FAILURES, RunLayout
from dflash_regen.ui.files import read_column, read_json
from dflash_regen.ui.runs import run_state

HISTOGRAM_BINS = 40


def _g(v) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def threshold(expectation: str, kwargs: dict) -> str:
    """An expectation's rule in a few words, e.g. '>= 7 for >= 98% of rows'."""
    lo, hi = kwargs.get("min_value"), kwargs.get("max_value")
    parts = []
    if lo is not None and hi is not None:
        parts.append(f"{_g(lo)} .. {_g(hi)}")
    elif lo is not None:
        parts.append(f">= {_g(lo)}")
    elif hi is not None:
        parts.append(f"<= {_g(hi)}")
    if "value" in kwargs:
        parts.append(f"= {_g(kwargs['value'])}")
    if "value_set" in kwargs:
        values = ", ".join(_g(v) for v in kwargs["value_set"])
        parts.append(f"{'not in' if '_not_be_in_set' in expectation else 'in'} {{{values}}}")
    if "column_B" in kwargs:
        parts.append(f"= {kwargs['column_B']}")
    if "mostly" in kwargs:
        parts.append(f"for >= {kwargs['mostly']:.0%} of rows")
    condition = kwargs.get("row_condition")
    if isinstance(condition, dict) and condition.get("pass_through_filter"):
        parts.append(f"where {condition['pass_through_filter']}")
    return " ".join(parts) or "-"


def quarantine_by_stage(run: Path) -> dict[str, dict[str, int]]:
    """Quarantined rows per stage (planning, generation, quality gate) and reason."""
    layout = RunLayout(run)
    stages = {"planning": [layout.planning_quarantine],
              "generation": layout.merged_files(FAILURES),
              "quality gate": [layout.gate_quarantine]}
    out = {}
    for stage, paths in stages.items():
        counts: dict[str, int] = {}
        for reason in read_column([p for p in paths if p.is_file()], "reason"):
            counts[reason] = counts.get(reason, 0) + 1
        out[stage] = dict(sorted(counts.items(), key=lambda kv: -kv[1]))
    return out


def histogram(values: list[int], bins: int = HISTOGRAM_BINS, split_at: int | None = None) -> list[dict]:
    """Integer-aligned equal-width bins; values at or below `split_at` get a bin of their own, so the
    empty-answer spike (loss masks of <= 6 tokens) is one bar, never blended with real answers."""
    out = []
    if split_at is not None:
        low = [v for v in values if v <= split_at]
        values = [v for v in values if v > split_at]
        if low:
            out.append({"start": min(low), "end": split_at, "count": len(low)})
    if not values:
        return out
    lo, hi = min(values), max(values)
    width = max(1, -(-(hi - lo + 1) // bins))
    counts: dict[int, int] = {}
    for v in values:
        start = lo + (v - lo) // width * width
        counts[start] = counts.get(start, 0) + 1
    return out + [{"start": s, "end": s + width - 1, "count": counts.get(s, 0)} for s in range(lo, hi + 1, width)]


def quality_report(run: Path, airflow_run: dict | None = None) -> dict:
    layout = RunLayout(run)
    quality = read_json(layout.report("quality"))
    plan = read_json(layout.report("plan")) or {}
    masks = read_column(layout.summary_files(), "loss_mask_sum")
    empty_at = (quality or {}).get("settings", {}).get("empty_mask_tokens", 6)
    expectations = []
    for e in (quality or {}).get("expectations", []):
        kwargs = e.get("kwargs", {})
        expectations.append({"expectation": e["expectation"],
                             "column": kwargs.get("column") or kwargs.get("column_A") or "(table)",
                             "threshold": threshold(e["expectation"], kwargs), "observed": e.get("observed"),
                             "success": bool(e.get("success")), "error": e.get("error")})
    by_stage = quarantine_by_stage(run)
    state = run_state(run, airflow_run)
    if quality is not None:
        status = "passed" if quality.get("success") else "failed"
    elif state["state"] == "failed":
        status = "not validated: the run failed"
    elif state["state"] == "success":
        status = "not validated"
    else:
        status = "not validated yet"
    return {
        "run": run.name, "run_state": state, "status": status,
        "prompts": plan.get("rows"), "samples": (quality or {}).get("samples"), "kept": (quality or {}).get("kept"),
        "quarantined": sum(n for reasons in by_stage.values() for n in reasons.values()),
        "quarantined_by_stage": by_stage,
        "expectations": expectations, "statistics": (quality or {}).get("statistics", {}),
        "loss_mask": {"samples": len(masks), "empty_at_or_below": empty_at,
                      "empty": sum(1 for m in masks if m <= empty_at),
                      "histogram": histogram(masks, split_at=empty_at)},
        "data_docs": layout.data_docs_index.is_file(),
        "server_ids": _server_ids(quality),
    }


def _server_ids(quality: dict | None) -> dict | None:
    """The samples held against their server's token ids (quality.json; None before a run that compared any)."""
    if not quality or "prompt_ids_compared" not in quality:
        return None
    return {key: quality.get(key) for key in ("prompt_ids_compared", "prompt_ids_mismatch",
                                              "prompt_ids_mismatch_samples", "token_exact", "record_exact",
                                              "rerender_drift")}


