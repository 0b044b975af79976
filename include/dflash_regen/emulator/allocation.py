"""GPU memory arithmetic of an SGLang 0.5.10 server running Qwen3.6-27B on one B200.

The formulas are SGLang's (SGLang 0.5.10's `model_runner_kv_cache_mixin.py`): after the weights
are loaded, `rest = available - total * (1 - mem_fraction_static)`; speculative decoding first reserves the
intermediate SSM states; the Mamba slots come from `--max-mamba-cache-size` or from the ratio fit
`mamba : KV = mamba_full_memory_ratio : 1`; the KV pool gets what is left; the scheduler then runs at most
`min(max_running_requests, estimate from KV capacity, mamba_slots // ratio)` requests.

The per-model constants are calibrated so that the cookbook launch (EAGLE 3/1/4, `extra_buffer`, spec v2,
`--mem-fraction-static 0.8`) reproduces the seed's node: ~1.14M KV tokens, 80 Mamba slots, ~35 GB of KV
cache and 16 running requests. One deliberate deviation: SGLang sizes the speculative reserve with the full
per-slot Mamba state; with the seed's figures that reserve would not fit in memory at all, so the reserve
here uses the SSM-only intermediate state (what the `intermediate_ssm_state_cache` actually holds).
"""

from __future__ import annotations

from dataclasses import dataclass

# SGLang's own constants (model_runner_kv_cache_mixin.py).
MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO = 3
MAMBA_CACHE_V2_ADDITIONAL_RATIO_OVERLAP = 2
MAMBA_CACHE_V2_ADDITIONAL_RATIO_NO_OVERLAP = 1

GIB = 1 << 30
DEFAULT_GPU_MEMORY_GB = 183.0  # B200 as SGLang reports it

# Calibrated Qwen3.6-27B figures, in SGLang's "GB" (GiB).
TORCH_CONTEXT_GB = 0.76  # CUDA context + NCCL before the weights load
TARGET_WEIGHTS_GB = 52.02  # Qwen3_5ForConditionalGeneration, BF16, vision tower included
DRAFT_WEIGHTS_GB = 0.86  # the MTP head (Qwen3_5ForCausalLMMTP), loaded after the target's memory pool
KV_BYTES_PER_TOKEN = 32768  # K + V over the full-attention layers, BF16: the seed's 35 GB for 1.14M tokens
# Bytes per KV element relative to BF16 (`--kv-cache-dtype`): FP8 halves the pool's bytes per token, so the same
# memory holds twice the tokens (SGLang sizes the pool by `cell_size`, which scales with the dtype's size).
KV_DTYPE_SCALE = {"auto": 1.0, "bf16": 1.0, "bfloat16": 1.0, "fp8_e4m3": 0.5, "fp8_e5m2": 0.5, "fp4_e2m1": 0.25}
MAMBA_CONV_GB_PER_SLOT = 0.0200
MAMBA_SSM_GB_PER_SLOT = 0.3668
MAMBA_INTERMEDIATE_SSM_GB = 0.1406  # one SSM state (48 layers x 48 heads x 128 x 128 fp32) per draft token
MAMBA_INTERMEDIATE_CONV_GB = 0.0047
CUDA_GRAPH_GB = 1.85  # what graph capture takes from the memory left over
SPEC_DEFAULT_MAX_RUNNING_REQUESTS = 48


def mamba_cache_per_req_gb() -> float:
    """Memory of one Mamba state slot (conv + SSM state of every linear-attention layer)."""
    return MAMBA_CONV_GB_PER_SLOT + MAMBA_SSM_GB_PER_SLOT


def auto_mem_fraction_static(gpu_memory_gb: float, speculative: bool) -> float:
    """SGLang's automatic `--mem-fraction-static` on a large GPU (approximation: a fixed reserve)."""
    reserved = 12.0 + (4.0 if speculative else 0.0)
    return round((gpu_memory_gb - reserved) / gpu_memory_gb, 3)


