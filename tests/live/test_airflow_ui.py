"""The pipeline used the way people use it: a real Airflow (scheduler, api-server, dag-processor) driven from
a real browser (Playwright + Debian's Chromium, headless, loopback only) and through the REST API.

One Airflow serves the module. `generate` is not retried here (env DFLASH_GENERATE_RETRIES=0), so a fault
leaves a failed shard for the test to clear, as a person would. Screenshots go to test-output/browser/.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from urllib.parse import quote, unquote

import pyarrow.parquet as pq
import pytest
from conftest import ROOT
from live_airflow import (
    LIVE_PROFILE,
    LiveAirflow,
    _running,
    completion_ids,
    kill_in_the_middle_of_shard,
    published_manifest,
    run_dir,
)
from notify_receivers import Receivers

from dflash_regen.layout import COMPLETIONS, RunLayout
from dflash_regen.settings.run_config import safe_run_id

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
SIDE_PANEL = {"width": 900, "height": 1000}  # Airflow's run view at this size leaves the tab ~630 px wide
NARROWEST = 370  # the tab's width with Airflow's grid panel widened (issue 17)


@pytest.fixture(scope="session")
def screenshots():
    folder = ROOT / "test-output" / "browser"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# ------------------------------------------------------------------------------------------------ the plugin
def test_report_pages_refuse_anonymous_requests_and_stay_inside_the_output_root(live_airflow):
    import requests

    url = live_airflow.url
    for path in ("/dflash/", "/dflash/runs/any/quality", "/dflash/runs/any/fleet.json",
                 "/dflash/runs/any/data-docs/index.html"):
        assert requests.get(url + path, timeout=30).status_code == 401, path
        bogus = {"Authorization": "Bearer not-a-token"}
        assert requests.get(url + path, headers=bogus, timeout=30).status_code in (401, 403), path
    assert live_airflow.api("GET", "/dflash/").status_code == 200
    live_airflow.output_root.mkdir(parents=True, exist_ok=True)
    (live_airflow.output_root / "secret.txt").write_text("not for the browser")
    for path in ("/dflash/runs/..%2F..%2Fsecret.txt/quality", "/dflash/runs/%2E%2E/quality",
                 "/dflash/runs/any/data-docs/..%2F..%2F..%2F..%2Fsecret.txt"):
        r = live_airflow.api("GET", path, check=False)
        assert r.status_code == 404 and "not for the browser" not in r.text, path
    plugins = live_airflow.api("GET", "/api/v2/plugins").json()["plugins"]
    ours = next(p for p in plugins if p["name"] == "dflash_regen_ui")
    assert {v["name"] for v in ours["external_views"]} == {"dflash-regen runs", "Data quality", "Fleet"}
    icons = [v["icon"] for v in ours["external_views"]]
    assert all(i.startswith("data:image/svg+xml") for i in icons) and len(set(icons)) == 3  # one icon per tab


# ----------------------------------------------------------------------------------------------- the browser
@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), (f"{CHROMIUM} is missing: install Debian's chromium "
                                     "(scripts/test.sh does: apt-get install -y chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def log_in(page, af: LiveAirflow) -> None:
    page.goto(af.url + "/")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", af.password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"{af.url}/")


def trigger_from_form(page, af: LiveAirflow, fields: dict[tuple[str, str], str], shot: Path) -> str:
    """Open the trigger form, fill `{(section, param): value}`, press Trigger; returns the new run id."""
    page.goto(f"{af.url}/dags/dflash_regen")
    page.get_by_role("button", name="Trigger Dag").click()
    form = page.locator("[role=dialog][data-state=open]")
    for (section, name), value in fields.items():
        # A choice (an enum Param) is a combobox to type into and pick from; its value sits in a hidden input.
        field = form.locator(f"#element_{name} input[role=combobox], input[name=element_{name}]:not([type=hidden])")
        if not field.is_visible():
            form.get_by_role("button", name=section, exact=True).click()
        field.fill(value)
        if field.get_attribute("role") == "combobox":
            field.press("Enter")
        assert form.locator(f"input[name=element_{name}]").input_value() == value, name
    form.screenshot(path=shot)
    form.get_by_role("button", name="Trigger", exact=True).click()
    page.wait_for_url("**/dags/dflash_regen/runs/**")
    return unquote(page.url.split("/runs/")[1].split("/")[0])


def open_run_tab(page, af: LiveAirflow, run_id: str, route: str, name: str):
    """Open one of our tabs on the run's page; returns the frame holding our page."""
    page.goto(f"{af.url}/dags/dflash_regen/runs/{quote(run_id)}")
    # a named tab, not an anonymous icon (the tab bar may also keep hidden copies of its links)
    tab = page.locator(f'a[href$="/plugin/{route}"]').filter(has_text=name, visible=True).first
    tab.wait_for(timeout=30_000)
    tab.click()
    return page.frame_locator("iframe").first


