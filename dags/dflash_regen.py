"""
### dflash_regen — regenerate a chat dataset with Qwen3.6-27B (thinking on) on a local SGLang fleet

Stages the weights to the RAM disk, launches one SGLang server per GPU and proves **every** server is
fit before any real work: enough KV tokens and running-request slots (`health_check`), and real answers —
not reasoning only, not truncated, tool calls parsed — to representative prompts at the production
`max_tokens` (`smoke_test`); `autotune` tries other server settings on the first GPU and reports (or, with
Param autotune = apply, relaunches the fleet with) the fastest; `calibrate` then measures one server on the
run's own prompts, names the resource that binds throughput with the flags that would lift it, and predicts
the run's wall time and
GPU-hours (`reports/capacity.json`). Meanwhile `plan_shards` validates the prompts (bad rows are quarantined with a
reason) and writes ~1,000-prompt shards; `generate` completes each shard on one leased server, resumably.
The fleet is stopped as soon as generation ends. `tokenize` computes `input_ids` and `loss_mask` with the
model's chat template (each shard's as soon as its own `generate` ends: the two are one mapped task group),
`validate` runs the Great Expectations gate (Data Docs in the run's `reports/`), and `publish` moves the dataset
into place atomically and emits the `dflash_regen_dataset` asset.

The gates are setup tasks: clearing one failed `generate` shard re-launches and re-checks the fleet, then
sends only that shard's missing samples.
Reports land in `<output_root>/runs/<run_id>/reports/`. The demo defaults run on the SGLang emulator.

With several GPU nodes (env `DFLASH_NODES`, README "Several nodes") each node gets a task group on its own queue:
its fleet setups, its share of the shards (by the rate `calibrate` measured on it) and its teardown.
"""

from __future__ import annotations

import datetime as dt
import os

from airflow.sdk import Asset, Param, TaskGroup, chain, dag, setup, task, task_group, teardown

from dflash_regen import dag_tasks, nodes
from dflash_regen.config import DEFAULTS as D
from dflash_regen.prompts import PROMPT_FORMATS

FLEET, GATES, PROMPTS, SAMPLING, DISPATCH, QUALITY, OUTPUT, EMULATOR = (
    "Fleet", "Fleet gates", "Prompts", "Sampling", "Dispatch", "Quality gate", "Output", "Emulator (demo and tests)")
# Training DAGs can be scheduled on this asset; each event's extra names the published version.
DATASET = Asset(name="dflash_regen_dataset", uri="file:///dflash-regen/published")
# Shard tasks running at once; each leases one server, so more than the fleet size would only wait.
PARALLEL_SHARDS = int(os.environ.get("DFLASH_PARALLEL_SHARDS", "7"))
# A failed shard is retried on another server; 0 leaves failed shards for a human to clear (UI tests do).
GENERATE_RETRIES = int(os.environ.get("DFLASH_GENERATE_RETRIES", "3"))
# Above every other task's priority (weight_rule "downstream" gives at most the task count).
TEARDOWN_PRIORITY = 100
# A run works on one GPU node's RAM disk and loopback servers, so all its tasks go to that node's Celery
# queue (one queue per node, see docker-compose.yaml); unset = Airflow's default queue, as in the demo.
NODE_QUEUE = {"queue": os.environ["DFLASH_WORKER_QUEUE"]} if os.environ.get("DFLASH_WORKER_QUEUE") else {}
# Several GPU nodes (env DFLASH_NODES, see dflash_regen/nodes.py): a task group per node on the node's queue.
NODES = nodes.parse_nodes(os.environ.get(nodes.NODES_ENV))

def _range(minimum: float | None = None, maximum: float | None = None, **exclusive: float) -> dict:
    """A number's bounds inside `allOf`, where only Airflow's trigger validation reads them. The form's number
    box clamps to a top-level minimum/maximum when the field loses focus (Ark UI's clampValueOnBlur), so a
    shard_size of 0 silently became 1 and ran; nested, a bad value stays in the box and Trigger is refused
    with "0 is less than the minimum of 1"."""
    rule = {k: v for k, v in (("minimum", minimum), ("maximum", maximum)) if v is not None} | exclusive
    return {"allOf": [rule]}


