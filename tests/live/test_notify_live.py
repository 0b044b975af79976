"""The run's news under a real scheduler: the DAG's failure callback runs in the dag processor (not in the run's
process as under `dag.test`, tests/e2e and tests/faults), and its message reaches a webhook through an Apprise URL
Param. The run fails at its first task, so it costs seconds of the one live Airflow."""

import time
from urllib.parse import quote

from notify_receivers import Receivers


def test_the_dag_processor_tells_a_webhook_that_the_run_failed_and_why(live_airflow):
    af = live_airflow
    with Receivers() as receivers:
        run_id = "notify_run_failed"
        webhook = receivers.params()["notify_apprise_urls"]  # the live Airflow has no SMTP connection: no email
        af.trigger(run_id, {"prompt_source": "/nonexistent/prompts.jsonl", "notify_apprise_urls": webhook})
        assert af.wait_run(run_id, timeout_s=300) == "failed"
        deadline = time.monotonic() + 120  # the dag processor picks the callback up after the run's state is set
        while not receivers.posts() and time.monotonic() < deadline:
            time.sleep(0.5)
        [text] = receivers.posts()
    lines = text.splitlines()
    assert lines[0] == f"Run {run_id} failed: plan_shards", text
    assert lines[1:3] == [f"{af.url}/dags/dflash_regen/runs/{quote(run_id)}", f"{af.url}/dflash/runs/{run_id}/fleet"]
    assert "plan_shards: PromptSourceError: prompt source /nonexistent/prompts.jsonl does not exist" in text
