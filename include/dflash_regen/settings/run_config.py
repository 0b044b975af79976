"""Typed, frozen run configuration built once from the DAG's Params.

Each field is the Param that fills it (`Spec.fills` in settings/params.py, which the DAG's form is built from),
validated against its JSON schema there, or derived here from such fields; then the checks that span several
Params. A bad value raises `ConfigError` naming the Param, the value and the rule, before any GPU work starts.
Airflow is not imported here: the DAG adapter passes the Params as a plain dict.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from dflash_regen.errors import ConfigError
from dflash_regen.layout import RunLayout, publish_dir
from dflash_regen.settings.deployment import DEMO_MODEL, DEMO_PROMPTS, EMULATOR
from dflash_regen.settings.params import COOKBOOK_ENV, COOKBOOK_FLAGS, SPECS, defaults, filled, invalid, key_of

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

LAUNCHER_FLAGS = {"--model-path", "--model", "--host", "--port", "--api-key"}  # set per server by fleet.servers
MAX_PORT = SPECS[key_of("FleetConfig.base_port")].maximum  # the last server's port too

# Default Param values (the DAG's trigger form shows them), the deployment's environment applied.
DEFAULTS: dict[str, Any] = defaults()

# Characters that only mean something to a shell. The server command is run from an argv list (never a
# shell), so they could only be a mistake or an injection attempt: refuse them with a clear message.
_SHELL_META = re.compile(r"[;&|`$<>(){}\\\n*?!]")
_RUN_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _flag_value(argv: Sequence[str], flag: str) -> str:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else ""


def split_command(text: str, name: str) -> list[str]:
    """Split Param `name`'s command line into argv, refusing shell syntax (it is never run by a shell)."""
    if _SHELL_META.search(text):
        bad = sorted(set(_SHELL_META.findall(text)))
        raise invalid(name, text, f"contains shell syntax {''.join(bad)!r}; give a plain command such as "
                      "'/opt/sglang-venv/bin/python -m sglang.launch_server' (it is run without a shell)")
    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise invalid(name, text, f"cannot be split into arguments ({exc})") from exc
    if not argv:
        raise invalid(name, text, "is empty")
    return argv


def parse_flags(text: str, name: str = "") -> list[tuple[str, str | None]]:
    """Parse Param `name`'s '--flag value --switch' (default: server_flags') into ordered (flag, value-or-None)
    pairs."""
    name = name or key_of("FleetConfig.server_flags")
    tokens = split_command(text, name) if text.strip() else []
    pairs: list[tuple[str, str | None]] = []
    for token in tokens:
        if token.startswith("--"):
            flag, eq, value = token.partition("=")
            pairs.append((flag, value if eq else None))
        elif pairs and pairs[-1][1] is None:
            pairs[-1] = (pairs[-1][0], token)
        else:
            raise invalid(name, text, f"{token!r} is not after a --flag; write flags as '--name value'")
    return pairs


def merge_flags(defaults: dict[str, str | None], overrides: list[tuple[str, str | None]]) -> list[str]:
    """Defaults overridden flag by flag; an override value of 'off' drops a default flag."""
    merged = dict(defaults)
    for flag, value in overrides:
        if value == "off":
            merged.pop(flag, None)
        else:
            merged[flag] = value
    argv: list[str] = []
    for flag, value in merged.items():
        argv.append(flag)
        if value is not None:
            argv.append(value)
    return argv


def safe_run_id(run_id: str) -> str:
    """Airflow run ids hold ':' and '+'; keep paths portable and readable."""
    cleaned = _RUN_ID_UNSAFE.sub("_", run_id).strip("._")
    if not cleaned:
        raise ConfigError(f"run id {run_id!r} has no usable characters for a directory name")
    return cleaned


def _server_flags(text: str, name: str = "") -> list[str]:
    """The cookbook flags with Param `name`'s overrides (default: server_flags'), refusing the flags the launcher
    sets per server."""
    name = name or key_of("FleetConfig.server_flags")
    overrides = parse_flags(text, name)
    for flag, _ in overrides:
        if flag in LAUNCHER_FLAGS:
            raise invalid(name, text, f"{flag} is set by the launcher (per server); remove it")
    return merge_flags(COOKBOOK_FLAGS, overrides)


