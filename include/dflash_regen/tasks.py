"""The thin adapter between the DAG and the library: Params in, typed config, plain results out.

Each function is one task body: it builds the run's config, calls one function of its stage's package and returns
its value. They pass paths and small dicts (XCom, the types in payloads.py), never data; the stages write their full
reports into the run's `reports/` folder. What is Airflow's stays here: skipping a task, failing it at once, a node
left out, the log callback (the run's news: notifiers.py). Errors that a retry cannot fix (bad Params, a failed
gate, no space on the RAM disk) become `AirflowFailException`, so Airflow fails the task at once with the library's
one-line explanation; a `Skipped` (a drain, a run the store completes) becomes `AirflowSkipException`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Concatenate, ParamSpec, TypeVar, cast

from airflow.sdk.configuration import conf
from airflow.sdk.definitions.retry_policy import RetryDecision, RetryPolicy
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from dflash_regen import atomic, notifiers, publish, quality
from dflash_regen.capacity import autotune, health, report
from dflash_regen.demo.model import model_source
from dflash_regen.demo.prompts import prompt_source
from dflash_regen.errors import ConfigError, NotRetryable, Skipped
from dflash_regen.fleet import runlock, servers, smoke, staging
from dflash_regen.generate import run_plan, skip
from dflash_regen.generate.shard import run_shard
from dflash_regen.payloads import (
    Assignment,
    Calibrated,
    CheckedInputs,
    Fleet,
    Generated,
    Health,
    NodeReady,
    Published,
    Pulled,
    Shard,
    Smoke,
    Staged,
    Tokenized,
    Tuned,
    Validated,
    Verdict,
)
from dflash_regen.settings import nodes
from dflash_regen.settings.deployment import deployment
from dflash_regen.settings.run_config import RunConfig
from dflash_regen.training import tokenize

log = logging.getLogger(__name__)


P = ParamSpec("P")
R = TypeVar("R")


def fail_fast(fn: Callable[P, R]) -> Callable[P, R]:
    """A library error retrying cannot fix fails the task at once; a `Skipped` (a drain, a run the store completes)
    skips it."""
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except NotRetryable as exc:
            raise _failed(exc) from exc.__cause__
        except Skipped as exc:  # not a failure (a drain, a run the store completes), nothing to retry
            raise AirflowSkipException(str(exc)) from exc
        except OSError as exc:
            if not atomic.is_disk_full(exc):
                raise
            raise _failed(atomic.disk_full(_written(exc, args, kwargs))) from exc

    return wrapper


def _failed(exc: NotRetryable) -> AirflowFailException:
    """One exception in the library error's place (its traceback): the task log's error then opens with the
    library's message instead of repeating it under a second traceback. A full disk met outside atomic.py (a
    server's log, the fleet's records) comes here as a DiskFull too, not as a bare "[Errno 28]"."""
    return AirflowFailException(_on_host(f"{type(exc).__name__}: {exc}")).with_traceback(exc.__traceback__)


def _written(exc: OSError, args: tuple, kwargs: dict) -> Path:
    """The file the failed write named, else the output root the task writes under (Params: every task's first
    argument)."""
    params = kwargs["params"] if "params" in kwargs else args[0]
    return Path(exc.filename if exc.filename else params.get("output_root") or deployment().output_root)


def _on_host(message: str) -> str:
    """The error as the operator on the host reads it: the host's path beside the container's (a container
    mounts the output root from the host folder DFLASH_OUTPUT_ROOT_ON_HOST names)."""
    try:
        return deployment().on_host(message)
    except ConfigError:  # a bad variable is told where the DAG is parsed; never hide the task's own error
        return message


def log_reason(context) -> None:
    """A failed or retried task's callback: its error's first line once more, at the end of the task log, where
    the log opens (the traceback is above it)."""
    error = context.get("exception")
    if error is not None:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        log.error("%s failed: %s", context["ti"].task_id if context.get("ti") else "the task", first)


def _cfg(params: dict, run_id: str, node: dict | None = None) -> RunConfig:
    """The run's config, as one node of several sees it (its GPUs, ports, staging dir, fleet dir) when given."""
    if not node:
        return RunConfig.from_params(params, run_id)
    spec = nodes.Node(**node)
    return RunConfig.from_params(spec.apply(params), run_id, node=spec.name)


