"""Typed, frozen run configuration built once from the DAG's Params.

Every field is validated on construction against the Param table (`settings/params.py`, which the DAG's form is
built from), plus the checks that span several Params; a bad value raises `ConfigError` naming the field, the value
and the rule, before any GPU work starts. Airflow is not imported here: the DAG adapter passes the Params as a
plain dict.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from dflash_regen.errors import ConfigError
from dflash_regen.layout import RunLayout, publish_dir
from dflash_regen.settings.deployment import DEMO_MODEL, DEMO_PROMPTS, EMULATOR
from dflash_regen.settings.params import COOKBOOK_ENV, COOKBOOK_FLAGS, SPECS, checked, defaults
from dflash_regen.settings.params import invalid as _fail

LAUNCHER_FLAGS = {"--model-path", "--model", "--host", "--port", "--api-key"}  # set per server by fleet.servers
MAX_PORT = SPECS["base_port"].maximum  # the last server's port too

# Default Param values (the DAG's trigger form shows them), the deployment's environment applied.
DEFAULTS: dict[str, Any] = defaults()

# Characters that only mean something to a shell. The server command is run from an argv list (never a
# shell), so they could only be a mistake or an injection attempt: refuse them with a clear message.
_SHELL_META = re.compile(r"[;&|`$<>(){}\\\n*?!]")
_RUN_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else ""


def split_command(text: str, name: str = "server_command") -> list[str]:
    """Split a command line into argv, refusing shell syntax (it is never run by a shell)."""
    if _SHELL_META.search(text):
        bad = sorted(set(_SHELL_META.findall(text)))
        raise _fail(name, text, f"contains shell syntax {''.join(bad)!r}; give a plain command such as "
                    "'/opt/sglang-venv/bin/python -m sglang.launch_server' (it is run without a shell)")
    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise _fail(name, text, f"cannot be split into arguments ({exc})") from exc
    if not argv:
        raise _fail(name, text, "is empty")
    return argv


def parse_flags(text: str) -> list[tuple[str, str | None]]:
    """Parse '--flag value --switch' into ordered (flag, value-or-None) pairs."""
    tokens = split_command(text, "server_flags") if text.strip() else []
    pairs: list[tuple[str, str | None]] = []
    for token in tokens:
        if token.startswith("--"):
            flag, eq, value = token.partition("=")
            pairs.append((flag, value if eq else None))
        elif pairs and pairs[-1][1] is None:
            pairs[-1] = (pairs[-1][0], token)
        else:
            raise _fail("server_flags", text, f"{token!r} is not after a --flag; write flags as '--name value'")
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


def _server_flags(text: str, name: str = "server_flags") -> list[str]:
    """The cookbook flags with `text`'s overrides, refusing the flags the launcher sets per server."""
    overrides = parse_flags(text)
    for flag, _ in overrides:
        if flag in LAUNCHER_FLAGS:
            raise _fail(name, text, f"{flag} is set by the launcher (per server); remove it")
    return merge_flags(COOKBOOK_FLAGS, overrides)


