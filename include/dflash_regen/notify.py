"""What a run tells its operator: each message's text, built from the run's folder, and when it is due.

A message opens with what happened and to which run, then the links to the run's pages (Airflow's run page and
the Fleet page), then the details. tasks.py sends it through Airflow's notifiers (SMTP, Apprise) to the
receivers the run's Params and Airflow connections name (docs/be-told-and-watch.md). Every text passes through
`redacted` first: the SGLang API key never leaves the run folder. No Airflow import here.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import quote

from dflash_regen import atomic
from dflash_regen.fleet.servers import API_KEY_ENV, redact
from dflash_regen.layout import RunLayout
from dflash_regen.ui.progress import run_progress

# Tasks whose failure is a failed gate: the fleet or the data was proven unfit (a message at once, named so).
GATES = ("health_check", "smoke_test", "autotune", "calibrate", "validate")
SHARD_TASK = "generate"  # its failure for good (no retries left) is a message of its own: the run goes on
VERDICT = "check_published"  # fails whenever nothing was published: named only when no other task failed
PAGES = "/dflash"  # where plugins/dflash_regen_ui.py mounts the report pages


@dataclass(frozen=True)
class Message:
    title: str  # the first line: what happened, to which run
    links: tuple[str, ...]
    details: tuple[str, ...] = ()
    failure: bool = True

    def text(self) -> str:
        return "\n".join([self.title, *self.links, *([""] if self.details else []), *self.details])


def first_line(error: object) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def run_links(base_url: str, dag_id: str, run_id: str) -> tuple[str, ...]:
    """Airflow's page of the run and the run's Fleet page (progress, shards, servers), under Airflow's base URL."""
    base, run = base_url.rstrip("/"), quote(run_id, safe="")
    return f"{base}/dags/{quote(dag_id)}/runs/{run}", f"{base}{PAGES}/runs/{run}/fleet"


def duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{max(minutes, 1)} min"


def _base_task(task_id: str) -> str:
    return task_id.rsplit(".", 1)[-1]  # <node>.health_check with several nodes


def task_failed(run_id: str, task_id: str, label: str, error: object, links: tuple[str, ...]) -> Message | None:
    """The message for a task that failed for good, when its failure is news before the run ends: a gate, or a
    shard (the other shards go on for hours). Any other task's failure is told by the run-failed message."""
    line = first_line(error)
    if _base_task(task_id) in GATES:
        return Message(f"Run {run_id}: gate {label} failed: {line}", links)
    if _base_task(task_id) == SHARD_TASK:
        return Message(f"Run {run_id}: {label} failed for good (no retries left): {line}", links,
                       ("The other shards go on; once the cause is fixed, clear this task to send its missing "
                        "prompts again (docs/operations.md).",))
    return None


def _record(layout: RunLayout, task_id: str, map_index: int) -> Path:
    return layout.notifications_dir / f"failed-{task_id}-{map_index}.json"


def record_failure(layout: RunLayout, task_id: str, map_index: int, label: str, error: object) -> None:
    """A task that failed for good: its first error line, for the run-failed message (the callback of a task sees
    its error; the run's callback does not)."""
    atomic.write_json(_record(layout, task_id, map_index),
                      {"task": label, "error": first_line(error), "at": time.time()})


def forget_failure(layout: RunLayout, task_id: str, map_index: int) -> None:
    """The task succeeded (cleared after its failure, then run again): the run's message no longer names it."""
    _record(layout, task_id, map_index).unlink(missing_ok=True)


def recorded_failures(layout: RunLayout) -> list[dict]:
    rows = [json.loads(p.read_text()) for p in layout.notifications_dir.glob("failed-*.json")]
    return sorted(rows, key=lambda r: r["at"])