PARAMS = {
    "model_source_dir": Param(D["model_source_dir"], type="string", minLength=1, section=FLEET,
                              title="Model source directory",
                              description="The HF checkpoint dir you would give --model-path (config.json, "
                                          "safetensors, tokenizer files; absolute path), or 'demo' for the "
                                          "generated stand-in model. Copied to the RAM disk before launch."),
    "staging_dir": Param(D["staging_dir"], type=["null", "string"], section=FLEET, title="Staging directory",
                         description="What each server's --model-path points at: the weights are copied here "
                                     "first (a RAM disk loads in under a minute); empty = /dev/shm/<model name>."),
    "server_command": Param(D["server_command"], type="string", minLength=1, section=FLEET,
                            title="Server command",
                            description="'emulator', or SGLang's launcher from its own venv on a local disk, e.g. "
                                        "/opt/sglang-venv/bin/python -m sglang.launch_server (run without a shell; "
                                        "--model-path, --host, --port and --api-key are added per server).",
                            examples=["emulator", "/opt/sglang-venv/bin/python -m sglang.launch_server"]),
    "server_flags": Param(D["server_flags"], type=["null", "string"], section=FLEET,
                          title="Extra or overriding SGLang flags",
                          description="Added to the Qwen3.6 MTP cookbook flags; '--flag off' drops a default, e.g. "
                                      "'--max-mamba-cache-size 160 --max-running-requests 32'."),
    "served_model_name": Param(D["served_model_name"], type="string", minLength=1, section=FLEET,
                               title="Served model name",
                               description="SGLang's --served-model-name, sent as 'model' in every request and "
                                           "recorded with each sample."),
    "num_servers": Param(D["num_servers"], type="integer", **_range(1, 64), section=FLEET,
                         title="Servers", description="One SGLang server per GPU (1-64), each with its own port "
                                                      "and CUDA_VISIBLE_DEVICES."),
    "gpu_ids": Param(D["gpu_ids"], type=["null", "string"], pattern=r"^(\d+(,\d+)*)?$", section=FLEET,
                     title="GPU ids",
                     description="CUDA_VISIBLE_DEVICES of each server, comma-separated, one per server; "
                                 "empty = 0..servers-1."),
    "base_port": Param(D["base_port"], type="integer", **_range(1024, 65000), section=FLEET,
                       title="Base port", description="Server i listens on 127.0.0.1:<base port + i>. Keep it "
                                                      "below the ephemeral range (usually 32768)."),
    "ready_timeout_s": Param(D["ready_timeout_s"], type="number", **_range(1, 7200), section=FLEET,
                             title="Ready timeout (s)",
                             description="How long a launch may take until /health answers: weight loading, "
                                         "CUDA graph capture and MTP draft warm-up included."),
    "import_timeout_s": Param(D["import_timeout_s"], type="number", **_range(1, 600), section=FLEET,
                              title="Import check timeout (s)",
                              description="Pre-flight: the server's python must `import sglang` in this time "
                                          "(a venv on a network filesystem hangs here)."),
    "min_kv_tokens": Param(D["min_kv_tokens"], type="integer", **_range(0, 10**9), section=GATES,
                           title="Minimum KV tokens",
                           description="Per server, the max_total_num_tokens SGLang reports at start-up. The "
                                       "seed's healthy B200 server had 1.14M; fewer means less "
                                       "--mem-fraction-static or a GPU shared with something else."),
    "min_running_requests": Param(D["min_running_requests"], type="integer", **_range(1, 100_000),
                                  section=GATES, title="Minimum running-request slots",
                                  description="Per server, the effective max running requests (Mamba slots // 5 "
                                              "with MTP, or --max-running-requests). The cookbook's B200 gives 16."),
    "expected_prompt_tokens": Param(D["expected_prompt_tokens"], type="integer", **_range(1, 10**7),
                                    section=GATES, title="Expected mean prompt tokens",
                                    description="Used for the KV headroom figures of health_check."),
    "expected_output_tokens": Param(D["expected_output_tokens"], type="integer", **_range(1, 10**7),
                                    section=GATES, title="Expected mean output tokens",
                                    description="Reasoning + answer per sample, for KV headroom figures. The "
                                                "seed's run: ~1,820."),
    "smoke_timeout_s": Param(D["smoke_timeout_s"], type="number", **_range(1, 86_400), section=GATES,
                             title="Smoke request timeout (s)",
                             description="Per smoke request at the production max_tokens; a 16K-token thinking "
                                         "answer takes minutes on a cold server."),
    "prompt_source": Param(D["prompt_source"], type="string", minLength=1, section=PROMPTS, title="Prompt source",
                           description="A .jsonl(.gz), .json (an array of rows or JSON lines), .csv or .parquet "
                                       "file, a directory of them, or a folder written by datasets' save_to_disk "
                                       "(absolute path); or 'demo' for the built-in sample prompts."),
    "prompt_format": Param(D["prompt_format"], type="string", enum=list(PROMPT_FORMATS), section=PROMPTS,
                           title="Prompt format",
                           description="auto: detect per row. openai: 'messages' turns; sharegpt: 'conversations' "
                                       "of from/value turns; specforge: 'conversations' of role/content turns (a "
                                       "published dataset); prompt: a 'prompt' column."),
    "shard_size": Param(D["shard_size"], type="integer", **_range(1, 1_000_000), section=PROMPTS,
                        title="Prompts per shard",
                        description="One generate task per shard. ~1,000 keeps a shard's retry under ~10 minutes "
                                    "on a B200 server; planning refuses more shards than Airflow can map "
                                    "([core] max_map_length, 1,024)."),
    "context_length": Param(D["context_length"], type="integer", **_range(256, 10_000_000), section=PROMPTS,
                            title="Context length",
                            description="The servers' context length (Qwen3.6: 262,144); prompt + max_tokens "
                                        "must fit, longer rows are quarantined."),
    "max_bad_row_share": Param(D["max_bad_row_share"], type="number", **_range(0, 1), section=PROMPTS,
                               title="Max share of bad rows",
                               description="Planning fails above this share of rows it cannot send (bad roles, "
                                           "duplicates, too long); below it they are quarantined with a reason."),
    "max_tokens": Param(D["max_tokens"], type="integer", **_range(16, 1_000_000), section=SAMPLING,
                        title="max_tokens", description="Budget for reasoning + answer per request. 512 left the "
                                                        "seed's answers empty; thinking needs >= 4096."),
    "temperature": Param(D["temperature"], type="number", **_range(0, 2), section=SAMPLING, title="Temperature",
                         description="Qwen3 thinking mode: 0.6. Do not use 0 (greedy): thinking loops until "
                                     "max_tokens."),
    "top_p": Param(D["top_p"], type="number", **_range(maximum=1, exclusiveMinimum=0), section=SAMPLING,
                   title="top_p", description="Nucleus sampling; Qwen3 thinking mode: 0.95."),
    "top_k": Param(D["top_k"], type="integer", anyOf=[{"const": -1}, {"minimum": 1, "maximum": 1_000_000}],
                   section=SAMPLING, title="top_k",
                   description="Sample from the k most likely tokens; Qwen3 thinking mode: 20. -1 = off "
                               "(SGLang's default without a generation_config)."),
    "min_p": Param(D["min_p"], type="number", **_range(0, 1), section=SAMPLING, title="min_p",
                   description="Drop tokens below this share of the top token's probability; Qwen3: 0."),
    "presence_penalty": Param(D["presence_penalty"], type="number", **_range(-2, 2), section=SAMPLING,
                              title="presence_penalty",
                              description="OpenAI-style penalty on tokens already generated; Qwen suggests 0 to "
                                          "1.5 against endless repetition (higher values can mix languages)."),
    "enable_thinking": Param(D["enable_thinking"], type="boolean", section=SAMPLING, title="Thinking mode",
                             description="chat_template_kwargs enable_thinking: the model reasons in <think> first "
                                         "(split into reasoning_content by --reasoning-parser qwen3)."),
    "seed": Param(D["seed"], type="integer", **_range(0, 2**31 - 1), section=SAMPLING, title="Run seed",
                  description="Each sample's seed is derived from it and the sample id (reproducible)."),
    "regenerate_history": Param(D["regenerate_history"], type="boolean", section=SAMPLING,
                                title="Regenerate every assistant turn",
                                description="Multi-turn prompts: regenerate earlier assistant turns too, feeding "
                                            "back the model's own answers (as SpecForge does)."),
    "budget": Param(D["budget"], type="string", enum=["full", "train_length"], section=SAMPLING,
                    title="Generation budget",
                    description="full = max_tokens for every request; train_length = max_tokens cut to "
                                "train_max_length minus the prompt's tokens (what the trainer reads): a sample cut "
                                "there is kept, marked truncated_at_train_length. calibrate reports what it saves."),
    "retry_truncated": Param(D["retry_truncated"], type="boolean", section=SAMPLING,
                             title="Retry truncated/empty once with 2x max_tokens",
                             description="A sample that ends with finish_reason 'length' or without an answer is "
                                         "sent once more with twice the budget; the second answer is kept."),
    "concurrency_per_server": Param(D["concurrency_per_server"], type="integer", **_range(0, 4096),
                                    section=DISPATCH, title="Requests in flight per server",
                                    description="What each shard keeps open on its server; 0 = the server's "
                                                "running-request slots (more only queue in SGLang)."),
    "calibration_prompts": Param(D["calibration_prompts"], type="integer", **_range(0, 100_000), section=DISPATCH,
                                 title="Calibration prompts",
                                 description="calibrate measures one server with this many of the run's prompts "
                                             "(at least twice its slots) and predicts the run; 0 = skip."),
    "apply_advised_concurrency": Param(D["apply_advised_concurrency"], type="boolean", section=DISPATCH,
                                       title="Apply the planner's client concurrency",
                                       description="Shards keep the calibrated in-flight count (slots plus a small "
                                                   "queue) instead of 'Requests in flight per server'. Server flags "
                                                   "stay yours: the advice names them."),
    "autotune": Param(D["autotune"], type="string", enum=["off", "advise", "apply"], section=DISPATCH,
                      title="Autotune server settings",
                      description="After the gates, try server settings one by one on the first GPU (current; Mamba "
                                  "pool for 2x and 4x the running batch; radix cache off; MTP off at the largest "
                                  "batch; FP8 KV; and your own below), measure each for a bounded time and predict "
                                  "the run: advise = report only, apply = relaunch the fleet with the fastest. "
                                  "Skipped when calibration_prompts is 0."),
    "autotune_candidate_s": Param(D["autotune_candidate_s"], type="number", **_range(1, 86_400), section=DISPATCH,
                                  title="Autotune: seconds per candidate",
                                  description="Each candidate's measurement stops after this long at most (the "
                                              "launch and gates come on top)."),
    "autotune_budget_s": Param(D["autotune_budget_s"], type="number", **_range(1, 7 * 86_400), section=DISPATCH,
                               title="Autotune: total budget (s)",
                               description="Candidates that would end past this are skipped (reported as such)."),
    "autotune_candidates": Param(D["autotune_candidates"], type="array", items={"type": "string"}, section=DISPATCH,
                                 title="Autotune: extra candidates",
                                 description="Flag sets to try on top of server_flags, one per line, e.g. "
                                             "'--max-running-requests 24 --max-mamba-cache-size 120'."),
    "stall_timeout_s": Param(D["stall_timeout_s"], type="number", **_range(1, 86_400), section=DISPATCH,
                             title="Stall timeout (s)",
                             description="A streamed answer with no byte for this long is a stall (retried). Not a "
                                         "total timeout: a 16K-token thinking answer streams for many minutes."),
    "request_cap_s": Param(D["request_cap_s"], type="number", **_range(1, 7 * 86_400), section=DISPATCH,
                           title="Overall request cap (s)",
                           description="Hard limit per request, even while it streams; far above a normal "
                                       "answer's time."),
    "request_retries": Param(D["request_retries"], type="integer", **_range(0, 100), section=DISPATCH,
                             title="Retries per request",
                             description="For connection resets, 5xx/429 and stalls, with backoff; a server "
                                         "that keeps failing is marked unhealthy and the shard moves."),
    "max_generate_error_share": Param(D["max_generate_error_share"], type="number", **_range(0, 1),
                                      section=DISPATCH, title="Max share of prompts the servers refuse",
                                      description="Per shard: prompts refused by two servers (4xx, or the same "
                                                  "5xx) are quarantined; above this share the shard fails."),
    "checkpoint_every": Param(D["checkpoint_every"], type="integer", **_range(1, 1_000_000), section=DISPATCH,
                              title="Checkpoint every N results",
                              description="Finished samples are written to a parquet part after this many; a "
                                          "crash loses at most the requests in flight."),
    "checkpoint_s": Param(D["checkpoint_s"], type="number", **_range(0.1, 86_400), section=DISPATCH,
                          title="Checkpoint every T seconds",
                          description="... or after this long, whichever comes first."),
    "mask_reasoning": Param(D["mask_reasoning"], type="boolean", section=QUALITY, title="Train on the reasoning",
                            description="Loss mask covers reasoning + answer (SpecForge qwen3.5); off = answer only."),
    "empty_mask_tokens": Param(D["empty_mask_tokens"], type="integer", **_range(0, 1000), section=QUALITY,
                               title="Empty-answer mask size",
                               description="Samples with a loss mask at or below this are empty answers (the seed's "
                                           "`</think>\\n\\nOK.<|im_end|>\\n` is 6 tokens)."),
    "max_bad_sample_share": Param(D["max_bad_sample_share"], type="number", **_range(0, 1), section=QUALITY,
                                  title="Max share of bad samples",
                                  description="Bad samples are quarantined; above this share nothing is published."),
    "max_truncated_share": Param(D["max_truncated_share"], type="number", **_range(0, 1), section=QUALITY,
                                 title="Max share of truncated answers (finish_reason length)",
                                 description="Answers cut by max_tokens are quarantined; above this share the gate "
                                             "fails: raise max_tokens."),
    "max_repetition_score": Param(D["max_repetition_score"], type="number", **_range(0, 1), section=QUALITY,
                                  title="Max reasoning repetition score",
                                  description="Share of repeated 8-grams; loops (temperature 0) score near 1."),
    "train_max_length": Param(D["train_max_length"], type="integer", **_range(1, 10_000_000), section=QUALITY,
                              title="Training max_length",
                              description="The trainer's sequence length (SpecForge's Qwen3.6-27B recipe: 4096); "
                                          "longer samples are truncated in training."),
    "max_overlong_share": Param(D["max_overlong_share"], type="number", **_range(0, 1), section=QUALITY,
                                title="Max share longer than max_length",
                                description="Above this share of samples longer than the training max_length, the "
                                            "gate fails: most tokens would never be trained on. Prompts alone past "
                                            "it are quarantined at planning, which fails above this share of them."),
    "dataset_name": Param(D["dataset_name"], type="string", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", section=OUTPUT,
                          title="Dataset name", description="Published to <output root>/published/<name>/<run id>/."),
    "output_root": Param(D["output_root"], type="string", pattern="^/", section=OUTPUT, title="Output root",
                         description="Absolute path; runs go to <output root>/runs/<run id>/."),
    "emulator_faults": Param(D["emulator_faults"], type="object", section=EMULATOR, title="Emulator faults",
                             description="Only with the emulator: faults per GPU id ('*' = every server), e.g. "
                                         '{"2": {"crash_after_requests": 8}} SIGKILLs the server on GPU 2 at its '
                                         '9th chat request, {"*": {"http_error_rate": 0.05}} answers 5% with '
                                         'HTTP 500/503, {"1": {"kv_tokens": 100000}} gives GPU 1 a small KV cache. '
                                         "Every knob: the docstring of dflash_regen.emulator. {} = none."),
    "emulator_profile": Param(D["emulator_profile"], type="object", section=EMULATOR, title="Emulator profile",
                              description='Only with the emulator: its speed, e.g. {"decode_tokens_per_s": 3000} '
                                          "(per request), or a GPU preset; {} = the default profile."),
}
if NODES:
    PARAMS["node_failure"] = Param(
        "fail", type="string", enum=["fail", "continue"], section=FLEET, title="A node fails its gates",
        description="fail: the run fails. continue: that node is left out (reports/nodes/<node>/left_out.json) and "
                    "its shards go to the nodes that passed.")