def mamba_ratio(*, disable_radix_cache: bool, extra_buffer: bool, overlap_schedule: bool, lazy: bool = False) -> int:
    """How many Mamba slots one running request needs (slots // ratio caps running requests).

    SGLang's `_calculate_mamba_ratio` + `get_mamba_tracking_slots`: radix cache off 1; else 3, plus the
    tracking slots of `extra_buffer` (2 with overlap scheduling, 1 without) or `extra_buffer_lazy` (1: the
    second slot is deferred). So extra_buffer 5 > extra_buffer_lazy 4 > no_buffer 3 > radix cache off 1.
    """
    if disable_radix_cache:
        return 1
    ratio = MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO
    if extra_buffer:
        ratio += (1 if lazy else MAMBA_CACHE_V2_ADDITIONAL_RATIO_OVERLAP if overlap_schedule
                  else MAMBA_CACHE_V2_ADDITIONAL_RATIO_NO_OVERLAP)
    return ratio


def estimated_max_num_reqs(max_total_num_tokens: int, context_len: int) -> int:
    """SGLang's request-pool estimate from KV capacity: clamp(tokens / context_len * 512, 2048, 4096)."""
    return max(min(int(max_total_num_tokens / context_len * 512), 4096), 2048)


@dataclass(frozen=True)
class AllocationInputs:
    """The server arguments (already resolved) that memory sizing depends on."""

    mem_fraction_static: float
    speculative: bool
    speculative_num_draft_tokens: int | None
    max_running_requests: int | None  # ServerArgs value (48 with speculative decoding if unset)
    max_mamba_cache_size: int | None
    max_total_tokens: int | None
    disable_radix_cache: bool
    extra_buffer: bool
    overlap_schedule: bool
    context_len: int
    page_size: int = 1
    dp_size: int = 1
    hybrid: bool = True  # a Mamba-hybrid architecture (Qwen3.5/3.6); False = plain attention model
    gpu_memory_gb: float = DEFAULT_GPU_MEMORY_GB
    kv_cache_dtype: str = "auto"
    extra_buffer_lazy: bool = False


@dataclass(frozen=True)
class Allocation:
    """What the server ends up with; every figure the startup log and /server_info report."""

    gpu_memory_gb: float
    weights_gb: float
    draft_weights_gb: float
    avail_after_weights_gb: float
    mamba_slots: int | None
    mamba_ratio: int | None
    mamba_conv_gb: float
    mamba_ssm_gb: float
    intermediate_ssm_gb: float
    intermediate_conv_gb: float
    max_total_num_tokens: int
    profiled_num_tokens: int
    kv_cache_gb: float  # K + V
    avail_after_pool_gb: float
    graph_gb: float
    effective_max_running_requests: int
    warnings: tuple[str, ...] = ()

    @property
    def k_size_gb(self) -> float:
        return self.kv_cache_gb / 2

    @property
    def v_size_gb(self) -> float:
        return self.kv_cache_gb / 2


def speculative_reserve_gb(max_running_requests: int, num_draft_tokens: int) -> tuple[float, float]:
    """(SSM, conv) intermediate state memory reserved for speculative verification."""
    states = max_running_requests * num_draft_tokens
    return states * MAMBA_INTERMEDIATE_SSM_GB, states * MAMBA_INTERMEDIATE_CONV_GB


MAMBA_FULL_RATIO_DEFAULT = 0.9