@dataclass(frozen=True)
class SamplingConfig:
    """How every request samples: smoke, generation and calibration send these (sglang.api.chat_payload)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int  # -1 = off (SGLang's convention)
    min_p: float
    presence_penalty: float
    enable_thinking: bool


@dataclass(frozen=True)
class FleetConfig:
    """How to launch and judge the servers."""

    server_argv: tuple[str, ...]  # interpreter + module (or executable), before the SGLang flags
    is_emulator: bool
    num_servers: int
    gpu_ids: tuple[str, ...]
    base_port: int
    host: str
    flags: tuple[str, ...]  # SGLang flags except model path, host, port, api key
    env: tuple[tuple[str, str], ...]
    served_model_name: str
    ready_timeout_s: float
    import_timeout_s: float
    min_kv_tokens: int
    min_running_requests: int
    expected_prompt_tokens: int
    expected_output_tokens: int
    smoke_timeout_s: float
    server_command: str  # the Param: "emulator" or the launcher's command line (server_argv is what runs)
    server_flags: str  # the Param (flags holds them merged with the cookbook's)
    emulator_faults: dict  # the Params ({} = none); only the emulator reads them, from env
    emulator_profile: dict

    def port(self, index: int) -> int:
        return self.base_port + index


@dataclass(frozen=True)
class PlanSettings:
    shard_size: int
    sampling: SamplingConfig  # planning reads its max_tokens: prompt + max_tokens must fit context_length
    context_length: int
    max_bad_row_share: float
    prompt_format: str  # one of settings/params.py PROMPT_FORMATS
    max_shards: int = 1024  # Airflow's [core] max_map_length: more mapped shards cannot be expanded
    train_max_length: int = 0  # prompts this long leave nothing to train on; 0 = not checked
    max_overlong_share: float = 1.0
    count_tokens: bool = False  # count every prompt's tokens (Param budget train_length), not only long ones

    def record(self) -> dict:
        """What planning depends on, as JSON (the plan's fingerprint and plan.json): max_tokens, not the rest of
        the sampling settings."""
        record = {k: v for k, v in self.__dict__.items() if k != "sampling"}
        return record | {"max_tokens": self.sampling.max_tokens}


@dataclass(frozen=True)
class GenerationSettings:
    sampling: SamplingConfig
    seed: int
    concurrency_per_server: int  # 0 = the server's effective running-request slots
    stall_timeout_s: float
    request_cap_s: float
    request_retries: int
    generate_retries: int  # Airflow's retries of a failed shard; tasks.generate applies it per run
    retry_truncated: bool
    regenerate_history: bool
    checkpoint_every: int
    checkpoint_s: float
    progress_s: float
    served_model_name: str
    reasoning_parser: str
    max_generate_error_share: float  # share of a shard's prompts the servers may refuse (quarantined) before it fails
    train_budget: int = 0  # Param budget train_length: max_tokens = this - the prompt's tokens; 0 = max_tokens
    run: str = ""  # the run id, recorded with each completion (its source_run)


def sample_seed(sample_id: str, run_seed: int) -> int:
    """Each sample's own seed: a rerun, a retry on another server or calibration samples it alike (the store
    checks stored rows against this rule: `generate/store.py` SEED_RULE)."""
    return (int(hashlib.sha256(sample_id.encode()).hexdigest()[:8], 16) + run_seed) % (2**31)


@dataclass(frozen=True)
class QualitySettings:
    """The data-quality gate's thresholds (each a Param of the same name)."""

    empty_mask_tokens: int
    max_bad_sample_share: float
    max_truncated_share: float
    max_repetition_score: float
    train_max_length: int
    max_overlong_share: float
    max_rerender_drift_share: float
    max_prompt_ids_mismatch_share: float

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> QualitySettings:
        """Each field is the Param that fills it, checked."""
        return _build(cls, filled(params, cls.__name__))


@dataclass(frozen=True)
class NotifySettings:
    """Where the run's messages go (dflash_regen.notify, sent by tasks.py)."""

    notify_email_to: str
    notify_smtp_conn_id: str
    notify_apprise_urls: list[str]
    notify_apprise_conn_id: str
    notify_progress_h: float


@dataclass(frozen=True)
class CapacitySettings:
    calibration_prompts: int  # 0 = no calibration
    apply_advised_concurrency: bool  # generate keeps the planner's in-flight count instead of in_flight


