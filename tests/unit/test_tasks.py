"""Several nodes, the task bodies: a node that fails a gate is left out or fails the run (Param node_failure),
and assign_shards splits the shards among the nodes that passed by their measured rate."""

import json

import pytest
from airflow.sdk.definitions.retry_policy import RetryAction
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from dflash_regen import notifiers, tasks
from dflash_regen.settings.run_config import RunConfig

NODES = {"fast": {"name": "fast", "queue": "q1", "gpus": "0,1"}, "slow": {"name": "slow", "queue": "q2", "gpus": "0"}}


def shards(n, size=10):
    return [{"shard": i, "prompts": size, "path": f"/x/{i}", "label": f"shard {i}"} for i in range(n)]


def test_a_node_failing_a_gate_is_left_out_with_continue_and_fails_the_run_without(run_params, receivers):
    params = run_params(node_failure="continue", **receivers.params())
    # health_check of a node whose fleet was never launched: a gate failure
    cfg = RunConfig.from_params(params, "r1", node="slow")
    launched = {"fleet_dir": str(cfg.fleet_dir)}
    with pytest.raises(AirflowSkipException, match="node slow is left out of this run"):
        tasks.health_check(params, "r1", launched, node=NODES["slow"])
    record = json.loads(cfg.layout.node_report("left_out").read_text())
    assert record["task"] == "health_check" and "re-run launch_fleet" in record["error"]
    # Told by email and webhook: the node, the task and its first error line, then the run's links.
    assert len(receivers.emails()) == len(receivers.posts()) == 1
    for text in (receivers.emails()[0].split("\n", 1)[1], receivers.posts()[0]):
        lines = text.splitlines()
        assert lines[0].startswith("Run r1: node slow left out, its health_check failed: ")
        assert lines[1].endswith("/dags/dflash_regen/runs/r1") and lines[2].endswith("/dflash/runs/r1/fleet")
    with pytest.raises(AirflowFailException):
        tasks.health_check(run_params(node_failure="fail"), "r2", launched, node=NODES["slow"])
    with pytest.raises(AirflowFailException):  # one node: no node, no leaving out
        tasks.health_check(params, "r3", launched)


def ready(params, run_id, name, prompts_per_s, servers=2):
    path = RunConfig.from_params(params, run_id).layout.node_report("ready", name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"node": name, "servers": servers, "prompts_per_s": prompts_per_s}))


def test_assign_shards_by_calibrated_rate_and_writes_the_split(run_params):
    params = run_params()
    ready(params, "r", "fast", 3.0)
    ready(params, "r", "slow", 1.0)
    split = tasks.assign_shards(params, "r", shards(8), ["fast", "slow"])
    assert [len(split["fast"]), len(split["slow"])] == [6, 2]
    report = json.loads(RunConfig.from_params(params, "r").layout.report("assignment").read_text())
    assert report["basis"] == "calibrated prompts/s" and report["nodes"]["slow"]["predicted_s"] == 20.0
    assert report["nodes"]["fast"]["rate_share"] == 0.75


def test_without_calibration_the_split_follows_healthy_servers(run_params):
    params = run_params()
    ready(params, "r", "fast", 3.0, servers=3)
    ready(params, "r", "slow", None, servers=1)
    split = tasks.assign_shards(params, "r", shards(8), ["fast", "slow"])
    assert [len(split["fast"]), len(split["slow"])] == [6, 2]


def test_a_left_out_node_gets_nothing_with_continue_and_fails_the_split_without(run_params):
    params = run_params(node_failure="continue")
    ready(params, "r", "fast", 3.0)
    assert tasks.assign_shards(params, "r", shards(4), ["fast", "slow"]) == {"fast": shards(4), "slow": []}
    with pytest.raises(AirflowFailException, match="nodes slow failed their setup.*node_failure"):
        tasks.assign_shards(run_params(node_failure="fail"), "r", shards(4), ["fast", "slow"])
    with pytest.raises(AirflowFailException, match="no node passed its gates"):
        tasks.assign_shards(params, "empty", shards(4), ["fast", "slow"])


