"""The fleet launcher and both gates against real emulator processes (launched like real SGLang)."""

import json
import subprocess
import sys
import time

import pytest
import requests

from dflash_regen.capacity.health import health_gate
from dflash_regen.errors import FleetError, GateFailed
from dflash_regen.fleet import smoke
from dflash_regen.fleet.servers import (
    API_KEY_ENV,
    REDACTED,
    Server,
    is_alive,
    launch_fleet,
    log_tail,
    start_ticks,
    stop_fleet,
    stop_servers,
)


def test_healthy_fleet_passes_both_gates_and_stops_cleanly(launch):
    cfg, servers, key = launch(num_servers=3)  # the demo's seven: tests/e2e
    assert [s.port for s in servers] == [cfg.fleet.base_port + i for i in range(3)]
    health = health_gate(servers, key, cfg.fleet)
    assert health["total_running_slots"] == 3 * 16
    first = health["servers"][0]
    assert first["allocation"]["mamba_slots"] == 80 and first["binding"].startswith("Mamba slots (80 // 5")
    assert "--max-mamba-cache-size 160" in first["advice"]
    assert first["log_figures"]["kv_tokens"] == first["allocation"]["kv_tokens"]
    report = smoke.smoke_gate(servers, key, cfg.sampling, cfg.fleet)
    assert report["passed"] and len(report["servers"]) == 3
    tool = [r for s in report["servers"] for r in s["results"] if r["prompt"] == "tool_call"]
    assert all(r["tool_calls"] == 1 and r["finish_reason"] == "tool_calls" for r in tool)
    stopped = stop_fleet(cfg.fleet_dir)
    assert len(stopped) == 3
    assert stop_fleet(cfg.fleet_dir) == []  # idempotent


def test_one_server_with_low_allocation_fails_health_naming_only_it(launch):
    cfg, servers, key = launch(num_servers=3, emulator_faults={"1": {"kv_tokens": 200_000}})
    with pytest.raises(GateFailed) as info:
        health_gate(servers, key, cfg.fleet)
    msg = str(info.value)
    assert "failed on 1 of 3 servers" in msg
    assert f"server 1 (GPU 1, 127.0.0.1:{cfg.fleet.base_port + 1})" in msg
    assert "only 200,000 KV tokens allocated (minimum 1,000,000)" in msg
    assert "server 0 " not in msg and "server 2 " not in msg


def test_two_bad_servers_at_once_are_both_named(launch):
    cfg, servers, key = launch(num_servers=3, emulator_faults={"0": {"kv_tokens": 200_000},
                                                               "2": {"kv_tokens": 400_000}})
    with pytest.raises(GateFailed) as info:
        health_gate(servers, key, cfg.fleet)
    msg = str(info.value)
    assert "failed on 2 of 3 servers" in msg
    assert f"server 0 (GPU 0, 127.0.0.1:{cfg.fleet.base_port}): only 200,000 KV tokens" in msg
    assert f"server 2 (GPU 2, 127.0.0.1:{cfg.fleet.base_port + 2}): only 400,000 KV tokens" in msg
    assert "server 1 " not in msg


def test_low_running_slots_fail_with_the_flags_that_raise_them(launch):
    cfg, servers, key = launch(num_servers=2, min_running_requests=32)
    with pytest.raises(GateFailed) as info:
        health_gate(servers, key, cfg.fleet)
    assert "only 16 running-request slots (minimum 32)" in str(info.value)
    assert "--max-mamba-cache-size 160 --max-running-requests 32" in str(info.value)


def test_one_server_with_empty_content_fails_smoke_naming_it(launch):
    cfg, servers, key = launch(num_servers=2, emulator_faults={"1": {"empty_content": True}})
    health_gate(servers, key, cfg.fleet)  # it is up and well allocated: only smoke can catch it
    with pytest.raises(GateFailed) as info:
        smoke.smoke_gate(servers, key, cfg.sampling, cfg.fleet)
    msg = str(info.value)
    assert "failed on 1 of 2 servers" in msg
    assert f"server 1 (GPU 1, 127.0.0.1:{cfg.fleet.base_port + 1}) [coding]: reasoning only" in msg


def test_the_seeds_512_max_tokens_fails_smoke_with_the_raise_hint(launch):
    cfg, servers, key = launch(num_servers=2, max_tokens=512)
    with pytest.raises(GateFailed) as info:
        smoke.smoke_gate(servers, key, cfg.sampling, cfg.fleet)
    msg = str(info.value)
    assert "failed on 2 of 2 servers" in msg
    assert "[coding]: ran out of tokens inside its reasoning: finish_reason 'length' after 512 completion " \
           "tokens (512 reasoning, 0 chars of content) at max_tokens=512; raise Param max_tokens" in msg


