"""The DAG folder parses with no connections, variables, GPU or servers, and the wiring keeps its promises."""

import copy
from pathlib import Path

import pytest
from airflow.dag_processing.dagbag import DagBag
from airflow.sdk.exceptions import ParamValidationError

from dflash_regen.settings.params import SPECS
from dflash_regen.settings.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[2]

EXPECTED_TASKS = {"stage_weights", "launch_fleet", "health_check", "smoke_test", "plan_shards", "autotune", "calibrate",
                  "generate", "tokenize", "validate", "publish", "stop_fleet", "check_published"}


@pytest.fixture(scope="module")
def dagbag():
    return DagBag(dag_folder=str(ROOT / "dags"))


@pytest.fixture(scope="module")
def dag(dagbag):
    return dagbag.dags["dflash_regen"]


def test_dag_folder_imports_without_errors(dagbag):
    assert dagbag.import_errors == {}
    assert list(dagbag.dags) == ["dflash_regen"]


def test_expected_tasks_in_pipeline_order_without_cycles(dag):
    assert {t.task_id for t in dag.tasks} == EXPECTED_TASKS
    order = [t.task_id for t in dag.topological_sort()]  # raises on a cycle
    assert order.index("stage_weights") < order.index("launch_fleet") < order.index("health_check") \
        < order.index("smoke_test") < order.index("generate") < order.index("stop_fleet")
    assert order.index("plan_shards") < order.index("generate")
    # the store decides before any GPU work whether the fleet is needed at all; every fleet setup is tied to the
    # teardown, so setups skipped for a run the store completes scope only generate, not tokenize or publish
    assert "plan_shards" in dag.get_task("stage_weights").upstream_task_ids
    assert {"launch_fleet", "health_check", "smoke_test", "autotune", "calibrate"} <= \
        dag.get_task("stop_fleet").upstream_task_ids
    assert not {t.task_id for t in dag.get_task("tokenize").get_upstreams_only_setups()}
    # calibrate measures a checked server with the run's own shards, before any shard is generated
    assert max(order.index("smoke_test"), order.index("plan_shards")) < order.index("calibrate") \
        < order.index("generate")
    # autotune tries settings on a gated fleet and hands calibrate the fleet it chose
    assert max(order.index("smoke_test"), order.index("plan_shards")) < order.index("autotune") \
        < order.index("calibrate")
    assert order.index("generate") < order.index("tokenize") < order.index("validate") < order.index("publish")


def test_clearing_one_shard_reruns_the_fleet_setups_and_teardown_but_not_planning(dag):
    generate = dag.get_task("generate")
    relatives = {t.task_id for t in generate.get_upstreams_only_setups_and_teardowns()}
    assert relatives == {"launch_fleet", "health_check", "smoke_test", "autotune", "calibrate", "stop_fleet"}
    assert generate.map_index_template == "{{ shard.label }}"
    assert generate.retries >= 2 and generate.retry_exponential_backoff == 2.0


def test_each_shard_is_tokenized_as_soon_as_its_own_generate_ends(dag):
    """generate and tokenize are one mapped task group: Airflow gives tokenize[i] generate[i] alone as its upstream
    (and clears them together), so one failed shard does not hold back the tokenizing of the others."""
    generate, tokenize = dag.get_task("generate"), dag.get_task("tokenize")
    group = generate.get_closest_mapped_task_group()
    assert group is not None and tokenize.get_closest_mapped_task_group() is group
    # (and the planned shard: tokenize reads it when generate was skipped, the store having supplied the run)
    assert tokenize.upstream_task_ids == {"generate", "plan_shards"} and tokenize.trigger_rule == "none_failed"
    # their map index labels render from their keyword arguments (a positional one is not in the template context)
    assert "shard" in generate.op_kwargs and {"generated", "shard"} <= tokenize.op_kwargs.keys()
    assert group.upstream_task_ids == {"plan_shards"}  # it maps over the planned shards
    # the teardown waits for generation, not for tokenizing
    assert "tokenize" not in dag.get_task("stop_fleet").get_flat_relative_ids(upstream=True)
    assert generate.max_active_tis_per_dagrun >= 1


def test_fleet_gates_are_setup_tasks_and_stop_is_the_teardown(dag):
    """Clearing a later task re-runs setups, not ordinary upstream tasks: the gates must be setups."""
    tasks = {t.task_id: t for t in dag.tasks}
    assert all(tasks[t].is_setup for t in ("launch_fleet", "health_check", "smoke_test", "autotune", "calibrate"))
    assert not tasks["stage_weights"].is_setup
    stop = tasks["stop_fleet"]
    assert stop.is_teardown
    assert {"launch_fleet", "generate"} <= stop.upstream_task_ids
    assert stop.trigger_rule == "all_done_setup_success"


