"""The pipeline's metrics as the monitoring profile's Prometheus scrapes them: from the real api-server, where the
plugin mounts them (plugins/dflash_regen_ui.py), with the deployment's bearer token and only with it.
tests/integration/test_monitoring.py has a real Prometheus read the same app's series."""

import requests
from conftest import LIVE_METRICS_TOKEN


def test_the_api_server_serves_the_pipelines_metrics_to_the_token_only(live_airflow):
    url = f"{live_airflow.url}/dflash-metrics/metrics"
    assert requests.get(url, timeout=30).status_code == 401
    assert requests.get(url, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    answer = requests.get(url, headers={"Authorization": f"Bearer {LIVE_METRICS_TOKEN}"}, timeout=30)
    assert answer.status_code == 200, answer.text[:500]
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    for family in ("prompts_planned", "prompts_done", "shards", "quarantined", "eta_seconds"):
        assert f"# TYPE dflash_regen_{family} gauge" in answer.text, answer.text[:500]