@dag(
    dag_id="dflash_regen",
    schedule=None,
    start_date=dt.datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    doc_md=__doc__,
    tags=["dflash", "sglang", "data"],
    params=PARAMS,
    default_args={"retries": 1, "retry_delay": dt.timedelta(seconds=10), **NODE_QUEUE},
)
def dflash_regen():
    @task
    def stage_weights(params=None, run_id=None) -> dict:
        return dag_tasks.stage_weights(params, run_id)

    @setup
    @task
    def launch_fleet(staged: dict, params=None, run_id=None, node=None) -> dict:
        return dag_tasks.launch_fleet(params, run_id, staged["model_path"], node=node)

    @setup
    @task(retries=0)
    def health_check(fleet: dict, params=None, run_id=None, node=None) -> dict:
        return dag_tasks.health_check(params, run_id, fleet, node=node)

    @setup
    @task(retries=0)
    def smoke_test(fleet: dict, params=None, run_id=None, node=None) -> dict:
        return dag_tasks.smoke_test(params, run_id, fleet, node=node)

    # Tries server settings on the first GPU and, with Param autotune = apply, relaunches the fleet with the fastest.
    @setup
    @task(retries=0)
    def autotune(staged: dict, shards: list[dict], params=None, run_id=None, node=None) -> dict:
        return dag_tasks.autotune_fleet(params, run_id, staged["model_path"], shards, node=node)

    @task
    def plan_shards(params=None, run_id=None) -> list[dict]:
        return dag_tasks.plan_shards(params, run_id)

    @setup
    @task
    def calibrate(fleet: dict, shards: list[dict], params=None, run_id=None, node=None) -> dict:
        return dag_tasks.calibrate(params, run_id, fleet, shards, node=node)

    @task(retries=GENERATE_RETRIES, retry_delay=dt.timedelta(seconds=5), retry_exponential_backoff=2.0,
          max_retry_delay=dt.timedelta(minutes=2), max_active_tis_per_dagrun=PARALLEL_SHARDS,
          map_index_template="{{ shard.label }}")
    def generate(shard: dict, params=None, run_id=None, node=None) -> dict:
        return dag_tasks.generate(params, run_id, shard, node=node)

    @task(map_index_template="{{ 'shard %04d' | format(generated.shard) }}")
    def tokenize(generated: dict, params=None, run_id=None, node=None) -> dict:
        return dag_tasks.tokenize_shard(params, run_id, generated, node=node)

    @task(retries=0)
    def validate(shards: list[dict], params=None, run_id=None) -> dict:
        return dag_tasks.validate(params, run_id, shards)

    @task(outlets=[DATASET])
    def publish(params=None, run_id=None, outlet_events=None) -> dict:
        result = dag_tasks.publish_dataset(params, run_id)
        outlet_events[DATASET].extra = result
        return result

    # First in line for a free executor slot: idle GPUs stay held until it runs (tokenize tasks queue up then).
    @teardown
    @task(priority_weight=TEARDOWN_PRIORITY, weight_rule="absolute")
    def stop_fleet(fleet: dict) -> list[str]:
        return dag_tasks.stop_fleet(fleet)

    # The run's verdict. Airflow counts skipped leaves as success, so a run marked failed by hand (its pending
    # tasks skipped) would turn green once its teardown ran; a teardown still runs then, and with
    # on_failure_fail_dagrun its result is the run's state: published, or failed.
    @teardown(on_failure_fail_dagrun=True)
    @task(retries=0)
    def check_published(params=None, run_id=None) -> dict:
        return dag_tasks.check_published(params, run_id)

    def per_shard(shards, ready, stop, node: dict | None = None, on_node: dict | None = None):
        """generate -> tokenize for each shard, one mapped task group: a shard's tokenize starts when its own
        generate ends (the CPU work overlaps the GPU work), and a failed shard holds back only its own. The
        teardown waits for generation alone. prefix_group_id=False keeps the task ids (generate, or
        <node>.generate) that a clear, the README and the report pages name."""
        prefix, on_node = (f"{node['name']}." if node else ""), on_node or {}

        @task_group(group_id="shard", prefix_group_id=False)
        def shard_tasks(shard: dict):
            # By keyword: the map index templates read their task's keyword arguments (shard, generated).
            generated = generate.override(task_id=prefix + "generate", **on_node)(shard=shard, node=node)
            ready >> generated >> stop  # the servers are not needed past generation
            return tokenize.override(task_id=prefix + "tokenize", **on_node)(generated=generated, node=node)

        return shard_tasks.expand(shard=shards)

    if not NODES:
        staged = stage_weights()
        fleet = launch_fleet(staged)
        shards = plan_shards()  # runs while the servers load: it needs no GPU
        calibrated = calibrate(fleet, shards)  # measures one server on the run's own prompts, predicts the run
        chain(health_check(fleet), smoke_test(fleet), autotune(staged, shards), calibrated)
        tokenized = per_shard(shards, calibrated, stop_fleet(fleet))
        chain(tokenized, validate(shards), publish(), check_published())
        return

    # Several nodes: per node, its fleet setups, shards and teardown on its own queue (queue cannot be mapped).
    @task
    def check_inputs(params=None, run_id=None) -> dict:
        return dag_tasks.check_inputs(params, run_id)

    @task
    def stage_node(checked: dict, params=None, run_id=None, node=None) -> dict:
        return dag_tasks.stage_node(params, run_id, checked, node=node)

    @task(trigger_rule="none_failed")  # a node left out (skipped) does not stop the others
    def assign_shards(shards: list[dict], params=None, run_id=None) -> dict:
        return dag_tasks.assign_shards(params, run_id, shards, [n.name for n in NODES])

    @task
    def node_ready(calibrated: dict, params=None, run_id=None, node=None) -> dict:
        return dag_tasks.node_ready(params, run_id, calibrated, node)

    @task
    def node_shards(assigned: dict, name: str) -> list[dict]:
        return assigned[name]

    checked_inputs, shards = check_inputs(), plan_shards()
    assigned = assign_shards(shards)
    tokenized = []
    for node in NODES:
        on_node = {"queue": node.queue} if node.queue else {}
        spec = node.to_dict()
        with TaskGroup(node.name, tooltip=f"GPU node {node.name} (queue {node.queue or 'default'})"):
            staged = stage_node.override(task_id="stage_weights", **on_node)(checked_inputs, node=spec)
            fleet = launch_fleet.override(**on_node)(staged, node=spec)
            health = health_check.override(**on_node)(fleet, node=spec)
            checked = smoke_test.override(**on_node)(fleet, node=spec)
            tuned = autotune.override(**on_node)(staged, shards, node=spec)
            calibrated = calibrate.override(**on_node)(fleet, shards, node=spec)
            chain(health, checked, tuned, calibrated)
            stop = stop_fleet.override(**on_node)(fleet)
            # Each setup gets this node's teardown, so clearing a shard of another node leaves them alone
            # (Airflow re-runs an upstream setup that has no teardown, whichever node it belongs to).
            [health, checked, tuned, calibrated] >> stop
            node_ready.override(**on_node)(calibrated, node=spec) >> assigned  # skipped when the node is left out
            mine = node_shards(assigned, node.name)
            tokenized.append(per_shard(mine, calibrated, stop, node=spec, on_node=on_node))
    validated = validate.override(trigger_rule="none_failed_min_one_success")(shards)
    tokenized >> validated
    chain(validated, publish(), check_published())


dflash_regen()
