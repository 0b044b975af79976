"""
### dflash_regen — regenerate a chat dataset with Qwen3.6-27B (thinking on) on a local SGLang fleet

`plan_shards` validates the prompts first (bad rows are quarantined with a reason), writes ~1,000-prompt shards
and takes every completion an earlier run made with the same generation settings from the completion store
(Param reuse); when nothing is left to generate, the weights are not staged and the fleet's setups and teardown
skip. Otherwise the weights are staged to the RAM disk, one SGLang server per GPU is launched and **every** server
is proven fit before any real work: enough KV tokens and running-request slots (`health_check`), and real answers —
not reasoning only, not truncated, tool calls parsed — to representative prompts at the production
`max_tokens` (`smoke_test`); `autotune` tries other server settings on the first GPU and reports (or, with
Param autotune = apply, relaunches the fleet with) the fastest; `calibrate` then measures one server on the
run's own prompts, names the resource that binds throughput with the flags that would lift it, and predicts
the run's wall time and
GPU-hours (`reports/capacity.json`); `generate` completes each shard on one leased server, resumably.
The fleet is stopped as soon as generation ends. `tokenize` computes `input_ids` and `loss_mask` with the
model's chat template (each shard's as soon as its own `generate` ends: the two are one mapped task group),
`validate` runs the Great Expectations gate (Data Docs in the run's `reports/`), and `publish` moves the dataset
into place atomically and emits the `dflash_regen_dataset` asset.

The gates are setup tasks: clearing one failed `generate` shard re-launches and re-checks the fleet, then
sends only that shard's missing samples.
Reports land in `<output_root>/runs/<run_id>/reports/`. The demo defaults run on the SGLang emulator.

With several GPU nodes (env `DFLASH_NODES`, docs/operations.md, "Several GPU nodes") each node gets a task group
on its own queue: its fleet setups, its share of the shards (by the rate `calibrate` measured on it) and its teardown.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from airflow.sdk import Asset, Param, TaskGroup, XComArg, chain, dag, setup, task, task_group, teardown

from dflash_regen import tasks
from dflash_regen.notifiers import RunNotifier
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
from dflash_regen.settings.deployment import GENERATE_RETRIES_MAX, deployment
from dflash_regen.settings.params import trigger_form

# The deployment's environment (settings/deployment.py: each variable and its fallback), read at parse time.
DEPLOYMENT = deployment()
# Training DAGs can be scheduled on this asset; each event's extra names the published version.
DATASET = Asset(name="dflash_regen_dataset", uri="file:///dflash-regen/published")
# Shard tasks running at once; each leases one server, so more than the fleet size would only wait.
PARALLEL_SHARDS = DEPLOYMENT.parallel_shards
# Above every other task's priority (weight_rule "downstream" gives at most the task count).
TEARDOWN_PRIORITY = 100
# A run works on one GPU node's RAM disk and loopback servers, so all its tasks go to that node's Celery
# queue (one queue per node, see docker-compose.yaml); unset = Airflow's default queue, as in the demo.
NODE_QUEUE = {"queue": DEPLOYMENT.worker_queue} if DEPLOYMENT.worker_queue else {}
# Several GPU nodes (env DFLASH_NODES, see settings/nodes.py): a task group per node on the node's queue.
NODES = nodes.parse_nodes(DEPLOYMENT.nodes)
# The trigger form: every Param's default, bounds and text come from the table in settings/params.py.
PARAMS = {name: Param(**spec) for name, spec in trigger_form(DEPLOYMENT, nodes=bool(NODES)).items()}


@dag(
    dag_id="dflash_regen",
    schedule=None,
    start_date=dt.datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    doc_md=__doc__,
    tags=["dflash", "sglang", "data"],
    params=PARAMS,
    # The callbacks repeat the error's first line at the end of the task log, where it opens; a task failed for good
    # is recorded for the run's message (until it succeeds after a clear) and, a gate or a shard, told at once
    # (docs/be-told-and-watch.md).
    default_args={"retries": 1, "retry_delay": dt.timedelta(seconds=10),
                  "on_failure_callback": [tasks.log_reason, RunNotifier("task_failed")],
                  "on_success_callback": RunNotifier("task_succeeded"),
                  "on_retry_callback": tasks.log_reason, **NODE_QUEUE},
    on_failure_callback=RunNotifier("run_failed"),
    on_success_callback=RunNotifier("published"),  # the run succeeds only when it published (check_published)
)
def dflash_regen():
    """The one-node flow; with several nodes, `several_nodes` runs between planning and validation."""
    shards = plan_shards()  # consults the completion store: what is left to generate
    if NODES:
        tokenized = several_nodes(shards)
    else:
        staged = stage_weights(shards, None)  # skipped, the fleet with it, when the store holds every completion
        calibrated, stop = fleet_setups(staged, shards)  # launched, gated, tuned, calibrated; stop_fleet at the end
        tokenized = [per_shard(shards, calibrated, stop)]  # generate -> tokenize, each shard
    validated = validate(shards, tokenized)
    chain(validated, publish(validated), check_published())


def fleet_setups(staged: XComArg, shards: XComArg, node: nodes.Node | None = None) -> tuple[XComArg, XComArg]:
    """A node's fleet setups (launched, gated, tuned, calibrated on one server with the run's own prompts) and its
    teardown (launch's fleet dir: stopped even when autotune failed); returns calibrate's value and the teardown.
    Every setup is tied to the teardown: a setup then scopes only the tasks up to it (generate), so fleet setups
    skipped for a run the store completes skip no tokenize, validate or publish; and clearing a shard of another
    node leaves them alone (Airflow re-runs an upstream setup that has no teardown, whichever node it is on)."""
    spec = node.to_dict() if node else None
    fleet = on(node, launch_fleet)(staged, node=spec)
    health = on(node, health_check)(fleet, node=spec)
    smoked = on(node, smoke_test)(fleet, node=spec)
    tuned = on(node, autotune)(staged, fleet, shards, node=spec)
    gates = [health, smoked, tuned, on(node, calibrate)(tuned, shards, node=spec)]
    chain(*gates)
    stop = on(node, stop_fleet)(fleet)
    gates >> stop
    return gates[-1], stop


def per_shard(shards: XComArg, ready: XComArg, stop: XComArg, node: nodes.Node | None = None) -> XComArg:
    """generate -> tokenize for each shard, one mapped task group: a shard's tokenize starts when its own
    generate ends (the CPU work overlaps the GPU work), and a failed shard holds back only its own. The
    teardown waits for generation alone. prefix_group_id=False keeps the task ids (generate, or
    <node>.generate) that a clear, the README and the report pages name."""
    prefix, spec = (f"{node.name}.", node.to_dict()) if node else ("", None)

    @task_group(group_id="shard", prefix_group_id=False)
    def shard_tasks(shard: Shard):
        # By keyword: the map index templates read their task's keyword arguments (shard, generated).
        generated = on(node, generate).override(task_id=prefix + "generate")(shard=shard, node=spec)
        ready >> generated >> stop  # the servers are not needed past generation
        return on(node, tokenize).override(task_id=prefix + "tokenize")(generated=generated, shard=shard, node=spec)

    tokenized = shard_tasks.expand(shard=shards)
    assert isinstance(tokenized, XComArg)  # the group hands on what its last task returns: tokenize's results
    return tokenized


def several_nodes(shards: XComArg) -> list[XComArg]:
    """Several nodes: the inputs and lock once for all, then a task group per node (its own queue and RAM disk),
    the shards split by each node's measured rate; each node's tokenize results."""
    checked, assigned = check_inputs(), assign_shards(shards)
    return [gpu_node(node, shards, checked, assigned) for node in NODES]


def gpu_node(node: nodes.Node, shards: XComArg, checked: XComArg, assigned: XComArg) -> XComArg:
    """One GPU node of several: it stages after check_inputs, its fleet setups, its share of the shards (none
    when it is left out) and its teardown."""
    with TaskGroup(node.name, tooltip=f"GPU node {node.name} (queue {node.queue or 'default'})"):
        staged = on(node, stage_weights)(None, checked, node=node.to_dict())
        calibrated, stop = fleet_setups(staged, shards, node)
        on(node, node_ready)(calibrated, node=node.to_dict()) >> assigned  # skipped when the node is left out
        return per_shard(node_shards(assigned, node.name), calibrated, stop, node)


def on(node: nodes.Node | None, task_fn):
    """`task_fn` on the node's queue (a queue cannot be mapped: one group per node); unchanged for one node."""
    return task_fn.override(queue=node.queue) if node and node.queue else task_fn


# The tasks: each calls one function of tasks.py (the thin adapter), which calls its stage's library function.
@task
def plan_shards(params=None, run_id=None) -> list[Shard]:
    return tasks.plan_shards(params, run_id)


# One node: after planning, skipped when the completion store holds every prompt's completion (and the fleet
# with it). Several: after check_inputs, one per node (to its own RAM disk).
@task
def stage_weights(shards: list[Shard] | None, checked: CheckedInputs | None, params=None, run_id=None,
                  node: dict | None = None) -> Staged:
    return tasks.stage_weights(params, run_id, shards, checked, node=node)


@setup
@task
def launch_fleet(staged: Staged, params=None, run_id=None, node: dict | None = None) -> Fleet:
    return tasks.launch_fleet(params, run_id, staged["model_path"], node=node)


@setup
@task(retries=0)
def health_check(fleet: Fleet, params=None, run_id=None, node: dict | None = None) -> Health:
    return tasks.health_check(params, run_id, fleet, node=node)


@setup
@task(retries=0)
def smoke_test(fleet: Fleet, params=None, run_id=None, node: dict | None = None) -> Smoke:
    return tasks.smoke_test(params, run_id, fleet, node=node)


# Tries server settings on the first GPU and, with Param autotune = apply, relaunches the fleet with the fastest;
# returns the fleet it leaves, the one calibrate measures.
@setup
@task(retries=0)
def autotune(staged: Staged, fleet: Fleet, shards: list[Shard], params=None, run_id=None,
             node: dict | None = None) -> Tuned:
    return tasks.autotune_fleet(params, run_id, staged["model_path"], fleet, shards, node=node)


@setup
@task
def calibrate(fleet: Tuned, shards: list[Shard], params=None, run_id=None, node: dict | None = None) -> Calibrated:
    return tasks.calibrate(params, run_id, fleet, shards, node=node)


# Airflow fixes retries at parse time: the most here; the run's generate_retries Param stops earlier.
@task(retries=GENERATE_RETRIES_MAX, retry_delay=dt.timedelta(seconds=5), retry_exponential_backoff=2.0,
      max_retry_delay=dt.timedelta(minutes=2), max_active_tis_per_dagrun=PARALLEL_SHARDS,
      map_index_template="{{ shard.label }}", on_success_callback=RunNotifier("progress"),
      retry_policy=tasks.GenerateRetries())
def generate(shard: Shard, params=None, run_id=None, ti=None, node: dict | None = None) -> Generated:
    return tasks.generate(params, run_id, shard, node=node, ti=ti)


# none_failed: a shard's generate skipped with the fleet (the store supplied it) still leaves it to tokenize.
@task(map_index_template="{{ 'shard %04d' | format(shard.shard) }}", trigger_rule="none_failed")
def tokenize(generated: Generated | None, shard: Shard, params=None, run_id=None,
             node: dict | None = None) -> Tokenized:
    return tasks.tokenize_shard(params, run_id, generated, shard, node=node)


# Each node's tokenize results in a list (one node: one), every planned shard expected. Not XComArg.concat(): a node's
# one result comes alone, none as None (tasks.validate makes them one list). Several nodes: a node left out (its
# tasks skipped) does not stop validation of the others' shards.
@task(retries=0, trigger_rule="none_failed_min_one_success" if NODES else "all_success")
def validate(shards: list[Shard], tokenized: Sequence[Pulled[Tokenized]], params=None, run_id=None) -> Validated:
    return tasks.validate(params, run_id, shards, tokenized)


@task(outlets=[DATASET])
def publish(validated: Validated, params=None, run_id=None, outlet_events=None) -> Published:
    result = tasks.publish_dataset(params, run_id, validated)
    outlet_events[DATASET].extra = result
    return result


# First in line for a free executor slot: idle GPUs stay held until it runs (tokenize tasks queue up then).
@teardown
@task(priority_weight=TEARDOWN_PRIORITY, weight_rule="absolute")
def stop_fleet(fleet: Fleet) -> list[str]:
    return tasks.stop_fleet(fleet)


# The run's verdict. Airflow counts skipped leaves as success, so a run marked failed by hand (its pending
# tasks skipped) would turn green once its teardown ran; a teardown still runs then, and with
# on_failure_fail_dagrun its result is the run's state: published, or failed.
@teardown(on_failure_fail_dagrun=True)
@task(retries=0)
def check_published(params=None, run_id=None) -> Verdict:
    return tasks.check_published(params, run_id)


# Several nodes only: the inputs and lock once for all nodes, and the shards split by each node's measured rate.
@task
def check_inputs(params=None, run_id=None) -> CheckedInputs:
    return tasks.check_inputs(params, run_id)


@task(trigger_rule="none_failed")  # a node left out (skipped) does not stop the others
def assign_shards(shards: list[Shard], params=None, run_id=None) -> Assignment:
    return tasks.assign_shards(params, run_id, shards, [n.name for n in NODES])


@task
def node_ready(calibrated: Calibrated, params=None, run_id=None, node: dict | None = None) -> NodeReady:
    return tasks.node_ready(params, run_id, calibrated, node)


@task
def node_shards(assigned: Assignment, name: str) -> list[Shard]:
    return assigned[name]


dflash_regen()
