"""SGLang's launch flags (per emulated version) and the `ServerArgs.__post_init__` rules that matter for Qwen3.6.

`build_parser()` accepts SGLang's flag names, defaults and choices (argparse's own exit 2 on anything
else); `resolve()` applies the rules that change what a server does — NEXTN is EAGLE, speculative decoding
resets `max_running_requests` to 48, topk 1 forces `num_draft_tokens = num_steps + 1`, Mamba-hybrid
models refuse speculative decoding with radix cache under `no_buffer` — and raises SGLang's ValueError
texts where SGLang refuses to start (the entry point lets them escape as a traceback, exit code 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from dflash_regen.emulator import allocation
from dflash_regen.emulator.versions import DEFAULT_VERSION, Forms

DEFAULT_FORMS = Forms(DEFAULT_VERSION)

log = logging.getLogger("sglang.srt.server_args")

REASONING_PARSERS = ["deepseek-r1", "deepseek-v3", "glm45", "gpt-oss", "kimi", "kimi_k2", "mimo", "qwen3",
                     "qwen3-thinking", "minimax", "minimax-append-think", "step3", "step3p5", "mistral",
                     "nemotron_3", "interns1"]
TOOL_CALL_PARSERS = ["deepseekv3", "deepseekv31", "deepseekv32", "glm", "glm45", "glm47", "gpt-oss", "kimi_k2",
                     "lfm2", "llama3", "mimo", "mistral", "pythonic", "qwen", "qwen25", "qwen3_coder", "step3",
                     "step3p5", "minimax-m2", "trinity", "interns1", "hermes", "gigachat3"]
SPECULATIVE_ALGORITHMS = ["EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"]
MAMBA_STRATEGIES = ["auto", "no_buffer", "extra_buffer"]
MAMBA_STRATEGIES_0514 = [*MAMBA_STRATEGIES, "extra_buffer_lazy"]
DTYPES = ["auto", "half", "float16", "bfloat16", "float", "float32"]
KV_CACHE_DTYPES = ["auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16", "fp4_e2m1"]
HYBRID_ARCHS = {"Qwen3NextForCausalLM", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5ForConditionalGeneration"}
DEFAULT_CONTEXT_LEN = 262144


def human_readable_int(value: str) -> int:
    """SGLang accepts '128k' / '1M' style sizes for --context-length."""
    text = value.strip().lower()
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    try:
        return int(float(number) * scale) if scale != 1 else int(number)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from exc


def build_parser(forms: Forms = DEFAULT_FORMS) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dflash_regen.emulator",
                                description=f"SGLang {forms.version} server emulator (same flags as "
                                            "sglang.launch_server)")
    p.add_argument("--model-path", "--model", dest="model_path", type=str, required=True)
    p.add_argument("--tokenizer-path", type=str, default=None)
    p.add_argument("--host", type=str, default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", type=str, default=None)
    p.add_argument("--admin-api-key", type=str, default=None)
    p.add_argument("--served-model-name", type=str, default=None)
    p.add_argument("--reasoning-parser", type=str, choices=REASONING_PARSERS, default=None)
    p.add_argument("--tool-call-parser", type=str, choices=TOOL_CALL_PARSERS, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--max-queued-requests", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--max-prefill-tokens", type=int, default=16384)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--max-mamba-cache-size", type=int, default=None)
    if forms.radix_cache_strategy_flag:  # renamed in 0.5.14; the old name an alias until 0.5.20
        names = ["--mamba-radix-cache-strategy"] + (["--mamba-scheduler-strategy"]
                                                    if forms.scheduler_strategy_alias else [])
        p.add_argument(*names, dest="mamba_scheduler_strategy", type=str, choices=MAMBA_STRATEGIES_0514,
                       default="auto")
    else:
        p.add_argument("--mamba-scheduler-strategy", type=str, choices=MAMBA_STRATEGIES, default="auto")
    p.add_argument("--mamba-full-memory-ratio", type=float, default=0.9)
    p.add_argument("--mamba-track-interval", type=int, default=256)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--context-length", type=human_readable_int, default=None)
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--enable-cache-report", action="store_true")
    p.add_argument("--speculative-algorithm", type=str, choices=SPECULATIVE_ALGORITHMS, default=None)
    p.add_argument("--speculative-draft-model-path", "--speculative-draft-model", dest="speculative_draft_model_path",
                   type=str, default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    p.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--gpu-id-step", type=int, default=1)
    p.add_argument("--log-level", type=str, default="info")
    p.add_argument("--log-level-http", type=str, default=None)
    p.add_argument("--log-requests", action="store_true")
    p.add_argument("--decode-log-interval", type=int, default=40)
    p.add_argument("--skip-server-warmup", action="store_true")
    p.add_argument("--watchdog-timeout", type=float, default=300)
    p.add_argument("--attention-backend", type=str, default=None)
    graph_bs = ["--cuda-graph-max-bs"] if forms.cuda_graph_max_bs_flag else []
    graph_bs += ["--cuda-graph-max-bs-decode"] if forms.radix_cache_strategy_flag else []
    p.add_argument(*graph_bs, dest="cuda_graph_max_bs", type=int, default=None)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--dtype", type=str, choices=DTYPES, default="auto")
    p.add_argument("--kv-cache-dtype", type=str, choices=KV_CACHE_DTYPES, default="auto")
    return p


@dataclass
class ServerArgs:
    """The resolved server arguments (field names and order as SGLang's dataclass, a relevant subset)."""

    model_path: str
    tokenizer_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    admin_api_key: str | None = None
    served_model_name: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    context_length: int | None = None
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    max_queued_requests: int | None = None
    max_total_tokens: int | None = None
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int = 16384
    page_size: int | None = None
    tp_size: int = 1
    dp_size: int = 1
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    log_level: str = "info"
    log_level_http: str | None = None
    log_requests: bool = False
    decode_log_interval: int = 40
    enable_metrics: bool = False
    enable_cache_report: bool = False
    skip_server_warmup: bool = False
    watchdog_timeout: float = 300
    attention_backend: str | None = None
    cuda_graph_max_bs: int | None = None
    disable_cuda_graph: bool = False
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    max_mamba_cache_size: int | None = None
    mamba_full_memory_ratio: float = 0.9
    mamba_scheduler_strategy: str = "auto"
    mamba_track_interval: int = 256

    def redacted_repr(self) -> str:
        """`repr()` as SGLang logs it, with the keys blanked (launch logs end up in tickets)."""
        shown = dataclasses.replace(self, api_key="***" if self.api_key else None,
                                    admin_api_key="***" if self.admin_api_key else None)
        return repr(shown)

    def enable_mamba_extra_buffer(self) -> bool:
        return self.mamba_scheduler_strategy in ("extra_buffer", "extra_buffer_lazy")

    def as_dict(self, forms: Forms) -> dict:
        """The fields as this version's `/server_info` names them."""
        d = dataclasses.asdict(self)
        if forms.radix_cache_strategy_flag:
            d["mamba_radix_cache_strategy"] = d.pop("mamba_scheduler_strategy")
            d["cuda_graph_max_bs_decode"] = d.pop("cuda_graph_max_bs")
        return d

    @property
    def speculative(self) -> bool:
        return self.speculative_algorithm is not None


@dataclass(frozen=True)
class ModelConfig:
    """What the emulator reads from the model dir's config.json (the dir holds no tokenizer files)."""

    path: str
    architecture: str
    model_type: str
    max_position_embeddings: int
    has_image_understanding: bool

    @property
    def hybrid(self) -> bool:
        return self.architecture in HYBRID_ARCHS


def read_model_config(model_path: str) -> ModelConfig:
    """Read `<model_path>/config.json`; fail with transformers' own message when it is not there."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        raise OSError(
            f"Can't load the configuration of '{model_path}'. If you were trying to load it from "
            "'https://huggingface.co/models', make sure you don't have a local directory with the same name. "
            f"Otherwise, make sure '{model_path}' is the correct path to a directory containing a config.json file")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise OSError(f"It looks like the config file at '{config_file}' is not a valid JSON file.") from exc
    text = config.get("text_config") or {}
    archs = config.get("architectures") or ["Qwen3_5ForConditionalGeneration"]
    return ModelConfig(
        path=model_path,
        architecture=archs[0],
        model_type=config.get("model_type", "qwen3_5"),
        max_position_embeddings=int(config.get("max_position_embeddings")
                                    or text.get("max_position_embeddings") or DEFAULT_CONTEXT_LEN),
        has_image_understanding="vision_config" in config or archs[0].endswith("ForConditionalGeneration"),
    )


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def resolve(ns: argparse.Namespace, env: dict[str, str] | None = None, *,
            gpu_memory_gb: float = allocation.DEFAULT_GPU_MEMORY_GB,
            forms: Forms = DEFAULT_FORMS) -> tuple[ServerArgs, ModelConfig]:
    """Build ServerArgs from parsed flags and apply SGLang's post-init rules (logging its warnings)."""
    env = dict(os.environ if env is None else env)
    if not forms.reads_spec_v2_env:
        env["SGLANG_ENABLE_SPEC_V2"] = "1"  # 0.5.14+: spec v2 always on; the variable is no longer read
    args = ServerArgs(**vars(ns))
    if args.served_model_name is None:
        args.served_model_name = args.model_path
    if args.tokenizer_path is None:
        args.tokenizer_path = args.model_path
    model = read_model_config(args.model_path)
    gpu_gb = gpu_memory_gb

    if args.mamba_scheduler_strategy == "auto":
        args.mamba_scheduler_strategy = "no_buffer"
    if args.chunked_prefill_size is None:
        args.chunked_prefill_size = 16384 if gpu_gb >= 160 else 8192
    if args.mem_fraction_static is None:
        args.mem_fraction_static = allocation.auto_mem_fraction_static(gpu_gb, args.speculative_algorithm is not None)

    _handle_speculative_decoding(args, env)
    if model.hybrid:
        _handle_mamba_radix_cache(args, model, env)
    if args.page_size is None:
        args.page_size = 1
    if args.cuda_graph_max_bs is None:
        args.cuda_graph_max_bs = args.max_running_requests if args.speculative else 256
    return args, model


def _handle_speculative_decoding(args: ServerArgs, env: dict[str, str]) -> None:
    if args.speculative_algorithm is None:
        return
    if args.speculative_algorithm == "NEXTN":
        args.speculative_algorithm = "EAGLE"
    if args.max_running_requests is None:
        args.max_running_requests = allocation.SPEC_DEFAULT_MAX_RUNNING_REQUESTS
        log.warning("Max running requests is reset to 48 for speculative decoding. You can override this by "
                    "explicitly setting --max-running-requests.")
    if args.speculative_algorithm == "NGRAM":
        return
    if (args.speculative_num_steps is None and args.speculative_eagle_topk is None
            and args.speculative_num_draft_tokens is None):
        # auto_choose_speculative_params: (3, 1, 4) for the Qwen architectures
        args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens = 3, 1, 4
    if args.speculative_num_steps is None:
        args.speculative_num_steps = 3
    if args.speculative_eagle_topk is None:
        args.speculative_eagle_topk = 1
    if args.speculative_eagle_topk == 1 and args.speculative_num_draft_tokens != args.speculative_num_steps + 1:
        log.warning("speculative_num_draft_tokens is adjusted to speculative_num_steps + 1 when "
                    "speculative_eagle_topk == 1")
        args.speculative_num_draft_tokens = args.speculative_num_steps + 1
    if args.speculative_num_draft_tokens is None:
        args.speculative_num_draft_tokens = args.speculative_num_steps + 1
    if _truthy(env.get("SGLANG_ENABLE_SPEC_V2")) and args.speculative_algorithm in {"EAGLE", "EAGLE3"}:
        if args.speculative_eagle_topk != 1:
            raise ValueError("Spec v2 currently only supports topk = 1 for speculative decoding.")
        log.warning("Spec v2 is enabled for eagle/eagle3 speculative decoding and overlap schedule is turned on.")
    else:
        args.disable_overlap_schedule = True
        log.warning("Overlap scheduler is disabled when spec v2 is off or using unsupported speculative "
                    "algorithm. You can set env SGLANG_ENABLE_SPEC_V2=True to enable the experimental overlap "
                    "scheduler. ")


def _handle_mamba_radix_cache(args: ServerArgs, model: ModelConfig, env: dict[str, str]) -> None:
    arch = model.architecture
    if args.attention_backend is None and (args.enable_mamba_extra_buffer() or args.disable_radix_cache):
        args.attention_backend = "trtllm_mha"
        log.info(f"Use trtllm_mha as attention backend on sm100 for {arch}")
        if args.page_size not in (16, 32, 64):
            log.warning("TensorRT-LLM MHA only supports page_size of 16, 32 or 64, changing page_size from "
                        f"{args.page_size} to 64.")
            args.page_size = 64
    if args.enable_mamba_extra_buffer():
        if args.disable_radix_cache:
            raise ValueError("mamba extra_buffer is not compatible with --disable-radix-cache. Remove "
                             "--disable-radix-cache or use --mamba-scheduler-strategy no_buffer.")
        if args.speculative_num_draft_tokens is not None and \
                args.mamba_track_interval < args.speculative_num_draft_tokens:
            raise AssertionError(f"mamba_track_interval {args.mamba_track_interval} must be greater than or equal "
                                 f"to speculative_num_draft_tokens {args.speculative_num_draft_tokens}")
        if args.page_size is not None and args.mamba_track_interval % args.page_size != 0:
            raise AssertionError(f"mamba_track_interval {args.mamba_track_interval} must be divisible by "
                                 f"page_size {args.page_size}")
    elif not args.disable_radix_cache:  # no_buffer with radix cache
        if args.speculative:
            raise ValueError(
                f"Speculative decoding for {arch} is not compatible with radix cache when using "
                "--mamba-scheduler-strategy no_buffer."
                "To use radix cache with speculative decoding, please use --mamba-scheduler-strategy "
                "extra_buffer and set SGLANG_ENABLE_SPEC_V2=1.")
        log.warning("Disabling overlap schedule since mamba no_buffer is not compatible with overlap schedule, "
                    "try to use --disable-radix-cache if overlap schedule is necessary")
        args.disable_overlap_schedule = True


def allocation_inputs(args: ServerArgs, model: ModelConfig, gpu_memory_gb: float) -> allocation.AllocationInputs:
    """The memory-sizing view of resolved server args."""
    return allocation.AllocationInputs(
        mem_fraction_static=float(args.mem_fraction_static or 0.8),
        speculative=args.speculative,
        speculative_num_draft_tokens=args.speculative_num_draft_tokens,
        max_running_requests=args.max_running_requests,
        max_mamba_cache_size=args.max_mamba_cache_size,
        max_total_tokens=args.max_total_tokens,
        disable_radix_cache=args.disable_radix_cache,
        extra_buffer=args.enable_mamba_extra_buffer(),
        overlap_schedule=not args.disable_overlap_schedule,
        context_len=context_len(args, model),
        page_size=args.page_size or 1,
        dp_size=args.dp_size,
        hybrid=model.hybrid,
        gpu_memory_gb=gpu_memory_gb,
        kv_cache_dtype=args.kv_cache_dtype,
        extra_buffer_lazy=args.mamba_scheduler_strategy == "extra_buffer_lazy",
    )


def context_len(args: ServerArgs, model: ModelConfig) -> int:
    return args.context_length or model.max_position_embeddings