def test_a_server_that_crashes_at_start_fails_launch_with_its_log_tail(launch, run_params):
    with pytest.raises(FleetError) as info:
        launch(num_servers=3, emulator_faults={"1": {"crash_at_start": True}})
    msg = str(info.value)
    assert "server 1 (GPU 1" in msg and "exited with code 1" in msg
    assert "Traceback" in msg and "last lines" in msg
    # no_leftover_servers checks that servers 0 and 2 were stopped by the failed launch


def test_unready_server_times_out_with_its_log(launch):
    with pytest.raises(FleetError) as info:
        launch(num_servers=1, ready_timeout_s=1.0, emulator_faults={"0": {"start_delay_s": 30}})
    assert "not ready after 1 s" in str(info.value) and "ready_timeout_s" in str(info.value)


def test_port_in_use_fails_preflight_before_launching(launch, run_params):
    params = run_params(2)
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", params["base_port"] + 1))
        busy.listen()
        with pytest.raises(FleetError, match=rf"port {params['base_port'] + 1} on 127.0.0.1 is already in use"):
            launch(num_servers=2, base_port=params["base_port"])


def test_api_key_is_required_and_never_written_to_specs_or_log_tails(launch):
    cfg, servers, key = launch(num_servers=1)
    url = servers[0].url
    assert requests.get(f"{url}/v1/models", timeout=5).status_code == 401
    assert requests.get(f"{url}/v1/models", timeout=5, headers={"Authorization": f"Bearer {key}"}).ok
    spec = cfg.layout.fleet.server_spec(0).read_text()
    assert key not in spec and f"--api-key={REDACTED}" in json.loads(spec)["argv"]
    assert key not in log_tail(servers[0].log_path, key, lines=1000)
    assert cfg.layout.fleet.api_key.stat().st_mode & 0o077 == 0


def test_relaunch_of_the_same_run_stops_leftovers_first(launch, tmp_path):
    cfg, first, _ = launch(num_servers=2)
    again = launch_fleet(cfg.fleet, tmp_path / "model", cfg.fleet_dir)
    assert {s.pid for s in again}.isdisjoint({s.pid for s in first})
    assert not any(is_alive(s) for s in first)


def test_stop_never_kills_a_recycled_pid(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        impostor = Server(0, "0", "127.0.0.1", 1, [], str(tmp_path / "log"), pid=proc.pid,
                                start_ticks=start_ticks(proc.pid) + 1)
        assert stop_servers([impostor]) == []
        time.sleep(0.2)
        assert proc.poll() is None
        real = Server(**{**impostor.__dict__, "start_ticks": start_ticks(proc.pid)})
        assert len(stop_servers([real])) == 1
        assert proc.wait(5) is not None
    finally:
        proc.kill()


def test_an_api_key_that_looks_like_a_flag_still_launches(launch, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "-starts-with-a-dash")
    _, servers, key = launch(num_servers=1)
    assert key == "-starts-with-a-dash"
    assert requests.get(f"{servers[0].url}/v1/models", timeout=5, headers={"Authorization": f"Bearer {key}"}).ok


def test_a_live_run_holds_its_output_root_and_a_dead_runs_servers_are_reaped(launch, tmp_path):
    from dflash_regen.errors import RunLocked
    from dflash_regen.fleet import runlock

    cfg, servers, _ = launch(num_servers=2)  # run "test_run", whose (`airflow dags test`) process is `holder`
    script = ("import sys; from pathlib import Path; from dflash_regen.fleet import runlock; "
              "runlock.acquire(Path(sys.argv[1]), 'test_run', 'test_run', lambda r: False); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", script, str(cfg.output_root)], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while runlock.read_holder(cfg.output_root) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        # The same logical date triggered again (same run id, another process) is refused, as is another run.
        for run_id in ("test_run", "other"):
            with pytest.raises(RunLocked, match=rf"^output root {cfg.output_root} is held by run 'test_run' since .* "
                                                rf"\(its process \(pid {holder.pid} on .*\) is still running\).*"
                                                "set Param output_root to another directory"):
                runlock.acquire(cfg.output_root, run_id, run_id, lambda r: False)
        assert runlock.reap_orphans(cfg.output_root, "other") == []  # not the holder: reaps nothing
    finally:
        holder.kill()
        holder.wait()
    # The holder's process is gone: a run Airflow still reports running keeps the lock, a finished one does not.
    with pytest.raises(RunLocked, match="Airflow reports it running"):
        runlock.acquire(cfg.output_root, "other", "other", lambda r: r == "test_run")
    runlock.acquire(cfg.output_root, "other", "other", lambda r: False)
    assert all(is_alive(s) for s in servers)
    stopped = runlock.reap_orphans(cfg.output_root, "other")
    assert len(stopped) == 2 and not any(is_alive(s) for s in servers)
