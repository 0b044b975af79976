"""The Param table is the one declaration of every setting: Airflow's own Param validation (the trigger form, the
REST API) and `RunConfig.from_params` validate with the same JSON schema and accept and refuse the same values, the
config's fields are filled from it, and renaming a Param is a change of its key there alone."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from airflow.sdk import Param
from airflow.sdk.exceptions import ParamValidationError

from dflash_regen.errors import ConfigError
from dflash_regen.settings.deployment import Deployment
from dflash_regen.settings.nodes import Node
from dflash_regen.settings.params import SPECS, checked, defaults, trigger_form
from dflash_regen.settings.run_config import DEFAULTS, RunConfig

ROOT = Path(__file__).resolve().parents[3]

FORM = trigger_form(Deployment(), nodes=True)
# Other Params a bound needs to be reachable past the cross-field checks (the last port, max_tokens < context).
COMPANIONS = {"base_port": {"num_servers": 1}, "max_tokens": {"context_length": 10_000_000},
              "context_length": {"max_tokens": 16}}
NUMERIC = [name for name, s in SPECS.items() if s.type in ("integer", "number")]


def step(name: str, bound: float, direction: int) -> float:
    """The nearest value past `bound` in `direction` that the Param's type can hold."""
    if SPECS[name].type == "integer":
        return bound + direction
    return math.nextafter(float(bound), math.inf * direction)


def cases(name: str) -> list[tuple[float, bool]]:
    """(value, accepted) at each bound of the Param and just outside it."""
    s = SPECS[name]
    found = []
    if s.minimum is not None:
        found += [(s.minimum, True), (step(name, s.minimum, -1), False)]
    if s.exclusive_minimum is not None:
        found += [(s.exclusive_minimum, False), (step(name, s.exclusive_minimum, 1), True)]
    if s.maximum is not None:
        found += [(s.maximum, True), (step(name, s.maximum, 1), False)]
    if s.off is not None:  # the value that switches it off, between refused neighbours outside the range
        found += [(s.off, True), (s.off - 1, False), (s.off + 1, s.minimum is not None and s.off + 1 >= s.minimum)]
    return found


def airflow_accepts(name: str, value) -> bool:
    try:
        Param(**{**FORM[name], "default": value}).resolve()
    except ParamValidationError:
        return False
    return True


def config_accepts(name: str, value) -> bool:
    try:
        RunConfig.from_params({**DEFAULTS, **COMPANIONS.get(name, {}), name: value}, "r")
    except ConfigError as exc:
        assert f"Param {name!r}" in str(exc), exc  # refused for this Param's range, not for another one
        return False
    return True


def test_every_number_param_has_bounds():
    assert NUMERIC and all(cases(name) for name in NUMERIC)


@pytest.mark.parametrize("name", NUMERIC)
def test_airflow_and_the_config_agree_at_every_bound(name):
    for value, accepted in cases(name):
        assert airflow_accepts(name, value) is accepted, (name, value, "Airflow")
        assert config_accepts(name, value) is accepted, (name, value, "config")


@pytest.mark.parametrize("name", [name for name, s in SPECS.items() if s.enum])
def test_airflow_and_the_config_agree_on_every_choice(name):
    for value in SPECS[name].enum:
        assert airflow_accepts(name, value) and checked({name: value}, name) == value
    assert not airflow_accepts(name, "not-a-choice")
    with pytest.raises(ConfigError, match=f"must be one of {', '.join(SPECS[name].enum)}"):
        checked({name: "not-a-choice"}, name)


@pytest.mark.parametrize(("name", "value"), [("gpu_ids", "0;1"), ("gpu_ids", "0, 1"), ("output_root", "relative"),
                                             ("dataset_name", "../x"), ("dataset_name", "a/b")])
def test_a_pattern_refused_by_airflow_is_refused_by_the_config_in_words(name, value):
    assert not airflow_accepts(name, value)
    with pytest.raises(ConfigError) as info:
        checked({name: value}, name)
    assert SPECS[name].rule in str(info.value)


# Values of every JSON type, empty and blank text, integral and fractional numbers, paths and lists.
PROBES = [None, "x", "", "  ", " x ", 1.5, 2.0, 3, -1, 0, True, [], ["a"], [1], {}, {"a": 1}, "/abs", "0,1", "a@b.c",
          "auto"]


def checked_accepts(name: str, value) -> bool:
    try:
        checked({name: value}, name)
    except ConfigError as exc:
        assert str(exc).startswith(f"Param {name!r} = {value!r} is invalid: must "), exc
        return False
    return True