def run_failed(run_id: str, failures: list[dict], reason: str, links: tuple[str, ...]) -> Message:
    """The run ended failed: every task that failed for good with its first error line, in the order they failed."""
    failures = [f for f in failures if f["task"] != VERDICT] or failures
    names = ", ".join(f["task"] for f in failures)
    title = f"Run {run_id} failed: {names}" if names else f"Run {run_id} failed ({reason})"
    details = [f"{f['task']}: {f['error']}" for f in failures]
    return Message(title, links, tuple(details) + ((f"Airflow's reason: {reason}",) if reason else ()))


def node_left_out(run_id: str, node: str, task: str, error: object, links: tuple[str, ...]) -> Message:
    return Message(f"Run {run_id}: node {node} left out, its {task} failed: {first_line(error)}", links,
                   ("Its shards go to the nodes that passed their gates (Param node_failure = continue).",))


def published(run_id: str, version_dir: Path, wall_s: float | None, links: tuple[str, ...]) -> Message:
    """The run published: where, how many samples of how many prompts, the quality verdict and the wall time."""
    manifest = json.loads((version_dir / "manifest.json").read_text())
    counts, quality = manifest["counts"], manifest.get("quality") or {}
    stats = quality.get("statistics") or {}
    verdict = "passed" if quality.get("success") else "FAILED"
    reasons = ", ".join(f"{k} {v:,}" for k, v in sorted((counts.get("quarantined_by_reason") or {}).items()))
    details = (f"Dataset: {version_dir}",
               f"Prompts {counts['prompts']:,} = published {counts['published']:,} + quarantined "
               f"{counts['quarantined']:,}" + (f" ({reasons})" if reasons else ""),
               f"Quality gate {verdict}: {stats.get('successful_expectations', '?')} of "
               f"{stats.get('evaluated_expectations', '?')} expectations met",
               f"Wall time: {duration(wall_s) if wall_s is not None else 'unknown'}")
    return Message(f"Run {run_id} published {counts['published']:,} samples", links, details, failure=False)


def progress_due(layout: RunLayout, every_h: float, started_at: float, now: float | None = None) -> int:
    """The number of the progress message due now (one every `every_h` hours since the run started), or 0. The
    first caller past each mark claims it (a file created exclusively), so shards ending at once send it once."""
    if every_h <= 0:
        return 0
    mark = int(((time.time() if now is None else now) - started_at) // (every_h * 3600))
    if mark < 1:
        return 0
    layout.notifications_dir.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(layout.notifications_dir / f"progress-{mark}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return 0
    return mark


def progress(run_id: str, layout: RunLayout, elapsed_s: float, links: tuple[str, ...]) -> Message:
    """Prompts done of those planned, and the ETA: the Fleet page's figures (ui/progress.py)."""
    _, p = run_progress(layout.run_dir)
    done, planned, eta = p["done"], p["planned"], p["eta_s"]
    share = f" ({p['share']:.0%})" if p.get("share") is not None else ""
    of = f"{planned:,}" if planned is not None else "?"
    title = (f"Run {run_id}: {done:,} of {of} prompts done{share} after "
             f"{duration(elapsed_s)}, ETA {'done' if eta == 0 else duration(eta) if eta is not None else 'unknown'}")
    return Message(title, links, (f"ETA from: {p['eta_source']}",) if p.get("eta_source") else (), failure=False)


def secrets(layout: RunLayout) -> set[str]:
    """The SGLang API keys this run may have used: the deployment's (env) and each fleet's, autotune's included."""
    keys = {os.environ.get(API_KEY_ENV, "")}
    for fleets in ("fleet", "autotune"):  # not the whole run folder: it holds a file per checkpoint
        keys |= {path.read_text().strip() for path in (layout.run_dir / fleets).glob("**/api_key")}
    return {k for k in keys if k}


def redacted(message: Message, keys: set[str]) -> Message:
    def clean(text: str) -> str:
        for key in keys:
            text = redact(text, key)
        return text

    return replace(message, title=clean(message.title), links=tuple(map(clean, message.links)),
                   details=tuple(map(clean, message.details)))
