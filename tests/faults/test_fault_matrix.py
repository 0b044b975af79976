"""The whole DAG on the emulated fleet, one injected fault per case.

Every case checks, from the files on disk: prompts = published + quarantined, no sample id twice, every
quarantined row has a reason, no process left running (fixture), and either one valid published version
or none, with the failing task's one-line reason in the log. `dag.test` runs tasks in the test process, so
cases that SIGKILL a task need a real scheduler: case 2 (shard task killed mid-shard, then cleared) is in
tests/live/test_airflow_ui.py, case 9 (node dies, same run id re-triggered) in test_scheduler_faults.py.
Case 10 (publish killed mid-way) is driven at its own level in tests/unit/test_publish.py: publishing a
test-sized run takes milliseconds, too short to kill from outside reliably.
"""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import tmpfs
from dag_helpers import layout_of, states

from dflash_regen.demo_prompts import demo_rows
from dflash_regen.layout import COMPLETIONS

pytestmark = pytest.mark.usefixtures("no_leftover_servers")


def logs(caplog, capfd) -> str:
    """What the tasks logged: stdlib records, plus the task runner's structlog lines (failures) on stdout/err."""
    out, err = capfd.readouterr()
    capfd.seen = getattr(capfd, "seen", "") + out + err  # readouterr() consumes: keep what was read
    return caplog.text + capfd.seen


def published_versions(conf) -> list[Path]:
    root = Path(conf["output_root"]) / "published" / conf["dataset_name"]
    return sorted(root.iterdir()) if root.is_dir() else []


def check_invariants(conf, dag_run, *, published: bool) -> dict:
    run = layout_of(conf, dag_run)
    ids = [sid for p in run.merged_files(COMPLETIONS)
           for sid in pq.read_table(p, columns=["sample_id"]).column("sample_id").to_pylist()]
    assert len(ids) == len(set(ids)), "a sample was generated twice"
    quarantine = run.failure_files() + [p for p in [run.gate_quarantine] if p.is_file()]
    for path in quarantine:
        reasons = pq.read_table(path, columns=["reason"]).column("reason").to_pylist()
        assert all(reasons), f"a quarantined row in {path} has no reason"
    versions = published_versions(conf)
    assert not [v for v in versions if v.name.startswith(".")], "a half-written version is visible"
    if not published:
        assert versions == []
        return {}
    assert len(versions) == 1
    manifest = json.loads((versions[0] / "manifest.json").read_text())
    c = manifest["counts"]
    assert c["prompts"] == c["published"] + c["quarantined"]
    assert pq.read_table(versions[0] / "tokenized").num_rows == c["published"]
    key = run.fleet.api_key.read_text().strip()
    assert key not in (versions[0] / "manifest.json").read_text()
    return manifest


def test_1_server_killed_mid_shard_fails_over(dag, run_params, caplog, capfd):
    # 3 smoke requests, then 5 generations, then the server on GPU 2 SIGKILLs itself.
    conf = run_params(7, shard_size=20, emulator_faults={"2": {"crash_after_requests": 8}}, stall_timeout_s=5.0)
    dag_run = dag.test(run_conf=conf)
    assert dag_run.state == "success", states(dag_run)
    manifest = check_invariants(conf, dag_run, published=True)
    assert manifest["counts"]["published"] >= 118
    assert "marked server 2 (GPU 2" in logs(caplog, capfd) and "unhealthy" in logs(caplog, capfd)
    # Its five in-flight requests died with it; the shard's retry produced them on another server.
    assert not any(name.startswith("server 2 ") for name in manifest["servers"])


def test_3_http_errors_and_hangs_still_produce_every_sample(dag, run_params):
    conf = run_params(7, shard_size=20, stall_timeout_s=3.0, smoke_timeout_s=5.0, request_retries=6,
                      emulator_faults={"*": {"http_error_rate": 0.05, "hang_rate": 0.01}})
    dag_run = dag.test(run_conf=conf)
    assert dag_run.state == "success", states(dag_run)
    manifest = check_invariants(conf, dag_run, published=True)
    assert manifest["counts"]["quarantined_by_reason"].keys() <= {"duplicate_id", "bad_role",
                                                                  "degenerate_repetition"}


def test_4_empty_content_server_fails_smoke_and_nothing_is_generated(dag, run_params, caplog, capfd):
    conf = run_params(7, emulator_faults={"5": {"empty_content": True}})
    dag_run = dag.test(run_conf=conf)
    got = states(dag_run)
    assert got["smoke_test"] == "failed" and got["generate"] == "upstream_failed"
    check_invariants(conf, dag_run, published=False)
    assert "smoke test failed on 1 of 7 servers" in logs(caplog, capfd) and "server 5 (GPU 5" in logs(caplog, capfd)
    assert not layout_of(conf, dag_run).results_dir(COMPLETIONS).exists()


