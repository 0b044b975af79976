"""The thin adapter between the DAG and the library: Params in, typed config, plain results out.

Each function is one task body: it builds the run's config, calls one function of its stage's package and returns
its value. They pass paths and small dicts (XCom), never data; the stages write their full reports into the run's
`reports/` folder. What is Airflow's stays here: skipping a task, failing it at once, a node left out, the
callbacks. Errors that a retry cannot fix (bad Params, a failed gate, no space on the RAM disk) become
`AirflowFailException`, so Airflow fails the task at once with the library's one-line explanation.
"""

from __future__ import annotations

import functools
import html
import logging
import time
from pathlib import Path

from airflow.sdk import BaseHook, BaseNotifier
from airflow.sdk.configuration import conf
from airflow.sdk.definitions.retry_policy import RetryDecision, RetryPolicy
from airflow.sdk.exceptions import AirflowFailException, AirflowNotFoundException, AirflowSkipException

from dflash_regen import notify, publish, quality
from dflash_regen.capacity import autotune, health, report
from dflash_regen.demo.model import model_source
from dflash_regen.demo.prompts import prompt_source
from dflash_regen.errors import Drained, NotRetryable
from dflash_regen.fleet import runlock, servers, smoke, staging
from dflash_regen.generate import run_plan, store
from dflash_regen.generate.shard import run_shard
from dflash_regen.settings import nodes
from dflash_regen.settings.run_config import DEFAULTS, NotifySettings, RunConfig
from dflash_regen.training import tokenize

log = logging.getLogger(__name__)