@dataclass(frozen=True)
class AutotuneSettings:
    """Params autotune, autotune_candidate_s, autotune_budget_s and autotune_candidates."""

    mode: str  # off | advise | apply (capacity/autotune.py MODES)
    candidate_s: float  # at most this long per candidate's measurement
    budget_s: float  # candidates that would end past this are skipped
    extra: tuple[str, ...]  # flag sets to try besides the derived candidates


@dataclass(frozen=True)
class RunConfig:
    run_id: str
    output_root: Path
    model_source_dir: str  # a directory, or "demo" for the generated demo model
    staging_dir: Path
    fleet: FleetConfig
    sampling: SamplingConfig
    prompt_source: str  # a file or directory, or "demo" for the generated demo prompts
    plan: PlanSettings
    generation: GenerationSettings
    quality: QualitySettings
    capacity: CapacitySettings
    mask_reasoning: bool
    dataset_name: str
    node: str  # a node of several (settings/nodes.py); "" = the one-node deployment
    autotune: AutotuneSettings
    budget: str  # full | train_length: max_tokens per request = train_max_length - its prompt tokens
    reuse: str  # same_settings | off: take completions from the store (generate/store.py)
    notify: NotifySettings

    @property
    def layout(self) -> RunLayout:
        """Every path of this run's folder, as this node sees it."""
        return RunLayout.of(self.output_root, self.run_id, self.node)

    @property
    def run_dir(self) -> Path:
        return self.layout.run_dir

    @property
    def fleet_dir(self) -> Path:
        return self.layout.fleet_dir

    @property
    def reports_dir(self) -> Path:
        return self.layout.reports_dir

    @property
    def node_reports_dir(self) -> Path:
        """The fleet's reports (staging, health, smoke, capacity): per node when there are several."""
        return self.layout.node_reports_dir

    @property
    def publish_dir(self) -> Path:
        return publish_dir(self.output_root, self.dataset_name, self.run_id)

    def with_extra_flags(self, extra: str) -> RunConfig:
        """This run with `extra` SGLang flags on top of Param server_flags (autotune's candidates, the fleet it
        applied), as if server_flags had said both."""
        text = " ".join(x for x in (self.fleet.server_flags, extra.strip()) if x)
        flags = _server_flags(text)
        return replace(self, fleet=replace(self.fleet, server_flags=text, flags=tuple(flags)),
                       generation=replace(self.generation, reasoning_parser=_flag_value(flags, "--reasoning-parser")))

    @classmethod
    def from_params(cls, params: Mapping[str, Any], run_id: str, node: str = "") -> RunConfig:
        """Every Param checked and put in the field(s) it fills (`params.filled`), the fields derived from them,
        and the checks that span several Params."""
        values = filled(params)
        own = _given(cls, values)  # RunConfig's own fields that Params fill
        paths = _paths(own)
        sampling = _build(SamplingConfig, values)
        fleet = _fleet(values)
        train_length = own["budget"] == "train_length"
        plan = _build(PlanSettings, values, sampling=sampling, count_tokens=train_length)
        if sampling.max_tokens >= plan.context_length:
            raise _fail(SamplingConfig, "max_tokens", sampling.max_tokens,
                        f"must be below {_param(PlanSettings, 'context_length')} {plan.context_length:,}")
        generation = _build(GenerationSettings, values, sampling=sampling, progress_s=30.0,
                            reasoning_parser=_flag_value(fleet.flags, "--reasoning-parser"),
                            train_budget=plan.train_max_length if train_length else 0, run=safe_run_id(run_id))
        extra = _given(AutotuneSettings, values)["extra"]
        for candidate in extra:
            _server_flags(candidate, _param(AutotuneSettings, "extra"))
        autotune = _build(AutotuneSettings, values, extra=tuple(x.strip() for x in extra if x.strip()))
        return _build(cls, values, run_id=safe_run_id(run_id), node=node, **paths, fleet=fleet, sampling=sampling,
                      plan=plan, generation=generation, autotune=autotune, quality=_build(QualitySettings, values),
                      capacity=_build(CapacitySettings, values), notify=_build(NotifySettings, values))


_Config = TypeVar("_Config", bound="DataclassInstance")


