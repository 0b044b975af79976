"""The thin adapter between the DAG and the library: Params in, typed config, plain results out.

Each function is one task body. They pass paths and small dicts (XCom), never data, and write their full
reports into the run's `reports/` folder. Errors that a retry cannot fix (bad Params, a failed gate,
no space on the RAM disk) become `AirflowFailException`, so Airflow fails the task at once with the
library's one-line explanation instead of retrying it.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
from airflow.sdk.configuration import conf
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from dflash_regen import atomic, capacity, publish, quality
from dflash_regen.capacity import autotune
from dflash_regen.capacity.health import health_gate
from dflash_regen.chat.template import TokenizeError, load_tokenizer
from dflash_regen.demo.model import write_demo_model
from dflash_regen.demo.prompts import write_demo_prompts
from dflash_regen.errors import Drained, GateFailed, NotRetryable, PublishRefused
from dflash_regen.fleet import runlock, smoke, staging
from dflash_regen.fleet import servers as fleet_servers
from dflash_regen.generate import store
from dflash_regen.generate.shard import drain_request, run_shard
from dflash_regen.layout import COMPLETIONS, FAILURES, RunLayout
from dflash_regen.prompts import inputs, planning
from dflash_regen.settings import nodes
from dflash_regen.settings.nodes import LEFT_OUT, READY
from dflash_regen.settings.run_config import DEMO_MODEL, DEMO_PROMPTS, RunConfig
from dflash_regen.sglang.api import Dialect
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
            atomic.write_json(cfg.layout.node_report(LEFT_OUT), {"node": cfg.node, "task": fn.__name__,
                                                                "error": str(exc), "at": time.time()})
            raise AirflowSkipException(f"node {cfg.node} is left out of this run (Param node_failure = continue), "
                                       f"its {fn.__name__} failed: {exc}") from exc

    return wrapper




def write_report(cfg: RunConfig, name: str, report: dict) -> Path:
    # The fleet's own reports are per node when there are several; plan, quality and the rest per run.
    own = name in {"staging", "health", "smoke", "capacity"}
    path = cfg.layout.node_report(name) if own else cfg.layout.report(name)
    atomic.write_json(path, report)
    return path


def _gate(cfg: RunConfig, name: str, check) -> dict:
    """A fleet gate's report, written whether it passed or failed (the Fleet page shows why it failed)."""
    try:
        report = check()
    except GateFailed as exc:
        write_report(cfg, name, {"passed": False, "error": str(exc)})
        raise
    write_report(cfg, name, report)
    return report


def _servers(cfg: RunConfig, launched: dict) -> tuple[list[fleet_servers.Server], str]:
    """The servers of the fleet `launch_fleet` returned, as its folder records them now (autotune may have
    relaunched them), and its API key."""
    fleet_dir = Path(launched["fleet_dir"])
    servers = fleet_servers.load_servers(fleet_dir)
    if len(servers) != cfg.fleet.num_servers:
        raise GateFailed(f"{fleet_dir} records {len(servers)} servers, expected {cfg.fleet.num_servers}; "
                         "re-run launch_fleet")
    return servers, fleet_servers.read_api_key(fleet_dir)


def _accepted(shards: list[dict]) -> int:
    """The run's accepted prompts: every planned shard's."""
    return sum(s["prompts"] for s in shards)


def _to_generate(shards: list[dict]) -> int:
    """What is left to send: the accepted prompts the completion store did not have (what the fleet is sized for)."""
    return sum(s.get("to_generate", s["prompts"]) for s in shards)


@fail_fast
def stage_weights(params: dict, run_id: str, shards: list[dict] | None = None) -> dict:
    cfg = RunConfig.from_params(params, run_id)  # validates every Param before any GPU work
    source = _check_inputs(cfg, run_id)
    if shards is not None and store.nothing_to_generate(shards):
        # Skipped: the fleet setups and its teardown skip after it; tokenize, validate and publish run.
        raise AirflowSkipException(f"nothing to generate: the completion store holds all {_accepted(shards):,} "
                                   "prompts' completions under this run's generation settings (reports/plan.json "
                                   "`reuse`), so no weights are staged and no server is launched or gated")
    return _stage(cfg, source)


@fail_fast
def check_inputs(params: dict, run_id: str) -> dict:
    """Several nodes: the run's inputs and lock once, before each node stages the weights to its own RAM disk."""
    cfg = RunConfig.from_params(params, run_id)
    return {"model_source_dir": str(_check_inputs(cfg, run_id))}


