"""The whole DAG on the emulated fleet, with injected faults; each case is sized to its fault (the fewest servers,
shards and prompts that show it, no calibration), and faults that cannot mask each other share one run.

Every case checks, from the files on disk: prompts = published + quarantined, no sample id twice, every
quarantined row has a reason, no process left running (fixture), and either one valid published version
or none, with the failing task's one-line reason in the log. `dag.test` runs tasks in the test process, so
cases that SIGKILL a task need a real scheduler: case 2 (shard task killed mid-shard, then cleared) is in
tests/live/test_airflow_ui.py, case 9 (node dies, same run id re-triggered) in test_scheduler_faults.py.
Case 10 (publish killed mid-way) is driven at its own level in tests/unit/test_publish.py: publishing a
test-sized run takes milliseconds, too short to kill from outside reliably. The security case (loopback only,
the key never logged) rides on the oldest-SGLang run in tests/e2e/test_dag_run.py.
"""

import json
from pathlib import Path
from urllib.parse import quote

import pytest
from conftest import tmpfs
from dag_helpers import check_invariants, layout_of, logs, states

from dflash_regen.demo.prompts import demo_rows
from dflash_regen.layout import COMPLETIONS

pytestmark = pytest.mark.usefixtures("no_leftover_servers")
# Calibration is covered by tests/integration/test_capacity_on_fleet.py and e2e; no case here needs it.
QUICK = {"calibration_prompts": 0}
# One shard, where the case is not about shards: each shard's tokenize task costs seconds (its tokenizer load).
ONE_SHARD = 1000


def test_1_and_11_a_killed_server_and_a_dead_scheduler_behind_a_live_front_are_both_failed_over(
        dag, run_params, caplog, capfd):
    # Three shards of 40 on three servers, each shard starting on its own server: server 0 is healthy; server 1's
    # scheduler dies after the 3 smoke requests (its HTTP front still answers); server 2 SIGKILLs itself after
    # the 3 smoke requests and 5 generations.
    conf = run_params(3, **QUICK, shard_size=40, stall_timeout_s=3.0,
                      emulator_faults={"1": {"dead_scheduler_after_requests": 3}, "2": {"crash_after_requests": 8}})
    dag_run = dag.test(run_conf=conf)
    assert dag_run.state == "success", states(dag_run)
    manifest = check_invariants(conf, dag_run, published=True)
    assert manifest["counts"]["published"] >= 118
    text = logs(caplog, capfd)
    assert "marked server 1 (GPU 1" in text and "marked server 2 (GPU 2" in text and "unhealthy" in text
    # Server 2 answered at most the 5 generations before its crash (how many of them finished first depends on the
    # machine's pace); its in-flight requests died with it and the shard's retry produced them on another server.
    # Server 1 answered none: every sample is published once (check_invariants) from the servers that lived.
    samples = {name.split(" (")[0]: s["samples"] for name, s in manifest["servers"].items()}
    assert samples.get("server 2", 0) <= 5 and "server 1" not in samples, samples
    assert sum(samples.values()) >= 118


def test_3_http_errors_and_hangs_still_produce_every_sample(dag, run_params):
    conf = run_params(2, **QUICK, shard_size=ONE_SHARD, stall_timeout_s=3.0, smoke_timeout_s=5.0, request_retries=6,
                      emulator_faults={"*": {"http_error_rate": 0.05, "hang_rate": 0.01}})
    dag_run = dag.test(run_conf=conf)
    assert dag_run.state == "success", states(dag_run)
    manifest = check_invariants(conf, dag_run, published=True)
    assert manifest["counts"]["quarantined_by_reason"].keys() <= {"duplicate_id", "bad_role",
                                                                  "degenerate_repetition"}


def test_4_empty_content_server_fails_smoke_and_nothing_is_generated(dag, run_params, caplog, capfd):
    conf = run_params(2, **QUICK, emulator_faults={"1": {"empty_content": True}})
    dag_run = dag.test(run_conf=conf)
    got = states(dag_run)
    assert got["smoke_test"] == "failed" and got["generate"] == "upstream_failed"
    check_invariants(conf, dag_run, published=False)
    assert "smoke test failed on 1 of 2 servers" in logs(caplog, capfd) and "server 1 (GPU 1" in logs(caplog, capfd)
    assert not layout_of(conf, dag_run).results_dir(COMPLETIONS).exists()