def _given(cls: type[DataclassInstance], values: Mapping[str, Any]) -> dict[str, Any]:
    """`cls`'s fields that Params fill, from `values` (`params.filled`'s, keyed "FleetConfig.num_servers")."""
    return {f.name: values[path] for f in fields(cls) if (path := f"{cls.__name__}.{f.name}") in values}


def _build(cls: type[_Config], values: Mapping[str, Any], **derived: Any) -> _Config:
    """A config dataclass: the fields Params fill and the `derived` ones, computed by the caller (a derived value
    replaces the Param's own: gpu_ids' text becomes a tuple)."""
    return cls(**(_given(cls, values) | derived))


def _param(cls: type, field: str) -> str:
    """The key of the Param that fills `cls`'s `field`, for messages that name it."""
    return key_of(f"{cls.__name__}.{field}")


def _fail(cls: type, field: str, value: Any, rule: str) -> ConfigError:
    """A bad value of the Param that fills `cls`'s `field`."""
    return invalid(_param(cls, field), value, rule)


def _paths(own: Mapping[str, Any]) -> dict[str, Any]:
    """The run's paths (`own`: RunConfig's fields the Params fill): output root normalised, the model and prompt
    sources absolute (or the demo's), the staging directory absolute (its default named after the model)."""
    model_source_dir, prompt_source = own["model_source_dir"], own["prompt_source"]
    if model_source_dir != DEMO_MODEL and not Path(model_source_dir).is_absolute():
        raise _fail(RunConfig, "model_source_dir", model_source_dir, f"must be an absolute path or {DEMO_MODEL!r}")
    model_name = "dflash-demo-model" if model_source_dir == DEMO_MODEL else Path(model_source_dir).name
    staging_dir = Path(own["staging_dir"] or f"/dev/shm/{model_name}")
    if not staging_dir.is_absolute() or ".." in staging_dir.parts:
        raise _fail(RunConfig, "staging_dir", str(staging_dir), "must be an absolute path without '..'")
    if prompt_source != DEMO_PROMPTS and not Path(prompt_source).is_absolute():
        raise _fail(RunConfig, "prompt_source", prompt_source, f"must be an absolute path or {DEMO_PROMPTS!r}")
    return {"output_root": Path(os.path.normpath(own["output_root"])), "staging_dir": staging_dir}


def _fleet(values: Mapping[str, Any]) -> FleetConfig:
    """The fleet's Params with what they derive: the argv to run, one GPU id per server, the last server's port
    in range, the cookbook flags with server_flags', the emulator's faults and profile in its environment."""
    given = _given(FleetConfig, values)
    command, num_servers, gpu_text, base_port = (given[f] for f in ("server_command", "num_servers", "gpu_ids",
                                                                    "base_port"))
    is_emulator = command == EMULATOR
    server_argv = ([sys.executable, "-m", "dflash_regen.emulator"] if is_emulator
                   else split_command(command, _param(FleetConfig, "server_command")))
    servers = _param(FleetConfig, "num_servers")
    gpu_ids = tuple(gpu_text.split(",")) if gpu_text else tuple(str(i) for i in range(num_servers))
    if len(gpu_ids) != num_servers:
        raise _fail(FleetConfig, "gpu_ids", gpu_text, f"must list {num_servers} comma-separated GPU numbers (one per "
                    f"server), or be empty for 0..{servers}-1")
    last_port = base_port + num_servers - 1
    if last_port > MAX_PORT:
        raise _fail(FleetConfig, "base_port", base_port, f"with {servers} = {num_servers} the last server would "
                    f"listen on port {last_port:,}, past {MAX_PORT:,}; lower {_param(FleetConfig, 'base_port')} or "
                    f"{servers}")
    env = dict(COOKBOOK_ENV)
    if is_emulator:
        for value, var in ((given["emulator_faults"], "DFLASH_EMU_FAULTS"),
                           (given["emulator_profile"], "DFLASH_EMU_PROFILE")):
            if value:
                env[var] = json.dumps(value, sort_keys=True)
    return _build(FleetConfig, values, server_argv=tuple(server_argv), is_emulator=is_emulator, gpu_ids=gpu_ids,
                  host="127.0.0.1", flags=tuple(_server_flags(given["server_flags"])), env=tuple(sorted(env.items())))