@pytest.mark.parametrize("name", list(SPECS))
def test_the_config_accepts_what_airflow_accepts_but_a_blank_text(name):
    """One validator: each Param's value is accepted by the config exactly when Airflow's Param accepts it; only a
    text of blanks, which the config reads stripped, is refused where the Param must not be empty."""
    for value in PROBES:
        expected = airflow_accepts(name, value) and not (SPECS[name].min_length and value == "  ")
        assert checked_accepts(name, value) is expected, (name, value)


def test_an_integral_number_is_an_integer_as_json_schema_says_and_a_number_is_a_float():
    assert checked({"seed": 2.0}, "seed") == 2 and type(checked({"seed": 2.0}, "seed")) is int
    assert type(checked({"min_p": 0}, "min_p")) is float


def test_every_config_field_a_param_fills_exists_and_every_param_but_node_failure_fills_one():
    cfg = RunConfig.from_params(DEFAULTS, "r")
    parts = {type(cfg).__name__: cfg} | {type(v).__name__: v for v in vars(cfg).values()
                                         if hasattr(v, "__dataclass_fields__")}
    for name, spec in SPECS.items():
        assert spec.paths or name == "node_failure", name
        for path in spec.paths:
            config, field = path.split(".")
            assert field in parts[config].__dataclass_fields__, (name, path)


def test_the_messages_name_the_param_the_value_and_the_rule():
    with pytest.raises(ConfigError, match=r"^Param 'shard_size' = 0 is invalid: must be between 1 and 1,000,000$"):
        checked({"shard_size": 0}, "shard_size")
    with pytest.raises(ConfigError, match=r"^Param 'checkpoint_s' = 0.05 is invalid: must be between 0.1 and 86,400$"):
        checked({"checkpoint_s": 0.05}, "checkpoint_s")
    with pytest.raises(ConfigError, match=r"^Param 'seed' = 1.5 is invalid: must be an integer$"):
        checked({"seed": 1.5}, "seed")


def test_optional_text_left_empty_in_the_form_reads_as_empty_and_text_is_stripped():
    assert checked({"server_flags": None}, "server_flags") == ""
    assert checked({"served_model_name": " qwen "}, "served_model_name") == "qwen"
    with pytest.raises(ConfigError, match="must be a non-empty string"):
        checked({"served_model_name": "  "}, "served_model_name")


def test_the_form_is_built_from_the_table_with_the_deployments_defaults():
    form = trigger_form(Deployment(base_port=31000, output_root="/data/out"), nodes=False)
    assert list(form) == [n for n, s in SPECS.items() if not s.nodes_only]
    assert form["base_port"]["default"] == 31000 and form["output_root"]["default"] == "/data/out"
    assert form["shard_size"] == {"default": 1000, "description": SPECS["shard_size"].description,
                                  "type": "integer", "allOf": [{"minimum": 1, "maximum": 1_000_000}],
                                  "section": "Prompts", "title": "Prompts per shard"}
    assert "node_failure" in trigger_form(Deployment(), nodes=True)


def test_optional_lists_and_objects_are_not_required_in_the_form_and_read_as_empty():
    """Airflow's form marks a field required unless its type admits null: only fields that may be left empty
    admit it, and the config reads an emptied one as [] or {}."""
    optional = {name for name, spec in FORM.items() if "null" in spec["type"]}
    assert {"autotune_candidates", "emulator_faults", "emulator_profile", "server_flags"} <= optional
    assert not optional & {"num_servers", "shard_size", "output_root", "max_tokens"}
    assert checked({"autotune_candidates": None}, "autotune_candidates") == []
    assert checked({"emulator_faults": None}, "emulator_faults") == {}
    assert airflow_accepts("emulator_faults", None) and airflow_accepts("autotune_candidates", None)


def test_the_emulator_section_is_in_the_form_only_where_the_deployment_runs_the_emulator():
    gpu = trigger_form(Deployment(server_command="/opt/sglang/bin/python -m sglang.launch_server"), nodes=False)
    assert not {"emulator_faults", "emulator_profile"} & set(gpu) and "server_command" in gpu
    assert {"emulator_faults", "emulator_profile"} <= set(trigger_form(Deployment(), nodes=False))
    # A GPU run's conf without them still validates: both read as empty.
    cfg = RunConfig.from_params({name: spec["default"] for name, spec in gpu.items()}, "r")
    assert cfg.run_id == "r"


