"""The record schemas of the run's parquet files: the data contracts, in one place
(docs/architecture.md lists them with the reports and the manifest).

Every writer builds its table with one of these and every reader relies on its column names; a change here
is a change of contract (a file written before it may lack a column: readers of old runs allow for that).
Where each lives is `layout`'s business.
"""

from __future__ import annotations

import pyarrow as pa

PROMPT_SHARD = pa.schema([
    ("sample_id", pa.string()), ("messages", pa.string()), ("tools", pa.string()), ("location", pa.string()),
    ("prompt_tokens", pa.int32()),
])
"""A planned prompt (`shards/shard-XXXXX.parquet`): `messages` and `tools` as OpenAI JSON text, `location` the
input file and row it came from, `prompt_tokens` counted by planning (null when the prompt is too short to
possibly not fit, unless Param budget train_length needs every count)."""

QUARANTINE = pa.schema([
    ("location", pa.string()), ("stage", pa.string()), ("reason", pa.string()), ("detail", pa.string()),
    ("sample_id", pa.string()),
])
"""A prompt never sent or refused (`failures/plan.parquet` from planning, `failures/shard-XXXXX.parquet` and its
parts from generation): `stage` plan | generate, `reason` a short key (duplicate_id, too_long, http_400...),
`detail` the full message (the servers' own words for a refused prompt)."""

COMPLETION = pa.schema([
    ("sample_id", pa.string()), ("shard", pa.int32()), ("server", pa.string()),
    ("reasoning_content", pa.string()), ("content", pa.string()), ("tool_calls", pa.string()),
    ("finish_reason", pa.string()), ("prompt_tokens", pa.int32()), ("completion_tokens", pa.int32()),
    ("reasoning_tokens", pa.int32()), ("latency_s", pa.float32()), ("finished_at", pa.float64()),
    ("attempt", pa.int16()),
    ("max_tokens", pa.int32()), ("temperature", pa.float32()), ("top_p", pa.float32()), ("top_k", pa.int32()),
    ("min_p", pa.float32()), ("presence_penalty", pa.float32()), ("seed", pa.int64()),
    ("enable_thinking", pa.bool_()), ("served_model", pa.string()), ("model_revision", pa.string()),
    ("reasoning_parser", pa.string()), ("think_marker_leak", pa.bool_()), ("empty_content", pa.bool_()),
    ("assistant_turns", pa.string()), ("truncated_at_train_length", pa.bool_()),
    ("source_run", pa.string()), ("prompt_digest", pa.string()),
    ("server_prompt_ids", pa.list_(pa.field("element", pa.int32()))),
    ("server_output_ids", pa.list_(pa.field("element", pa.int32()))),
])
"""One generated sample (`completions/shard-XXXXX.parquet` and its checkpoint parts): the answer (reasoning,
content, tool calls as JSON text), how it ended and its token usage, the server that answered, the request's
latency, attempt count and sampling params, flags for a leaked `<think>` marker or an empty answer, every
assistant turn of a tool-call round (JSON text), whether Param budget train_length cut it, the run that generated
it (`source_run`: an earlier run's for a completion the store supplied) and the digest of the prompt it answers
(`prompts.formats.prompt_digest`, the store's check), and the token ids the server reported for the last
request's prompt and output where its version returns them (`Dialect.token_ids_request`, sglang/api.py; null
otherwise, and in files written before them)."""

TOKENIZED = pa.schema([
    ("sample_id", pa.string()), ("input_ids", pa.list_(pa.field("element", pa.int32()))),
    ("loss_mask", pa.list_(pa.field("element", pa.int8()))), ("n_tokens", pa.int32()), ("loss_mask_sum", pa.int32()),
])
"""A training sample (`tokenized/shard-XXXXX.parquet` and the published `tokenized/part-XXXXX.parquet`, the same
file hard-linked when nothing of its shard was quarantined): ids of the model's chat template and SpecForge's
`qwen3.5` loss mask (1 = supervised), with their counts. List items are named as a parquet round trip names them
("element"), so a file publish rewrites is byte for byte one it links."""

SUMMARY = pa.schema([
    ("sample_id", pa.string()), ("n_tokens", pa.int32()), ("mask_len", pa.int32()),
    ("loss_mask_sum", pa.int32()), ("finish_reason", pa.string()),
    ("content_chars", pa.int32()), ("reasoning_tokens", pa.int32()),
    ("content_tokens", pa.int32()), ("think_marker_leak", pa.bool_()),
    ("tool_call_expected", pa.bool_()), ("tool_call_present", pa.bool_()),
    ("repetition_score", pa.float32()), ("enable_thinking", pa.bool_()),
    ("history_from_input", pa.bool_()), ("truncated_at_train_length", pa.bool_()),
    ("rerender_token_delta", pa.int32()),
    ("prompt_ids_match", pa.bool_()), ("token_exact", pa.bool_()), ("rerender_drift", pa.string()),
    ("record_exact", pa.bool_()),
])
"""The per-sample summary (`tokenized/summary-XXXXX.parquet`), the contract the quality gate validates: the
row rules (`quality.row_problem`) and the Great Expectations suite read these columns, and nothing else, of
every tokenized sample. `reasoning_tokens`/`content_tokens` are supervised tokens of each part,
`history_from_input` says assistant turns after the last user turn came from the input (SpecForge trains
them too), `repetition_score` is the share of repeated 8-grams in the reasoning, `rerender_token_delta` the
generated turn's tokens as the trainer renders them minus the tokens the server generated (0: the same count;
null where no comparison holds: `training.tokenize.rerender_token_delta`). Where the server reported token ids
(`training.tokenize.server_ids_check`): `prompt_ids_match` says the sample's `input_ids` start with the server's
prompt ids (null: none reported), `token_exact` that the last turn's ids are the model's own, and `rerender_drift`
whether and why the re-render of the last turn from its parsed fields differs from them (none, whitespace,
tool_value, other; null: no output ids), and `record_exact` whether the published `conversations` record re-renders
to the published ids (a tool_value drift is published with the raw tool-call text, which does)."""

GATE_QUARANTINE = pa.schema([("sample_id", pa.string()), ("reason", pa.string()), ("detail", pa.string())])
"""A sample the quality gate's row rules refused (`quality/quarantine.parquet`): left out of the published
dataset, counted in its manifest by reason."""
