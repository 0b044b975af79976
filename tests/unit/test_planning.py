import json

import pyarrow.parquet as pq
import pytest

from dflash_regen.planning import PlanFailed, PlanSettings, plan_shards, shard_label

SETTINGS = PlanSettings(shard_size=3, max_tokens=1000, context_length=4096, max_bad_share=0.5)


def write_rows(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def user(text, **extra):
    return {"messages": [{"role": "user", "content": text}], **extra}


def test_shards_hold_rows_in_input_order_and_replanning_gives_the_same_shards(tmp_path):
    src = write_rows(tmp_path / "p.jsonl", [user(f"q{i}") for i in range(7)])
    plan = plan_shards(src, tmp_path / "shards", tmp_path / "q.parquet", SETTINGS)
    assert [s["prompts"] for s in plan["shards"]] == [3, 3, 1]
    assert plan["shards"][0]["label"] == "shard 0000 (3 prompts)"
    first = pq.read_table(plan["shards"][0]["path"]).to_pylist()
    assert [json.loads(r["messages"])[0]["content"] for r in first] == ["q0", "q1", "q2"]
    again = plan_shards(src, tmp_path / "shards2", tmp_path / "q2.parquet", SETTINGS)
    for a, b in zip(plan["shards"], again["shards"], strict=True):
        assert pq.read_table(a["path"]).equals(pq.read_table(b["path"]))


def test_unchanged_input_reuses_the_recorded_plan(tmp_path):
    src = write_rows(tmp_path / "p.jsonl", [user("a"), user("b")])
    plan = plan_shards(src, tmp_path / "shards", tmp_path / "q.parquet", SETTINGS)
    mtime = (tmp_path / "shards" / "shard-00000.parquet").stat().st_mtime_ns
    assert plan_shards(src, tmp_path / "shards", tmp_path / "q.parquet", SETTINGS) == plan
    assert (tmp_path / "shards" / "shard-00000.parquet").stat().st_mtime_ns == mtime


def test_bad_duplicate_and_over_long_rows_are_quarantined_and_counts_reconcile(tmp_path):
    long_text = " ".join(f"w{i}" for i in range(4000))
    rows = [user("ok", id="a"), user("dup", id="a"), "{broken", user(long_text, id="long"), user("fine")]
    src = write_rows(tmp_path / "p.jsonl", rows)
    lenient = PlanSettings(shard_size=3, max_tokens=1000, context_length=4096, max_bad_share=0.9)
    plan = plan_shards(src, tmp_path / "shards", tmp_path / "q.parquet", lenient)
    q = pq.read_table(tmp_path / "q.parquet").to_pylist()
    assert {r["reason"] for r in q} == {"duplicate_id", "not_json", "too_long"}
    assert [r["location"] for r in q] == ["p.jsonl:2", "p.jsonl:3", "p.jsonl:4"]
    assert plan["rows"] == 5 == plan["accepted"] + plan["quarantined"]
    assert "exceed context_length 4,096" in next(r["detail"] for r in q if r["reason"] == "too_long")


def test_too_many_bad_rows_fail_planning_with_the_reasons(tmp_path):
    src = write_rows(tmp_path / "p.jsonl", ["{", "{", user("ok")])
    with pytest.raises(PlanFailed, match=r"2 of 3 rows \(66.7%\) are unusable.*max_bad_row_share=50.0%"):
        plan_shards(src, tmp_path / "shards", tmp_path / "q.parquet", SETTINGS)
    assert (tmp_path / "q.parquet").is_file()  # the bad rows are kept for the user to look at


def test_label_format():
    assert shard_label(42, 1000) == "shard 0042 (1,000 prompts)"