@leave_out_node
@fail_fast
def stage_node(params: dict, run_id: str, checked: dict, node: dict | None = None) -> dict:
    cfg = _cfg(params, run_id, node)
    for name in (READY, LEFT_OUT):  # a run (or the same run id again) decides afresh whether the node takes part
        cfg.layout.node_report(name).unlink(missing_ok=True)
    return _stage(cfg, Path(checked["model_source_dir"]))


def _check_inputs(cfg: RunConfig, run_id: str) -> Path:
    """Output root, run lock and prompt source checked; returns the model dir to stage."""
    inputs.check_output_root(cfg.output_root)
    runlock.acquire(cfg.output_root, run_id, cfg.run_id, _run_is_active)
    if cfg.prompt_source != DEMO_PROMPTS:
        first = inputs.check_prompt_source(Path(cfg.prompt_source), cfg.plan.prompt_format)
        log.info("prompt source %s: first usable row at %s", cfg.prompt_source, first)
    return _model_source(cfg)


def _model_source(cfg: RunConfig) -> Path:
    if cfg.model_source_dir != DEMO_MODEL:
        return Path(cfg.model_source_dir)
    source = write_demo_model(cfg.output_root / "demo-model", with_tokenizer=True)  # idempotent
    log.info("demo: a stand-in model dir at %s", source)
    return source


def _model_dir(cfg: RunConfig) -> Path:
    """Where tokenize and publish read the tokenizer and config: the staged copy when this model was staged, else
    the source (a run whose every completion came from the store stages nothing)."""
    marker = cfg.staging_dir / staging.MARKER
    source = _model_source(cfg)
    if marker.is_file() and json.loads(marker.read_text()).get("source") == str(source):
        return cfg.staging_dir
    return source


def _stage(cfg: RunConfig, source: Path) -> dict:
    report = staging.stage(source, cfg.staging_dir)
    write_report(cfg, "staging", report.to_dict())
    return {"model_path": str(cfg.staging_dir), "copied_bytes": report.copied_bytes}


def _run_is_active(run_id: str) -> bool:
    """Whether Airflow runs `run_id` of this DAG now (its tasks' processes come and go)."""
    from airflow.sdk import get_current_context

    try:
        ti = get_current_context()["ti"]
        return ti.get_dagrun_state(ti.dag_id, run_id) in {"running", "queued"}
    except Exception as exc:  # noqa: BLE001 - no record (deleted by a re-trigger) or no scheduler: not running
        log.info("Airflow knows no running run %r (%s: %s)", run_id, type(exc).__name__, exc)
        return False


@leave_out_node
@fail_fast
def launch_fleet(params: dict, run_id: str, model_path: str, node: dict | None = None) -> dict:
    cfg = _cfg(params, run_id, node)
    runlock.reap_orphans(cfg.output_root, cfg.run_id)  # servers of runs that died before their teardown
    cfg.layout.drain_request.unlink(missing_ok=True)  # a (re)launch, after a drain the clear that resumes the run
    servers = fleet_servers.launch_fleet(cfg.fleet, Path(model_path), cfg.fleet_dir)
    return {"fleet_dir": str(cfg.fleet_dir), "servers": [{"index": s.index, "url": s.url, "gpu": s.gpu,
                                                            "pid": s.pid, "log": s.log_path} for s in servers]}


@leave_out_node
@fail_fast
def health_check(params: dict, run_id: str, launched: dict, node: dict | None = None) -> dict:
    cfg = _cfg(params, run_id, node)
    servers, key = _servers(cfg, launched)
    report = _gate(cfg, "health", lambda: health_gate(servers, key, cfg.fleet))
    return {"servers": len(servers), "total_running_slots": report["total_running_slots"]}


@leave_out_node
@fail_fast
def smoke_test(params: dict, run_id: str, launched: dict, node: dict | None = None) -> dict:
    cfg = _cfg(params, run_id, node)
    servers, key = _servers(cfg, launched)
    _gate(cfg, "smoke", lambda: smoke.smoke_gate(servers, key, cfg.sampling, cfg.fleet))
    return {"servers": len(servers), "passed": True}


