"""Shard generation against real emulator processes: exactly once, resumable, fault tolerant."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dflash_regen import schemas
from dflash_regen.demo.prompts import write_demo_prompts
from dflash_regen.errors import Drained, NoServerFree
from dflash_regen.fleet.servers import is_alive, launch_fleet, lease, load_servers
from dflash_regen.generate import checkpoints
from dflash_regen.generate import shard as generate_shard
from dflash_regen.layout import COMPLETIONS, FAILURES, shard_sources
from dflash_regen.prompts.planning import plan_shards
from dflash_regen.settings.run_config import sample_seed

CHAT = '"POST /v1/chat/completions HTTP/1.1" 200'  # a chat request in a server's access log


def plan(cfg, tmp_path, n=40, shard_size=40, rows=None):
    src = tmp_path / "prompts.jsonl"
    if rows is None:
        write_demo_prompts(src, n)
    else:
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = type(cfg.plan)(prompt_format="auto", shard_size=shard_size, sampling=cfg.plan.sampling,
                              context_length=cfg.plan.context_length, max_bad_row_share=1.0)
    return plan_shards(src, cfg.layout, settings)


def run_shard(cfg, key, descriptor, **settings):
    servers = load_servers(cfg.fleet_dir)
    paths = generate_shard.ShardPaths.of(cfg.layout, descriptor["shard"], Path(descriptor["path"]))
    gen_settings = cfg.generation.__class__(**{**cfg.generation.__dict__, **settings})
    with lease(cfg.fleet_dir, servers, descriptor["shard"], wait_s=5) as server:
        return generate_shard.generate_shard(paths, server, key, gen_settings, fleet_dir=cfg.fleet_dir), server


def wait_dead(server, timeout_s=30):
    """Until a SIGKILLed server is gone (a busy machine may take a moment to end it)."""
    deadline = time.monotonic() + timeout_s
    while is_alive(server):
        assert time.monotonic() < deadline, f"{server.name} still alive {timeout_s} s after SIGKILL"
        time.sleep(0.02)


def ids_of(path):
    return pq.read_table(path, columns=["sample_id"]).column("sample_id").to_pylist()


def test_a_shard_completes_once_with_the_generation_mode_recorded(launch, tmp_path):
    cfg, servers, key = launch(num_servers=1)
    shard = plan(cfg, tmp_path)["shards"][0]
    result, _ = run_shard(cfg, key, shard)
    rows = pq.read_table(result["path"]).to_pylist()
    assert sorted(r["sample_id"] for r in rows) == sorted(ids_of(shard["path"]))
    assert result["completed"] == 40 and result["quarantined"] == 0
    assert pq.read_schema(result["path"]) == schemas.COMPLETION
    assert pq.read_schema(cfg.layout.merged(FAILURES, 0)) == schemas.QUARANTINE  # empty, with its schema
    row = rows[0]
    assert row["enable_thinking"] and row["reasoning_parser"] == "qwen3" and row["served_model"] == "qwen3.6-27b"
    assert row["temperature"] == pytest.approx(0.6) and row["seed"] == sample_seed(row["sample_id"], 0)
    assert all(r["reasoning_content"] and r["finish_reason"] in {"stop", "tool_calls"} for r in rows)
    assert any(r["tool_calls"] for r in rows)  # the demo set has tool prompts
    again, _ = run_shard(cfg, key, shard)
    assert again["generated_now"] == 0 and again["completed"] == 40  # a finished shard is not redone


@pytest.mark.parametrize("version", ["0.5.16", "0.5.23"])
def test_the_servers_token_ids_are_kept_where_the_version_streams_them(launch, tmp_path, version):
    """0.5.20+ streams the prompt's and the output's ids (sglext); 0.5.13-0.5.19 refuse them with `stream`, so the
    streaming generate asks nothing there and the columns stay null."""
    from conftest import FAST_PROFILE

    from dflash_regen.emulator import model as emulated

    cfg, _, key = launch(num_servers=1, emulator_profile={**FAST_PROFILE, "sglang_version": version})
    shard = plan(cfg, tmp_path, n=8, shard_size=8)["shards"][0]
    result, _ = run_shard(cfg, key, shard)
    rows = pq.read_table(result["path"]).to_pylist()
    if version == "0.5.16":
        assert all(r["server_prompt_ids"] is None and r["server_output_ids"] is None for r in rows)
        return
    for r in rows:
        assert len(r["server_prompt_ids"]) == r["prompt_tokens"]
        out = r["server_output_ids"]
        assert len(out) == r["completion_tokens"] and out[-1] == emulated.IM_END  # `<|im_end|>` counted
        assert emulated.decode(out).startswith(r["reasoning_content"].strip()[:40])


def test_on_0_5_23_the_published_last_turns_are_the_models_ids_and_a_wrong_prompt_fails_the_gate(launch, tmp_path):
    """Generate on 0.5.23 with the emulator's wrong_prompt_ids_substring fault on one prompt, tokenize (the real
    stage) and validate: every other sample's prompt is the server's and its last turn the emulator's own ids; the
    sabotaged one is caught by name and fails the gate at Param max_prompt_ids_mismatch_share 0."""
    from conftest import FAST_PROFILE

    from dflash_regen import quality
    from dflash_regen.chat.template import load_tokenizer
    from dflash_regen.demo.model import default_tokenizer_cache, write_demo_model
    from dflash_regen.emulator import model as emulated
    from dflash_regen.settings.params import defaults
    from dflash_regen.sglang.api import Dialect
    from dflash_regen.training.tokenize import tokenize_shard

    cfg, _, key = launch(num_servers=1, emulator_profile={**FAST_PROFILE, "sglang_version": "0.5.23"},
                         emulator_faults={"*": {"wrong_prompt_ids_substring": "square root of 2"}})
    shard = plan(cfg, tmp_path, n=16, shard_size=16)["shards"][0]
    result, _ = run_shard(cfg, key, shard)
    tok = load_tokenizer(write_demo_model(tmp_path / "tok", shards=1, shard_bytes=1024, with_tokenizer=True,
                                          tokenizer_cache=default_tokenizer_cache()))
    tokenize_shard(Path(shard["path"]), Path(result["path"]), cfg.layout, 0, tok, include_reasoning=True,
                   dialect=Dialect("0.5.23"))
    rows = {r["sample_id"]: r for r in pq.read_table(result["path"]).to_pylist()}
    tokens = {r["sample_id"]: r for r in pq.read_table(cfg.layout.tokenized(0)).to_pylist()}
    summary = {r["sample_id"]: r for r in pq.read_table(cfg.layout.summary(0)).to_pylist()}
    prompts = {r["sample_id"]: r for r in pq.read_table(shard["path"]).to_pylist()}
    sabotaged = {sid for sid, p in prompts.items()  # the fault reads the last user message, as the poison does
                 if "square root of 2" in emulated.last_user_text(json.loads(p["messages"]))}
    assert sabotaged and len(sabotaged) < len(rows)
    assert {sid for sid, s in summary.items() if s["prompt_ids_match"] is False} == sabotaged
    newline = tok.backend_tokenizer.encode("\n", add_special_tokens=False).ids
    for sid in set(rows) - sabotaged:
        row, ids = rows[sid], tokens[sid]["input_ids"]
        assert summary[sid]["prompt_ids_match"] and summary[sid]["token_exact"], sid
        assert ids == row["server_prompt_ids"] + row["server_output_ids"] + newline, sid
        assert summary[sid]["rerender_drift"] == "none", sid  # the emulator writes the template's own form
    report = quality.validate_run(cfg.layout, len(rows), quality.QualitySettings.from_params(defaults()),
                                  cfg.layout.data_docs)
    check = next(e for e in report["expectations"] if e["kwargs"].get("column") == "prompt_ids_match")
    assert not report["success"] and not check["success"]
    assert report["prompt_ids_mismatch"] == len(sabotaged) and report["prompt_ids_compared"] == len(rows)
    assert sorted(sabotaged) == report["prompt_ids_mismatch_samples"]
    assert report["token_exact"] == len(rows) - len(sabotaged)


def test_leases_are_exclusive_and_a_dead_server_is_not_leased(launch):
    cfg, servers, _ = launch(num_servers=2)
    with ExitStack() as first_hold, ExitStack() as second_hold:
        first = first_hold.enter_context(lease(cfg.fleet_dir, servers, 0, wait_s=1))
        second = second_hold.enter_context(lease(cfg.fleet_dir, servers, 0, wait_s=1))
        assert first.index != second.index
        with pytest.raises(NoServerFree, match="stayed leased"):
            with lease(cfg.fleet_dir, servers, 0, wait_s=0.5):
                pass
        first_hold.close()
        os.kill(second.pid, signal.SIGKILL)
        second_hold.close()
    wait_dead(second)
    with lease(cfg.fleet_dir, servers, 0, wait_s=1) as server:
        assert server.index == first.index


def test_a_lease_is_released_when_its_block_raises(launch):
    cfg, servers, _ = launch(num_servers=1)
    with pytest.raises(RuntimeError, match="the shard failed"):
        with lease(cfg.fleet_dir, servers, 0, wait_s=1):
            raise RuntimeError("the shard failed")
    with lease(cfg.fleet_dir, servers, 0, wait_s=0.3) as server:  # free again at once, not after a wait
        assert server.index == servers[0].index


def test_a_dead_server_is_never_leased_whichever_server_a_shard_prefers(launch):
    cfg, servers, _ = launch(num_servers=2)
    dead, live = servers
    os.kill(dead.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while is_alive(dead) and time.monotonic() < deadline:
        time.sleep(0.05)
    for shard in range(4):  # every preference order, whatever it is, has the dead server first for some shard
        with lease(cfg.fleet_dir, servers, shard, wait_s=1) as server:
            assert server.index == live.index, f"shard {shard} leased the dead {server.name}"
            with pytest.raises(NoServerFree):  # the live one is taken: the dead one is no fallback
                with lease(cfg.fleet_dir, servers, shard, wait_s=0.3):
                    pass


def test_server_killed_mid_shard_fails_over_with_nothing_lost_or_duplicated(launch, tmp_path):
    cfg, servers, key = launch(num_servers=2, emulator_profile={"decode_tokens_per_s": 4000, "startup_s": 0.1})
    shard = plan(cfg, tmp_path, n=60, shard_size=60)["shards"][0]
    parts = cfg.layout.parts(COMPLETIONS, 0)

    def kill_server_0_once_results_are_checkpointed():  # shard 0 leases server 0 first
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list(parts.glob("part-*.parquet")):
            time.sleep(0.05)
        os.kill(servers[0].pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_server_0_once_results_are_checkpointed)
    killer.start()
    with pytest.raises(generate_shard.ShardFailed) as failure:
        run_shard(cfg, key, shard, checkpoint_every=5, stall_timeout_s=5, request_retries=1)
    killer.join()
    assert cfg.layout.fleet.unhealthy(0).exists() and not is_alive(servers[0])
    before = checkpoints.read_done(parts, cfg.layout.merged(COMPLETIONS, 0))
    assert 0 < len(before) < 60
    # The first line says what happened to which server and what the retry will do; the log tail follows.
    first, *rest = str(failure.value).splitlines()
    assert first == (f"shard 0 failed on {servers[0].name}: the server process was killed by SIGKILL; "
                     f"{len(before)} of 60 samples are kept, a retry or a clear of this shard sends only the "
                     f"other {60 - len(before)}, to another server"), first
    assert f"last lines of {servers[0].log_path}:" in rest
    assert failure.value.__cause__ is None and failure.value.__suppress_context__
    result, server = run_shard(cfg, key, shard)  # the retry leases the other server
    assert server.index == 1
    assert result["generated_now"] == 60 - len(before)
    got = ids_of(result["path"])
    assert sorted(got) == sorted(ids_of(shard["path"])) and len(got) == len(set(got))


def test_a_shard_that_failed_on_a_server_prefers_another_one_after_a_relaunch(launch, tmp_path, caplog):
    cfg, servers, _ = launch(num_servers=2)
    generate_shard.record_failure(cfg.fleet_dir, 0, servers[0], "the server process was killed by SIGKILL")
    relaunched = launch_fleet(cfg.fleet, tmp_path / "model", cfg.fleet_dir)  # as a clear does
    assert not cfg.layout.fleet.unhealthy_markers()  # a fresh fleet: every server healthy again
    avoid = generate_shard.servers_failed_on(cfg.fleet_dir, 0)
    assert avoid == {0: "the server process was killed by SIGKILL"}
    with ExitStack() as hold:
        with caplog.at_level("WARNING", logger="dflash_regen.fleet"):
            server = hold.enter_context(lease(cfg.fleet_dir, relaunched, 0, wait_s=1, avoid=avoid))  # 0 -> 0
        assert server.index == 1
        assert ("shard 0 failed on server 0 before (the server process was killed by SIGKILL); leased "
                f"{relaunched[1].name} instead") in caplog.text
        # While the other server is busy, the shard waits for it rather than go back to server 0 ...
        with pytest.raises(NoServerFree):
            with lease(cfg.fleet_dir, relaunched, 0, wait_s=0.5, avoid=avoid):
                pass
    # ... unless server 0 is the only healthy one left.
    os.kill(relaunched[1].pid, signal.SIGKILL)
    wait_dead(relaunched[1])
    with lease(cfg.fleet_dir, relaunched, 0, wait_s=1, avoid=avoid) as again:
        assert again.index == 0


def test_shard_process_killed_while_checkpointing_resumes_from_its_parts(launch, tmp_path):
    cfg, servers, key = launch(num_servers=1, emulator_profile={"decode_tokens_per_s": 3000, "startup_s": 0.1})
    shard = plan(cfg, tmp_path, n=60, shard_size=60)["shards"][0]
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"params": launch.params, "shard": shard, "key": key}))
    script = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from dflash_regen.settings.run_config import RunConfig
from test_generation import run_shard
job = json.load(open({str(job)!r}))
run_shard(RunConfig.from_params(job["params"], "test_run"), job["key"], job["shard"], checkpoint_every=3)
"""
    proc = subprocess.Popen([sys.executable, "-c", script])
    parts = cfg.layout.parts(COMPLETIONS, 0)
    deadline = time.monotonic() + 60
    while len(list(parts.glob("part-*.parquet"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the shard process ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert not cfg.layout.merged(COMPLETIONS, 0).exists()
    done_before = checkpoints.read_done(parts, cfg.layout.merged(COMPLETIONS, 0))
    assert len(done_before) >= 9
    result, _ = run_shard(cfg, key, shard)
    got = ids_of(result["path"])
    assert result["generated_now"] == 60 - len(done_before)
    assert sorted(got) == sorted(ids_of(shard["path"])) and len(got) == len(set(got))
    assert not list(parts.glob("*.parquet")) and not list(parts.glob(".*tmp"))


def test_errors_and_hangs_are_retried_until_every_sample_is_produced(launch, tmp_path):
    cfg, _, key = launch(num_servers=1, emulator_faults={"*": {"http_error_rate": 0.05, "hang_rate": 0.02}})
    shard = plan(cfg, tmp_path, n=100, shard_size=100)["shards"][0]
    result, _ = run_shard(cfg, key, shard, stall_timeout_s=2.0, request_retries=6)
    assert result["completed"] == 100 and result["quarantined"] == 0
    rows = pq.read_table(result["path"], columns=["attempt"]).column("attempt").to_pylist()
    assert max(rows) >= 2  # some requests really were retried


def test_prompts_the_server_rejects_are_quarantined_with_its_message(launch, tmp_path):
    cfg, _, key = launch(num_servers=1, emulator_faults={"*": {"error_substring": "REJECT", "error_status": 400}})
    rows = [{"id": "short", "messages": [{"role": "user", "content": "hi"}]},
            {"id": "bad", "messages": [{"role": "user", "content": "REJECT me"}]}]
    shard = plan(cfg, tmp_path, rows=rows)["shards"][0]
    result, _ = run_shard(cfg, key, shard, max_generate_error_share=0.5)
    assert result["completed"] == 1 and result["quarantined"] == 1
    failure = pq.read_table(cfg.layout.merged(FAILURES, 0)).to_pylist()[0]
    assert failure["sample_id"] == "bad" and failure["reason"] == "http_400"
    assert "HTTP 400: Failed to apply the chat template" in failure["detail"]


def test_prompts_longer_than_the_servers_own_context_are_quarantined_before_sending(launch, tmp_path):
    # Planning checked Param context_length (262,144); the server was launched with 20,000.
    cfg, servers, key = launch(num_servers=1, server_flags="--context-length 20000", max_tokens=16384)
    long = " ".join(f"word{i}" for i in range(6000))
    rows = [{"id": "short", "messages": [{"role": "user", "content": "hi"}]},
            {"id": "long", "messages": [{"role": "user", "content": long}]}]
    shard = plan(cfg, tmp_path, rows=rows)["shards"][0]
    result, _ = run_shard(cfg, key, shard, max_generate_error_share=0.5)
    assert result["completed"] == 1 and result["quarantined"] == 1
    failure = pq.read_table(cfg.layout.merged(FAILURES, 0)).to_pylist()[0]
    assert failure["sample_id"] == "long" and failure["reason"] == "too_long"
    assert f"+ max_tokens 16,384 exceed the context length 20,000 of {servers[0].name}; not sent. Set Param " \
           "context_length to 20,000" in failure["detail"]


def test_truncated_and_empty_answers_are_recorded_not_dropped_and_may_be_retried_once(launch, tmp_path):
    cfg, _, key = launch(num_servers=1, max_tokens=512)
    rows = [{"id": "prime", "messages": [{"role": "user",
                                          "content": "Write a Python function to check if a number is prime."}]}]
    shard = plan(cfg, tmp_path, rows=rows)["shards"][0]
    result, _ = run_shard(cfg, key, shard)
    row = pq.read_table(result["path"]).to_pylist()[0]
    assert (row["finish_reason"], row["empty_content"], row["content"]) == ("length", True, None)
    assert row["completion_tokens"] == row["reasoning_tokens"] == 512
    retried, _ = run_shard(cfg, key, {**shard, "shard": 1}, retry_truncated=True)
    row = pq.read_table(retried["path"]).to_pylist()[0]
    assert row["max_tokens"] == 1024 and row["attempt"] >= 2


def test_regenerate_history_replaces_earlier_assistant_turns_with_the_models_own(launch, tmp_path):
    cfg, _, key = launch(num_servers=1)
    rows = [{"id": "mt", "messages": [{"role": "user", "content": "What is 2+2?"},
                                      {"role": "assistant", "content": "ORIGINAL ANSWER"},
                                      {"role": "user", "content": "And 3+3?"}]}]
    shard = plan(cfg, tmp_path, rows=rows)["shards"][0]
    plain, _ = run_shard(cfg, key, shard)
    assert len(json.loads(pq.read_table(plain["path"]).to_pylist()[0]["assistant_turns"])) == 1
    regen, _ = run_shard(cfg, key, {**shard, "shard": 1}, regenerate_history=True)
    turns = json.loads(pq.read_table(regen["path"]).to_pylist()[0]["assistant_turns"])
    assert len(turns) == 2 and all(t["reasoning_content"] and t["content"] for t in turns)
    assert turns[0]["content"] != "ORIGINAL ANSWER"


SHARD_PROCESS = """
import json, os, signal, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from dflash_regen.settings.run_config import RunConfig
from test_generation import run_shard
job = json.load(open({job!r}))
if job.get("die_on_part_unlink"):  # SIGKILL between the merged file's rename and the parts' removal
    for name in ("unlink", "remove"):
        real = getattr(os, name)
        def die(path, *a, _real=real, **k):
            if Path(path).name.startswith("part-"):
                os.kill(os.getpid(), signal.SIGKILL)
            return _real(path, *a, **k)
        setattr(os, name, die)
Path(job["ready"]).touch()
while not Path(job["go"]).exists():  # start together with the other shard process, if any
    time.sleep(0.01)
result, server = run_shard(RunConfig.from_params(job["params"], "test_run"), job["key"], job["shard"])
print(json.dumps({{"generated_now": result["generated_now"], "server": server.index}}))
"""


def start_shard_process(params, key, shard, tmp_path, name, **job):
    job_file = tmp_path / f"{name}.json"
    job_file.write_text(json.dumps({"params": params, "shard": shard, "key": key, "go": str(tmp_path / "go"),
                                    "ready": str(tmp_path / f"{name}.ready"), **job}))
    script = SHARD_PROCESS.format(tests=str(Path(__file__).parent), job=str(job_file))
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)


def start_together(tmp_path, procs, names):
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"{n}.ready").exists() for n in names) and time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a shard process ended before the start"
        time.sleep(0.02)
    (tmp_path / "go").touch()


