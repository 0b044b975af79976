"""The DAG's Params, declared once: each one's key, default, JSON schema, form text and the config field it fills.

The DAG builds its `Param`s from `SPECS` (`trigger_form`), so the trigger form, the REST API and Airflow's own
validation see these schemas; `checked` validates a value against the same schema with the same validator call as
Airflow's `Param.resolve`, so the two cannot drift. `run_config.RunConfig.from_params` puts each checked value in
the config field its Spec `fills` ("SamplingConfig.min_p"): renaming a Param is a change of its key here, nothing
else (tests/unit/settings/test_params.py proves it). Checks that span several Params (the last server's port,
max_tokens against the context length, one GPU id per server) stay in `run_config`. Defaults a deployment sets come
from `deployment.deployment()`. No Airflow import here.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jsonschema import FormatChecker, ValidationError  # type: ignore[import-untyped]
from jsonschema.exceptions import best_match  # type: ignore[import-untyped]
from jsonschema.validators import validator_for  # type: ignore[import-untyped]

from dflash_regen.errors import ConfigError
from dflash_regen.settings.deployment import EMULATOR, GENERATE_RETRIES_MAX, Deployment, deployment

FORMATS = ("openai", "sharegpt", "specforge", "prompt")  # prompt row formats (prompts/formats.py reads each)
PROMPT_FORMATS = ("auto", *FORMATS)

OPTIONAL_TEXT = ("null", "string")  # the form sends null for a text box left empty; plain "string" refuses it
# Optional lists and objects: the form marks a field required unless its type admits null.
OPTIONAL_LIST, OPTIONAL_OBJECT = ("null", "array"), ("null", "object")

# Qwen3.6-27B with MTP as SGLang's cookbook launches it: the flags under the `server_flags` Param, which can
# override, drop ('--flag off') or extend each of them. The form lists them in that Param's description.
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


@dataclass(frozen=True)
class Spec:
    """One Param: default, JSON type, bounds, form text and the config field(s) it fills. Numbers:
    `minimum`/`exclusive_minimum`/`maximum`, and `off`, one value outside them that switches the option off
    (top_k -1)."""

    default: Any
    type: str | tuple[str, ...]  # a JSON schema type; OPTIONAL_TEXT for text that may be left empty
    section: str
    title: str
    description: str
    fills: str | tuple[str, ...] = ()  # the config field(s) it fills: "FleetConfig.base_port" (run_config.py)
    deployed: str = ""  # the `Deployment` field that sets its default (settings/deployment.py), if one does
    minimum: float | None = None
    exclusive_minimum: float | None = None
    maximum: float | None = None
    off: int | None = None
    enum: tuple[str, ...] = ()
    pattern: str = ""  # a JSON schema pattern; `rule` says it in words for config's message
    rule: str = ""  # the rule in words where the schema alone would be cryptic (a pattern, a list's items)
    min_length: int = 0
    items: dict | None = None
    examples: tuple[str, ...] = ()
    nodes_only: bool = False  # a Param of the several-nodes DAG only (DFLASH_NODES)

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.fills,) if isinstance(self.fills, str) else self.fills

    @functools.cached_property
    def validator(self) -> Any:
        """What `jsonschema.validate` builds on each call of Airflow's `Param.resolve` (the schema's draft, a
        FormatChecker), built once: checking the schema itself took 5 ms a value. `checked` validates with it."""
        schema = self.schema()
        cls = validator_for(schema)
        cls.check_schema(schema)
        return cls(schema, format_checker=FormatChecker())

    @property
    def kind(self) -> str:
        """The JSON type a value has when it is not left empty (null)."""
        return self.type if isinstance(self.type, str) else next(k for k in self.type if k != "null")

    def schema(self) -> dict:
        """The Param's JSON schema (everything but default and description).

        A number's bounds go inside `allOf` (or `anyOf` with `off`), where only Airflow's trigger validation reads
        them. The form's number box clamps to a top-level minimum/maximum when the field loses focus (Ark UI's
        clampValueOnBlur), so a shard_size of 0 silently became 1 and ran; nested, a bad value stays in the box
        and Trigger is refused with "0 is less than the minimum of 1"."""
        schema: dict[str, Any] = {"type": list(self.type) if isinstance(self.type, tuple) else self.type}
        bounds = {k: v for k, v in (("minimum", self.minimum), ("exclusiveMinimum", self.exclusive_minimum),
                                    ("maximum", self.maximum)) if v is not None}
        if self.off is not None:
            schema["anyOf"] = [{"const": self.off}, bounds]
        elif bounds:
            schema["allOf"] = [bounds]
        for key, value in (("enum", list(self.enum)), ("pattern", self.pattern), ("minLength", self.min_length),
                           ("items", self.items), ("examples", list(self.examples))):
            if value:
                schema[key] = value
        return schema | {"section": self.section, "title": self.title}


FLEET, GATES, PROMPTS, SAMPLING, DISPATCH, QUALITY, OUTPUT, EMULATOR_SECTION = (
    "Fleet", "Fleet gates", "Prompts", "Sampling", "Dispatch", "Quality gate", "Output", "Emulator (demo and tests)")
NOTIFY = "Notifications"
DEMO = Deployment()  # the defaults without a deployment environment; `defaults()` applies the deployment's

# In the trigger form's order (sections appear in the order of their first Param).
SPECS: dict[str, Spec] = {
    "model_source_dir": Spec(
        DEMO.model_source_dir, "string", FLEET, fills="RunConfig.model_source_dir",
        deployed="model_source_dir", title="Model source directory", min_length=1,
        description=("The HF checkpoint dir you would give --model-path (config.json, safetensors, tokenizer files; "
                     "absolute path), or 'demo' for the generated stand-in model. Copied to the RAM disk before "
                     "launch.")),
    "staging_dir": Spec(
        DEMO.staging_dir, OPTIONAL_TEXT, FLEET, fills="RunConfig.staging_dir", deployed="staging_dir",
        title="Staging directory",
        description=("What each server's --model-path points at: the weights are copied here first (a RAM disk loads "
                     "in under a minute); empty = /dev/shm/<model name>.")),
    "server_command": Spec(
        DEMO.server_command, "string", FLEET, fills="FleetConfig.server_command", deployed="server_command",
        title="Server command", min_length=1,
        examples=("emulator", "/opt/sglang-venv/bin/python -m sglang.launch_server"),
        description=("'emulator', or SGLang's launcher from its own venv on a local disk, e.g. "
                     "/opt/sglang-venv/bin/python -m sglang.launch_server (run without a shell; --model-path, --host, "
                     "--port and --api-key are added per server).")),
    "server_flags": Spec(
        "", OPTIONAL_TEXT, FLEET, fills="FleetConfig.server_flags", title="Extra or overriding SGLang flags",
        description=("Added to the Qwen3.6 MTP cookbook flags, which every server gets: "
                     + " ".join(f if v is None else f"{f} {v}" for f, v in COOKBOOK_FLAGS.items())
                     + " (and env " + " ".join(f"{k}={v}" for k, v in COOKBOOK_ENV.items()) + "). Same flag = "
                     "override; '--flag off' drops a default, e.g. '--max-mamba-cache-size 160 "
                     "--max-running-requests 32'.")),
    "served_model_name": Spec(
        "qwen3.6-27b", "string", FLEET, fills=("FleetConfig.served_model_name", "GenerationSettings.served_model_name"),
        title="Served model name", min_length=1,
        description="SGLang's --served-model-name, sent as 'model' in every request and recorded with each sample."),
    "num_servers": Spec(
        7, "integer", FLEET, fills="FleetConfig.num_servers", title="Servers", minimum=1, maximum=64,
        description="One SGLang server per GPU (1-64), each with its own port and CUDA_VISIBLE_DEVICES."),
    "gpu_ids": Spec(
        "", OPTIONAL_TEXT, FLEET, fills="FleetConfig.gpu_ids", title="GPU ids", pattern=r"^(\d+(,\d+)*)?$",
        rule="must be GPU numbers separated by commas (no spaces), e.g. 0,1,2, or empty for 0..num_servers-1",
        description="CUDA_VISIBLE_DEVICES of each server, comma-separated, one per server; empty = 0..servers-1."),
    "base_port": Spec(
        DEMO.base_port, "integer", FLEET, fills="FleetConfig.base_port",
        deployed="base_port", title="Base port", minimum=1024, maximum=65_535,
        description=("Server i listens on 127.0.0.1:<base port + i>. Keep it below the ephemeral range (usually "
                     "32768).")),
    "ready_timeout_s": Spec(
        900.0, "number", FLEET, fills="FleetConfig.ready_timeout_s", title="Ready timeout (s)", minimum=1, maximum=7200,
        description=("How long a launch may take until /health answers: weight loading, CUDA graph capture and MTP "
                     "draft warm-up included.")),
    "import_timeout_s": Spec(
        120.0, "number", FLEET, fills="FleetConfig.import_timeout_s",
        title="Import check timeout (s)", minimum=1, maximum=600,
        description=("Pre-flight: the server's python must `import sglang` in this time (a venv on a network "
                     "filesystem hangs here).")),
    "min_kv_tokens": Spec(
        1_000_000, "integer", GATES, fills="FleetConfig.min_kv_tokens",
        title="Minimum KV tokens", minimum=0, maximum=1_000_000_000,
        description=("Per server, the max_total_num_tokens SGLang reports at start-up. The seed's healthy B200 server "
                     "had 1.14M; fewer means less --mem-fraction-static or a GPU shared with something else.")),
    "min_running_requests": Spec(
        16, "integer", GATES, fills="FleetConfig.min_running_requests",
        title="Minimum running-request slots", minimum=1, maximum=100_000,
        description=("Per server, the effective max running requests (Mamba slots // 5 with MTP, or "
                     "--max-running-requests). The cookbook's B200 gives 16.")),
    "expected_prompt_tokens": Spec(
        600, "integer", GATES, fills="FleetConfig.expected_prompt_tokens",
        title="Expected mean prompt tokens", minimum=1, maximum=10_000_000,
        description="Used for the KV headroom figures of health_check."),
    "expected_output_tokens": Spec(
        1820, "integer", GATES, fills="FleetConfig.expected_output_tokens",
        title="Expected mean output tokens", minimum=1, maximum=10_000_000,
        description="Reasoning + answer per sample, for KV headroom figures. The seed's run: ~1,820."),
    "smoke_timeout_s": Spec(
        1800.0, "number", GATES, fills="FleetConfig.smoke_timeout_s",
        title="Smoke request timeout (s)", minimum=1, maximum=86_400,
        description=("Per smoke request at the production max_tokens; a 16K-token thinking answer takes minutes on a "
                     "cold server.")),
    "prompt_source": Spec(
        DEMO.prompt_source, "string", PROMPTS, fills="RunConfig.prompt_source", deployed="prompt_source",
        title="Prompt source", min_length=1,
        description=("A .jsonl(.gz), .json (an array of rows or JSON lines), .csv or .parquet file, a directory of "
                     "them, or a folder written by datasets' save_to_disk (absolute path); or 'demo' for the built-in "
                     "sample prompts.")),
    "prompt_format": Spec(
        "auto", "string", PROMPTS, fills="PlanSettings.prompt_format", title="Prompt format", enum=PROMPT_FORMATS,
        description=("auto: detect per row. openai: 'messages' turns; sharegpt: 'conversations' of from/value turns; "
                     "specforge: 'conversations' of role/content turns (a published dataset); prompt: a 'prompt' "
                     "column.")),
    "shard_size": Spec(
        1000, "integer", PROMPTS, fills="PlanSettings.shard_size",
        deployed="shard_size", title="Prompts per shard", minimum=1, maximum=1_000_000,
        description=("One generate task per shard. ~1,000 keeps a shard's retry under ~10 minutes on a B200 server; "
                     "planning refuses more shards than Airflow can map ([core] max_map_length, 1,024).")),
    "context_length": Spec(
        262_144, "integer", PROMPTS, fills="PlanSettings.context_length",
        title="Context length", minimum=256, maximum=10_000_000,
        description=("The servers' context length (Qwen3.6: 262,144); prompt + max_tokens must fit, longer rows are "
                     "quarantined.")),
    "max_bad_row_share": Spec(
        0.05, "number", PROMPTS, fills="PlanSettings.max_bad_row_share",
        title="Max share of bad rows", minimum=0, maximum=1,
        description=("Planning fails above this share of rows it cannot send (bad roles, duplicates, too long); below "
                     "it they are quarantined with a reason.")),
    "max_tokens": Spec(
        16_384, "integer", SAMPLING, fills="SamplingConfig.max_tokens",
        title="max_tokens", minimum=16, maximum=1_000_000,
        description=("Budget for reasoning + answer per request. 512 left the seed's answers empty; thinking needs >= "
                     "4096.")),
    "temperature": Spec(
        0.6, "number", SAMPLING, fills="SamplingConfig.temperature", title="Temperature", minimum=0, maximum=2,
        description="Qwen3 thinking mode: 0.6. Do not use 0 (greedy): thinking loops until max_tokens."),
    "top_p": Spec(
        0.95, "number", SAMPLING, fills="SamplingConfig.top_p", title="top_p", exclusive_minimum=0, maximum=1,
        description="Nucleus sampling; Qwen3 thinking mode: 0.95."),
    "top_k": Spec(
        20, "integer", SAMPLING, fills="SamplingConfig.top_k", title="top_k", minimum=1, maximum=1_000_000, off=-1,
        description=("Sample from the k most likely tokens; Qwen3 thinking mode: 20. -1 = off (SGLang's default "
                     "without a generation_config).")),
    "min_p": Spec(
        0.0, "number", SAMPLING, fills="SamplingConfig.min_p", title="min_p", minimum=0, maximum=1,
        description="Drop tokens below this share of the top token's probability; Qwen3: 0."),
    "presence_penalty": Spec(
        0.0, "number", SAMPLING, fills="SamplingConfig.presence_penalty",
        title="presence_penalty", minimum=-2, maximum=2,
        description=("OpenAI-style penalty on tokens already generated; Qwen suggests 0 to 1.5 against endless "
                     "repetition (higher values can mix languages).")),
    "enable_thinking": Spec(
        True, "boolean", SAMPLING, fills="SamplingConfig.enable_thinking", title="Thinking mode",
        description=("chat_template_kwargs enable_thinking: the model reasons in <think> first (split into "
                     "reasoning_content by --reasoning-parser qwen3).")),
    "seed": Spec(
        0, "integer", SAMPLING, fills="GenerationSettings.seed", title="Run seed", minimum=0, maximum=2**31 - 1,
        description="Each sample's seed is derived from it and the sample id (reproducible)."),
    "regenerate_history": Spec(
        False, "boolean", SAMPLING, fills="GenerationSettings.regenerate_history",
        title="Regenerate every assistant turn",
        description=("Multi-turn prompts: regenerate earlier assistant turns too, feeding back the model's own answers"
                     " (as SpecForge does).")),
    "budget": Spec(
        "full", "string", SAMPLING, fills="RunConfig.budget", title="Generation budget", enum=("full", "train_length"),
        description=("full = max_tokens for every request; train_length = max_tokens cut to train_max_length minus the"
                     " prompt's tokens (what the trainer reads): a sample cut there is kept, marked "
                     "truncated_at_train_length. calibrate reports what it saves.")),
    "retry_truncated": Spec(
        False, "boolean", SAMPLING, fills="GenerationSettings.retry_truncated",
        title="Retry truncated/empty once with 2x max_tokens",
        description=("A sample that ends with finish_reason 'length' or without an answer is sent once more with twice"
                     " the budget; the second answer is kept.")),
    "reuse": Spec(
        "same_settings", "string", SAMPLING, fills="RunConfig.reuse",
        title="Reuse completions of earlier runs", enum=("same_settings", "off"),
        description=("same_settings: a prompt some run on this output root already answered with the same weights, "
                     "chat template, sampling, max_tokens, budget, thinking, history and seed is not sent again; its "
                     "completion comes from the store (docs/operations.md, 'Reuse across runs'). off: "
                     "send every prompt.")),
    "concurrency_per_server": Spec(
        0, "integer", DISPATCH, fills="GenerationSettings.concurrency_per_server",
        title="Requests in flight per server", minimum=0, maximum=4096,
        description=("What each shard keeps open on its server; 0 = the server's running-request slots (more only "
                     "queue in SGLang).")),
    "calibration_prompts": Spec(
        64, "integer", DISPATCH, fills="CapacitySettings.calibration_prompts",
        title="Calibration prompts", minimum=0, maximum=100_000,
        description=("calibrate measures one server with this many of the run's prompts (at least twice its slots) and"
                     " predicts the run; 0 = skip.")),
    "apply_advised_concurrency": Spec(
        False, "boolean", DISPATCH, fills="CapacitySettings.apply_advised_concurrency",
        title="Apply the planner's client concurrency",
        description=("Shards keep the calibrated in-flight count (slots plus a small queue) instead of 'Requests in "
                     "flight per server'. Server flags stay yours: the advice names them.")),
    "autotune": Spec(
        "advise", "string", DISPATCH, fills="AutotuneSettings.mode",
        title="Autotune server settings", enum=("off", "advise", "apply"),
        description=("After the gates, try server settings one by one on the first GPU (current; Mamba pool for 2x and"
                     " 4x the running batch; radix cache off; MTP off at the largest batch; FP8 KV; and your own "
                     "below), measure each for a bounded time and predict the run: advise = report only, apply = "
                     "relaunch the fleet with the fastest. Skipped when calibration_prompts is 0.")),
    "autotune_candidate_s": Spec(
        180.0, "number", DISPATCH, fills="AutotuneSettings.candidate_s",
        title="Autotune: seconds per candidate", minimum=1, maximum=86_400,
        description="Each candidate's measurement stops after this long at most (the launch and gates come on top)."),
    "autotune_budget_s": Spec(
        1800.0, "number", DISPATCH, fills="AutotuneSettings.budget_s",
        title="Autotune: total budget (s)", minimum=1, maximum=7 * 86_400,
        description="Candidates that would end past this are skipped (reported as such)."),
    "autotune_candidates": Spec(
        [], OPTIONAL_LIST, DISPATCH, fills="AutotuneSettings.extra",
        title="Autotune: extra candidates", items={"type": "string"},
        rule='must be a list of flag sets, e.g. ["--max-running-requests 24", "--kv-cache-dtype fp8_e4m3"]',
        description=("Flag sets to try on top of server_flags, one per line, e.g. '--max-running-requests 24 "
                     "--max-mamba-cache-size 120'.")),
    "stall_timeout_s": Spec(
        300.0, "number", DISPATCH, fills="GenerationSettings.stall_timeout_s",
        title="Stall timeout (s)", minimum=1, maximum=86_400,
        description=("A streamed answer with no byte for this long is a stall (retried). Not a total timeout: a "
                     "16K-token thinking answer streams for many minutes.")),
    "request_cap_s": Spec(
        7200.0, "number", DISPATCH, fills="GenerationSettings.request_cap_s",
        title="Overall request cap (s)", minimum=1, maximum=7 * 86_400,
        description="Hard limit per request, even while it streams; far above a normal answer's time."),
    "request_retries": Spec(
        4, "integer", DISPATCH, fills="GenerationSettings.request_retries",
        title="Retries per request", minimum=0, maximum=100,
        description=("For connection resets, 5xx/429 and stalls, with backoff; a server that keeps failing is marked "
                     "unhealthy and the shard moves.")),
    "generate_retries": Spec(
        DEMO.generate_retries, "integer", DISPATCH, fills="GenerationSettings.generate_retries",
        deployed="generate_retries", title="Retries of a failed shard", minimum=0,
        maximum=GENERATE_RETRIES_MAX,
        description=("Airflow retries a failed generate task this many times (with backoff), each on the server "
                     "that failed it avoided; 0 leaves it for a human to clear. A clear gives the shard as many "
                     "again. Default: the deployment's DFLASH_GENERATE_RETRIES.")),
    "max_generate_error_share": Spec(
        0.05, "number", DISPATCH, fills="GenerationSettings.max_generate_error_share",
        title="Max share of prompts the servers refuse", minimum=0, maximum=1,
        description=("Per shard: prompts refused by two servers (4xx, or the same 5xx) are quarantined; above this "
                     "share the shard fails.")),
    "checkpoint_every": Spec(
        50, "integer", DISPATCH, fills="GenerationSettings.checkpoint_every",
        title="Checkpoint every N results", minimum=1, maximum=1_000_000,
        description=("Finished samples are written to a parquet part after this many; a crash loses at most the "
                     "requests in flight.")),
    "checkpoint_s": Spec(
        30.0, "number", DISPATCH, fills="GenerationSettings.checkpoint_s",
        title="Checkpoint every T seconds", minimum=0.1, maximum=86_400,
        description="... or after this long, whichever comes first."),
    "mask_reasoning": Spec(
        True, "boolean", QUALITY, fills="RunConfig.mask_reasoning", title="Train on the reasoning",
        description="Loss mask covers reasoning + answer (SpecForge qwen3.5); off = answer only."),
    "empty_mask_tokens": Spec(
        6, "integer", QUALITY, fills="QualitySettings.empty_mask_tokens",
        title="Empty-answer mask size", minimum=0, maximum=1000,
        description=("Samples with a loss mask at or below this are empty answers (the seed's "
                     "`</think>\\n\\nOK.<|im_end|>\\n` is 6 tokens).")),
    "max_bad_sample_share": Spec(
        0.02, "number", QUALITY, fills="QualitySettings.max_bad_sample_share",
        title="Max share of bad samples", minimum=0, maximum=1,
        description="Bad samples are quarantined; above this share nothing is published."),
    "max_truncated_share": Spec(
        0.05, "number", QUALITY, fills="QualitySettings.max_truncated_share",
        title="Max share of truncated answers (finish_reason length)", minimum=0,
        maximum=1,
        description="Answers cut by max_tokens are quarantined; above this share the gate fails: raise max_tokens."),
    "max_rerender_drift_share": Spec(
        0.05, "number", QUALITY, fills="QualitySettings.max_rerender_drift_share",
        title="Max share re-rendered unlike the server's output", minimum=0, maximum=1,
        description=("The trainer re-renders each answer from its parsed fields (reasoning, content, tool calls); "
                     "where that differs from the tokens the server generated (whitespace around </think> the "
                     "template normalizes, tool-call values re-serialized), the sample is marked "
                     "(rerender_token_delta); above this share the gate fails.")),
    "max_prompt_ids_mismatch_share": Spec(
        0.0, "number", QUALITY, fills="QualitySettings.max_prompt_ids_mismatch_share",
        title="Max share whose prompt is not the server's", minimum=0, maximum=1,
        description=("Where the SGLang version reports the prompt's token ids (0.5.20+ while streaming), each "
                     "sample's input_ids must start with them: the prompt the model answered is the one trained on. "
                     "Samples that do not are marked (prompt_ids_match); above this share the gate fails.")),
    "max_repetition_score": Spec(
        0.5, "number", QUALITY, fills="QualitySettings.max_repetition_score",
        title="Max reasoning repetition score", minimum=0, maximum=1,
        description="Share of repeated 8-grams; loops (temperature 0) score near 1."),
    "train_max_length": Spec(
        4096, "integer", QUALITY, fills=("PlanSettings.train_max_length", "QualitySettings.train_max_length"),
        title="Training max_length", minimum=1, maximum=10_000_000,
        description=("The trainer's sequence length (SpecForge's Qwen3.6-27B recipe: 4096); longer samples are "
                     "truncated in training.")),
    "max_overlong_share": Spec(
        0.1, "number", QUALITY, fills=("PlanSettings.max_overlong_share", "QualitySettings.max_overlong_share"),
        title="Max share longer than max_length", minimum=0, maximum=1,
        description=("Above this share of samples longer than the training max_length, the gate fails: most tokens "
                     "would never be trained on. Prompts alone past it are quarantined at planning, which fails above "
                     "this share of them.")),
    "dataset_name": Spec(
        "qwen3.6-27b-regen", "string", OUTPUT, fills="RunConfig.dataset_name",
        title="Dataset name", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        rule="must be letters, digits, '.', '_' or '-' (no '/' or '..'), starting with a letter or digit",
        description="Published to <output root>/published/<name>/<run id>/."),
    "output_root": Spec(
        DEMO.output_root, "string", OUTPUT, fills="RunConfig.output_root",
        deployed="output_root", title="Output root", pattern=r"^/", rule="must be an absolute path",
        description="Absolute path; runs go to <output root>/runs/<run id>/."),
    "notify_email_to": Spec(
        "", OPTIONAL_TEXT, NOTIFY, fills="NotifySettings.notify_email_to", title="Email the run's news to",
        pattern=r"^([^,\s@]+@[^,\s@]+(,[^,\s@]+@[^,\s@]+)*)?$",
        rule="must be email addresses separated by commas (no spaces), or empty",
        description=("Comma-separated addresses; sent through the SMTP connection below (Airflow's smtp type, its "
                     "from_email extra the sender). Empty = no email. What is sent: docs/be-told-and-watch.md.")),
    "notify_smtp_conn_id": Spec(
        "smtp_default", "string", NOTIFY, fills="NotifySettings.notify_smtp_conn_id",
        title="SMTP connection", min_length=1,
        description="The Airflow connection of the mail server (smtp type); not defined = no email."),
    "notify_apprise_urls": Spec(
        [], OPTIONAL_LIST, NOTIFY, fills="NotifySettings.notify_apprise_urls",
        title="Apprise URLs", items={"type": "string"},
        rule='must be a list of Apprise URLs, e.g. ["slack://T000/B000/XXXX", "json://host:8000/hook"]',
        description=("Slack, Teams, Discord, webhooks (json://, form://) and the rest, one Apprise URL per line. "
                     "They show in the run's conf: keep tokens in the Apprise connection below instead.")),
    "notify_apprise_conn_id": Spec(
        "apprise_default", "string", NOTIFY, fills="NotifySettings.notify_apprise_conn_id",
        title="Apprise connection", min_length=1,
        description=("The Airflow connection (apprise type) whose config lists the URLs to notify too; not defined "
                     "= only the URLs above.")),
    "notify_progress_h": Spec(
        0.0, "number", NOTIFY, fills="NotifySettings.notify_progress_h",
        title="Progress message every N hours", minimum=0, maximum=1000,
        description=("Prompts done and the ETA (the Fleet page's), at most once per N hours of the run, sent when a "
                     "shard ends; 0 = none.")),
    "emulator_faults": Spec(
        {}, OPTIONAL_OBJECT, EMULATOR_SECTION, fills="FleetConfig.emulator_faults", title="Emulator faults",
        description=("Only with the emulator: faults per GPU id ('*' = every server), e.g. "
                     '{"2": {"crash_after_requests": 8}} SIGKILLs the server on GPU 2 at its 9th chat request, '
                     '{"*": {"http_error_rate": 0.05}} answers 5% with HTTP 500/503, {"1": {"kv_tokens": 100000}} '
                     "gives GPU 1 a small KV cache. Every knob: the docstring of dflash_regen.emulator. {} = none.")),
    "emulator_profile": Spec(
        DEMO.emulator_profile, OPTIONAL_OBJECT, EMULATOR_SECTION, fills="FleetConfig.emulator_profile",
        deployed="emulator_profile", title="Emulator profile",
        description=('Only with the emulator: its speed, e.g. {"decode_tokens_per_s": 3000} (per request), or a GPU '
                     "preset; {} = the default profile.")),
    "node_failure": Spec(
        "fail", "string", FLEET, title="A node fails its gates", enum=("fail", "continue"), nodes_only=True,
        description=("fail: the run fails. continue: that node is left out (reports/nodes/<node>/left_out.json) and "
                     "its shards go to the nodes that passed.")),
}


def defaults(dep: Deployment | None = None, *, nodes: bool = False) -> dict[str, Any]:
    """Every Param's default, the deployment's where it sets one (`deployment()` unless given)."""
    deployed = (dep or deployment()).param_defaults()
    return {name: copy.deepcopy(deployed.get(spec.deployed, spec.default)) for name, spec in SPECS.items()
            if nodes or not spec.nodes_only}


def trigger_form(dep: Deployment, *, nodes: bool) -> dict[str, dict]:
    """Per Param, the keyword arguments of its `airflow.sdk.Param` (default, description, JSON schema). The
    Emulator section only where the deployment runs the emulator: on a GPU node its Params would only confuse."""
    values = defaults(dep, nodes=nodes)
    emulated = dep.server_command == EMULATOR
    return {name: {"default": values[name], "description": SPECS[name].description, **SPECS[name].schema()}
            for name in values if emulated or SPECS[name].section != EMULATOR_SECTION}


def key_of(path: str) -> str:
    """The key of the Param that fills config field `path` ("FleetConfig.num_servers"), for messages that name it."""
    for name, spec in SPECS.items():
        if path in spec.paths:
            return name
    raise KeyError(f"no Param fills config field {path!r}; add it to a Spec's fills in settings/params.py")


def filled(params: Mapping[str, Any], config: str = "") -> dict[str, Any]:
    """Each Param's checked value under every config field it fills ("FleetConfig.base_port"); with `config`, only
    the Params filling that config class's fields ("QualitySettings")."""
    values: dict[str, Any] = {}
    for name, spec in SPECS.items():
        paths = [p for p in spec.paths if not config or p.startswith(f"{config}.")]
        if paths:
            values |= dict.fromkeys(paths, checked(params, name))
    return values