@leave_out_node
@fail_fast
def autotune_fleet(params: dict, run_id: str, model_path: str, shards: list[dict], node: dict | None = None) -> dict:
    """Try server settings on the first GPU, report (`reports/autotune.json`), and with `apply` relaunch the
    fleet with the fastest; the fleet is re-gated (health + smoke) either way, since tuning took its first GPU."""
    cfg = _cfg(params, run_id, node)
    settings = cfg.autotune
    if settings.mode == "off":
        log.info("autotune off (Param autotune)")
        return {"mode": "off"}
    if not cfg.capacity.calibration_prompts:
        log.info("autotune skipped: it measures with calibration's sample and Param calibration_prompts is 0")
        return {"mode": settings.mode, "skipped": "calibration_prompts is 0"}
    print_ = autotune.fingerprint(cfg, _accepted(shards))
    report = autotune.read_report(cfg.node_reports_dir)
    reused = bool(report and report.get("fingerprint") == print_ and report.get("candidates"))
    if reused:
        log.info("autotune: reusing reports/autotune.json from an earlier attempt (same settings)")
    else:
        try:
            report = autotune.tune(cfg, Path(model_path), shards, _to_generate(shards),
                                   candidate_s=settings.candidate_s, budget_s=settings.budget_s,
                                   extra=list(settings.extra))
        except capacity.TooFewPrompts as exc:  # the fleet still runs: nothing was stopped
            log.warning("autotune skipped: %s", exc)
            return {"mode": settings.mode, "skipped": str(exc)}
        report["fingerprint"] = print_
    winner = next((r for r in report["candidates"] if r.get("chosen")), None)
    flags = winner["flags"] if settings.mode == "apply" and winner else ""
    run_cfg = cfg.with_extra_flags(flags) if flags else cfg
    report.update(mode=settings.mode, applied_flags=flags,
                  action=(f"fleet relaunched with {winner['candidate']}: {flags}" if flags else
                          "fleet relaunched with the run's own flags" +
                          (f"; to use {winner['candidate']}, add '{winner['flags']}' to server_flags or set Param "
                           "autotune to apply" if winner and winner["flags"] else "")))
    autotune.write_report(cfg.node_reports_dir, report)
    log.info("autotune (reports/autotune.json):\n%s", autotune.format_table(report))
    if reused and not flags:  # nothing was stopped: the fleet the setups launched and gated stays
        return {"mode": settings.mode, "chosen": report["chosen"], "applied_flags": "", "reused": True}
    started = time.monotonic()
    servers = fleet_servers.launch_fleet(run_cfg.fleet, Path(model_path), cfg.fleet_dir)
    key = fleet_servers.read_api_key(cfg.fleet_dir)
    try:
        write_report(cfg, "health", health_gate(servers, key, run_cfg.fleet))
        write_report(cfg, "smoke", smoke.smoke_gate(servers, key, run_cfg.sampling, run_cfg.fleet))
    except GateFailed:
        fleet_servers.stop_fleet(cfg.fleet_dir)
        raise
    report["relaunch_s"] = round(time.monotonic() - started, 1)
    autotune.write_report(cfg.node_reports_dir, report)
    return {"mode": settings.mode, "chosen": report["chosen"], "applied_flags": flags,
            "tuning_s": report["tuning_s"]}


@leave_out_node
@fail_fast
def calibrate(params: dict, run_id: str, launched: dict, shards: list[dict], node: dict | None = None) -> dict:
    """Measure one server on the run's prompts, advise, predict; `reports/capacity.json`."""
    cfg = _cfg(params, run_id, node)
    if not cfg.capacity.calibration_prompts:
        log.info("calibration skipped (Param calibration_prompts = 0)")
        return {"calibrated": False}
    servers, key = _servers(cfg, launched)
    fleet_dir = Path(launched["fleet_dir"])
    healthy = fleet_servers.healthy_servers(fleet_dir, servers)
    shape = capacity.RunShape(prompts=_to_generate(shards), servers=len(healthy), shard_size=cfg.plan.shard_size,
                              concurrency_per_server=cfg.generation.concurrency_per_server)
    tuned = autotune.applied_flags(cfg.node_reports_dir)  # the fleet runs the autotuned flags on top
    flags = " ".join(x for x in (cfg.fleet.server_flags, tuned or "") if x)
    print_ = capacity.fingerprint(cfg, flags, shape)
    report = capacity.read_report(cfg.node_reports_dir)
    if report and report.get("fingerprint") == print_:  # a cleared shard re-runs the setups: no GPU minutes again
        log.info("calibrate: reusing reports/capacity.json from an earlier attempt (same fleet settings and run)")
        return _calibrated(report)
    health = json.loads(cfg.layout.node_report("health").read_text())
    with fleet_servers.lease(fleet_dir, healthy, 0, wait_s=cfg.fleet.ready_timeout_s) as server:
        try:
            report = capacity.calibrate(server, key, health, shards, cfg.generation, shape,
                                        prompts=cfg.capacity.calibration_prompts, server_flags=flags,
                                        train_max_length=cfg.plan.train_max_length)
        except capacity.TooFewPrompts as exc:  # a run this small is over before a prediction would help
            log.warning("calibration skipped: %s", exc)
            return {"calibrated": False}
        except capacity.CapacityError as exc:
            if not fleet_servers.is_alive(server):  # so the retry measures another server, as a shard's would
                fleet_servers.mark_unhealthy(fleet_dir, server, str(exc))
            raise
    report["fingerprint"] = print_
    write_report(cfg, "capacity", report)
    log.info("capacity plan (reports/capacity.json):\n%s", capacity.format_table(report))
    return _calibrated(report)