def font_of(frame) -> str:
    """The body's computed font: the escaped stylesheet once left every page in the browser's default (Times)."""
    font = frame.locator("body").evaluate("b => getComputedStyle(b).fontFamily")
    assert "Times" not in font and "system-ui" in font, font
    return font


def fail_shards(af: LiveAirflow, run_id: str, victims: dict[int, str], dataset: str) -> dict[int, dict]:
    """Kill, per shard, its `victim` ('server' or 'task') in the middle of it; the run fails on those shards
    alone. Returns, per shard, what was killed and how many of its results were on disk then."""
    killers = {shard: kill_in_the_middle_of_shard(run_dir(af, run_id), shard=shard, victim=victim)
               for shard, victim in victims.items()}
    assert af.wait_run(run_id, timeout_s=600) == "failed"
    for shard, killer in killers.items():
        killer.join(1)
        assert killer.killed, f"the fault never fired: shard {shard} checkpointed nothing while it ran"
    states = af.wait_settled(run_id)
    failed = {f"generate[{shard}]" for shard in victims}
    others = [k for k in states if k.startswith("generate[") and k not in failed]
    assert all(states[k] == "failed" for k in failed) and others, states
    assert all(states[k] == "success" for k in others), states
    assert states["publish"] == "upstream_failed" and states["stop_fleet"] == "success", states
    report = af.failures(run_id)  # what the live tests print when a run ends otherwise than they expect
    # A killed server fails its shard's try 1, which generate_retries 0 does not retry; a killed task process
    # is retried by Airflow (the DAG's retries are the most a run may ask), and that try 2 fails at once.
    assert all(f"--- generate[{shard}] try {1 if victim == 'server' else 2}: failed\n" in report
               for shard, victim in victims.items()), report
    assert "was killed and this run's generate_retries is 0" in report, report
    assert not (af.output_root / "published" / dataset).exists(), "a failed run published something"
    return {shard: killer.killed for shard, killer in killers.items()}


def task_error(af: LiveAirflow, run_id: str, task_id: str, try_number: int, map_index: int = -1) -> str:
    """'<type>: <message>' of the exception a task failed with, as Airflow logged it (error_detail)."""
    r = af.api("GET", f"/api/v2/dags/dflash_regen/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
               params={"map_index": map_index, "full_content": True}, headers={"Accept": "application/json"})
    for entry in r.json()["content"]:
        for error in (entry.get("error_detail") or []) if isinstance(entry, dict) else []:
            return f"{error['exc_type']}: {error['exc_value']}"
    raise AssertionError(f"no exception in the log of {task_id}[{map_index}] try {try_number}")