def test_publish_emits_the_dataset_asset(dag):
    outlets = dag.get_task("publish").outlets
    assert [a.name for a in outlets] == ["dflash_regen_dataset"]


def test_policy_no_catchup_single_active_run_gates_not_retried(dag):
    assert dag.catchup is False and dag.schedule is None and dag.max_active_runs == 1
    tasks = {t.task_id: t for t in dag.tasks}
    assert tasks["launch_fleet"].retries >= 1
    for gate in ("health_check", "smoke_test", "autotune", "validate"):  # a retry cannot fix a failed gate
        assert tasks[gate].retries == 0


def test_param_defaults_validate_and_build_a_run_config(dag):
    values = dag.params.validate()
    cfg = RunConfig.from_params(values, "manual__1")
    assert cfg.fleet.num_servers == 7 and cfg.sampling.max_tokens >= 4096


def test_every_param_has_a_title_a_section_and_a_description(dag):
    for name in dag.params:
        param = dag.params.get_param(name)
        assert param.schema.get("title"), name
        assert param.schema.get("section"), name
        assert param.description and len(param.description) > 20, name


def test_every_param_is_built_from_the_spec_table(dag):
    """One declaration per Param (settings/params.py): the form's schema is the one config validates against."""
    assert list(dag.params) == [name for name, spec in SPECS.items() if not spec.nodes_only]
    for name in dag.params:
        param = dag.params.get_param(name)
        assert (param.schema, param.description) == (SPECS[name].schema(), SPECS[name].description), name


def test_no_number_field_has_bounds_the_form_would_clamp_to(dag):
    """The trigger form's number box clamps to a top-level minimum/maximum when it loses focus (shard_size 0
    became 1 and ran); bounds nested in allOf are enforced by Airflow's validation only, which refuses."""
    for name in dag.params:
        schema = dag.params.get_param(name).schema
        assert not {"minimum", "maximum"} & set(schema), name
        if schema.get("type") in ("integer", "number"):
            assert schema.get("allOf") or schema.get("anyOf"), f"{name} has no range"


def test_sampling_defaults_are_qwen3_thinking_mode_and_reach_the_config(dag):
    cfg = RunConfig.from_params(dag.params.validate(), "manual__1")
    s = cfg.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.presence_penalty) == (0.6, 0.95, 20, 0.0, 0.0)
    assert cfg.generation.sampling is s  # generation sends the same settings the smoke test checked


def test_optional_text_fields_can_be_left_empty_in_the_form(dag):
    # The form sends null for an empty text box; a plain "string" type then refuses to trigger at all.
    params = copy.deepcopy(dag.params)
    optional = [n for n in params if params.get_param(n).value == ""]
    assert {"server_flags", "gpu_ids"} <= set(optional)
    for name in optional:
        params[name] = None
    cfg = RunConfig.from_params(params.validate(), "manual__1")
    assert cfg.fleet.gpu_ids == tuple(str(i) for i in range(7))


BAD_VALUES = [
    ("num_servers", 99, "99 is greater than the maximum of 64"),
    ("base_port", 65536, "65536 is greater than the maximum of 65535"),
    ("shard_size", 0, "0 is less than the minimum of 1"),
    ("shard_size", 1.5, "1.5 is not of type 'integer'"),
    ("top_k", 0, "0 is not valid under any of the given schemas"),
    ("top_p", 0, "0 is less than or equal to the minimum of 0"),
    ("temperature", 2.5, "2.5 is greater than the maximum of 2"),
    ("gpu_ids", "0;1", "'0;1' does not match"),
    ("output_root", "relative", "'relative' does not match"),
]


@pytest.mark.parametrize(("name", "value", "message"), BAD_VALUES)
def test_trigger_form_rejects_bad_values(dag, name, value, message):
    params = copy.deepcopy(dag.params)
    with pytest.raises(ParamValidationError, match=message):
        params[name] = value


def test_a_trigger_with_a_bad_value_is_refused_before_a_run_exists(dag):
    """The REST API and the form's Trigger validate the run's conf against the serialized DAG's Params
    (airflow.serialization.definitions.param) and answer 400 with this text; no run is created."""
    from airflow.exceptions import ParamValidationError as ServerParamValidationError
    from airflow.serialization.serialized_objects import DagSerialization

    served = DagSerialization.from_dict(DagSerialization.to_dict(dag))
    for name, value, message in BAD_VALUES:
        with pytest.raises(ServerParamValidationError, match=f"^Invalid input for param {name}: {message}"):
            served.params.deep_merge({name: value}).validate()
    served.params.deep_merge({"shard_size": 20, "top_k": -1}).validate()


