"""Typed, frozen run configuration built once from the DAG's Params.

Every field is validated on construction; a bad value raises `ConfigError` naming the field, the value
and the rule, before any GPU work starts. Airflow is not imported here: the DAG adapter passes the
Params as a plain dict.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_regen.errors import ConfigError
from dflash_regen.layout import RunLayout
from dflash_regen.prompts import PROMPT_FORMATS
from dflash_regen.quality import QualitySettings

EMULATOR = "emulator"
DEMO_MODEL = "demo"
DEMO_PROMPTS = "demo"

# Qwen3.6-27B with MTP as SGLang's cookbook launches it (notes/sglang-api.md §1.1). Every flag can be
# overridden or extended by the `server_flags` Param.
COOKBOOK_FLAGS: dict[str, str | None] = {
    "--reasoning-parser": "qwen3",
    "--tool-call-parser": "qwen3_coder",
    "--speculative-algorithm": "EAGLE",
    "--speculative-num-steps": "3",
    "--speculative-eagle-topk": "1",
    "--speculative-num-draft-tokens": "4",
    "--mamba-scheduler-strategy": "extra_buffer",
    "--mem-fraction-static": "0.8",
    "--enable-metrics": None,
}
COOKBOOK_ENV = {"SGLANG_ENABLE_SPEC_V2": "1"}


def _env_object(name: str) -> dict:
    try:
        value = json.loads(os.environ.get(name) or "{}")
    except ValueError as exc:
        raise ConfigError(f"environment variable {name} is not valid JSON ({exc}); unset it or give a JSON "
                          'object such as {"decode_tokens_per_s": 3000}') from exc
    if not isinstance(value, dict):
        raise ConfigError(f"environment variable {name} must be a JSON object, got {type(value).__name__}")
    return value


# Default Param values (the DAG's trigger form shows them). Deployment-specific ones come from the
# environment so a GPU node's docker-compose can set them once; the fallbacks run the demo.
DEFAULTS: dict[str, Any] = {
    "model_source_dir": os.environ.get("DFLASH_MODEL_SOURCE", DEMO_MODEL),
    "staging_dir": os.environ.get("DFLASH_STAGING_DIR", ""),
    "server_command": os.environ.get("DFLASH_SERVER_COMMAND", EMULATOR),
    "server_flags": "",
    "served_model_name": "qwen3.6-27b",
    "num_servers": 7,
    "gpu_ids": "",
    "base_port": int(os.environ.get("DFLASH_BASE_PORT", "30000")),
    "ready_timeout_s": 900.0,
    "import_timeout_s": 120.0,
    "min_kv_tokens": 1_000_000,
    "min_running_requests": 16,
    "expected_prompt_tokens": 600,
    "expected_output_tokens": 1820,
    "max_tokens": 16384,
    # Qwen3's thinking-mode sampling (Qwen3 model card, "Best Practices"; the Qwen3.6 card's own figures are not in
    # notes/ or seeds/): temperature 0.6, top_p 0.95, top_k 20, min_p 0; presence_penalty 0 is SGLang's default.
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "enable_thinking": True,
    "smoke_timeout_s": 1800.0,
    "prompt_source": os.environ.get("DFLASH_PROMPT_SOURCE", DEMO_PROMPTS),
    "prompt_format": "auto",
    "shard_size": 1000,
    "context_length": 262144,
    "max_bad_row_share": 0.05,
    "max_generate_error_share": 0.05,
    "seed": 0,
    "concurrency_per_server": 0,
    "calibration_prompts": 64,
    "apply_advised_concurrency": False,
    "autotune": "advise",
    "autotune_candidate_s": 180.0,
    "autotune_budget_s": 1800.0,
    "autotune_candidates": [],
    "budget": "full",
    "stall_timeout_s": 300.0,
    "request_cap_s": 7200.0,
    "request_retries": 4,
    "retry_truncated": False,
    "regenerate_history": False,
    "checkpoint_every": 50,
    "checkpoint_s": 30.0,
    "mask_reasoning": True,
    "empty_mask_tokens": 6,
    "max_bad_sample_share": 0.02,
    "max_truncated_share": 0.05,
    "max_repetition_score": 0.5,
    "train_max_length": 4096,
    "max_overlong_share": 0.1,
    "dataset_name": "qwen3.6-27b-regen",
    "output_root": os.environ.get("DFLASH_OUTPUT_ROOT", str(Path.home() / "dflash-regen")),
    "emulator_faults": {},
    "emulator_profile": _env_object("DFLASH_EMULATOR_PROFILE"),
}

# Characters that only mean something to a shell. The server command is run from an argv list (never a
# shell), so they could only be a mistake or an injection attempt: refuse them with a clear message.
_SHELL_META = re.compile(r"[;&|`$<>(){}\\\n*?!]")
_RUN_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_DATASET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _fail(name: str, value: Any, rule: str) -> ConfigError:
    return ConfigError(f"Param {name!r} = {value!r} is invalid: {rule}")


def _int(params: dict, name: str, lo: int, hi: int) -> int:
    value = params.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, value, "must be an integer")
    if not lo <= value <= hi:
        raise _fail(name, value, f"must be between {lo:,} and {hi:,}")
    return value


def _float(params: dict, name: str, lo: float, hi: float) -> float:
    value = params.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(name, value, "must be a number")
    if not lo <= value <= hi:
        raise _fail(name, value, f"must be between {lo} and {hi}")
    return float(value)


def _top_k(params: dict) -> int:
    value = _int(params, "top_k", -1, 1_000_000)
    if value == 0:
        raise _fail("top_k", value, "must be -1 (off) or at least 1; SGLang refuses 0")
    return value


def _str(params: dict, name: str, *, allow_empty: bool = False) -> str:
    value = params.get(name)
    if value is None and allow_empty:  # the trigger form sends null for an optional field left empty
        return ""
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        raise _fail(name, value, "must be a non-empty string")
    return value.strip()


def _bool(params: dict, name: str) -> bool:
    value = params.get(name)
    if not isinstance(value, bool):
        raise _fail(name, value, "must be true or false")
    return value


def _choice(params: dict, name: str, choices: tuple[str, ...]) -> str:
    value = params.get(name)
    if value not in choices:
        raise _fail(name, value, f"must be one of {', '.join(choices)}")
    return value


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

    def port(self, index: int) -> int:
        return self.base_port + index


@dataclass(frozen=True)
class PlanSettings:
    shard_size: int
    max_tokens: int
    context_length: int
    max_bad_share: float
    prompt_format: str = "auto"  # one of prompts.PROMPT_FORMATS
    max_shards: int = 1024  # Airflow's [core] max_map_length: more mapped shards cannot be expanded
    train_max_length: int = 0  # prompts this long leave nothing to train on; 0 = not checked
    max_overlong_share: float = 1.0
    count_tokens: bool = False  # count every prompt's tokens (Param budget train_length), not only long ones


@dataclass(frozen=True)
class GenerationSettings:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int  # -1 = off (SGLang's convention)
    min_p: float
    presence_penalty: float
    enable_thinking: bool
    seed: int
    in_flight: int  # 0 = the server's effective running-request slots
    stall_s: float
    request_cap_s: float
    request_retries: int
    retry_truncated: bool
    regenerate_history: bool
    checkpoint_every: int
    checkpoint_s: float
    progress_s: float
    served_model: str
    reasoning_parser: str
    max_error_share: float = 0.05  # share of a shard's prompts the servers may refuse (quarantined) before it fails
    train_budget: int = 0  # Param budget train_length: max_tokens = this - the prompt's tokens; 0 = max_tokens


@dataclass(frozen=True)
class CapacitySettings:
    calibration_prompts: int  # 0 = no calibration
    apply_advised_concurrency: bool  # generate keeps the planner's in-flight count instead of in_flight


@dataclass(frozen=True)
class AutotuneSettings:
    mode: str = "off"  # off | advise | apply (autotune.MODES)
    candidate_s: float = 180.0  # at most this long per candidate's measurement
    budget_s: float = 1800.0  # candidates that would end past this are skipped
    extra: tuple[str, ...] = ()  # flag sets to try besides the derived candidates


@dataclass(frozen=True)
class SamplingConfig:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int  # -1 = off (SGLang's convention)
    min_p: float
    presence_penalty: float
    enable_thinking: bool
    smoke_timeout_s: float


@dataclass(frozen=True)
class RunConfig:
    run_id: str
    output_root: Path
    model_source: str  # a directory, or "demo" for the generated demo model
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
    params: dict = field(repr=False, compare=False, default_factory=dict)
    node: str = ""  # a node of several (dflash_regen.nodes); "" = the one-node deployment
    autotune: AutotuneSettings = AutotuneSettings()
    budget: str = "full"  # full | train_length: max_tokens per request = train_max_length - its prompt tokens

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
        return self.output_root / "published" / self.dataset_name / self.run_id

    @classmethod
    def from_params(cls, params: dict, run_id: str, node: str = "") -> RunConfig:
        output_root = Path(_str(params, "output_root")).expanduser()
        if not output_root.is_absolute():
            raise _fail("output_root", str(output_root), "must be an absolute path")
        output_root = Path(os.path.normpath(output_root))

        model_source = _str(params, "model_source_dir")
        if model_source != DEMO_MODEL and not Path(model_source).is_absolute():
            raise _fail("model_source_dir", model_source, f"must be an absolute path or {DEMO_MODEL!r}")
        staging_text = _str(params, "staging_dir", allow_empty=True)
        model_name = "dflash-demo-model" if model_source == DEMO_MODEL else Path(model_source).name
        staging_dir = Path(staging_text or f"/dev/shm/{model_name}")
        if not staging_dir.is_absolute() or ".." in staging_dir.parts:
            raise _fail("staging_dir", str(staging_dir), "must be an absolute path without '..'")

        command_text = _str(params, "server_command")
        is_emulator = command_text == EMULATOR
        server_argv = ([sys.executable, "-m", "dflash_regen.emulator"] if is_emulator
                       else split_command(command_text))

        num_servers = _int(params, "num_servers", 1, 64)
        gpu_text = _str(params, "gpu_ids", allow_empty=True)
        if gpu_text:
            gpu_ids = tuple(g.strip() for g in gpu_text.split(","))
            if len(gpu_ids) != num_servers or not all(g.isdigit() for g in gpu_ids):
                raise _fail("gpu_ids", gpu_text, f"must list {num_servers} comma-separated GPU numbers "
                            "(one per server), or be empty for 0..num_servers-1")
        else:
            gpu_ids = tuple(str(i) for i in range(num_servers))
        base_port = _int(params, "base_port", 1024, 65535 - num_servers)

        overrides = parse_flags(_str(params, "server_flags", allow_empty=True))
        for flag, _ in overrides:
            if flag in {"--model-path", "--model", "--host", "--port", "--api-key"}:
                raise _fail("server_flags", flag, "is set by the launcher (per server); remove it")
        flags = merge_flags(COOKBOOK_FLAGS, overrides)
        served = _str(params, "served_model_name")

        env = dict(COOKBOOK_ENV)
        if is_emulator:
            for name, var in (("emulator_faults", "DFLASH_EMU_FAULTS"), ("emulator_profile", "DFLASH_EMU_PROFILE")):
                value = params.get(name) or {}
                if not isinstance(value, dict):
                    raise _fail(name, value, "must be a JSON object")
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
            ready_timeout_s=_float(params, "ready_timeout_s", 1, 7200),
            import_timeout_s=_float(params, "import_timeout_s", 1, 600),
            min_kv_tokens=_int(params, "min_kv_tokens", 0, 10**9),
            min_running_requests=_int(params, "min_running_requests", 1, 100_000),
            expected_prompt_tokens=_int(params, "expected_prompt_tokens", 1, 10**7),
            expected_output_tokens=_int(params, "expected_output_tokens", 1, 10**7),
        )
        enable_thinking = _bool(params, "enable_thinking")
        sampling = SamplingConfig(
            max_tokens=_int(params, "max_tokens", 16, 1_000_000),
            temperature=_float(params, "temperature", 0.0, 2.0),
            top_p=_float(params, "top_p", 0.01, 1.0),
            top_k=_top_k(params),
            min_p=_float(params, "min_p", 0.0, 1.0),
            presence_penalty=_float(params, "presence_penalty", -2.0, 2.0),
            enable_thinking=enable_thinking,
            smoke_timeout_s=_float(params, "smoke_timeout_s", 1, 86_400),
        )
        prompt_source = _str(params, "prompt_source")
        if prompt_source != DEMO_PROMPTS and not Path(prompt_source).is_absolute():
            raise _fail("prompt_source", prompt_source, f"must be an absolute path or {DEMO_PROMPTS!r}")
        plan = PlanSettings(
            shard_size=_int(params, "shard_size", 1, 1_000_000),
            max_tokens=sampling.max_tokens,
            context_length=_int(params, "context_length", 256, 10_000_000),
            max_bad_share=_float(params, "max_bad_row_share", 0.0, 1.0),
            prompt_format=_choice(params, "prompt_format", PROMPT_FORMATS),
            train_max_length=_int(params, "train_max_length", 1, 10_000_000),
            max_overlong_share=_float(params, "max_overlong_share", 0.0, 1.0),
            count_tokens=_choice(params, "budget", ("full", "train_length")) == "train_length",
        )
        if plan.max_tokens >= plan.context_length:
            raise _fail("max_tokens", plan.max_tokens, f"must be below context_length {plan.context_length:,}")
        generation = GenerationSettings(
            max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, min_p=sampling.min_p, presence_penalty=sampling.presence_penalty,
            enable_thinking=sampling.enable_thinking, seed=_int(params, "seed", 0, 2**31 - 1),
            in_flight=_int(params, "concurrency_per_server", 0, 4096),
            stall_s=_float(params, "stall_timeout_s", 1, 86_400),
            request_cap_s=_float(params, "request_cap_s", 1, 7 * 86_400),
            request_retries=_int(params, "request_retries", 0, 100),
            retry_truncated=_bool(params, "retry_truncated"),
            regenerate_history=_bool(params, "regenerate_history"),
            checkpoint_every=_int(params, "checkpoint_every", 1, 1_000_000),
            checkpoint_s=_float(params, "checkpoint_s", 0.1, 86_400),
            progress_s=30.0, served_model=served, reasoning_parser=_flag_value(flags, "--reasoning-parser"),
            max_error_share=_float(params, "max_generate_error_share", 0.0, 1.0),
            train_budget=(plan.train_max_length if _choice(params, "budget", ("full", "train_length")) == "train_length"
                          else 0),
        )
        quality = QualitySettings(
            empty_mask_tokens=_int(params, "empty_mask_tokens", 0, 1000),
            max_bad_share=_float(params, "max_bad_sample_share", 0.0, 1.0),
            max_truncated_share=_float(params, "max_truncated_share", 0.0, 1.0),
            max_repetition=_float(params, "max_repetition_score", 0.0, 1.0),
            max_length=_int(params, "train_max_length", 1, 10_000_000),
            max_overlong_share=_float(params, "max_overlong_share", 0.0, 1.0),
        )
        capacity = CapacitySettings(calibration_prompts=_int(params, "calibration_prompts", 0, 100_000),
                                    apply_advised_concurrency=_bool(params, "apply_advised_concurrency"))
        extra = params.get("autotune_candidates") or []
        if not isinstance(extra, list) or not all(isinstance(x, str) for x in extra):
            raise _fail("autotune_candidates", extra, "must be a list of flag sets, e.g. "
                        '["--max-running-requests 24", "--kv-cache-dtype fp8_e4m3"]')
        for flags in extra:
            for flag, _ in parse_flags(flags):
                if flag in {"--model-path", "--model", "--host", "--port", "--api-key"}:
                    raise _fail("autotune_candidates", flags, f"{flag} is set by the launcher (per server); remove it")
        autotune = AutotuneSettings(mode=_choice(params, "autotune", ("off", "advise", "apply")),
                                    candidate_s=_float(params, "autotune_candidate_s", 1, 86_400),
                                    budget_s=_float(params, "autotune_budget_s", 1, 7 * 86_400),
                                    extra=tuple(x.strip() for x in extra if x.strip()))
        dataset_name = _str(params, "dataset_name")
        if not _DATASET_NAME.fullmatch(dataset_name):
            raise _fail("dataset_name", dataset_name, "must be letters, digits, '.', '_' or '-' (no '/' or '..'), "
                        "starting with a letter or digit")
        return cls(run_id=safe_run_id(run_id), output_root=output_root, model_source=model_source,
                   staging_dir=staging_dir, fleet=fleet, sampling=sampling, prompt_source=prompt_source,
                   plan=plan, generation=generation, quality=quality, capacity=capacity,
                   mask_reasoning=_bool(params, "mask_reasoning"), dataset_name=dataset_name, params=dict(params),
                   node=node, autotune=autotune, budget=_choice(params, "budget", ("full", "train_length")))