def test_the_form_refuses_a_shard_size_of_zero_before_a_run_exists(live_airflow, browser, screenshots):
    af = live_airflow
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    log_in(page, af)
    runs = af.api("GET", "/api/v2/dags/dflash_regen/dagRuns").json()["total_entries"]
    page.goto(f"{af.url}/dags/dflash_regen")
    page.get_by_role("button", name="Trigger Dag").click()
    form = page.locator("[role=dialog][data-state=open]")
    form.get_by_role("button", name="Prompts", exact=True).click()
    field = form.locator("input[name=element_shard_size]")
    field.fill("0")
    field.blur()  # the number box used to clamp 0 to the schema's minimum of 1 here, and the run went ahead
    assert field.input_value() == "0"
    form.get_by_role("button", name="Trigger", exact=True).click()
    page.get_by_text("0 is less than the minimum of 1").first.wait_for(timeout=30_000)
    page.screenshot(path=screenshots / "02b-bad-shard-size-refused.png")
    assert af.api("GET", "/api/v2/dags/dflash_regen/dagRuns").json()["total_entries"] == runs
    page.close()


def test_user_triggers_from_the_form_a_rest_client_and_the_user_each_clear_one_failed_shard_and_read_the_reports(
        live_airflow, browser, screenshots):
    """One run, two faults: the server working on shard 2 is SIGKILLed (the user clears it from the UI) and shard
    3's own task process is SIGKILLed (issue 7 case 2; cleared through the REST API, one mapped index only)."""
    af = live_airflow
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    log_in(page, af)
    page.screenshot(path=screenshots / "01-logged-in.png")

    # 4 shards on 4 servers (fewer tasks and processes: each costs seconds on a loaded 2-core box), each shard
    # on its own server; the smallest calibration: twice the 16 slots; autotune off, picked from its choices
    # (tests/integration/test_autotune_on_fleet.py and the e2e demo run tune).
    form = {("Fleet", "num_servers"): "4", ("Prompts", "shard_size"): "30", ("Dispatch", "checkpoint_every"): "4",
            ("Dispatch", "calibration_prompts"): "32", ("Dispatch", "autotune"): "off",
            # the session's other live runs answer the same demo prompts: reusing them, no fault would fire
            ("Sampling", "reuse"): "off"}
    run_id = trigger_from_form(page, af, form, screenshots / "02-trigger-form.png")
    folder = run_dir(af, run_id)
    # The faults land once each shard has results on disk.
    killed_in = fail_shards(af, run_id, {2: "server", 3: "task"}, dataset="qwen3.6-27b-regen")
    killed = killed_in[2]
    # The killed server, named as its errors name it (read before a clear relaunches the fleet).
    spec = next(s for s in (json.loads(p.read_text()) for p in RunLayout(folder).fleet.server_specs())
                if s["pid"] == killed["pid"])
    server = f"server {spec['index']} (GPU {spec['gpu']}, 127.0.0.1:{spec['port']})"

    # The failed run's pages say it failed, where, and why, before anyone clears anything.
    fleet = open_run_tab(page, af, run_id, "dflash-fleet", "Fleet")
    fleet.locator("#run-state").filter(has_text="run failed").wait_for(timeout=30_000)
    assert "generate[2] failed" in fleet.locator("#failures").inner_text()
    incidents = fleet.locator("#incidents").inner_text()
    assert "shard failed" in incidents and "shard 2 failed on server" in incidents, incidents
    page.screenshot(path=screenshots / "03-failed-run-fleet.png")
    quality = open_run_tab(page, af, run_id, "dflash-quality", "Data quality")
    assert "The gate never ran: the run failed at generate[2]" in quality.locator("#not-validated").inner_text()
    quality.get_by_role("link", name="GX Data Docs").click()
    assert "the run failed at generate[2], before validating" in quality.locator("#why").inner_text()

    # A REST client clears shard 3 alone: its setups and downstream re-run, no other shard does; the run then
    # fails again on shard 2, which is still failed.
    # generate -> tokenize is one mapped task group per shard: the failed shards held back no other's tokenize
    states = af.task_states(run_id)
    assert states["tokenize[2]"] == states["tokenize[3]"] == "upstream_failed", states
    assert states["tokenize[0]"] == states["tokenize[1]"] == "success", states
    body = {"dag_run_id": run_id, "task_ids": [["generate", 3]], "only_failed": False, "include_downstream": True}
    dry = af.api("POST", "/api/v2/dags/dflash_regen/clearTaskInstances", json={**body, "dry_run": True}).json()
    cleared = {(ti["task_id"], ti["map_index"]) for ti in dry["task_instances"]}
    assert {("generate", 3), ("tokenize", 3), ("launch_fleet", -1), ("health_check", -1), ("smoke_test", -1),
            ("stop_fleet", -1), ("validate", -1), ("publish", -1)} <= cleared, cleared
    others = {(t, i) for t in ("generate", "tokenize") for i in (0, 1, 2)}
    assert not others & cleared, "clearing one shard re-ran others"
    af.api("POST", "/api/v2/dags/dflash_regen/clearTaskInstances", json={**body, "dry_run": False})
    states = af.wait_settled(run_id, timeout_s=600)
    assert states["generate[3]"] == "success" and states["generate[2]"] == "failed", states
    assert af.wait_run(run_id, timeout_s=120) == "failed"  # the scheduler sets the run's state a moment later
    assert not (af.output_root / "published" / "qwen3.6-27b-regen").exists()
    retry_log = af.task_log(run_id, "generate", 3, map_index=3)  # try 1 killed, try 2 not run, try 3 cleared
    done_before = int(re.search(r"(\d+) done before", retry_log).group(1))
    assert done_before >= killed_in[3]["results_on_disk"] > 0, retry_log[-2000:]

    # The user opens the failed shard, reads why, and clears it (with Downstream, the form's default).
    # The first line of its error names the server and how it died.
    first = task_error(af, run_id, "generate", 1, map_index=2).splitlines()[0]
    assert re.fullmatch(rf"ShardFailed: shard 2 failed on {re.escape(server)}: the server process was killed by "
                        r"SIGKILL; \d+ of \d+ samples are kept, a retry or a clear of this shard sends only the "
                        r"other \d+, to another server", first), first
    page.goto(f"{af.url}/dags/dflash_regen/runs/{quote(run_id)}/tasks/generate/mapped/2")
    page.get_by_text(f"shard 2 failed on {server}: the server process was killed by SIGKILL").first \
        .wait_for(timeout=30_000)
    page.screenshot(path=screenshots / "04-failed-shard-log.png")
    page.get_by_role("button", name="Press shift+c to clear").click()
    dialog = page.locator("[role=dialog][data-state=open]")
    dialog.get_by_text("Affected Tasks").wait_for()
    dialog.get_by_text("launch_fleet").first.wait_for()  # the list fills in after its heading (a dry run)
    affected = dialog.inner_text()
    assert "launch_fleet" in affected and "smoke_test" in affected and "publish" in affected, affected
    dialog.screenshot(path=screenshots / "05-clear-dialog.png")
    dialog.get_by_role("button", name="Confirm").click()

    assert af.wait_run(run_id, timeout_s=600, states={"success"}) == "success"
    states = af.task_states(run_id)
    assert set(states.values()) == {"success"}, states
    retry_log = af.task_log(run_id, "generate", 2, map_index=2)
    done_before = int(re.search(r"(\d+) done before", retry_log).group(1))
    assert done_before >= killed["results_on_disk"] > 0, retry_log[-2000:]

    manifest = published_manifest(af, run_id, "qwen3.6-27b-regen")
    counts = manifest["counts"]
    assert counts["prompts"] == counts["published"] + counts["quarantined"]
    ids = completion_ids(folder)
    assert len(ids) == len(set(ids)), "a sample was generated twice"

    # The data-quality page, inside Airflow's run view.
    report = open_run_tab(page, af, run_id, "dflash-quality", "Data quality")
    report.locator("h1").filter(has_text="passed").wait_for(timeout=30_000)
    font_of(report)
    page.screenshot(path=screenshots / "06-data-quality.png", full_page=True)
    assert int(report.locator("#prompts").inner_text().replace(",", "")) == counts["prompts"]
    assert int(report.locator("#kept").inner_text().replace(",", "")) == counts["published"]
    assert int(report.locator("#quarantined").inner_text().replace(",", "")) == counts["quarantined"]
    assert "counts reconcile" in report.locator("#reconcile").inner_text()
    results = report.locator("#expectations tr td:first-child").all_inner_texts()
    assert len(results) >= 10 and set(results) == {"pass"}, results
    assert report.locator("svg.chart rect.bar").count() > 5  # the loss-mask histogram
    report.get_by_role("link", name="Open the full Great Expectations Data Docs").click()
    report.get_by_text("validation of dflash_quality").first.wait_for()  # the offline page list
    assert all(b.is_hidden() for b in report.get_by_text("Clear Filters").all())  # GX filters need its CDN
    page.screenshot(path=screenshots / "07-data-docs.png", full_page=True)

    fleet = open_run_tab(page, af, run_id, "dflash-fleet", "Fleet")
    fleet.locator("#servers").wait_for()
    font_of(fleet)
    assert fleet.locator("#servers tr").count() == 1 + 4  # header + every server
    assert fleet.locator("#done").inner_text().split("/")[0].strip() == f"{len(ids):,}"
    assert 'class="badge ok">run success' in fleet.locator("#run-state").inner_html()
    incidents = fleet.locator("#incidents").inner_text()  # the server killed, the shard failed and retried
    assert "shard 2 failed on server" in incidents and "shard 2 retried on server" in incidents, incidents
    assert fleet.locator("svg.chart g.mark").count() == fleet.locator("#incidents li").count()
    rows = [row.locator("td").all_inner_texts() for row in fleet.locator("#shards tr").all()[1:]]
    attempts = {int(cells[0]): int(cells[4]) for cells in rows}
    assert attempts[2] == 2, rows  # shard 2: two attempts
    assert [a > 1 for a in attempts.values()] == sorted((a > 1 for a in attempts.values()), reverse=True), rows
    assert "was marked unhealthy" in fleet.locator("#servers").inner_text()
    page.screenshot(path=screenshots / "08-fleet.png", full_page=True)
    # History kept across the clears and the relaunches: the run's start is its first try's, the killed server's
    # incident stays listed and the server stays marked beside the health check that passed after the relaunch,
    # and shard 2 lists both servers it ran on.
    report = af.api("GET", f"/dflash/runs/{quote(run_id, safe='')}/fleet.json").json()
    first_attempt = min(a["started_at"] for s in report["shards"] for a in s["history"])
    # The page: the start shown is no later than the first shard attempt (the clears came after it), the server's
    # death is listed with how it died.
    shown = re.search(r"started (\S+ \S+) UTC", fleet.locator("#run-state").inner_text()).group(1)
    assert shown <= time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(first_attempt)), (shown, first_attempt)
    unhealthy = fleet.locator("#incidents li.server-unhealthy").all_inner_texts()
    assert any("SIGKILL" in i for i in unhealthy), incidents
    # The same in fleet.json:
    assert report["run_state"]["start"] <= first_attempt, (report["run_state"]["start"], first_attempt)
    assert any(i["kind"] == "server unhealthy" and "SIGKILL" in i["text"] for i in report["incidents"]), report
    marked = next(s for s in report["servers"] if s["server"] == server)
    assert marked["marked"] and marked["checked_at"] > marked["marked"][-1]["at"], marked
    assert len({a["server"] for a in next(s for s in report["shards"] if s["shard"] == 2)["history"]}) == 2

    # In the narrow side panel, then on its own through the page's full-page link.
    page.set_viewport_size(SIDE_PANEL)
    fleet.locator("#servers").wait_for()
    page.locator("iframe").first.screenshot(path=screenshots / "09-fleet-side-panel.png")
    # Airflow's iframe sandbox blocks target=_blank; the link opens through the top window (same origin).
    with page.context.expect_page(timeout=10_000) as opened:
        fleet.get_by_role("link", name="full page").click()
    full = opened.value
    full.set_viewport_size({"width": 1400, "height": 1000})
    assert full.url.endswith(f"/dflash/runs/{quote(run_id, safe='')}/fleet"), full.url
    full.locator("#incidents").wait_for()
    assert full.get_by_role("link", name="full page").count() == 0  # no link to the page it is on
    font_of(full)
    full.screenshot(path=screenshots / "10-fleet-full-page.png", full_page=True)
    full.set_viewport_size({"width": NARROWEST, "height": 1000})
    width = full.evaluate("document.documentElement.scrollWidth")
    assert width <= NARROWEST, f"the page is {width} px wide at {NARROWEST} px: only its tables may scroll sideways"
    full.screenshot(path=screenshots / "10b-fleet-370px.png", full_page=True)

    # Browse > dflash-regen runs: Airflow's run id, its state and counts.
    full.goto(f"{af.url}/dflash/")
    row = full.locator("#runs tr", has_text=run_id)
    assert "success" in row.inner_text() and f"{counts['published']:,}" in row.inner_text()
    full.screenshot(path=screenshots / "11-runs.png", full_page=True)
    page.close()