def test_parsing_the_dag_does_not_import_heavy_libraries():
    """The DAG file is parsed by every Airflow component, often: GX, transformers and the emulator stay lazy."""
    import subprocess
    import sys

    code = ("import runpy, sys; runpy.run_path(sys.argv[1]); "
            "print(sorted(m for m in ('great_expectations', 'transformers', 'fastapi', 'dflash_regen.emulator') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, str(ROOT / "dags" / "dflash_regen.py")], capture_output=True,
                          text=True, timeout=120, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.fixture(scope="module")
def served(dag):
    """The DAG as the scheduler sees it (serialized and back)."""
    from airflow.serialization.serialized_objects import DagSerialization

    return DagSerialization.from_dict(DagSerialization.to_dict(dag))


def test_the_teardown_outranks_every_task_that_can_run_beside_it(served):
    """stop_fleet waited ~2.5 min behind tokenize tasks holding every executor slot, with the GPUs held."""
    from types import SimpleNamespace

    from airflow.task.priority_strategy import validate_and_load_priority_weight_strategy

    def weight(task):  # what the scheduler orders queued task instances by
        return validate_and_load_priority_weight_strategy(task.weight_rule).get_weight(SimpleNamespace(task=task))

    stop = served.get_task("stop_fleet")
    before = stop.get_flat_relative_ids(upstream=True)  # all done before the teardown can run
    beside = [t for t in served.tasks if t.task_id not in before and t.task_id != "stop_fleet"]
    assert {t.task_id for t in beside} >= {"tokenize", "validate", "publish", "check_published"}
    assert all(weight(stop) > weight(t) for t in beside), {t.task_id: weight(t) for t in [stop, *beside]}


def test_the_runs_state_is_decided_by_whether_it_published(served):
    """Airflow counts skipped leaves as success: a run marked failed by hand (pending tasks skipped) turned
    green when its teardown ran. check_published (a teardown, so it still runs; on_failure_fail_dagrun) is
    the only leaf that decides the run's state."""
    from typing import NamedTuple

    from airflow.models.dagrun import DagRun

    class TI(NamedTuple):
        task_id: str
        state: str

    tis = [TI(t.task_id, "skipped" if t.task_id == "publish" else "success") for t in served.tasks]
    deciding = DagRun._tis_for_dagrun_state(None, dag=served, tis=tis)  # Airflow's own leaf rule
    assert {ti.task_id for ti in deciding} == {"check_published"}
    check = served.get_task("check_published")
    assert check.is_teardown and check.on_failure_fail_dagrun and check.upstream_task_ids == {"publish"}


def test_a_setup_error_is_one_exception_whose_first_line_is_the_message(run_params, tmp_path):
    """Airflow logs the raised exception first and its causes below it; the adapter's wrapper takes the library
    error's place (its traceback, its cause), so the log opens with the message instead of a second copy."""
    import traceback

    from airflow.sdk.exceptions import AirflowFailException

    from dflash_regen import tasks

    params = run_params(1, model_source_dir=str(tmp_path / "no-such-model"))
    with pytest.raises(AirflowFailException) as info:
        tasks.stage_weights(params, "manual__1")
    assert str(info.value).splitlines()[0] == (f"StagingError: model source {tmp_path / 'no-such-model'} is not a "
                                               "directory; set Param model_source_dir to the directory that holds "
                                               "config.json and the weight files")
    assert info.value.__cause__ is None and info.value.__suppress_context__
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "list_source" in frames  # where the library raised it


def test_a_failed_or_retried_tasks_log_ends_with_its_errors_first_line(dag, caplog):
    """Airflow opens a task log at its end, on the traceback: every task's callbacks repeat the one-line reason
    there."""
    from airflow.sdk.exceptions import AirflowFailException

    from dflash_regen import tasks

    for t in dag.tasks:
        assert tasks.log_reason in (t.on_failure_callback or []), t.task_id
        assert tasks.log_reason in (t.on_retry_callback or []), t.task_id
    error = AirflowFailException("GateFailed: server 3 has 120,000 KV tokens, below 1,000,000\ncause: ...")
    with caplog.at_level("ERROR"):
        tasks.log_reason({"exception": error, "ti": type("TI", (), {"task_id": "health_check"})()})
    assert caplog.records[-1].getMessage() == ("health_check failed: GateFailed: server 3 has 120,000 KV tokens, "
                                               "below 1,000,000")