class Try:
    """Airflow's view of one try of a task with the DAG's fixed retries: its number and max_tries (a clear sets
    max_tries = try_number + retries)."""

    def __init__(self, try_number, max_tries=10, retries=10):
        self.try_number, self.max_tries = try_number, max_tries
        self.task = type("Task", (), {"retries": retries})()


def decision(ti, allowed):
    """What the generate task's retry policy tells Airflow after a failure of this try."""
    context = {"ti": ti, "params": {"generate_retries": allowed}}
    return tasks.GenerateRetries().evaluate(RuntimeError("server-3 died"), ti.try_number, ti.max_tries, context)


def test_generate_retries_per_run_lets_airflow_retry_until_the_params_count_then_fails_for_good():
    assert [decision(Try(n), allowed=2).action for n in (1, 2, 3)] == \
        [RetryAction.DEFAULT, RetryAction.DEFAULT, RetryAction.FAIL]
    assert decision(Try(1), allowed=0).action == RetryAction.FAIL
    assert "generate_retries is 0" in decision(Try(1), allowed=0).reason
    # Cleared after its 4th try: max_tries = 4 + 10, and the 5th try is the first of a new attempt.
    assert decision(Try(5, max_tries=14), allowed=1).action == RetryAction.DEFAULT
    assert decision(Try(6, max_tries=14), allowed=1).action == RetryAction.FAIL


def test_a_try_airflow_starts_past_the_params_retries_fails_at_once(run_params):
    """A killed task process is retried by Airflow without asking the policy: that try fails before sending."""
    params = run_params(2, generate_retries=0)
    shard = {"shard": 2, "prompts": 10, "path": "/nonexistent/shard-0002.parquet", "label": "shard 0002"}
    with pytest.raises(AirflowFailException, match="^shard 0002 not run again: try 1 was killed and this run's "
                                                   "generate_retries is 0"):
        tasks.generate(params, "r1", shard, ti=Try(2))