@dataclass(frozen=True)
class SamplingConfig:
    """How every request samples: smoke, generation and calibration send these (sglang.http.chat_payload)."""

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
        """Each field is the Param of its name, checked."""
        return cls(**{f.name: checked(params, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class NotifySettings:
    """Where the run's messages go (dflash_regen.notify, sent by tasks.py); each field is the Param of its name."""

    notify_email_to: str
    notify_smtp_conn_id: str
    notify_apprise_urls: list[str]
    notify_apprise_conn_id: str
    notify_progress_h: float

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> NotifySettings:
        return cls(**{f.name: checked(params, f.name) for f in fields(cls)})


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
    def from_params(cls, params: dict, run_id: str, node: str = "") -> RunConfig:
        def get(name: str) -> Any:  # the value, checked against its Param's spec
            return checked(params, name)

        output_root = Path(os.path.normpath(get("output_root")))

        model_source_dir = get("model_source_dir")
        if model_source_dir != DEMO_MODEL and not Path(model_source_dir).is_absolute():
            raise _fail("model_source_dir", model_source_dir, f"must be an absolute path or {DEMO_MODEL!r}")
        model_name = "dflash-demo-model" if model_source_dir == DEMO_MODEL else Path(model_source_dir).name
        staging_dir = Path(get("staging_dir") or f"/dev/shm/{model_name}")
        if not staging_dir.is_absolute() or ".." in staging_dir.parts:
            raise _fail("staging_dir", str(staging_dir), "must be an absolute path without '..'")

        command_text = get("server_command")
        is_emulator = command_text == EMULATOR
        server_argv = ([sys.executable, "-m", "dflash_regen.emulator"] if is_emulator
                       else split_command(command_text))

        num_servers = get("num_servers")
        gpu_text = get("gpu_ids")
        if gpu_text:
            gpu_ids = tuple(gpu_text.split(","))
            if len(gpu_ids) != num_servers:
                raise _fail("gpu_ids", gpu_text, f"must list {num_servers} comma-separated GPU numbers "
                            "(one per server), or be empty for 0..num_servers-1")
        else:
            gpu_ids = tuple(str(i) for i in range(num_servers))
        base_port = get("base_port")
        if base_port + num_servers - 1 > MAX_PORT:
            raise _fail("base_port", base_port, f"with num_servers = {num_servers} the last server would listen on "
                        f"port {base_port + num_servers - 1:,}, past {MAX_PORT:,}; lower base_port or num_servers")

        server_flags = get("server_flags")
        flags = _server_flags(server_flags)
        served = get("served_model_name")

        env = dict(COOKBOOK_ENV)
        faults, profile = get("emulator_faults"), get("emulator_profile")
        if is_emulator:
            for value, var in ((faults, "DFLASH_EMU_FAULTS"), (profile, "DFLASH_EMU_PROFILE")):
                if value:
                    env[var] = json.dumps(value, sort_keys=True)

        fleet = FleetConfig(
            server_argv=tuple(server_argv),
            is_emulator=is_emulator,
            num_servers=num_servers,
            gpu_ids=gpu_ids,
            base_port=base_port,
            host="127.0.0.1",
            flags=tuple(flags),
            env=tuple(sorted(env.items())),
            served_model_name=served,
            ready_timeout_s=get("ready_timeout_s"),
            import_timeout_s=get("import_timeout_s"),
            min_kv_tokens=get("min_kv_tokens"),
            min_running_requests=get("min_running_requests"),
            expected_prompt_tokens=get("expected_prompt_tokens"),
            expected_output_tokens=get("expected_output_tokens"),
            smoke_timeout_s=get("smoke_timeout_s"),
            server_command=command_text,
            server_flags=server_flags,
            emulator_faults=faults,
            emulator_profile=profile,
        )
        sampling = SamplingConfig(
            max_tokens=get("max_tokens"),
            temperature=get("temperature"),
            top_p=get("top_p"),
            top_k=get("top_k"),
            min_p=get("min_p"),
            presence_penalty=get("presence_penalty"),
            enable_thinking=get("enable_thinking"),
        )
        prompt_source = get("prompt_source")
        if prompt_source != DEMO_PROMPTS and not Path(prompt_source).is_absolute():
            raise _fail("prompt_source", prompt_source, f"must be an absolute path or {DEMO_PROMPTS!r}")
        budget = get("budget")
        plan = PlanSettings(
            shard_size=get("shard_size"),
            sampling=sampling,
            context_length=get("context_length"),
            max_bad_row_share=get("max_bad_row_share"),
            prompt_format=get("prompt_format"),
            train_max_length=get("train_max_length"),
            max_overlong_share=get("max_overlong_share"),
            count_tokens=budget == "train_length",
        )
        if sampling.max_tokens >= plan.context_length:
            raise _fail("max_tokens", sampling.max_tokens, f"must be below context_length {plan.context_length:,}")
        generation = GenerationSettings(
            sampling=sampling,
            seed=get("seed"),
            concurrency_per_server=get("concurrency_per_server"),
            stall_timeout_s=get("stall_timeout_s"),
            request_cap_s=get("request_cap_s"),
            request_retries=get("request_retries"),
            generate_retries=get("generate_retries"),
            retry_truncated=get("retry_truncated"),
            regenerate_history=get("regenerate_history"),
            checkpoint_every=get("checkpoint_every"),
            checkpoint_s=get("checkpoint_s"),
            progress_s=30.0, served_model_name=served, reasoning_parser=_flag_value(flags, "--reasoning-parser"),
            max_generate_error_share=get("max_generate_error_share"),
            train_budget=plan.train_max_length if budget == "train_length" else 0,
            run=safe_run_id(run_id),
        )
        quality = QualitySettings.from_params(params)
        capacity = CapacitySettings(calibration_prompts=get("calibration_prompts"),
                                    apply_advised_concurrency=get("apply_advised_concurrency"))
        extra = get("autotune_candidates")
        for candidate in extra:
            _server_flags(candidate, "autotune_candidates")
        autotune = AutotuneSettings(mode=get("autotune"), candidate_s=get("autotune_candidate_s"),
                                    budget_s=get("autotune_budget_s"),
                                    extra=tuple(x.strip() for x in extra if x.strip()))
        return cls(run_id=safe_run_id(run_id), output_root=output_root, model_source_dir=model_source_dir,
                   staging_dir=staging_dir, fleet=fleet, sampling=sampling, prompt_source=prompt_source,
                   plan=plan, generation=generation, quality=quality, capacity=capacity,
                   mask_reasoning=get("mask_reasoning"), dataset_name=get("dataset_name"), node=node,
                   autotune=autotune, budget=budget, reuse=get("reuse"), notify=NotifySettings.from_params(params))
