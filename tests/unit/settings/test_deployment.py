"""The deployment's environment is read in one place, each variable into its setting."""

import pytest

from dflash_regen.errors import ConfigError
from dflash_regen.settings.deployment import Deployment, deployment
from dflash_regen.settings.params import defaults

ENV = {"DFLASH_MODEL_SOURCE": "/models/Qwen3.6-27B", "DFLASH_STAGING_DIR": "/dev/shm/q", "DFLASH_SERVER_COMMAND":
       "/opt/sglang-venv/bin/python -m sglang.launch_server", "DFLASH_BASE_PORT": "31000", "DFLASH_PROMPT_SOURCE":
       "/data/prompts", "DFLASH_OUTPUT_ROOT": "/data/out", "DFLASH_EMULATOR_PROFILE": '{"decode_tokens_per_s": 3000}',
       "DFLASH_PARALLEL_SHARDS": "14", "DFLASH_GENERATE_RETRIES": "0", "DFLASH_WORKER_QUEUE": "gpu-node-1",
       "DFLASH_NODES": '[{"name": "a"}]', "DFLASH_SERVED_ROOTS": "/data/old:/data/out/",
       "DFLASH_METRICS_TOKEN": "prometheus-token", "DFLASH_OUTPUT_ROOT_ON_HOST": "/srv/dflash"}


def test_every_variable_reaches_its_setting():
    assert deployment(ENV) == Deployment(
        model_source_dir="/models/Qwen3.6-27B", staging_dir="/dev/shm/q",
        server_command="/opt/sglang-venv/bin/python -m sglang.launch_server", base_port=31000,
        prompt_source="/data/prompts", output_root="/data/out", emulator_profile={"decode_tokens_per_s": 3000},
        parallel_shards=14, generate_retries=0, worker_queue="gpu-node-1", nodes='[{"name": "a"}]',
        served_roots="/data/old:/data/out/", metrics_token="prometheus-token", output_root_on_host="/srv/dflash")
    assert "prometheus-token" not in repr(deployment(ENV))


def test_unset_or_empty_variables_run_the_demo():
    assert deployment({}) == deployment({name: "" for name in ENV}) == Deployment()
    assert (Deployment().model_source_dir, Deployment().server_command, Deployment().base_port) == ("demo", "emulator",
                                                                                                30000)


def test_the_deployment_sets_the_param_defaults():
    values = defaults(deployment(ENV))
    assert (values["model_source_dir"], values["base_port"], values["output_root"]) == ("/models/Qwen3.6-27B",
                                                                                        31000, "/data/out")
    assert values["emulator_profile"] == {"decode_tokens_per_s": 3000} and values["shard_size"] == 1000


@pytest.mark.parametrize(("name", "text", "message"), [
    ("DFLASH_BASE_PORT", "30k", "environment variable DFLASH_BASE_PORT = '30k' is not an integer"),
    ("DFLASH_EMULATOR_PROFILE", "{bad", "environment variable DFLASH_EMULATOR_PROFILE is not valid JSON"),
    ("DFLASH_EMULATOR_PROFILE", "[1]", "DFLASH_EMULATOR_PROFILE must be a JSON object, got list"),
])
def test_a_bad_variable_is_named(name, text, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        deployment({name: text})


def test_the_report_pages_serve_the_output_root_first_then_the_listed_ones_and_only_absolute_paths():
    assert [str(r) for r in deployment(ENV).report_roots()] == ["/data/out", "/data/old"]
    assert [str(r) for r in Deployment(output_root="/x").report_roots()] == ["/x"]
    with pytest.raises(ConfigError, match=r"relative paths \['data'\]"):
        deployment({**ENV, "DFLASH_SERVED_ROOTS": "data"}).report_roots()


def test_a_deployment_may_size_the_shards_for_its_prompts():
    assert defaults(deployment({"DFLASH_SHARD_SIZE": "20"}))["shard_size"] == 20
    assert defaults(deployment({}))["shard_size"] == 1000  # the Param table's


@pytest.mark.parametrize("message, told", [
    ("no space left on the disk of /data/out/runs/r1 writing a.parquet: it needs",
     "no space left on the disk of /data/out/runs/r1 (on the host: /srv/dflash/runs/r1) writing a.parquet: it needs"),
    ("Param output_root '/data/out' is not writable by uid 50000",
     "Param output_root '/data/out' (on the host: /srv/dflash) is not writable by uid 50000"),
    ("full at /data/out.", "full at /data/out (on the host: /srv/dflash)."),
    ("/data/outside/x and /data/out/y", "/data/outside/x and /data/out/y (on the host: /srv/dflash/y)"),
    ("nothing under the root", "nothing under the root"),
])
def test_an_error_names_the_host_path_beside_the_containers(message, told):
    assert deployment(ENV).on_host(message) == told
    assert Deployment(output_root="/data/out").on_host(message) == message  # not in a container: as it was
    assert Deployment(output_root="/data/out", output_root_on_host="/data/out/").on_host(message) == message