# ------------------------------------------------------------------------- more runs: queued, early, roots, drain
CHAT = '"POST /v1/chat/completions HTTP/1.1" 200'  # a chat request in a server's access log


class FleetPoller:
    """Reads a run's fleet.json every `every_s` in the background (what the Fleet page shows), keeping each
    reading's progress: the ETA's series."""

    def __init__(self, af: LiveAirflow, run_id: str, every_s: float = 2.0):
        self.url = f"/dflash/runs/{quote(run_id, safe='')}/fleet.json"
        self.af, self.every_s, self.series, self.stop = af, every_s, [], threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self):
        while not self.stop.is_set():
            r = self.af.api("GET", self.url, check=False)
            if r.ok:
                report = r.json()
                p = report["progress"]
                self.series.append({"at": time.time(), "done": p["done"], "left": p["left"], "eta_s": p["eta_s"],
                                    "rate": p["rate_per_s"], "source": p["eta_source"],
                                    "state": report["run_state"]["state"], "draining": bool(report["drain"])})
            self.stop.wait(self.every_s)

    def finish(self) -> list[dict]:
        self.stop.set()
        self.thread.join(30)
        return self.series


def test_queued_and_early_failed_runs_a_second_root_a_refused_root_and_a_drain_from_the_fleet_page(
        live_airflow, browser, screenshots):
    """Three more runs and one refused, short and back to back (the DAG runs one at a time, max_active_runs=1):
    - `early` fails at stage_weights within seconds (a model source that is not there);
    - `drained`, on the second output root the api-server serves, is queued behind it; then the user drains it from
      its Fleet page while it generates; its ETA is read all along;
    - `outside` names an output root the pages do not serve: listed as such, its pages answer 403; deleted while
      queued (nothing of it ever runs).
    The queued run and the failed one are shown in the runs list and both tabs with Airflow's state and the failed
    task's first error line."""
    af = live_airflow
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.on("dialog", lambda dialog: dialog.accept())  # the Drain button asks first
    log_in(page, af)
    drained, early, outside = "manual__ui_drained", "manual__ui_early", "manual__ui_outside"
    # The early run also tells a webhook (an Apprise URL Param) that it failed: under a real scheduler the DAG's
    # failure callback runs in the dag processor, not in the run's process as under dag.test (tests/e2e, faults).
    receivers = Receivers().__enter__()
    af.trigger(early, {"model_source_dir": str(af.home.parent / "no-model-here"), "reuse": "off",
                       "notify_apprise_urls": receivers.params()["notify_apprise_urls"]})
    af.wait_run(early, states={"running", "failed"})
    # The runs triggered next stay queued until the DAG is unpaused below. Behind max_active_runs alone they would
    # start as soon as the early run failed, which on a quiet box can be before their tabs are opened.
    af.pause(True)
    # Two shards of 60 on two servers; no calibration or tuning (fewer requests and minutes); slow emulated decoding
    # and few requests in flight, so the run is still generating when the user drains it.
    af.trigger(drained, {"output_root": str(af.second_root), "num_servers": 2, "shard_size": 60,
                         "checkpoint_every": 8, "calibration_prompts": 0, "autotune": "off", "reuse": "off",
                         "concurrency_per_server": 4,
                         "emulator_profile": {**LIVE_PROFILE, "decode_tokens_per_s": 300}})
    poller = FleetPoller(af, drained)  # readings start once the run has a folder
    af.trigger(outside, {"output_root": str(af.home.parent / "out-not-served")})
    assert af.run_state(drained) == af.run_state(outside) == "queued"

    # The runs list: the queued run (on the second root), the refused one; their tabs.
    page.goto(f"{af.url}/dflash/")
    rows = {run: page.locator("#runs tr", has_text=run).inner_text() for run in (drained, outside)}
    assert "queued" in rows[drained] and "(queued)" in rows[drained] and "fleet" in rows[drained], rows
    assert f"output root {af.home.parent / 'out-not-served'} is not served here" in rows[outside], rows
    page.screenshot(path=screenshots / "12-runs-queued-refused.png", full_page=True)
    for tab, name in (("dflash-fleet", "Fleet"), ("dflash-quality", "Data quality")):
        frame = open_run_tab(page, af, drained, tab, name)
        frame.locator("#why").filter(has_text="it is queued").wait_for(timeout=30_000)
        assert "run queued" in frame.locator("#run-state").inner_text()
    page.screenshot(path=screenshots / "13-queued-run-fleet.png")
    for path in ("fleet", "quality", "fleet.json", "quality.json", "data-docs/index.html"):
        r = af.api("GET", f"/dflash/runs/{outside}/{path}", check=False)
        assert r.status_code == 403 and "DFLASH_SERVED_ROOTS" in r.text, (path, r.status_code, r.text[:300])
    af.delete_run(outside)
    af.pause(False)

    # The early run failed at stage_weights: its first line in the list and both tabs.
    af.wait_settled(early, timeout_s=300)
    first = task_error(af, early, "stage_weights", 1).splitlines()[0]
    assert "model_source_dir" in first, first
    line = first.split(": ", 1)[1] if first.startswith("AirflowFailException: ") else first
    page.goto(f"{af.url}/dflash/")
    row = page.locator("#runs tr", has_text=early).inner_text()
    assert "failed" in row and f"failed at stage_weights: {line}" in row, (row, line)
    page.screenshot(path=screenshots / "16-runs-early-failure.png", full_page=True)
    for tab, name in (("dflash-fleet", "Fleet"), ("dflash-quality", "Data quality")):
        frame = open_run_tab(page, af, early, tab, name)
        frame.locator("#run-state").filter(has_text="run failed").wait_for(timeout=30_000)
        assert f"stage_weights failed: {line}" in frame.locator("#failures").inner_text()
    page.screenshot(path=screenshots / "17-early-failure-quality.png")
    deadline = time.monotonic() + 120  # the dag processor picks the callback up after the run's state is set
    while not receivers.posts() and time.monotonic() < deadline:
        time.sleep(0.5)
    receivers.__exit__(None, None, None)
    [told] = receivers.posts()
    assert told.splitlines()[:3] == [f"Run {early} failed: stage_weights", f"{af.url}/dags/dflash_regen/runs/{early}",
                                     f"{af.url}/dflash/runs/{early}/fleet"], told
    assert line in told, (line, told)
    af.wait_run(drained, states={"running"})  # next in line

    # The drain: from the Fleet page (opened now, the button pressed once the run has checkpointed some answers and
    # the ETA has been read a while). Its folder first: a run without one has no Fleet page to drain from yet.
    deadline = time.monotonic() + 300
    while not poller.series and time.monotonic() < deadline:
        time.sleep(0.5)
    fleet = open_run_tab(page, af, drained, "dflash-fleet", "Fleet")
    while not [s for s in poller.series if s["done"] >= 32] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert af.run_state(drained) == "running", poller.series
    fleet.get_by_role("button", name="Drain").click()
    fleet.locator("#draining").filter(has_text="asked by admin").wait_for(timeout=30_000)
    page.screenshot(path=screenshots / "14-draining.png")
    states = af.wait_settled(drained, timeout_s=300)
    assert af.run_state(drained) == "failed"
    assert {states["generate[0]"], states["generate[1]"]} == {"skipped"}, states  # drained, not failed
    assert states["stop_fleet"] == "success" and states["check_published"] == "failed", af.failures(drained)

    # Every request the shards sent was answered and kept (none lost in flight), the servers are gone.
    folder = RunLayout.of(af.second_root, safe_run_id(drained)).run_dir
    layout = RunLayout(folder)
    smoke = {s["server"]: len(s["results"]) for s in json.loads(layout.report("smoke").read_text())["servers"]}
    kept: dict[str, int] = {}
    for path in layout.result_files(COMPLETIONS):
        for server in pq.read_table(path, columns=["server"]).column("server").to_pylist():
            kept[server] = kept.get(server, 0) + 1
    sent = {}
    for spec in (json.loads(p.read_text()) for p in layout.fleet.server_specs()):
        name = f"server {spec['index']} (GPU {spec['gpu']}, 127.0.0.1:{spec['port']})"
        sent[name] = layout.fleet.server_log(spec["index"]).read_text().count(CHAT) - smoke[name]
        assert not _running(spec["pid"]), f"{name} (pid {spec['pid']}) still runs after the drain"
    assert sent == kept and 0 < sum(kept.values()) < 120, (sent, kept)

    # The pages say who stopped it: the Fleet tab, the Data-quality tab (the verdict's first line), the runs list.
    fleet = open_run_tab(page, af, drained, "dflash-fleet", "Fleet")
    assert "Drained by admin" in fleet.locator("#draining").inner_text()
    page.screenshot(path=screenshots / "15-drained-fleet.png")
    quality = open_run_tab(page, af, drained, "dflash-quality", "Data quality")
    assert "drained by admin" in quality.locator("#failures").inner_text()
    page.goto(f"{af.url}/dflash/")
    assert "drained by admin" in page.locator("#runs tr", has_text=drained).inner_text()

    # The ETA, read every 2 s from the first checkpoint until the drain, against the run's final figure: the prompts
    # left at each reading over the rate the run kept up over its whole generation, its answers over the time from
    # its first to its last (read from its completions: no pause in this run). Not a wall-clock end: the drain cut
    # the run short, and a rate is what an ETA extrapolates. Both sides come from this run on this machine, so a
    # busy box slows both alike.
    finished = sorted(t for path in layout.result_files(COMPLETIONS)
                      for t in pq.read_table(path, columns=["finished_at"]).column("finished_at").to_pylist())
    final_rate = len(finished) / (finished[-1] - finished[0])
    series = poller.finish()
    readings = [s for s in series if s["rate"] and not s["draining"] and s["state"] == "running" and s["left"]]
    ratios = [s["eta_s"] * final_rate / s["left"] for s in readings]
    shown = "\n".join(f"{s['at'] - series[0]['at']:6.1f} s: done {s['done']}, left {s['left']}, eta "
                      f"{s['eta_s']}, rate {s['rate']}, {s['source']}, {s['state']}"
                      f"{', draining' if s['draining'] else ''}" for s in series)
    assert len(readings) >= 3, f"too few readings from the first checkpoint to the drain:\n{shown}"
    assert all(0.5 <= r <= 2 for r in ratios), \
        f"ETA / (left / final rate {final_rate:.3f}/s): {[round(r, 2) for r in ratios]}\n{shown}"
    print(f"ETA ratios {min(ratios):.2f}..{max(ratios):.2f} over {len(ratios)} readings; final rate "
          f"{final_rate:.3f} prompts/s\n{shown}")

    page.close()