def _calibrated(report: dict) -> dict:
    return {"calibrated": True, "binding": report["binding"]["resource"], "wall_s": report["scenarios"][0]["wall_s"],
            "advised_flags": report["advice"]["server_flags"]}


def node_ready(params: dict, run_id: str, calibrated: dict, node: dict) -> dict:
    """Several nodes: this node passed every gate; its rate (prompts/s of its healthy servers, measured by
    calibrate) decides its share of the shards. Not a setup: a cleared shard does not re-decide the split."""
    cfg = _cfg(params, run_id, node)
    healthy = fleet_servers.healthy_servers(cfg.fleet_dir, fleet_servers.load_servers(cfg.fleet_dir))
    report = capacity.read_report(cfg.node_reports_dir) if calibrated.get("calibrated") else None
    rps = report["scenarios"][0]["requests_per_s_per_server"] * len(healthy) if report else None
    ready = {"node": cfg.node, "servers": len(healthy), "prompts_per_s": rps}
    atomic.write_json(cfg.layout.node_report(READY), ready)
    return ready


def stop_fleet(launched: dict) -> list[str]:
    return fleet_servers.stop_fleet(Path(launched["fleet_dir"]))


@fail_fast
def assign_shards(params: dict, run_id: str, shards: list[dict], node_names: list[str]) -> dict[str, list[dict]]:
    """Several nodes: shards to the nodes that passed their gates, in proportion to each one's calibrated rate
    (prompts/s of its fleet; by healthy server count when a node was not calibrated). `reports/assignment.json`."""
    cfg = RunConfig.from_params(params, run_id)
    report, assigned = nodes.assign_run(cfg.layout, shards, node_names, params.get("node_failure") == "continue")
    write_report(cfg, "assignment", report)
    return {name: assigned.get(name, []) for name in node_names}


@fail_fast
def plan_shards(params: dict, run_id: str) -> list[dict]:
    """Shard descriptors for `generate.expand()`: small dicts, never the prompts themselves."""
    cfg = RunConfig.from_params(params, run_id)
    inputs.check_output_root(cfg.output_root)  # runs beside stage_weights: fail as clearly, not retried
    source = Path(cfg.prompt_source)
    if cfg.prompt_source == DEMO_PROMPTS:
        source = write_demo_prompts(cfg.output_root / "demo-prompts" / "prompts.jsonl")
    # Airflow fails the expansion of more mapped tasks than this, after planning: refuse them here with the fix.
    settings = replace(cfg.plan, max_shards=conf.getint("core", "max_map_length", fallback=1024))
    plan = planning.plan_shards(source, cfg.layout, settings)
    shards = [dict(s) for s in plan["shards"]]
    reuse = store.plan_reuse(cfg, shards, _model_source(cfg))  # sets each shard's to_generate
    log.info("completion store (Param reuse = %s): %d of %d prompts reused, %d to generate%s%s", cfg.reuse,
             reuse["reused"], reuse["prompts"], reuse["to_generate"],
             f"; nothing reused: {reuse['why_none']}" if reuse.get("why_none") else "",
             f"; {reuse['problems_line']}" if reuse.get("problems_line") else "")
    write_report(cfg, "plan", {k: v for k, v in plan.items() if k != "shards"} | {"shards": len(plan["shards"]),
                                                                                 "reuse": reuse})
    return [{**s, "run_prompts": reuse["to_generate"]} for s in shards]


@fail_fast
def generate(params: dict, run_id: str, shard: dict, node: dict | None = None) -> dict:
    try:
        return run_shard(_cfg(params, run_id, node), shard)
    except Drained as exc:  # the operator's drain: not a failure, nothing to retry
        raise AirflowSkipException(str(exc)) from exc


