"""Capacity planner: measure one server, fit throughput vs concurrency, name what binds, predict the run.

- **Measure** (`measure_server`): on one server, stream prompts drawn from the run's own shards (their real
  length mix, with the run's sampling settings and per-sample seeds) at a few concurrency levels up to the slot
  limit, and read SGLang's `/metrics` (`sglang:generation_tokens_total`, `sglang:num_running_reqs`) for the
  aggregate output tok/s and the running batch at each level. The top level runs the whole sample to the end,
  so its output lengths are an unbiased sample of the run's; lower levels are short windows.
- **Fit** (`Curve`): time per output token grows linearly with the running batch, `tpot(b) = a + k*b` (a
  decode step reads the weights once for the batch, then does per-request work), so the aggregate
  `b / (a + k*b)` saturates at `1/k`.
- **Advise** (`advise`): what caps the running batch (client concurrency, KV tokens, Mamba slots, the
  `--max-running-requests` cap) or whether the GPU is already compute-saturated; with SGLang's pool
  arithmetic (Mamba slots and the speculative reserve come out of the KV pool) the largest batch the same
  memory can run, and the exact flags for it.
- **Predict** (`predict`): the whole run's generation wall time and GPU-hours. Each shard is simulated (`c`
  requests in flight, each decoding at the curve's rate for the current batch, so a shard's drain is counted)
  and the shards are spread over the servers as the mapped tasks take them; the 80% interval comes from the
  fit's covariance and a bootstrap of the length sample.

The report is `<run>/reports/capacity.json` (`plan_report`), re-plannable for another run size from the
stored measurement (`python -m dflash_regen.capacity plan`).

Modules: `measure` (talks to one server), `model` (the curve, memory, binding verdict, advice and prediction:
pure arithmetic), `report` (capacity.json and its table; `calibrate` = measure + plan), `__main__` (the CLI).
"""

from dflash_regen.capacity.measure import levels_for, measure_server, read_metrics, sample_prompts
from dflash_regen.capacity.model import (
    COMPUTE_GAIN,
    GRAPH_BATCH,
    KV_HEADROOM,
    Binding,
    Curve,
    Memory,
    RunShape,
    advise,
    binding_resource,
    client_concurrency,
    makespan,
    memories,
    predict,
    running_batch,
    simulate_shard,
    train_length_budget,
)
from dflash_regen.capacity.report import (
    REPORT,
    calibrate,
    fingerprint,
    format_table,
    plan_report,
    read_report,
    table_rows,
)
from dflash_regen.errors import CapacityError, TooFewPrompts

__all__ = [
    "COMPUTE_GAIN", "GRAPH_BATCH", "KV_HEADROOM", "REPORT", "Binding", "CapacityError", "Curve", "Memory", "RunShape",
    "TooFewPrompts", "advise", "binding_resource", "calibrate", "client_concurrency", "fingerprint", "format_table",
    "levels_for",
    "makespan", "measure_server", "memories", "plan_report", "predict", "read_metrics", "read_report",
    "running_batch", "sample_prompts", "simulate_shard", "table_rows", "train_length_budget",
]