def test_6_malformed_rows_of_every_kind_are_quarantined_with_distinct_reasons(dag, run_params, tmp_path):
    good = demo_rows(60)[:60]
    bad = ['{"messages": [', "", json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
           json.dumps({"messages": []}), json.dumps({"id": good[0]["id"], "messages": good[0]["messages"]}),
           json.dumps({"id": "long", "messages": [{"role": "user", "content": " ".join(map(str, range(9000)))}]}),
           json.dumps({"id": "badtool", "messages": [{"role": "user", "content": "x"}], "tools": [{"function": {}}]}),
           json.dumps({"id": "repaired", "messages": [{"role": "user", "content": "weather in Oslo?"}],
                       "tools": [{"name": "get_weather", "parameters": '{"type": "object"}'}]})]
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in good) + "\n".join(bad) + "\n")
    conf = run_params(7, shard_size=20, prompt_source=str(source), max_bad_row_share=0.2, context_length=20000)
    dag_run = dag.test(run_conf=conf)
    assert dag_run.state == "success", states(dag_run)
    manifest = check_invariants(conf, dag_run, published=True)
    reasons = manifest["counts"]["quarantined_by_reason"]
    assert {"not_json", "empty", "bad_role", "duplicate_id", "too_long", "bad_tool"} <= reasons.keys()
    assert reasons["empty"] == 2  # a blank line and an empty message list
    assert manifest["counts"]["prompts"] == 68


def test_5_low_allocation_fails_health_naming_the_server(dag, run_params, caplog, capfd):
    conf = run_params(7, emulator_faults={"3": {"kv_tokens": 100_000}})
    dag_run = dag.test(run_conf=conf)
    assert states(dag_run)["health_check"] == "failed"
    check_invariants(conf, dag_run, published=False)
    assert "health check failed on 1 of 7 servers" in logs(caplog, capfd) and "server 3 (GPU 3" in logs(caplog, capfd)


def test_7_staging_dir_without_space_fails_before_copying(dag, run_params, tmp_path, caplog, capfd):
    with tmpfs(tmp_path / "small-shm", "size=2m", "a small tmpfs (a real full RAM disk)") as small:
        conf = run_params(7, staging_dir=str(small / "model"))
        dag_run = dag.test(run_conf=conf)
        got = states(dag_run)
        assert got["stage_weights"] == "failed" and got["launch_fleet"] == "upstream_failed"
        assert "not enough free space in" in logs(caplog, capfd) and "only 2.10 MB free" in logs(caplog, capfd)
        assert not any((small / "model").glob("*.safetensors"))
        check_invariants(conf, dag_run, published=False)


def test_8_and_12_looping_reasoning_is_truncated_quarantined_and_too_much_of_it_fails_the_gate(
        dag, run_params, tmp_path, caplog, capfd):
    # One looping prompt: kept out of the published set and counted.
    source = tmp_path / "prompts.jsonl"
    looper = {"id": "looper", "messages": [{"role": "user", "content": "Count primes (loop-test)"}]}
    rows = demo_rows(60)[:60] + [looper]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    conf = run_params(7, shard_size=20, prompt_source=str(source), max_tokens=8192,
                      emulator_faults={"*": {"loop_substring": "loop-test"}})
    dag_run = dag.test(run_conf=conf)
    assert dag_run.state == "success", states(dag_run)
    manifest = check_invariants(conf, dag_run, published=True)
    assert manifest["counts"]["quarantined_by_reason"]["truncated"] == 1

    # A fifth of the prompts loop: the gate refuses the run and nothing is published.
    conf = run_params(7, shard_size=20, max_tokens=8192, output_root=str(tmp_path / "out2"),
                      emulator_faults={"*": {"loop_substring": "Summarise"}})
    dag_run = dag.test(run_conf=conf)
    got = states(dag_run)
    assert got["validate"] == "failed" and got["publish"] == "upstream_failed"
    check_invariants(conf, dag_run, published=False)
    assert "quality gate failed, nothing will be published" in logs(caplog, capfd)
    assert "expect_column_values_to_not_be_in_set finish_reason: observed" in logs(caplog, capfd)


def test_11_dead_scheduler_behind_a_live_http_front_is_detected_and_failed_over(dag, run_params, caplog, capfd):
    conf = run_params(7, shard_size=20, stall_timeout_s=3.0,
                      emulator_faults={"1": {"dead_scheduler_after_requests": 3}})
    dag_run = dag.test(run_conf=conf)
    assert dag_run.state == "success", states(dag_run)
    check_invariants(conf, dag_run, published=True)
    assert "marked server 1 (GPU 1" in logs(caplog, capfd)


def test_security_loopback_only_key_never_logged(dag, run_params, caplog, capfd):
    conf = run_params(2, shard_size=40)
    dag_run = dag.test(run_conf=conf)
    assert dag_run.state == "success", states(dag_run)
    fleet = layout_of(conf, dag_run).fleet
    key = fleet.api_key.read_text().strip()
    assert key not in logs(caplog, capfd)
    for spec in fleet.server_specs():
        record = json.loads(spec.read_text())
        assert record["host"] == "127.0.0.1" and key not in spec.read_text()
    for log in (fleet.server_log(i) for i in range(len(fleet.server_specs()))):
        assert key not in log.read_text()
    check_invariants(conf, dag_run, published=True)