@fail_fast
def tokenize_shard(params: dict, run_id: str, generated: dict | None, node: dict | None = None,
                   shard: dict | None = None) -> dict:
    """`generated` is None when generate was skipped: the store supplied the whole run (`plan_reuse` merged it)."""
    cfg = _cfg(params, run_id, node)  # the tokenizer is in the node's staged model dir
    index = generated["shard"] if generated else shard["shard"]
    path = Path(generated["path"]) if generated else cfg.layout.merged(COMPLETIONS, index)
    if not path.is_file() and (request := drain_request(cfg.layout.drain_request)):
        raise AirflowSkipException(f"shard {index} is not tokenized: the run was drained by {request['by']} before "
                                   "its generation finished")
    if not path.is_file():
        raise NotRetryable(f"shard {index} has no completions at {path} and its generate did not run (skipped); "
                           "clear plan_shards with Downstream to plan and generate the run again")
    tok = load_tokenizer(_model_dir(cfg))
    return tokenize.tokenize_shard(cfg.layout.shard(index), path, cfg.layout, index, tok,
                                    include_reasoning=cfg.mask_reasoning, dialect=_served_dialect(cfg, path))


def _served_dialect(cfg: RunConfig, completions: Path | None = None) -> Dialect | None:
    """The SGLang version the node's fleet ran (its health report): how it handed the tools to the template. A run
    whose fleet was skipped (the store supplied it) asks the runs that generated its completions."""
    path = cfg.layout.node_report("health")
    paths = [path]
    if not path.is_file() and completions is not None and completions.is_file():
        sources = set(pq.read_table(completions, columns=["source_run"]).column("source_run").to_pylist())
        paths = [RunLayout.of(cfg.output_root, run, cfg.node).node_report("health") for run in sorted(sources) if run]
    servers = [s for p in paths if p.is_file() for s in json.loads(p.read_text())["servers"]]
    versions = sorted({s["version"] for s in servers if s.get("version")})
    if len(versions) > 1:
        raise TokenizeError(f"the fleet in {path} ran SGLang {', '.join(versions)}: one version per node "
                                     "renders one tools block; relaunch the fleet with one server_command")
    if not versions:
        log.warning("no SGLang version in %s: tools are rendered as sent, which may differ from the server's "
                    "<tools> block", path)
    return Dialect(versions[0]) if versions else None


@fail_fast
def validate(params: dict, run_id: str, shards: list[dict]) -> dict:
    cfg = RunConfig.from_params(params, run_id)
    rejected = sum(pq.read_metadata(p).num_rows for p in cfg.layout.merged_files(FAILURES))
    report = quality.validate_run(cfg.layout, _accepted(shards) - rejected, cfg.quality, cfg.layout.data_docs)
    write_report(cfg, "quality", report)
    if not report["success"]:
        failed = [f"{e['expectation']} {e['kwargs'].get('column', '')}: observed {e['observed']}"
                  for e in report["expectations"] if not e["success"]]
        raise GateFailed(f"quality gate failed, nothing will be published: {'; '.join(failed)}. Data Docs: "
                         f"{report['data_docs']}")
    return {"kept": report["kept"], "quarantined": report["quarantined"]}


@fail_fast
def check_published(params: dict, run_id: str) -> dict:
    """The run's verdict: a run that published nothing is failed, whatever skipped or was marked."""
    cfg = RunConfig.from_params(params, run_id)
    manifest = cfg.publish_dir / "manifest.json"
    if not manifest.is_file() and (request := drain_request(cfg.layout.drain_request)):
        raise PublishRefused(f"run {cfg.run_id} was drained by {request['by']} and published nothing: its "
                             "checkpoints are kept; clear the skipped generate tasks (with Downstream), or trigger a "
                             "new run (Param reuse sends only what is left), to finish it")
    if not manifest.is_file():
        raise PublishRefused(f"run {cfg.run_id} published nothing ({manifest} is missing): the tasks that failed or "
                             "were skipped before publish say why; clear them (with Downstream) to finish the run")
    return {"path": str(cfg.publish_dir)}


@fail_fast
def publish_dataset(params: dict, run_id: str) -> dict:
    cfg = RunConfig.from_params(params, run_id)
    plan = json.loads(cfg.layout.plan.read_text())
    report = json.loads(cfg.layout.report("quality").read_text())
    if not report["success"]:
        raise GateFailed("the quality report says the gate failed; refusing to publish")
    publish.clean_stale_tmp(cfg.publish_dir.parent)
    config = {k: v for k, v in params.items() if k not in {"emulator_faults"}}
    manifest = publish.publish_run(cfg.layout, cfg.publish_dir, plan, report, config, _model_dir(cfg),
                                   nodes=nodes.split_report(cfg.layout),  # several nodes: what each did
                                   reuse=store.provenance(cfg.layout))
    return {"path": str(cfg.publish_dir), "samples": manifest["counts"]["published"],
            "quarantined": manifest["counts"]["quarantined"], "tokens": manifest["tokens"]["total"]}
