"""SGLang's model-loading sequence as log lines in the emulated version's forms (`versions.Forms`),
paced by the profile's `startup_s`, with the start-time faults: a slow weight load (`start_delay_s`) and a
CUDA out-of-memory crash during graph capture (`crash_at_start`).
"""

from __future__ import annotations

import logging
import time

from dflash_regen.emulator.allocation import Allocation
from dflash_regen.emulator.cli import ModelConfig, ServerArgs
from dflash_regen.emulator.faults import Faults, Profile
from dflash_regen.emulator.versions import Forms

log = logging.getLogger("sglang.srt.model_executor.model_runner")

DRAFT_ARCH = "Qwen3_5ForCausalLMMTP"
CUDA_GRAPH_CAPTURE_FAILED_MSG = (
    "Possible solutions:\n"
    "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)\n"
    "2. set --cuda-graph-max-bs to a smaller value (e.g., 16)\n"
    "3. disable torch compile by not using --enable-torch-compile\n"
    "4. disable CUDA graph by --disable-cuda-graph. (Not recommended. Huge performance loss)\n"
    "Open an issue on GitHub https://github.com/sgl-project/sglang/issues/new/choose \n")


def capture_batch_sizes(max_bs: int) -> list[int]:
    """The batch sizes SGLang captures graphs for: 1, 2, 4, then steps of 8 (16 above 256)."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 1025, 16))
    return [b for b in sizes if b <= max(max_bs, 1)]


def _kv_dtype(args: ServerArgs) -> str:
    return {"auto": "torch.bfloat16", "bf16": "torch.bfloat16", "bfloat16": "torch.bfloat16",
            "fp8_e4m3": "torch.float8_e4m3fn", "fp8_e5m2": "torch.float8_e5m2",
            "fp4_e2m1": "torch.float4_e2m1fn_x2"}[args.kv_cache_dtype]


class _Clock:
    """Spends the profile's startup time in proportion across the phases."""

    def __init__(self, total_s: float):
        self.total_s = total_s

    def spend(self, share: float) -> float:
        started = time.monotonic()
        if self.total_s > 0:
            time.sleep(self.total_s * share)
        return time.monotonic() - started


def _oom(alloc: Allocation) -> RuntimeError:
    return RuntimeError(
        f"CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of {alloc.gpu_memory_gb:.2f} "
        f"GiB of which {max(alloc.avail_after_pool_gb - 1.9, 0.01):.2f} GiB is free. Of the allocated memory "
        f"{alloc.gpu_memory_gb - alloc.avail_after_pool_gb:.2f} GiB is allocated by PyTorch. If reserved but "
        "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
        "fragmentation.")


def capture_cuda_graphs(alloc: Allocation, faults: Faults) -> None:
    if faults.crash_at_start:
        error = _oom(alloc)
        log.error(f"Capture cuda graph failed: {error}\n{CUDA_GRAPH_CAPTURE_FAILED_MSG}")
        raise error


