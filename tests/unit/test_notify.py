"""The run's messages: each opens with what happened to which run, then the run's links; the API key never shows;
a progress message goes out once per mark whichever shard asks first."""

import json

from dflash_regen import notify
from dflash_regen.layout import RunLayout

LINKS = notify.run_links("http://airflow.example:8080/", "dflash_regen", "manual__2026-12-05T10:00:00+00:00")


def test_the_links_are_airflows_run_page_and_the_fleet_page_under_the_base_url():
    assert LINKS == ("http://airflow.example:8080/dags/dflash_regen/runs/manual__2026-12-05T10%3A00%3A00%2B00%3A00",
                     "http://airflow.example:8080/dflash/runs/manual__2026-12-05T10%3A00%3A00%2B00%3A00/fleet")


def test_a_gate_and_a_shard_failed_for_good_are_told_at_once_other_tasks_only_with_the_run():
    gate = notify.task_failed("r1", "health_check", "health_check", "health check failed on 1 of 2 servers\ntrace",
                              LINKS)
    assert gate.text().splitlines()[:3] == ["Run r1: gate health_check failed: health check failed on 1 of 2 servers",
                                            *LINKS]
    node_gate = notify.task_failed("r1", "b200.validate", "b200.validate", "quality gate failed", LINKS)
    assert node_gate.title == "Run r1: gate b200.validate failed: quality gate failed"
    shard = notify.task_failed("r1", "generate", "generate [shard 0003 (40 prompts)]", ValueError("boom"), LINKS)
    assert shard.title == "Run r1: generate [shard 0003 (40 prompts)] failed for good (no retries left): boom"
    assert notify.task_failed("r1", "plan_shards", "plan_shards", "bad rows", LINKS) is None


def test_the_run_failed_message_names_each_failed_task_with_its_first_error_line(tmp_path):
    layout = RunLayout(tmp_path / "run")
    notify.record_failure(layout, "generate", 3, "generate [shard 0003]", "shard 3 failed on server 1")
    notify.record_failure(layout, "health_check", -1, "health_check", "health check failed on 1 of 2 servers: "
                          "server 1\nmore")
    notify.record_failure(layout, "check_published", -1, "check_published", "nothing was published")
    notify.forget_failure(layout, "generate", 3)  # cleared, then it succeeded
    message = notify.run_failed("r1", notify.recorded_failures(layout), "task_failure", LINKS)
    lines = message.text().splitlines()
    assert lines[0] == "Run r1 failed: health_check"  # the verdict only says nothing was published: left out
    assert lines[1:3] == list(LINKS) and "health_check: health check failed on 1 of 2 servers: server 1" in lines
    marked = notify.run_failed("r2", [{"task": "check_published", "error": "nothing was published", "at": 1}],
                               "task_failure", LINKS)
    assert marked.title == "Run r2 failed: check_published"  # a run marked failed by hand: the verdict alone


def test_the_published_message_gives_path_counts_verdict_and_wall_time(tmp_path):
    version = tmp_path / "published" / "ds" / "r1"
    version.mkdir(parents=True)
    (version / "manifest.json").write_text(json.dumps({
        "counts": {"prompts": 122, "published": 119, "quarantined": 3,
                   "quarantined_by_reason": {"duplicate_id": 1, "bad_role": 2}},
        "quality": {"success": True, "statistics": {"evaluated_expectations": 12, "successful_expectations": 12}}}))
    message = notify.published("r1", version, 32 * 3600 + 5 * 60, LINKS)
    assert not message.failure
    assert message.text().splitlines() == [
        "Run r1 published 119 samples", *LINKS, "", f"Dataset: {version}",
        "Prompts 122 = published 119 + quarantined 3 (bad_role 2, duplicate_id 1)",
        "Quality gate passed: 12 of 12 expectations met", "Wall time: 32 h 05 min"]


def test_the_api_key_of_every_fleet_and_the_deployments_is_redacted(tmp_path, monkeypatch):
    layout = RunLayout(tmp_path / "run")
    for fleet in (layout.run_dir / "fleet", layout.run_dir / "autotune" / "candidate-0"):
        fleet.mkdir(parents=True)
    (layout.run_dir / "fleet" / "api_key").write_text("fleet-key-123\n")
    (layout.run_dir / "autotune" / "candidate-0" / "api_key").write_text("tune-key-456")
    monkeypatch.setenv("DFLASH_SGLANG_API_KEY", "env-key-789")
    leaky = notify.Message("Run r1: launch --api-key=fleet-key-123 failed", ("http://x/?k=env-key-789",),
                           ("argv: --api-key=tune-key-456",))
    text = notify.redacted(leaky, notify.secrets(layout)).text()
    assert "key-" not in text and text.count("***") == 3


def test_a_progress_message_is_due_once_per_mark_whoever_asks_first(tmp_path):
    layout = RunLayout(tmp_path / "run")
    start = 1_000_000.0
    assert notify.progress_due(layout, 0, start, now=start + 10 * 3600) == 0  # off
    assert notify.progress_due(layout, 4, start, now=start + 3 * 3600) == 0  # not yet
    assert notify.progress_due(layout, 4, start, now=start + 4.5 * 3600) == 1
    assert notify.progress_due(layout, 4, start, now=start + 4.6 * 3600) == 0  # another shard: already sent
    assert notify.progress_due(layout, 4, start, now=start + 9 * 3600) == 2


def test_durations_read_in_hours_and_minutes():
    assert [notify.duration(s) for s in (5, 600, 3600, 40 * 3600 + 59)] == ["1 min", "10 min", "1 h 00 min",
                                                                          "40 h 01 min"]