def test_no_receiver_configured_sends_nothing_and_a_receiver_down_is_only_a_warning(run_params, caplog):
    from notify_receivers import SMTP_CONN_ID, free_port

    from dflash_regen import notify

    cfg = RunConfig.from_params(run_params(), "r1")
    assert notifiers._notifiers(cfg.notify, notify.Message("t", ())) == []  # defaults: no email, URL, connection
    closed = free_port()  # nothing listens there
    down = RunConfig.from_params(run_params(notify_email_to="ops@example.test", notify_smtp_conn_id=SMTP_CONN_ID,
                                            notify_apprise_urls=[f"json://127.0.0.1:{closed}/x"]), "r1")
    conn = {"conn_type": "smtp", "host": "127.0.0.1", "port": closed, "extra": {"from_email": "a@example.test",
                                                                                 "disable_ssl": True, "retry_limit": 0}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(f"AIRFLOW_CONN_{SMTP_CONN_ID.upper()}", json.dumps(conn))
        notifiers._send(down, notify.Message("Run r1: gate health_check failed: x", ()))
    assert "email via dflash_test_smtp: 'Run r1: gate health_check failed: x' not sent: ConnectionRefusedError" \
        in caplog.text
    assert "A Connection error occurred sending JSON notification to 127.0.0.1" in caplog.text  # Apprise's warning


def test_the_api_key_never_reaches_a_receiver(run_params, receivers):
    from dflash_regen import notify

    cfg = RunConfig.from_params(run_params(**receivers.params()), "r1")
    cfg.fleet_dir.mkdir(parents=True)
    cfg.layout.fleet.api_key.write_text("sk-run-key-0123")
    notifiers._send(cfg, notify.Message("Run r1: gate smoke_test failed: --api-key=sk-run-key-0123 refused", ("l",)))
    assert receivers.posts() == ["Run r1: gate smoke_test failed: --api-key=*** refused\nl"]
    assert receivers.emails() == [f"Subject: {receivers.posts()[0].splitlines()[0]}\n{receivers.posts()[0]}"]


def test_an_apprise_connection_is_a_receiver_too(run_params, receivers, monkeypatch):
    from dflash_regen import notify

    url = receivers.params()["notify_apprise_urls"][0]
    monkeypatch.setenv("AIRFLOW_CONN_APPRISE_DEFAULT",
                       json.dumps({"conn_type": "apprise", "extra": {"config": [{"path": url}]}}))
    notifiers._send(RunConfig.from_params(run_params(), "r1"), notify.Message("Run r1 published 9 samples", ("l",)))
    assert receivers.posts() == ["Run r1 published 9 samples\nl"] and receivers.emails() == []


def test_validate_gets_every_node_s_tokenize_results_however_airflow_hands_them(run_params, monkeypatch):
    """A mapped task's results reach a downstream task as a list, one result alone as itself, none (every instance
    skipped, or none mapped: a node left out) as None: the gate gets them all as one list, the plan beside it."""
    from dflash_regen import quality

    gated = {}
    monkeypatch.setattr(quality, "gate_run", lambda cfg, planned, tokenized: gated.update(t=tokenized, p=planned)
                        or {"kept": 1, "quarantined": 0})
    made = [{"shard": i, "samples": 10, "skipped": False} for i in range(3)]
    assert tasks.validate(run_params(), "r1", shards(3), [made[:2], made[2], None]) == {"kept": 1, "quarantined": 0}
    assert gated == {"t": made, "p": shards(3)}


def test_a_planned_shard_tokenize_did_not_return_fails_the_gate_before_it_reads(run_params):
    """Several nodes: validate runs when one node's tokenize skipped (a drain); the plan still expects its shard."""
    from dflash_regen import quality
    from dflash_regen.errors import GateFailed

    cfg = RunConfig.from_params(run_params(), "r1")
    tokenized = [{"shard": 0, "samples": 10, "skipped": False}, {"shard": 2, "samples": 10, "skipped": False}]
    with pytest.raises(GateFailed, match=r"^shards \[1, 3\] of the run's 4 were not tokenized \(their tokenize "
                                         r"tasks skipped\), nothing will be published"):
        quality.gate_run(cfg, shards(4), tokenized)


def test_a_failed_tasks_first_line_names_the_host_path_of_the_output_root(monkeypatch):
    """In a container the output root is mounted from a host folder (docker-compose.yaml): the operator reads
    the error there."""
    from dflash_regen.errors import DiskFull

    @tasks.fail_fast
    def body():
        raise DiskFull("no space left on the disk of /data/dflash-regen/runs/r1 writing plan.json: it needs 1 MB")

    monkeypatch.setenv("DFLASH_OUTPUT_ROOT", "/data/dflash-regen")
    monkeypatch.setenv("DFLASH_OUTPUT_ROOT_ON_HOST", "/srv/data")
    with pytest.raises(AirflowFailException) as info:
        body()
    assert str(info.value).startswith("DiskFull: no space left on the disk of /data/dflash-regen/runs/r1 "
                                      "(on the host: /srv/data/runs/r1) writing plan.json")
    monkeypatch.delenv("DFLASH_OUTPUT_ROOT_ON_HOST")
    with pytest.raises(AirflowFailException, match=r"runs/r1 writing"):
        body()


def test_a_full_disk_met_outside_atomic_writes_fails_the_task_naming_where_not_a_bare_errno(tmp_path):
    """A server's log or the fleet's records are written outside atomic.py: their ENOSPC is named all the same
    (the rehearsal's full data volume met it in launch_fleet)."""
    import errno

    root = tmp_path / "out"
    log_file = root / "runs" / "r1" / "fleet" / "server-0.log"

    @tasks.fail_fast
    def body(params: dict, run_id: str, filename: str | None = None):
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    with pytest.raises(AirflowFailException) as info:
        body({"output_root": str(root)}, "r1")
    assert str(info.value).startswith(f"DiskFull: no space left on the disk of {tmp_path} writing out: "), info.value
    with pytest.raises(AirflowFailException) as info:
        body({"output_root": str(root)}, "r1", filename=str(log_file))
    assert str(info.value).startswith(f"DiskFull: no space left on the disk of {tmp_path} writing server-0.log: ")
    assert "MB are free" in str(info.value) and "clear the task" in str(info.value)

    @tasks.fail_fast
    def refused(params: dict, run_id: str):
        raise PermissionError(errno.EACCES, "Permission denied", str(log_file))

    with pytest.raises(PermissionError):  # not a full disk: Airflow's own retry and traceback, unchanged
        refused({"output_root": str(root)}, "r1")
