"""The deployment's environment, read in one place: the defaults a GPU node's docker-compose sets once.

No Airflow import: the DAG calls `deployment()` when it is parsed, and `params.defaults` (so
`run_config.DEFAULTS`) takes the Param defaults from it.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dflash_regen.errors import ConfigError

EMULATOR = "emulator"
NODES_ENV = "DFLASH_NODES"  # several GPU nodes (settings/nodes.py reads it)
DEMO_MODEL = "demo"
DEMO_PROMPTS = "demo"


@dataclass(frozen=True)
class Deployment:
    """What a deployment sets once in the environment, read by `deployment()` (an empty variable counts as unset;
    the fallbacks run the demo):

    Param defaults (the trigger form shows them; a run can still override each):
      DFLASH_MODEL_SOURCE      model_source_dir        (demo)
      DFLASH_STAGING_DIR       staging_dir             ('' = /dev/shm/<model name>)
      DFLASH_SERVER_COMMAND    server_command          (emulator)
      DFLASH_BASE_PORT         base_port               (30000)
      DFLASH_PROMPT_SOURCE     prompt_source           (demo)
      DFLASH_OUTPUT_ROOT       output_root             (~/dflash-regen)
      DFLASH_EMULATOR_PROFILE  emulator_profile        (JSON object; {} = the emulator's default)
      DFLASH_SHARD_SIZE        shard_size              ('' = the Param table's; `make airflow` sizes it for the demo)
      DFLASH_GENERATE_RETRIES  generate_retries        (3; 0 leaves a failed shard for a human to clear)
    Read when the DAG is parsed (not Params: Airflow fixes them per task, not per run):
      DFLASH_PARALLEL_SHARDS   generate tasks running at once (7)
      DFLASH_WORKER_QUEUE      the Celery queue of every task ('' = Airflow's default queue)
      DFLASH_NODES             several GPU nodes, a JSON list (settings/nodes.py; '' = one node)
    Read by the report pages (the api-server):
      DFLASH_SERVED_ROOTS      more output roots whose runs the pages show, ':'-separated ('' = only output_root);
                               a run whose conf names another root is refused, so a conf cannot open any path
      DFLASH_METRICS_TOKEN     the bearer token Prometheus sends for the pipeline's /metrics ('' = not exported;
                               ui/metrics.py)
    Read where a task fails (tasks.py, fail_fast):
      DFLASH_OUTPUT_ROOT_ON_HOST  the host folder mounted at DFLASH_OUTPUT_ROOT ('' = not in a container): an
                               error naming a path under the root names the host's path beside it
    """

    model_source_dir: str = DEMO_MODEL
    staging_dir: str = ""
    server_command: str = EMULATOR
    base_port: int = 30000
    prompt_source: str = DEMO_PROMPTS
    output_root: str = field(default_factory=lambda: str(Path.home() / "dflash-regen"))
    emulator_profile: dict = field(default_factory=dict)
    shard_size: int = 0  # 0: the Param table's default
    parallel_shards: int = 7
    generate_retries: int = 3
    worker_queue: str = ""
    nodes: str = ""  # parsed by settings/nodes.py parse_nodes, which owns the format
    served_roots: str = ""
    metrics_token: str = field(default="", repr=False)  # a secret: never in a log line
    output_root_on_host: str = ""

    def on_host(self, message: str) -> str:
        """`message` with the host's path beside the first path under the output root it names: the operator
        reads the error on the host, where the root is mounted from another folder."""
        root = self.output_root.rstrip("/")
        if not root or self.output_root_on_host.rstrip("/") in ("", root):  # not in a container, or the same path
            return message
        for found in re.finditer(re.escape(root) + r"(/[^\s'\",:;()]*)?", message):
            path = found[0].rstrip(".")  # a sentence's full stop is not part of the path
            if found.end() < len(message) and len(path) == len(root) and message[found.end()] not in " '\",:;().":
                continue  # another folder whose name starts like the root's
            host = self.output_root_on_host.rstrip("/") + path[len(root):]
            end = found.start() + len(path)
            end += message[end:end + 1] in ("'", '"')  # after a closing quote
            return f"{message[:end]} (on the host: {host}){message[end:]}"
        return message

    def report_roots(self) -> list[Path]:
        """The output roots the report pages may read: the default one first, then DFLASH_SERVED_ROOTS."""
        roots = [r.strip() for r in (self.output_root, *self.served_roots.split(os.pathsep)) if r.strip()]
        relative = [r for r in roots if not os.path.isabs(r)]
        if relative:
            raise ConfigError(f"DFLASH_SERVED_ROOTS / DFLASH_OUTPUT_ROOT name relative paths {relative}: give "
                              "absolute paths, ':'-separated")
        return list(dict.fromkeys(Path(os.path.normpath(r)) for r in roots))

    def param_defaults(self) -> dict[str, Any]:
        """The fields that set a Param's default (each Param's Spec names its field: `deployed`)."""
        return {"model_source_dir": self.model_source_dir, "staging_dir": self.staging_dir,
                "server_command": self.server_command, "base_port": self.base_port,
                "prompt_source": self.prompt_source, "output_root": self.output_root,
                "emulator_profile": copy.deepcopy(self.emulator_profile),
                "generate_retries": self.generate_retries} | \
            ({"shard_size": self.shard_size} if self.shard_size else {})


_ENV = {"model_source_dir": "DFLASH_MODEL_SOURCE", "staging_dir": "DFLASH_STAGING_DIR",
        "server_command": "DFLASH_SERVER_COMMAND", "base_port": "DFLASH_BASE_PORT",
        "prompt_source": "DFLASH_PROMPT_SOURCE", "output_root": "DFLASH_OUTPUT_ROOT",
        "emulator_profile": "DFLASH_EMULATOR_PROFILE", "shard_size": "DFLASH_SHARD_SIZE",
        "parallel_shards": "DFLASH_PARALLEL_SHARDS",
        "generate_retries": "DFLASH_GENERATE_RETRIES", "worker_queue": "DFLASH_WORKER_QUEUE", "nodes": NODES_ENV,
        "served_roots": "DFLASH_SERVED_ROOTS", "metrics_token": "DFLASH_METRICS_TOKEN",
        "output_root_on_host": "DFLASH_OUTPUT_ROOT_ON_HOST"}


# The generate task's retries in the DAG: Airflow fixes them when it parses the DAG, so the DAG asks for the most
# and the generate_retries Param lowers them per run (tasks.py).
GENERATE_RETRIES_MAX = 10


def deployment(environ: Mapping[str, str] | None = None) -> Deployment:
    """The deployment's settings from the environment (see `Deployment`); a bad value names its variable."""
    environ = os.environ if environ is None else environ
    found: dict[str, Any] = {}
    for f in fields(Deployment):
        name = _ENV[f.name]
        text = (environ.get(name) or "").strip()
        if not text:
            continue
        if f.type == "int":
            try:
                found[f.name] = int(text)
            except ValueError:
                raise ConfigError(f"environment variable {name} = {text!r} is not an integer; unset it or give a "
                                  "whole number") from None
        elif f.type == "dict":
            found[f.name] = _env_object(name, text)
        else:
            found[f.name] = text
    retries = found.get("generate_retries", 0)
    if not 0 <= retries <= GENERATE_RETRIES_MAX:
        raise ConfigError(f"environment variable DFLASH_GENERATE_RETRIES = {retries} is outside "
                          f"0..{GENERATE_RETRIES_MAX} (the most retries the DAG gives a shard); give a number in that "
                          "range")
    return Deployment(**found)


def _env_object(name: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"environment variable {name} is not valid JSON ({exc}); unset it or give a JSON "
                          'object such as {"decode_tokens_per_s": 3000}') from exc
    if not isinstance(value, dict):
        raise ConfigError(f"environment variable {name} must be a JSON object, got {type(value).__name__}")
    return value