def invalid(name: str, value: Any, rule: str) -> ConfigError:
    return ConfigError(f"Param {name!r} = {value!r} is invalid: {rule}")


def _show(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


def range_rule(spec: Spec) -> str:
    """A number's bounds in words: "must be between 1 and 64", "must be -1 (off) or ..."."""
    if spec.exclusive_minimum is not None:
        low = f"above {_show(spec.exclusive_minimum)}"
    else:
        low = f"at least {_show(spec.minimum)}" if spec.minimum is not None else ""
    high = f"at most {_show(spec.maximum)}" if spec.maximum is not None else ""
    if spec.minimum is not None and spec.maximum is not None:
        rule = f"between {_show(spec.minimum)} and {_show(spec.maximum)}"
    else:
        rule = " and ".join(x for x in (low, high) if x)
    return f"must be {spec.off} (off) or {rule}" if spec.off is not None else f"must be {rule}"


_TYPE_WORDS = {"integer": "an integer", "number": "a number", "boolean": "true or false", "object": "a JSON object",
               "array": "a list of strings", "string": "a string"}


def _rule(spec: Spec, error: ValidationError) -> str:
    """The rule a value broke, in words: `error` is JSON Schema's, `spec.rule` says a pattern or a list's items."""
    if spec.enum:
        return f"must be one of {', '.join(spec.enum)}"
    if error.validator in ("minimum", "exclusiveMinimum", "maximum", "anyOf"):  # anyOf: the bounds or `off`
        return range_rule(spec)
    if error.validator == "pattern":
        return spec.rule or f"must match {spec.pattern}"
    if spec.rule and spec.kind in ("array", "object"):
        return spec.rule
    return "must be a non-empty string" if spec.min_length else f"must be {_TYPE_WORDS[spec.kind]}"


def _validate(name: str, spec: Spec, value: Any, sent: Any) -> None:
    error = best_match(spec.validator.iter_errors(value))
    if error is not None:
        raise invalid(name, sent, _rule(spec, error))


def _normalised(spec: Spec, value: Any) -> Any:
    """A valid value as config reads it: text stripped, an optional text, list or object left empty (null) as
    '' / [] / {}, a number as float and an integer as int (JSON Schema counts 2.0 as an integer)."""
    if value is None:
        return {"string": "", "array": [], "object": {}}.get(spec.kind)
    if spec.kind in ("number", "integer"):
        return float(value) if spec.kind == "number" else int(value)
    return value.strip() if isinstance(value, str) else value


def checked(params: Mapping[str, Any], name: str) -> Any:
    """`params[name]` validated against its Param's JSON schema as Airflow validates it, then normalised
    (`_normalised`); the normalised value is validated too, so a text of blanks is not a non-empty text. A bad
    value raises `ConfigError` naming the Param, the value sent and the rule."""
    spec, value = SPECS[name], params.get(name)
    _validate(name, spec, value, value)
    normal = _normalised(spec, value)
    if normal != value:
        _validate(name, spec, normal, value)
    return normal