def compute(inputs: AllocationInputs, *, mamba_full_memory_ratio: float = MAMBA_FULL_RATIO_DEFAULT,
            kv_tokens_override: int | None = None, mamba_slots_override: int | None = None) -> Allocation:
    """Size the memory pools like SGLang's model runner and scheduler do.

    `kv_tokens_override` / `mamba_slots_override` model a GPU that had less free memory than expected
    (the emulator's `kv_tokens` / `max_mamba_slots` faults): the pools come out at that size and
    everything downstream (running requests, log lines) follows.
    """
    warnings: list[str] = []
    total = inputs.gpu_memory_gb
    avail = total - TORCH_CONTEXT_GB - TARGET_WEIGHTS_GB
    rest = avail - total * (1 - inputs.mem_fraction_static)

    slots: int | None = None
    ratio: int | None = None
    conv_gb = ssm_gb = inter_ssm = inter_conv = 0.0
    if inputs.hybrid:
        if inputs.speculative:
            reqs = (inputs.max_running_requests or SPEC_DEFAULT_MAX_RUNNING_REQUESTS) // max(inputs.dp_size, 1)
            inter_ssm, inter_conv = speculative_reserve_gb(reqs, inputs.speculative_num_draft_tokens or 1)
            rest -= inter_ssm + inter_conv
        if inputs.max_mamba_cache_size is not None:
            slots = inputs.max_mamba_cache_size
        elif inputs.disable_radix_cache and inputs.max_running_requests is not None:
            slots = inputs.max_running_requests
        else:
            mamba_gb = rest * mamba_full_memory_ratio / (1 + mamba_full_memory_ratio)
            slots = int(mamba_gb // mamba_cache_per_req_gb())
        if mamba_slots_override is not None:
            slots = mamba_slots_override
        conv_gb = slots * MAMBA_CONV_GB_PER_SLOT
        ssm_gb = slots * MAMBA_SSM_GB_PER_SLOT
        rest -= conv_gb + ssm_gb
        ratio = mamba_ratio(disable_radix_cache=inputs.disable_radix_cache, extra_buffer=inputs.extra_buffer,
                            overlap_schedule=inputs.overlap_schedule, lazy=inputs.extra_buffer_lazy)

    bytes_per_token = KV_BYTES_PER_TOKEN * KV_DTYPE_SCALE.get(inputs.kv_cache_dtype, 1.0)
    profiled = max(int(int(rest * GIB) // bytes_per_token), 0)
    tokens = profiled
    if inputs.max_total_tokens is not None:
        if inputs.max_total_tokens > profiled:
            warnings.append(f"max_total_tokens={inputs.max_total_tokens} is larger than the profiled value "
                            f"{profiled}. Use the profiled value instead.")
        tokens = min(profiled, inputs.max_total_tokens)
    if kv_tokens_override is not None:
        tokens = kv_tokens_override
    page = max(inputs.page_size, 1)
    tokens = tokens // page * page
    if tokens <= 0:
        raise RuntimeError("Not enough memory. Please try to increase --mem-fraction-static. "
                           f"Current value: self.server_args.mem_fraction_static={inputs.mem_fraction_static}")
    kv_gb = tokens * bytes_per_token / GIB

    estimated = estimated_max_num_reqs(tokens, inputs.context_len)
    if inputs.max_running_requests is None:
        running = min(estimated, tokens // 2)
    else:
        running = min(inputs.max_running_requests // max(inputs.dp_size, 1), estimated)
    if slots is not None and ratio is not None:
        running = min(running, slots // ratio)
    running = max(running, 1)

    # The pools take exactly what they hold; what is left is (1 - mem_fraction_static) of the GPU plus
    # whatever a fault or an explicit cap did not allocate.
    used_by_pools = kv_gb + conv_gb + ssm_gb + inter_ssm + inter_conv
    avail_after_pool = avail - used_by_pools
    return Allocation(
        gpu_memory_gb=total,
        weights_gb=TARGET_WEIGHTS_GB,
        draft_weights_gb=DRAFT_WEIGHTS_GB if inputs.speculative else 0.0,
        avail_after_weights_gb=avail,
        mamba_slots=slots,
        mamba_ratio=ratio,
        mamba_conv_gb=conv_gb,
        mamba_ssm_gb=ssm_gb,
        intermediate_ssm_gb=inter_ssm,
        intermediate_conv_gb=inter_conv,
        max_total_num_tokens=tokens,
        profiled_num_tokens=profiled,
        kv_cache_gb=kv_gb,
        avail_after_pool_gb=avail_after_pool,
        graph_gb=CUDA_GRAPH_GB,
        effective_max_running_requests=running,
        warnings=tuple(warnings),
    )