def fail_fast(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NotRetryable as exc:
            # One exception in the library error's place (its traceback, its cause): the task log's error then
            # opens with the library's message instead of repeating it under a second traceback.
            raise AirflowFailException(f"{type(exc).__name__}: {exc}").with_traceback(exc.__traceback__) \
                from exc.__cause__

    return wrapper


def log_reason(context) -> None:
    """A failed or retried task's callback: its error's first line once more, at the end of the task log, where
    the log opens (the traceback is above it)."""
    error = context.get("exception")
    if error is not None:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        log.error("%s failed: %s", context["ti"].task_id if context.get("ti") else "the task", first)


class RunNotifier(BaseNotifier):
    """The run's news through Airflow's notifiers (docs/be-told-and-watch.md). `event` is one of EVENTS: every
    task's failure and success callbacks (a gate, a shard failed for good; a success after a clear), generate's
    success callback (progress every N hours) and the DAG's own callbacks (the run failed, the run published),
    which the dag processor runs under a scheduler and `dag.test` in its own process. Telling never fails a task
    or the run: a warning in the log."""

    def __init__(self, event: str):
        super().__init__()
        self.event = event

    def render_template_fields(self, context, jinja_env=None) -> None:
        """Nothing to render (no template fields); and `dag.test` hands the DAG's callbacks its serialized DAG,
        which has no template environment, so BaseNotifier's rendering would fail the callback there."""

    def notify(self, context) -> None:
        try:
            EVENTS[self.event](context, dict(context.get("params") or DEFAULTS), context["run_id"])
        except Exception as exc:  # noqa: BLE001 - a message lost is a warning, never a failed task or run
            log.warning("%s notification not sent: %s: %s", self.event, type(exc).__name__, exc)


def _links(run_id: str) -> tuple[str, ...]:
    base = conf.get("api", "base_url", fallback=None) or "http://localhost:8080"
    return notify.run_links(base, "dflash_regen", run_id)


def _defined(conn_id: str) -> bool:
    try:
        return BaseHook.get_connection(conn_id) is not None
    except AirflowNotFoundException:
        return False


def _notifiers(settings: NotifySettings, message: notify.Message) -> list[tuple[str, BaseNotifier]]:
    """Each receiver the run names, as an Airflow notifier: email (SMTP connection), Apprise URLs (Param) and the
    Apprise connection's; none configured = none."""
    from airflow.providers.apprise.notifications.apprise import AppriseNotifier
    from airflow.providers.smtp.notifications.smtp import SmtpNotifier
    from apprise import AppriseConfig, NotifyType

    out: list[tuple[str, BaseNotifier]] = []
    smtp = settings.notify_smtp_conn_id
    if settings.notify_email_to and _defined(smtp):
        out.append((f"email via {smtp}", SmtpNotifier(to=settings.notify_email_to.split(","), subject=message.title,
                                                     html_content=f"<pre>{html.escape(message.text())}</pre>",
                                                     smtp_conn_id=smtp)))
    elif settings.notify_email_to:
        log.warning("Param notify_email_to is set but Airflow has no connection %r: no email sent", smtp)
    kind = NotifyType.FAILURE if message.failure else NotifyType.SUCCESS
    if settings.notify_apprise_urls:
        urls = AppriseConfig()
        urls.add_config("\n".join(settings.notify_apprise_urls), format="text")
        out.append(("Apprise URLs", AppriseNotifier(body=message.text(), notify_type=kind, config=urls)))
    if _defined(settings.notify_apprise_conn_id):
        out.append((f"Apprise via {settings.notify_apprise_conn_id}",
                    AppriseNotifier(body=message.text(), notify_type=kind,
                                    apprise_conn_id=settings.notify_apprise_conn_id)))
    return out


def _send(cfg: RunConfig, message: notify.Message | None) -> None:
    """To every receiver, the API key redacted; a receiver that fails (down, refused) is a warning in the log. The
    notifiers get no context: the text is whole (see RunNotifier.render_template_fields)."""
    if message is None:
        return
    try:
        message = notify.redacted(message, notify.secrets(cfg.layout))
        receivers = _notifiers(cfg.notify, message)
    except Exception as exc:  # noqa: BLE001 - unreadable key file, bad connection: a warning (the text unredacted)
        log.warning("a message was not sent: %s: %s", type(exc).__name__, exc)
        return
    for receiver, notifier in receivers:
        try:
            notifier.notify({})
        except Exception as exc:  # noqa: BLE001 - the run goes on whatever the receiver does
            log.warning("%s: %r not sent: %s: %s", receiver, message.title, type(exc).__name__, exc)


def _task_failed(context, params: dict, run_id: str) -> None:
    """A task failed for good: its first error line kept for the run-failed message; a gate or a shard told now."""
    ti, cfg = context["ti"], RunConfig.from_params(params, run_id)
    label = ti.task_id + (f" [{getattr(ti, 'rendered_map_index', None) or ti.map_index}]" if ti.map_index >= 0 else "")
    notify.record_failure(cfg.layout, ti.task_id, ti.map_index, label, context.get("exception"))
    _send(cfg, notify.task_failed(run_id, ti.task_id, label, context.get("exception"), _links(run_id)))


def _task_succeeded(context, params: dict, run_id: str) -> None:
    ti = context["ti"]
    notify.forget_failure(RunConfig.from_params(params, run_id).layout, ti.task_id, ti.map_index)


def _run_failed(context, params: dict, run_id: str) -> None:
    cfg = RunConfig.from_params(params, run_id)
    failures = notify.recorded_failures(cfg.layout)
    _send(cfg, notify.run_failed(run_id, failures, context.get("reason", ""), _links(run_id)))


def _wall_s(context) -> float | None:
    start = getattr(context.get("dag_run"), "start_date", None)
    return time.time() - start.timestamp() if start else None


def _published(context, params: dict, run_id: str) -> None:
    cfg = RunConfig.from_params(params, run_id)
    _send(cfg, notify.published(run_id, cfg.publish_dir, _wall_s(context), _links(run_id)))


def _progress(context, params: dict, run_id: str) -> None:
    """A shard ended (generate's success callback, in place of the default one): progress every N hours."""
    cfg, wall_s, ti = RunConfig.from_params(params, run_id), _wall_s(context), context["ti"]
    notify.forget_failure(cfg.layout, ti.task_id, ti.map_index)  # what _task_succeeded does, on the same config
    if wall_s is not None and notify.progress_due(cfg.layout, cfg.notify.notify_progress_h, time.time() - wall_s):
        _send(cfg, notify.progress(run_id, cfg.layout, wall_s, _links(run_id)))


EVENTS = {"task_failed": _task_failed, "task_succeeded": _task_succeeded, "run_failed": _run_failed,
          "published": _published, "progress": _progress}


def _cfg(params: dict, run_id: str, node: dict | None = None) -> RunConfig:
    """The run's config, as one node of several sees it (its GPUs, ports, staging dir, fleet dir) when given."""
    if not node:
        return RunConfig.from_params(params, run_id)
    spec = nodes.Node(**node)
    return RunConfig.from_params(spec.apply(params), run_id, node=spec.name)


def leave_out_node(fn):
    """With several nodes and Param node_failure = continue, a node's setup that fails for good leaves the node
    out (skipped, its reason in reports/nodes/<node>/left_out.json) and the run goes on with the others."""
    @functools.wraps(fn)
    def wrapper(params: dict, run_id: str, *args, node: dict | None = None, **kwargs):
        try:
            return fn(params, run_id, *args, node=node, **kwargs)
        except AirflowFailException as exc:
            if not node or params.get("node_failure") != "continue":
                raise
            cfg = _cfg(params, run_id, node)
            cfg.layout.write_report(nodes.LEFT_OUT, {"node": cfg.node, "task": fn.__name__, "error": str(exc),
                                                     "at": time.time()})
            _send(cfg, notify.node_left_out(run_id, cfg.node, fn.__name__, exc, _links(run_id)))
            raise AirflowSkipException(f"node {cfg.node} is left out of this run (Param node_failure = continue), "
                                       f"its {fn.__name__} failed: {exc}") from exc

    return wrapper


def _model_dir(cfg: RunConfig) -> Path:
    return staging.model_dir(cfg, model_source(cfg))


def _run_is_active(run_id: str) -> bool:
    """Whether Airflow runs `run_id` of this DAG now (its tasks' processes come and go)."""
    from airflow.sdk import get_current_context

    try:
        ti = get_current_context()["ti"]
        return ti.get_dagrun_state(ti.dag_id, run_id) in {"running", "queued"}
    except Exception as exc:  # noqa: BLE001 - no record (deleted by a re-trigger) or no scheduler: not running
        log.info("Airflow knows no running run %r (%s: %s)", run_id, type(exc).__name__, exc)
        return False


def _check_inputs(params: dict, run_id: str) -> dict:
    cfg = RunConfig.from_params(params, run_id)  # validates every Param before any GPU work
    runlock.open_run(cfg, run_id, _run_is_active)
    return {"model_source_dir": str(model_source(cfg))}


@fail_fast
def check_inputs(params: dict, run_id: str) -> dict:
    """Several nodes: the run's inputs and lock once, before each node stages the weights to its own RAM disk."""
    return _check_inputs(params, run_id)


@leave_out_node
@fail_fast
def stage_weights(params: dict, run_id: str, shards: list[dict] | None = None, checked: dict | None = None,
                  node: dict | None = None) -> dict:
    """One node: the run's inputs and lock checked here (`checked` None); several: by check_inputs."""
    checked = checked or _check_inputs(params, run_id)
    cfg = _cfg(params, run_id, node)
    if shards is not None and (why := store.nothing_to_generate(shards)):
        raise AirflowSkipException(why)  # the fleet setups and its teardown skip after it; tokenize and the rest run
    nodes.forget_decision(cfg.layout)  # a run (or the same run id again) decides afresh whether the node takes part
    return staging.stage_run(cfg, Path(checked["model_source_dir"]))


@leave_out_node
@fail_fast
def launch_fleet(params: dict, run_id: str, model_path: str, node: dict | None = None) -> dict:
    return runlock.launch_run(_cfg(params, run_id, node), Path(model_path))


@leave_out_node
@fail_fast
def health_check(params: dict, run_id: str, launched: dict, node: dict | None = None) -> dict:
    return health.check_fleet(_cfg(params, run_id, node), launched)


@leave_out_node
@fail_fast
def smoke_test(params: dict, run_id: str, launched: dict, node: dict | None = None) -> dict:
    return smoke.smoke_fleet(_cfg(params, run_id, node), launched)


@leave_out_node
@fail_fast
def autotune_fleet(params: dict, run_id: str, model_path: str, launched: dict, shards: list[dict],
                   node: dict | None = None) -> dict:
    """The fleet autotune leaves (relaunched, or `launched` itself) with what it chose."""
    return autotune.autotune_fleet(_cfg(params, run_id, node), Path(model_path), launched, shards)


@leave_out_node
@fail_fast
def calibrate(params: dict, run_id: str, fleet: dict, shards: list[dict], node: dict | None = None) -> dict:
    return report.calibrate_fleet(_cfg(params, run_id, node), fleet, shards)


def node_ready(params: dict, run_id: str, calibrated: dict, node: dict) -> dict:
    """Several nodes: this node passed every gate. Not a setup: a cleared shard does not re-decide the split."""
    return report.node_ready(_cfg(params, run_id, node), calibrated)


def stop_fleet(launched: dict) -> list[str]:
    return servers.stop_fleet(Path(launched["fleet_dir"]))


@fail_fast
def assign_shards(params: dict, run_id: str, shards: list[dict], node_names: list[str]) -> dict[str, list[dict]]:
    """Several nodes: shards to the nodes that passed their gates, in proportion to each one's calibrated rate
    (prompts/s of its fleet; by healthy server count when a node was not calibrated). `reports/assignment.json`."""
    cfg = RunConfig.from_params(params, run_id)
    return nodes.assign_run(cfg.layout, shards, node_names, params.get("node_failure") == "continue")


@fail_fast
def plan_shards(params: dict, run_id: str) -> list[dict]:
    """Shard descriptors for `generate.expand()`: small dicts, never the prompts themselves."""
    cfg = RunConfig.from_params(params, run_id)
    # Airflow fails the expansion of more mapped tasks than this, after planning: refuse them here with the fix.
    max_shards = conf.getint("core", "max_map_length", fallback=1024)
    return run_plan.plan_run(cfg, prompt_source(cfg), model_source(cfg), max_shards)


@fail_fast
def generate(params: dict, run_id: str, shard: dict, node: dict | None = None, ti=None) -> dict:
    cfg = _cfg(params, run_id, node)
    if ti is not None and _retries_used(ti) > cfg.generation.generate_retries:
        raise AirflowFailException(f"{shard['label']} not run again: try {ti.try_number - 1} was killed and "
                                   f"{_no_retry_left(cfg.generation.generate_retries)} (its log says more)")
    try:
        return run_shard(cfg, shard)
    except Drained as exc:  # the operator's drain: not a failure, nothing to retry
        raise AirflowSkipException(str(exc)) from exc


def _retries_used(ti) -> int:
    """Retries since the task was last cleared: Airflow counts tries across clears, and a clear sets max_tries =
    try_number + retries, so this attempt's first try is max_tries - retries + 1."""
    return ti.try_number - (ti.max_tries - ti.task.retries + 1)


def _no_retry_left(allowed: int) -> str:
    return f"this run's generate_retries is {allowed}; clear the task to run it again"


class GenerateRetries(RetryPolicy):
    """The run's Param generate_retries within the generate task's fixed retries (the DAG gives it the most,
    GENERATE_RETRIES_MAX): once they are used, a failure fails the task for good, its error unchanged. A task
    process killed from outside is retried by Airflow without asking; `generate` then fails that try at once."""

    def evaluate(self, exception, try_number, max_tries, context=None) -> RetryDecision:
        if not context or "generate_retries" not in (context.get("params") or {}):
            return RetryDecision.default()
        allowed = int(context["params"]["generate_retries"])
        return RetryDecision.fail(_no_retry_left(allowed)) if _retries_used(context["ti"]) >= allowed \
            else RetryDecision.default()


@fail_fast
def tokenize_shard(params: dict, run_id: str, generated: dict | None, shard: dict, node: dict | None = None) -> dict:
    """`generated` is None when generate was skipped: the store supplied the whole run (`plan_reuse` merged it)."""
    cfg = _cfg(params, run_id, node)  # the tokenizer is in the node's staged model dir
    index, path = (generated["shard"], Path(generated["path"])) if generated else (shard["shard"], None)
    try:
        return tokenize.tokenize_completions(cfg, index, path, _model_dir(cfg))
    except Drained as exc:  # the operator's drain: not a failure, nothing to retry
        raise AirflowSkipException(str(exc)) from exc


@fail_fast
def validate(params: dict, run_id: str, shards: list[dict]) -> dict:
    return quality.gate_run(RunConfig.from_params(params, run_id), shards)


@fail_fast
def publish_dataset(params: dict, run_id: str, validated: dict) -> dict:
    cfg = RunConfig.from_params(params, run_id)
    # Not where the run's news goes: the deployment's, and an Apprise URL may hold a token.
    config = {k: v for k, v in params.items() if k != "emulator_faults" and not k.startswith("notify_")}
    return publish.publish_validated(cfg, validated, config, _model_dir(cfg))


@fail_fast
def check_published(params: dict, run_id: str) -> dict:
    """The run's verdict: a run that published nothing is failed, whatever skipped or was marked."""
    return publish.check_published(RunConfig.from_params(params, run_id))