def test_5_low_allocation_fails_health_naming_the_server_and_still_stops_the_fleet(dag, run_params, caplog, capfd,
                                                                                   receivers):
    conf = run_params(2, **QUICK, emulator_faults={"1": {"kv_tokens": 100_000}}, **receivers.params())
    dag_run = dag.test(run_conf=conf)
    got = states(dag_run)
    assert got["launch_fleet"] == "success" and got["health_check"] == "failed"
    assert got["smoke_test"] == "upstream_failed" and got["generate"] == "upstream_failed"
    assert got["publish"] == "upstream_failed"
    assert got["stop_fleet"] == "success"  # the teardown runs although a gate failed
    assert dag_run.state == "failed"
    check_invariants(conf, dag_run, published=False)
    assert not (Path(conf["output_root"]) / "published").exists()
    assert "health check failed on 1 of 2 servers" in logs(caplog, capfd) and "server 1 (GPU 1" in logs(caplog, capfd)
    report = json.loads(layout_of(conf, dag_run).report("health").read_text())
    assert not report["passed"] and "server 1 (GPU 1" in report["error"]
    # Told by email and webhook (tests/notify_receivers.py): the gate at once (its callback), then the run (the
    # DAG's failure callback, which dag.test runs itself) naming the failed task with its first error line; each
    # opens with what happened to which run, then the run's links; the API key is in neither.
    emails = [e.split("\n", 1)[1] for e in receivers.emails()]
    assert emails == receivers.posts() and len(emails) == 2, (emails, receivers.posts())
    gate, failed = (text.splitlines() for text in emails)
    error = "GateFailed: " + report["error"].strip().splitlines()[0]  # the task error's first line, as its log ends
    assert gate[0] == f"Run {dag_run.run_id}: gate health_check failed: {error}"
    assert failed[0] == f"Run {dag_run.run_id} failed: health_check" and f"health_check: {error}" in failed
    for lines in (gate, failed):
        assert lines[1].endswith(f"/dags/dflash_regen/runs/{quote(dag_run.run_id, safe='')}")
        assert lines[2].endswith(f"/dflash/runs/{quote(dag_run.run_id, safe='')}/fleet")
    key = layout_of(conf, dag_run).fleet.api_key.read_text().strip()
    assert not any(key in m.as_string() for m in receivers.mailbox.messages) and not any(key in p for p in emails)


def test_6_and_8_malformed_rows_of_every_kind_and_a_looping_prompt_are_quarantined_with_distinct_reasons(
        dag, run_params, tmp_path):
    good = demo_rows(60)[:60]
    bad = ['{"messages": [', "", json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
           json.dumps({"messages": []}), json.dumps({"id": good[0]["id"], "messages": good[0]["messages"]}),
           json.dumps({"id": "long", "messages": [{"role": "user", "content": " ".join(map(str, range(9000)))}]}),
           json.dumps({"id": "badtool", "messages": [{"role": "user", "content": "x"}], "tools": [{"function": {}}]}),
           json.dumps({"id": "repaired", "messages": [{"role": "user", "content": "weather in Oslo?"}],
                       "tools": [{"name": "get_weather", "parameters": '{"type": "object"}'}]}),
           # reasons until max_tokens: truncated, kept out of the published set and counted
           json.dumps({"id": "looper", "messages": [{"role": "user", "content": "Count primes (loop-test)"}]})]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in good) + "\n".join(bad) + "\n")
    conf = run_params(2, **QUICK, shard_size=ONE_SHARD, prompt_source=str(source), max_bad_row_share=0.2,
                      context_length=20000, max_tokens=8192, emulator_faults={"*": {"loop_substring": "loop-test"}})
    dag_run = dag.test(run_conf=conf)
    assert dag_run.state == "success", states(dag_run)
    manifest = check_invariants(conf, dag_run, published=True)
    reasons = manifest["counts"]["quarantined_by_reason"]
    assert {"not_json", "empty", "bad_role", "duplicate_id", "too_long", "bad_tool"} <= reasons.keys()
    assert reasons["empty"] == 2  # a blank line and an empty message list
    assert reasons["truncated"] == 1
    assert manifest["counts"]["prompts"] == 69


def test_7_staging_dir_without_space_fails_before_copying(dag, run_params, tmp_path, caplog, capfd):
    with tmpfs(tmp_path / "small-shm", "size=2m", "a small tmpfs (a real full RAM disk)") as small:
        conf = run_params(2, **QUICK, staging_dir=str(small / "model"))
        dag_run = dag.test(run_conf=conf)
        got = states(dag_run)
        assert got["stage_weights"] == "failed" and got["launch_fleet"] == "upstream_failed"
        assert "not enough free space in" in logs(caplog, capfd) and "only 2.10 MB free" in logs(caplog, capfd)
        assert not any((small / "model").glob("*.safetensors"))
        check_invariants(conf, dag_run, published=False)


def test_12_too_much_looping_reasoning_fails_the_gate_and_nothing_is_published(dag, run_params, caplog, capfd):
    # A fifth of the prompts loop (case 8, one looping prompt, is in test_6_and_8).
    conf = run_params(2, **QUICK, shard_size=ONE_SHARD, max_tokens=8192,
                      emulator_faults={"*": {"loop_substring": "Summarise"}})
    dag_run = dag.test(run_conf=conf)
    got = states(dag_run)
    assert got["validate"] == "failed" and got["publish"] == "upstream_failed"
    check_invariants(conf, dag_run, published=False)
    assert "quality gate failed, nothing will be published" in logs(caplog, capfd)
    assert "expect_column_values_to_not_be_in_set finish_reason: observed" in logs(caplog, capfd)