def test_the_form_lists_the_cookbook_flags_every_server_gets():
    from dflash_regen.settings.params import COOKBOOK_ENV, COOKBOOK_FLAGS

    described = FORM["server_flags"]["description"]
    for flag, value in COOKBOOK_FLAGS.items():
        assert (flag if value is None else f"{flag} {value}") in described
    assert all(f"{k}={v}" in described for k, v in COOKBOOK_ENV.items())


RENAME = """
import json, runpy, sys
from functools import reduce
from dflash_regen.errors import ConfigError
from dflash_regen.settings import params
from dflash_regen.settings.deployment import Deployment
from dflash_regen.settings.nodes import Node
from dflash_regen.settings.run_config import RunConfig

case = json.loads(sys.argv[2])
base = params.defaults(Deployment())


def read(conf):
    return reduce(getattr, case["field"], RunConfig.from_params(conf, "r"))


try:
    RunConfig.from_params({**base, **case["bad"]}, "r")
except ConfigError as exc:
    error = str(exc)
print(json.dumps({
    "module": params.__file__, "form": list(params.trigger_form(Deployment(), nodes=False)),
    "new": read({**base, case["new"]: case["value"]}), "old": read({**base, case["old"]: case["value"]}),
    "default": read(base), "error": error, "deployed": params.defaults(Deployment(base_port=31000)),
    "node": Node(name="n", gpus="0,1", base_port=31000, staging_dir="/dev/shm/n").apply({}),
    "docs": runpy.run_path(sys.argv[1])["render"]()}))
"""


@pytest.mark.parametrize(("old", "new", "value", "field", "bad", "error"), [
    ("min_p", "minimum_p", 0.25, ("sampling", "min_p"), {"minimum_p": 2},
     "Param 'minimum_p' = 2 is invalid: must be between 0 and 1"),
    ("num_servers", "servers", 2, ("fleet", "num_servers"), {"servers": 7, "base_port": 65530},
     "Param 'base_port' = 65530 is invalid: with servers = 7 the last server would listen on port 65,536, past "
     "65,535; lower base_port or servers"),
    ("base_port", "first_port", 31000, ("fleet", "base_port"), {"first_port": 65530},
     "Param 'first_port' = 65530 is invalid: with num_servers = 7 the last server would listen on port 65,536, past "
     "65,535; lower first_port or num_servers"),
    ("autotune_candidates", "autotune_extra", ["--page-size 8"], ("autotune", "extra"),
     {"autotune_extra": ["--port 1"]},
     "Param 'autotune_extra' = '--port 1' is invalid: --port is set by the launcher (per server); remove it"),
])
def test_renaming_a_param_is_a_one_line_change(tmp_path, old, new, value, field, bad, error):
    """A Param renamed on its declaration's line alone, in a copy of the package: the trigger form, the config,
    its messages, the deployment's defaults, a node's Params and the Param reference follow, and the old key is
    neither in the form nor read."""
    shutil.copytree(ROOT / "include" / "dflash_regen", tmp_path / "dflash_regen",
                    ignore=shutil.ignore_patterns("__pycache__"))
    source = tmp_path / "dflash_regen" / "settings" / "params.py"
    lines = source.read_text().splitlines(keepends=True)
    [line] = [i for i, text in enumerate(lines) if text.strip() == f'"{old}": Spec(']
    lines[line] = lines[line].replace(f'"{old}"', f'"{new}"')
    source.write_text("".join(lines))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")} | {"PYTHONPATH": str(tmp_path)}
    case = {"old": old, "new": new, "value": value, "field": field, "bad": bad}
    done = subprocess.run([sys.executable, "-c", RENAME, str(ROOT / "scripts" / "params_reference.py"),
                           json.dumps(case)], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)

    def renamed(names):
        return [new if name == old else name for name in names]

    assert got["module"] == str(source)
    assert got["form"] == renamed(trigger_form(Deployment(), nodes=False))
    assert got["new"] == value and got["old"] == got["default"] != value
    assert got["error"] == error
    deployed = defaults(Deployment(base_port=31000))
    assert got["deployed"] == dict(zip(renamed(deployed), deployed.values(), strict=True))
    node = Node(name="n", gpus="0,1", base_port=31000, staging_dir="/dev/shm/n").apply({})
    assert got["node"] == dict(zip(renamed(node), node.values(), strict=True))
    docs = (ROOT / "docs" / "params.md").read_text()
    assert docs.count(f"| `{old}` |") == 1 and got["docs"] == docs.replace(f"| `{old}` |", f"| `{new}` |")
