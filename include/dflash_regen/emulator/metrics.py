"""`/metrics`: SGLang's Prometheus text (gauges of the running batch and pools, token and request counters)."""

from __future__ import annotations

from dflash_regen.emulator.state import Emulator

SPLIT_BY_STREAMING = {"prompt_tokens_total", "generation_tokens_total"}


def metrics_text(emu: Emulator) -> str:
    sched, alloc = emu.scheduler, emu.alloc
    labels = (f'engine_type="unified",model_name="{emu.args.served_model_name}",moe_ep_rank="0",pp_rank="0",'
              'tp_rank="0"')
    tokenizer_labels = f'model_name="{emu.args.served_model_name}"'
    kv_used = sched.kv_used
    accept = sched.avg_spec_accept_length or 0.0
    draft = emu.args.speculative_num_draft_tokens or 1
    gauges = [
        ("num_running_reqs", "The number of running requests.", len(sched.running)),
        ("num_queue_reqs", "The number of requests in the waiting queue.", len(sched.waiting)),
        ("num_used_tokens", "The number of used tokens.", kv_used),
        ("token_usage", "The token usage.", kv_used / alloc.max_total_num_tokens),
        ("full_token_usage", "The token usage for full attention layers.", kv_used / alloc.max_total_num_tokens),
        ("mamba_usage", "The token usage for Mamba layers.",
         sched.mamba_used / alloc.mamba_slots if alloc.mamba_slots else 0.0),
        ("gen_throughput", "The generation throughput (token/s).", sched.last_gen_throughput),
        ("cache_hit_rate", "The prefix cache hit rate.", 0.0),
        ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", alloc.max_total_num_tokens),
        ("spec_accept_length", "The average acceptance length of speculative decoding.", accept),
        ("spec_accept_rate", "The average acceptance rate of speculative decoding.", accept / draft),
        ("num_retracted_reqs", "The number of retracted requests.", 0),
        ("num_paused_reqs", "The number of paused requests by async weight sync.", 0),
        ("is_cuda_graph", "Whether the batch is using CUDA graph.", 1),
        ("engine_startup_time", "The time taken for the engine to start up.", emu.startup_s),
        ("engine_load_weights_time", "The time taken for the engine to load weights.", emu.load_weights_s),
    ]
    counters = [
        ("prompt_tokens_total", "Number of prefill tokens processed.", sched.prompt_tokens_total),
        ("generation_tokens_total", "Number of generation tokens processed.", sched.generation_tokens_total),
        ("cached_tokens_total", "Number of cached prompt tokens.", 0),
        ("num_requests_total", "Number of requests processed.", sched.num_requests_total),
        ("num_aborted_requests_total", "Number of requests aborted.", sched.num_aborted_requests_total),
    ]
    lines = []
    for name, help_text, value in gauges:
        lines += [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} gauge",
                  f"sglang:{name}{{{labels}}} {float(value)}"]
    for name, help_text, value in counters:
        lines += [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} counter"]
        if emu.forms.is_streaming_label and name in SPLIT_BY_STREAMING:
            # 0.5.18+: one series per is_streaming value (the warm-up is a non-streaming request)
            streamed = getattr(sched, f"streamed_{name}", 0)
            lines += [f'sglang:{name}{{{tokenizer_labels},is_streaming="true"}} {float(streamed)}',
                      f'sglang:{name}{{{tokenizer_labels},is_streaming="false"}} {float(value - streamed)}']
        else:
            lines.append(f"sglang:{name}{{{tokenizer_labels}}} {float(value)}")
    return "\n".join(lines) + "\n"
