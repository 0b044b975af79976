"""`/metrics`: SGLang's Prometheus text (gauges of the running batch and pools, token and request counters,
the latency histograms the fleet dashboard plots), in the emulated version's names and labels.

What differs by version is read from SGLang's own `srt/observability/metrics_collector.py` (checked per version
by tests/contract/test_sglang_contract.py): from 0.5.18 the prompt/generation token and request counters and
the two latency histograms carry `is_streaming`, and `engine_startup_time`/`engine_load_weights_time` became
`startup_time_seconds{phase=...}`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflash_regen.emulator.scheduler import Histogram
    from dflash_regen.emulator.state import Emulator

SPLIT_BY_STREAMING = {"prompt_tokens_total", "generation_tokens_total", "num_requests_total"}
STARTUP_PHASES = ("load_weight", "kv_cache_allocation", "scheduler_e2e", "tokenizer_e2e")  # 0.5.18+


def _histogram(name: str, help_text: str, labels: str, by_streaming: dict[bool, Histogram], split: bool) -> list[str]:
    lines = [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} histogram"]
    parts = [(f'{labels},is_streaming="{str(s).lower()}"', [by_streaming[s]]) for s in (True, False)] if split \
        else [(labels, list(by_streaming.values()))]
    for label_text, histograms in parts:
        bounds = histograms[0].bounds
        cumulative = [sum((h.cumulative or [0] * (len(bounds) + 1))[i] for h in histograms)
                      for i in range(len(bounds) + 1)]
        for bound, count in zip((*map(str, map(float, bounds)), "+Inf"), cumulative, strict=True):
            lines.append(f'sglang:{name}_bucket{{{label_text},le="{bound}"}} {float(count)}')
        lines += [f"sglang:{name}_sum{{{label_text}}} {float(sum(h.sum for h in histograms))}",
                  f"sglang:{name}_count{{{label_text}}} {float(sum(h.count for h in histograms))}"]
    return lines


def metrics_text(emu: Emulator) -> str:
    sched, alloc = emu.scheduler, emu.alloc
    labels = (f'engine_type="unified",model_name="{emu.args.served_model_name}",moe_ep_rank="0",pp_rank="0",'
              'tp_rank="0"')
    tokenizer_labels = f'model_name="{emu.args.served_model_name}"'
    kv_used = sched.kv_used
    accept = sched.avg_spec_accept_length or 0.0
    draft = emu.args.speculative_num_draft_tokens or 1
    split = emu.forms.is_streaming_label
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
    ]
    if not split:
        gauges += [("engine_startup_time", "The time taken for the engine to start up.", emu.startup_s),
                   ("engine_load_weights_time", "The time taken for the engine to load weights.", emu.load_weights_s)]
    counters = [
        ("prompt_tokens_total", "Number of prefill tokens processed.", sched.prompt_tokens_total),
        ("generation_tokens_total", "Number of generation tokens processed.", sched.generation_tokens_total),
        ("num_requests_total", "Number of requests processed.", sched.num_requests_total),
        ("num_aborted_requests_total", "Number of requests aborted.", sched.num_aborted_requests_total),
    ]
    lines = []
    for name, help_text, value in gauges:
        lines += [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} gauge",
                  f"sglang:{name}{{{labels}}} {float(value)}"]
    if split:
        lines += ["# HELP sglang:startup_time_seconds Startup time of each phase in seconds.",
                  "# TYPE sglang:startup_time_seconds gauge"]
        startup = {"load_weight": emu.load_weights_s, "kv_cache_allocation": 0.0, "scheduler_e2e": emu.startup_s,
                   "tokenizer_e2e": emu.startup_s}
        lines += [f'sglang:startup_time_seconds{{{labels},phase="{phase}"}} {float(startup[phase])}'
                  for phase in STARTUP_PHASES]
    for name, help_text, value in counters:
        lines += [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} counter"]
        if split and name in SPLIT_BY_STREAMING:
            # 0.5.18+: one series per is_streaming value (the warm-up is a non-streaming request)
            streamed = getattr(sched, f"streamed_{name}", 0)
            lines += [f'sglang:{name}{{{tokenizer_labels},is_streaming="true"}} {float(streamed)}',
                      f'sglang:{name}{{{tokenizer_labels},is_streaming="false"}} {float(value - streamed)}']
        else:
            lines.append(f"sglang:{name}{{{tokenizer_labels}}} {float(value)}")
    # no prefix cache hits here (cache_hit_rate 0), but the counter exists with its source label in every version
    lines += ["# HELP sglang:cached_tokens_total Number of cached prompt tokens by source (device/host/storage).",
              "# TYPE sglang:cached_tokens_total counter",
              f'sglang:cached_tokens_total{{{tokenizer_labels},cache_source="device"}} 0.0']
    lines += _histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                        tokenizer_labels, sched.ttft, split)
    lines += _histogram("e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                        tokenizer_labels, sched.e2e, split)
    return "\n".join(lines) + "\n"