def load_model(args: ServerArgs, model: ModelConfig, alloc: Allocation, faults: Faults,
               profile: Profile, forms: Forms) -> dict[str, float]:
    """Log the loading sequence (sleeping through it); returns timings for the metrics."""
    clock = _Clock(profile.startup_s)
    total = alloc.gpu_memory_gb
    log.info("Init torch distributed begin.")
    took = clock.spend(0.05)
    log.info(f"Init torch distributed ends. elapsed={took:.2f} s, mem usage={0.76:.2f} GB")
    before = total - 0.76
    log.info(f"Load weight begin. avail mem={before:.2f} GB")
    started = time.monotonic()
    if faults.start_delay_s:
        time.sleep(faults.start_delay_s)
    clock.spend(0.45)
    load_s = time.monotonic() - started
    log.info(f"Load weight end. elapsed={load_s:.2f} s, type={model.architecture}, "
             f"avail mem={alloc.avail_after_weights_gb:.2f} GB, mem usage={alloc.weights_gb:.2f} GB.")
    log.info(f"Using KV cache dtype: {_kv_dtype(args)}")
    if alloc.mamba_slots is not None:
        msg = (f"Mamba Cache is allocated. max_mamba_cache_size: {alloc.mamba_slots}, "
               f"conv_state size: {alloc.mamba_conv_gb:.2f}GB, ssm_state size: {alloc.mamba_ssm_gb:.2f}GB ")
        if args.speculative:
            msg += (f"intermediate_ssm_state_cache size: {alloc.intermediate_ssm_gb:.2f}GB "
                    f"intermediate_conv_window_cache size: {alloc.intermediate_conv_gb:.2f}GB ")
        log.info(msg)
    dtype = f"dtype: {_kv_dtype(args)}, " if forms.kv_line_dtype else ""
    log.info(f"KV Cache is allocated. {dtype}#tokens: {alloc.max_total_num_tokens}, K size: {alloc.k_size_gb:.2f} GB, "
             f"V size: {alloc.v_size_gb:.2f} GB")
    for warning in alloc.warnings:
        log.warning(warning)
    log.info(f"Memory pool end. avail mem={alloc.avail_after_pool_gb:.2f} GB")
    clock.spend(0.05)
    avail = alloc.avail_after_pool_gb
    if not args.disable_cuda_graph:
        log.info(f"Capture cuda graph begin. This can take up to several minutes. avail mem={avail:.2f} GB")
        log.info(f"Capture cuda graph bs {capture_batch_sizes(args.cuda_graph_max_bs or 256)}")
        took = clock.spend(0.25)
        capture_cuda_graphs(alloc, faults)
        avail -= alloc.graph_gb
        log.info(f"Capture cuda graph end. Time elapsed: {took:.2f} s. mem usage={alloc.graph_gb:.2f} GB. "
                 f"avail mem={avail:.2f} GB.")
    if args.speculative:
        log.info(f"Load weight begin. avail mem={avail:.2f} GB")
        took = clock.spend(0.05)
        avail -= alloc.draft_weights_gb
        log.info(f"Load weight end. elapsed={took:.2f} s, type={DRAFT_ARCH}, avail mem={avail:.2f} GB, "
                 f"mem usage={alloc.draft_weights_gb:.2f} GB.")
        draft_kv = alloc.kv_cache_gb / 16  # one attention layer instead of the target's sixteen
        log.info(f"KV Cache is allocated. {dtype}#tokens: {alloc.max_total_num_tokens}, "
                 f"K size: {draft_kv / 2:.2f} GB, V size: {draft_kv / 2:.2f} GB")
        avail -= draft_kv
        for what in ("draft", "draft extend"):
            log.info(f"Capture {what} cuda graph begin. This can take up to several minutes. avail mem={avail:.2f} GB")
            took = clock.spend(0.05)
            avail -= 0.21
            log.info(f"Capture {what} cuda graph end. Time elapsed: {took:.2f} s. mem usage=0.21 GB. "
                     f"avail mem={avail:.2f} GB.")
    clock.spend(0.05)
    context = args.context_length or model.max_position_embeddings
    if forms.logs_mamba_cap and alloc.mamba_slots and alloc.mamba_ratio and \
            alloc.effective_max_running_requests == alloc.mamba_slots // alloc.mamba_ratio:
        log.warning(f"max_running_requests is capped to {alloc.effective_max_running_requests} by the mamba state "
                    f"cache (max_mamba_cache_size={alloc.mamba_slots}, {alloc.mamba_ratio} state slots per "
                    "request). To raise it: increase --mamba-full-memory-ratio or --max-mamba-cache-size, or halve "
                    "the state size with --mamba-ssm-dtype bfloat16.")
    log.info(f"max_total_num_tokens={alloc.max_total_num_tokens}, chunked_prefill_size={args.chunked_prefill_size}, "
             f"max_prefill_tokens={args.max_prefill_tokens}, max_running_requests="
             f"{alloc.effective_max_running_requests}, context_len={context}, available_gpu_mem={avail:.2f} GB")
    return {"load_weights_s": load_s}