def test_two_shard_processes_racing_on_one_shard_leave_each_sample_once(launch, tmp_path):
    # Airflow can run one shard twice at once (a zombie task and its retry): each leases its own server and
    # sends every sample, so the checkpoint parts really hold each sample twice.
    cfg, _, key = launch(num_servers=2)
    shard = plan(cfg, tmp_path, n=24, shard_size=24)["shards"][0]
    procs = [start_shard_process(launch.params, key, shard, tmp_path, name) for name in ("a", "b")]
    start_together(tmp_path, procs, ["a", "b"])
    outs = [json.loads(p.communicate(timeout=120)[0].splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert {o["server"] for o in outs} == {0, 1}
    assert sum(o["generated_now"] for o in outs) > 24, "the race produced no duplicate work"
    got = ids_of(cfg.layout.merged(COMPLETIONS, 0))
    assert sorted(got) == sorted(ids_of(shard["path"])) and len(got) == len(set(got))


def test_a_kill_between_merge_and_unlink_leaves_duplicates_the_retry_removes(launch, tmp_path):
    cfg, _, key = launch(num_servers=1)
    shard = plan(cfg, tmp_path, n=12, shard_size=12)["shards"][0]
    proc = start_shard_process(launch.params, key, shard, tmp_path, "a", die_on_part_unlink=True)
    start_together(tmp_path, [proc], ["a"])
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    on_disk = [i for p in shard_sources(cfg.layout.merged(COMPLETIONS, 0), cfg.layout.parts(COMPLETIONS, 0))
               for i in ids_of(p)]
    assert len(on_disk) == 24  # every sample twice: in the merged file and still in its parts
    result, _ = run_shard(cfg, key, shard)
    got = ids_of(result["path"])
    assert result["generated_now"] == 0
    assert sorted(got) == sorted(ids_of(shard["path"])) and len(got) == len(set(got)) == 12


POISON_ROWS = [{"id": f"ok{i}", "messages": [{"role": "user", "content": f"Tell me about topic {i}."}]}
               for i in range(5)] + [{"id": "poison", "messages": [{"role": "user", "content": "Call {tool} POISON"}]}]


def test_a_prompt_two_servers_fail_is_quarantined_and_the_shard_goes_on(launch, tmp_path):
    cfg, servers, key = launch(num_servers=2, emulator_faults={"*": {"error_substring": "POISON"}})
    shard = plan(cfg, tmp_path, rows=POISON_ROWS)["shards"][0]
    result, server = run_shard(cfg, key, shard, request_retries=1, max_generate_error_share=0.5)
    assert result["completed"] == 5 and result["quarantined"] == 1
    (failure,) = pq.read_table(cfg.layout.merged(FAILURES, 0)).to_pylist()
    assert failure["sample_id"] == "poison" and failure["reason"] == "http_500" and failure["stage"] == "generate"
    assert all(s.name in failure["detail"] for s in servers)
    assert "Failed to apply the chat template" in failure["detail"]
    assert not cfg.layout.fleet.unhealthy_markers()  # both answer every other prompt: neither is unhealthy
    # Above the Param's share the shard fails at once, naming the Param and a refused sample.
    with pytest.raises(generate_shard.TooManyPromptErrors, match=r"refused 1 of 6 prompts \(16.7%\), above Param "
                                                             r"max_generate_error_share=10.0%; e.g. poison: http_500"):
        run_shard(cfg, key, shard, max_generate_error_share=0.1)


def test_a_prompt_only_one_server_fails_is_answered_by_the_other(launch, tmp_path):
    cfg, servers, key = launch(num_servers=2, emulator_faults={"0": {"error_substring": "POISON"}})
    shard = plan(cfg, tmp_path, rows=POISON_ROWS)["shards"][0]  # shard 0 leases server 0 first
    result, server = run_shard(cfg, key, shard, request_retries=1)
    assert server.index == 0 and result["completed"] == 6 and result["quarantined"] == 0
    rows = {r["sample_id"]: r["server"] for r in pq.read_table(result["path"]).to_pylist()}
    assert rows["poison"] == servers[1].name and rows["ok0"] == servers[0].name


def test_a_cluster_of_poison_prompts_leaves_a_healthy_server_healthy(launch, tmp_path):
    """Twelve poison prompts fill every slot three times over, with no success between: 36 failed requests in a
    row, far past the failure limit (8 at 4 in flight). The server answers its probes, so it stays healthy: the
    prompts are quarantined and the shard completes on it."""
    cfg, servers, key = launch(num_servers=2, emulator_faults={"*": {"error_substring": "POISON"}})
    rows = [{"id": f"poison{i}", "messages": [{"role": "user", "content": f"Call {{tool}} POISON {i}"}]}
            for i in range(12)] + POISON_ROWS[:5]
    shard = plan(cfg, tmp_path, rows=rows)["shards"][0]
    result, server = run_shard(cfg, key, shard, concurrency_per_server=4, request_retries=2,
                               max_generate_error_share=0.8)
    assert server.index == 0 and result["completed"] == 5 and result["quarantined"] == 12
    reasons = {r["sample_id"]: r["reason"] for r in pq.read_table(cfg.layout.merged(FAILURES, 0)).to_pylist()}
    assert reasons == {f"poison{i}": "http_500" for i in range(12)}
    assert not cfg.layout.fleet.unhealthy_markers()


def test_a_wrong_api_key_fails_the_shard_at_once_naming_the_setting(launch, tmp_path):
    cfg, servers, _ = launch(num_servers=1)
    shard = plan(cfg, tmp_path, n=6, shard_size=6)["shards"][0]
    with pytest.raises(generate_shard.AuthError, match="refused the API key with HTTP 401.*DFLASH_SGLANG_API_KEY"):
        run_shard(cfg, "not-the-key", shard)
    # Not retried: the server saw each refused request once (6 prompts and the slots query), not once per retry.
    refused = Path(servers[0].log_path).read_text().count('HTTP/1.1" 401')
    assert 1 <= refused <= 7, refused
    assert not cfg.layout.parts(FAILURES, 0).exists()  # nothing quarantined


def test_a_drain_lets_the_requests_in_flight_finish_keeps_them_and_sends_nothing_more(launch, tmp_path):
    """The operator drains the run: the shard's requests in flight are answered and checkpointed, no new one is
    sent, a shard not started leases no server, and a resume sends exactly the rest."""
    cfg, servers, key = launch(num_servers=1, emulator_profile={"decode_tokens_per_s": 600, "startup_s": 0.1})
    shard = plan(cfg, tmp_path, n=60, shard_size=60)["shards"][0]
    parts = cfg.layout.parts(COMPLETIONS, 0)

    def drain_once_results_are_checkpointed():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list(parts.glob("part-*.parquet")):
            time.sleep(0.02)
        generate_shard.request_drain(cfg.layout, "alice")

    drainer = threading.Thread(target=drain_once_results_are_checkpointed)
    drainer.start()
    with pytest.raises(Drained) as drained:
        run_shard(cfg, key, shard, checkpoint_every=2, concurrency_per_server=4)
    drainer.join()
    kept = checkpoints.read_done(parts, cfg.layout.merged(COMPLETIONS, 0))
    sent = Path(servers[0].log_path).read_text().count(CHAT)
    assert 0 < len(kept) < 60
    assert sent == len(kept)  # every request sent was answered and kept; none was sent after the drain's answers
    first = str(drained.value).splitlines()[0]
    assert first.startswith("shard 0 drained (asked by alice at ") and \
        first.endswith(f"{len(kept)} of 60 samples are kept; a clear of this shard, or a new run (it reuses them), "
                       f"sends the other {60 - len(kept)}"), first
    assert json.loads(cfg.layout.status(0).read_text())["attempts"][-1]["state"] == "drained"

    with pytest.raises(Drained):  # a shard whose task starts after the drain leases no server
        generate_shard.run_shard(cfg, shard)
    assert Path(servers[0].log_path).read_text().count(CHAT) == sent

    cfg.layout.drain_request.unlink()  # what the relaunch of a clear does
    result, _ = run_shard(cfg, key, shard)
    assert result["generated_now"] == 60 - len(kept)
    got = ids_of(result["path"])
    assert sorted(got) == sorted(ids_of(shard["path"])) and len(got) == len(set(got))