def leave_out_node(fn: Callable[Concatenate[dict, str, P], R]) -> Callable[Concatenate[dict, str, P], R]:
    """With several nodes and Param node_failure = continue, a node's setup that fails for good leaves the node
    out (skipped, its reason in reports/nodes/<node>/left_out.json, told) and the run goes on with the others."""
    @functools.wraps(fn)
    def wrapper(params: dict, run_id: str, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(params, run_id, *args, **kwargs)
        except AirflowFailException as exc:
            if not (isinstance(node := kwargs.get("node"), dict) and node) or params.get("node_failure") != "continue":
                raise
            cfg = _cfg(params, run_id, node)
            nodes.record_left_out(cfg.layout, cfg.node, fn.__name__, exc)
            notifiers.node_left_out(cfg, run_id, fn.__name__, exc)
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


def _check_inputs(params: dict, run_id: str) -> CheckedInputs:
    cfg = RunConfig.from_params(params, run_id)  # validates every Param before any GPU work
    runlock.open_run(cfg, run_id, _run_is_active)
    return {"model_source_dir": str(model_source(cfg))}


@fail_fast
def check_inputs(params: dict, run_id: str) -> CheckedInputs:
    """Several nodes: the run's inputs and lock once, before each node stages the weights to its own RAM disk."""
    return _check_inputs(params, run_id)


@leave_out_node
@fail_fast
def stage_weights(params: dict, run_id: str, shards: list[Shard] | None = None, checked: CheckedInputs | None = None,
                  node: dict | None = None) -> Staged:
    """One node: the run's inputs and lock checked here (`checked` None), skipped when the store completes the run
    (`shards`); several: by check_inputs, the split after staging (`shards` None)."""
    checked = checked or _check_inputs(params, run_id)
    return skip.stage_unless_stored(_cfg(params, run_id, node), Path(checked["model_source_dir"]), shards)


@leave_out_node
@fail_fast
def launch_fleet(params: dict, run_id: str, model_path: str, node: dict | None = None) -> Fleet:
    return runlock.launch_run(_cfg(params, run_id, node), Path(model_path))


@leave_out_node
@fail_fast
def health_check(params: dict, run_id: str, launched: Fleet, node: dict | None = None) -> Health:
    return health.check_fleet(_cfg(params, run_id, node), launched)


@leave_out_node
@fail_fast
def smoke_test(params: dict, run_id: str, launched: Fleet, node: dict | None = None) -> Smoke:
    return smoke.smoke_fleet(_cfg(params, run_id, node), launched)


@leave_out_node
@fail_fast
def autotune_fleet(params: dict, run_id: str, model_path: str, launched: Fleet, shards: list[Shard],
                   node: dict | None = None) -> Tuned:
    """The fleet autotune leaves (relaunched, or `launched` itself) with what it chose."""
    return autotune.autotune_fleet(_cfg(params, run_id, node), Path(model_path), launched, shards)


@leave_out_node
@fail_fast
def calibrate(params: dict, run_id: str, fleet: Tuned, shards: list[Shard], node: dict | None = None) -> Calibrated:
    return report.calibrate_fleet(_cfg(params, run_id, node), fleet, shards)


def node_ready(params: dict, run_id: str, calibrated: Calibrated, node: dict | None) -> NodeReady:
    """Several nodes: this node passed every gate. Not a setup: a cleared shard does not re-decide the split."""
    return report.node_ready(_cfg(params, run_id, node), calibrated)


def stop_fleet(launched: Fleet) -> list[str]:
    return servers.stop_fleet(Path(launched["fleet_dir"]))


@fail_fast
def assign_shards(params: dict, run_id: str, shards: list[Shard], node_names: list[str]) -> Assignment:
    """Several nodes: shards to the nodes that passed their gates, in proportion to each one's calibrated rate
    (prompts/s of its fleet; by healthy server count when a node was not calibrated). `reports/assignment.json`."""
    cfg = RunConfig.from_params(params, run_id)
    return nodes.assign_run(cfg.layout, shards, node_names, params.get("node_failure") == "continue")


@fail_fast
def plan_shards(params: dict, run_id: str) -> list[Shard]:
    """Shard descriptors for `generate.expand()`: small dicts, never the prompts themselves."""
    cfg = RunConfig.from_params(params, run_id)
    # Airflow fails the expansion of more mapped tasks than this, after planning: refuse them here with the fix.
    max_shards = conf.getint("core", "max_map_length", fallback=1024)
    # The plan's shards, as planning wrote them (reports/plan.json when reused): descriptors from here on.
    return cast(list[Shard], run_plan.plan_run(cfg, prompt_source(cfg), model_source(cfg), max_shards))


@fail_fast
def generate(params: dict, run_id: str, shard: Shard, node: dict | None = None, ti=None) -> Generated:
    cfg = _cfg(params, run_id, node)
    if ti is not None and _retries_used(ti) > cfg.generation.generate_retries:
        raise AirflowFailException(f"{shard['label']} not run again: try {ti.try_number - 1} was killed and "
                                   f"{_no_retry_left(cfg.generation.generate_retries)} (its log says more)")
    return run_shard(cfg, shard)


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
def tokenize_shard(params: dict, run_id: str, generated: Generated | None, shard: Shard,
                   node: dict | None = None) -> Tokenized:
    """`generated` is None when generate was skipped: the store supplied the whole run (`plan_reuse` merged it)."""
    cfg = _cfg(params, run_id, node)  # the tokenizer is in the node's staged model dir
    index, path = (generated["shard"], Path(generated["path"])) if generated else (shard["shard"], None)
    return tokenize.tokenize_completions(cfg, index, path, _model_dir(cfg))


@fail_fast
def validate(params: dict, run_id: str, shards: list[Shard], tokenized: Sequence[Pulled[Tokenized]]) -> Validated:
    """The quality gate over what each node's tokenize returned, every planned shard (`shards`) expected."""
    results = [result for pulled in tokenized for result in _results(pulled)]
    return quality.gate_run(RunConfig.from_params(params, run_id), shards, results)


def _results(pulled: Pulled[Tokenized]) -> list[Tokenized]:
    """A mapped task's results as a downstream task gets them (payloads.Pulled) as a list: one alone in a list,
    a skipped instance's entry (absent, or Airflow's placeholder for it) left out."""
    items = [pulled] if isinstance(pulled, dict) else list(pulled or [])
    return [item for item in items if isinstance(item, dict)]


@fail_fast
def publish_dataset(params: dict, run_id: str, validated: Validated) -> Published:
    cfg = RunConfig.from_params(params, run_id)
    return publish.publish_validated(cfg, validated, publish.recorded_config(params), _model_dir(cfg))


@fail_fast
def check_published(params: dict, run_id: str) -> Verdict:
    """The run's verdict: a run that published nothing is failed, whatever skipped or was marked."""
    return publish.check_published(RunConfig.from_params(params, run_id))
