"""Row rules and the real Great Expectations suite on hand-made summary tables."""

import pytest

from dflash_regen.quality import QualitySettings, apply_row_rules, row_problem, run_suite
from dflash_regen.settings.params import defaults
from dflash_regen.training.tokenize import repetition_score

S = QualitySettings.from_params(defaults())


def good(i, **changes):
    row = {"sample_id": f"s{i}", "n_tokens": 900, "mask_len": 900, "loss_mask_sum": 700, "finish_reason": "stop",
           "content_chars": 300, "reasoning_tokens": 500, "think_marker_leak": False, "tool_call_expected": False,
           "tool_call_present": False, "repetition_score": 0.01, "enable_thinking": True}
    return {**row, **changes}


@pytest.mark.parametrize(("changes", "reason"), [
    ({"loss_mask_sum": 6, "content_chars": 3}, "empty_answer_mask"),
    ({"finish_reason": "length", "content_chars": 0}, "truncated"),
    ({"content_chars": 0}, "empty_content"),
    ({"think_marker_leak": True}, "think_marker_in_content"),
    ({"reasoning_tokens": 0}, "no_reasoning"),
    ({"repetition_score": 0.9}, "degenerate_repetition"),
    ({"mask_len": 899}, "mask_length_mismatch"),
])
def test_row_rules_name_the_problem(changes, reason):
    assert row_problem(good(0, **changes), S) == reason
    assert row_problem(good(0), S) == ""


def test_a_tool_call_answer_without_content_is_kept_and_passes_the_suite(tmp_path):
    tool = good(0, content_chars=0, tool_call_expected=True, tool_call_present=True)
    assert row_problem(tool, S) == ""
    rows = [good(i) for i in range(1, 10)] + [dict(tool, sample_id=f"t{i}") for i in range(10)]
    assert run_suite(rows, expected_rows=19, s=S, docs_dir=tmp_path / "docs")["success"] is True


def test_repetition_score_separates_loops_from_prose():
    prose = " ".join(f"word{i}" for i in range(400))
    loop = "Wait, let me check the base case again. " * 60
    assert repetition_score(prose) == 0.0
    assert repetition_score(loop) > 0.9


def test_the_seeds_dataset_fails_the_suite_and_writes_data_docs(tmp_path):
    rows = [good(i) for i in range(13)] + [good(100 + i, loss_mask_sum=6, content_chars=3) for i in range(87)]
    report = run_suite(rows, expected_rows=100, s=S, docs_dir=tmp_path / "docs")
    assert report["success"] is False
    failed = {e["expectation"] for e in report["expectations"] if not e["success"]}
    assert "expect_column_values_to_be_between" in failed
    mask = next(e for e in report["expectations"] if e["kwargs"].get("column") == "loss_mask_sum")
    assert mask["success"] is False and "87 unexpected (87.00%)" in mask["observed"]
    assert (tmp_path / "docs" / "index.html").is_file()


def test_a_clean_run_passes_after_row_rules_quarantine_a_few(tmp_path):
    rows = [good(i) for i in range(200)] + [good(900, finish_reason="length", content_chars=0)]
    kept, quarantined = apply_row_rules(rows, S)
    assert quarantined == [{"sample_id": "s900", "reason": "truncated",
                            "detail": "finish_reason 'length' after 500 reasoning tokens (900 in all)"}]
    report = run_suite(rows, expected_rows=201, s=S, docs_dir=tmp_path / "docs")
    assert report["success"] is True, report["expectations"]


def test_counts_that_do_not_reconcile_fail(tmp_path):
    report = run_suite([good(i) for i in range(10)], expected_rows=11, s=S, docs_dir=tmp_path / "docs")
    count = next(e for e in report["expectations"] if e["expectation"] == "expect_table_row_count_to_equal")
    assert report["success"] is False and count["success"] is False and count["observed"] == 10


def test_duplicate_ids_fail(tmp_path):
    report = run_suite([good(1), good(1)], expected_rows=2, s=S, docs_dir=tmp_path / "docs")
    unique = next(e for e in report["expectations"] if e["expectation"] == "expect_column_values_to_be_unique")
    assert not unique["success"]


def test_missing_reasoning_counts_only_where_thinking_was_on(tmp_path):
    off = [good(i, reasoning_tokens=0, enable_thinking=False) for i in range(50)]
    on = [good(100 + i) for i in range(50)]
    assert run_suite(off + on, expected_rows=100, s=S, docs_dir=tmp_path / "a")["success"] is True
    missing = [good(200 + i, reasoning_tokens=0) for i in range(50)]
    report = run_suite(missing + on, expected_rows=100, s=S, docs_dir=tmp_path / "b")
    reasoning = next(e for e in report["expectations"] if e["kwargs"].get("column") == "reasoning_tokens")
    assert report["success"] is False and reasoning["success"] is False


def test_quarantined_rows_keep_the_measured_value_against_its_limit():
    rows = [good(1, repetition_score=0.8123), good(2, loss_mask_sum=6), good(3, mask_len=899)]
    _, quarantined = apply_row_rules(rows, S)
    assert [q["detail"] for q in quarantined] == [
        "repetition score 0.812 above Param max_repetition_score=0.5",
        "loss mask covers 6 tokens, at or below Param empty_mask_tokens=6",
        "loss_mask has 899 entries for 900 input_ids"]


def test_a_run_with_no_sample_left_fails_validation_with_the_reasons(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_regen.errors import GateFailed
    from dflash_regen.layout import FAILURES, RunLayout
    from dflash_regen.quality import validate_run

    layout = RunLayout(tmp_path)
    layout.results_dir(FAILURES).mkdir()
    pq.write_table(pa.table({"sample_id": ["a", "b"], "reason": ["http_400", "http_400"]}),
                   layout.merged(FAILURES, 0))
    with pytest.raises(GateFailed, match=r"^no samples to validate: every prompt of the run was quarantined before "
                                         r"the quality gate \(by reason: \{'http_400': 2\}"):
        validate_run(layout, 0, S, tmp_path / "docs")


def test_answers_re_rendered_other_than_generated_are_kept_marked_and_bounded(tmp_path):
    """`rerender_token_delta` (training/tokenize.py): kept and counted below Param max_rerender_drift_share, a
    failed gate above it; nulls (no comparison possible) count neither way."""
    rows = ([good(i, rerender_token_delta=0) for i in range(90)] + [good(100 + i, rerender_token_delta=None)
                                                                    for i in range(50)]
            + [good(200 + i, rerender_token_delta=1) for i in range(4)])
    assert apply_row_rules(rows, S)[1] == []  # marked, not quarantined
    report = run_suite(rows, expected_rows=len(rows), s=S, docs_dir=tmp_path / "a")
    drift = next(e for e in report["expectations"] if e["kwargs"].get("column") == "rerender_token_delta")
    assert report["success"] and drift["success"] and "4 unexpected" in drift["observed"]  # 4 of 94 compared
    rows += [good(300 + i, rerender_token_delta=-2) for i in range(4)]  # 8 of 98: above 5%
    report = run_suite(rows, expected_rows=len(rows), s=S, docs_dir=tmp_path / "b")
    drift = next(e for e in report["expectations"] if e["kwargs"].get("column") == "rerender_token_delta")
    assert not report["success"] and not drift["success"]
