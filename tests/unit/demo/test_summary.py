import json

from dflash_regen.demo.summary import task_failures


def test_a_failed_demo_lists_each_failed_task_with_the_first_line_of_its_error(tmp_path):
    attempt = tmp_path / "task_id=generate" / "map_index=2" / "attempt=1.log"
    attempt.parent.mkdir(parents=True)
    error = {"exc_type": "ShardFailed", "exc_value": "shard 2 failed on server 2 (GPU 2, 127.0.0.1:30002): the server "
                                                     "process was killed by SIGKILL; ...\nlast lines: ..."}
    lines = [{"event": "shard 2 on server 2", "level": "info"},
             {"event": "Task failed with exception", "level": "error", "error_detail": [error]}]
    attempt.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    (tmp_path / "task_id=publish").mkdir()
    (tmp_path / "task_id=publish" / "attempt=1.log").write_text(json.dumps({"event": "ok", "level": "info"}))
    assert task_failures(tmp_path) == ["generate[2] try 1: ShardFailed: shard 2 failed on server 2 (GPU 2, "
                                       "127.0.0.1:30002): the server process was killed by SIGKILL; ..."]


def test_a_demo_rerun_the_store_supplied_says_no_fleet_was_needed(tmp_path):
    from dflash_regen.demo.summary import summarize
    from dflash_regen.layout import RunLayout

    run = RunLayout.of(tmp_path, "demo__2")
    run.reports_dir.mkdir(parents=True)
    run.report("plan").write_text(json.dumps({"rows": 122, "accepted": 120, "quarantined": 2, "shards": 6,
                                              "quarantined_by_reason": {}, "reuse": {"reused": 120, "to_generate": 0}}))
    text = summarize(tmp_path, tmp_path / "logs", 0)
    assert "store    120 completions reused from earlier runs, 0 left to generate" in text
    assert "no fleet needed" in text and "stage -> launch" not in text
