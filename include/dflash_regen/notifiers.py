"""The run's news through Airflow's notifiers (docs/be-told-and-watch.md): the callbacks that tell, and the sending.

notify.py builds each message; this module picks the receivers the run names (email through an SMTP connection,
Apprise URLs and connection) and sends it. Telling never fails a task or the run: a warning in the log.
"""

from __future__ import annotations

import html
import logging
import time

from airflow.sdk import BaseHook, BaseNotifier
from airflow.sdk.configuration import conf
from airflow.sdk.exceptions import AirflowNotFoundException

from dflash_regen import notify
from dflash_regen.settings.run_config import DEFAULTS, NotifySettings, RunConfig

log = logging.getLogger(__name__)


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


def node_left_out(cfg: RunConfig, run_id: str, task: str, error: BaseException) -> None:
    """Several nodes: `cfg`'s node is left out of run `run_id`, its `task` failed with `error`."""
    _send(cfg, notify.node_left_out(run_id, cfg.node, task, error, _links(run_id)))
