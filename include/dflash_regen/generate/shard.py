"""Generate one shard's completions on one leased server, exactly once and resumably.

- **Lease**: the task holds one healthy server for the shard (`fleet.servers.lease`); `run_shard` is the whole task.
- **Progress is keyed by `sample_id`**: finished rows go to checkpoint parts
  (`completions/shard-XXXXX/part-*.parquet`, tmp + rename) every N results or T seconds, and 4xx-rejected
  prompts to `failures/shard-XXXXX/part-*.parquet`. A rerun reads both and sends only what is missing,
  then writes one shard file holding each sample once. A crash loses at most the in-flight requests.
- **Failures**: transient errors are retried per request with backoff; when the server stops answering
  it is marked unhealthy and the task fails with `ShardFailed`, whose first line names the server, how it
  ended (the signal or exit code its watcher recorded) and how many samples are kept; the server is also
  recorded in `fleet/failed-shard-XXXXX.json`, which outlives a relaunch, so the retry (or a clear) leases
  another server first: on real hardware a faulty GPU is the likely cause.
  A 5xx that every retry of one prompt meets, while the server answers a probe, is put to a second
  server: failing there too, it is the prompt's fault (quarantined with both servers' messages, as 4xx
  answers are); a 401/403 fails the shard at once (the API key). Quarantines above `max_generate_error_share` of a
  shard fail it.

One sample's requests (payload, seed, retries, second opinion) are `generate/samples.py`'s; the parts and their
merge are `generate/checkpoints.py`'s.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path

import pyarrow.parquet as pq

from dflash_regen import atomic, capacity
from dflash_regen.errors import (
    AuthError,
    ConfigError,
    DflashError,
    Drained,
    NotRetryable,
    PromptError,
    ServerUnhealthy,
    ShardFailed,
    TooManyPromptErrors,
    TransientError,
)
from dflash_regen.fleet.servers import (
    Server,
    healthy_servers,
    how_it_ended,
    lease,
    load_servers,
    log_tail,
    mark_unhealthy,
    read_api_key,
)
from dflash_regen.generate.checkpoints import merge_parts, read_done, write_part
from dflash_regen.generate.samples import Generator, Stopped
from dflash_regen.generate.status import ShardStatus
from dflash_regen.layout import COMPLETIONS, FAILURES, FleetFiles, RunLayout
from dflash_regen.payloads import Generated, Shard
from dflash_regen.prompts.formats import Prompt
from dflash_regen.prompts.planning import TokenCounter, token_bound
from dflash_regen.schemas import COMPLETION, QUARANTINE
from dflash_regen.settings.run_config import GenerationSettings, RunConfig
from dflash_regen.sglang.api import Api, Dialect

log = logging.getLogger(__name__)
HEARTBEAT_S = 5.0  # a running shard's status is rewritten at least this often (a few hundred bytes)


# ---------------------------------------------------------------------------------- where a shard failed
def _failed_path(fleet_dir: Path, shard: int) -> Path:
    return FleetFiles(fleet_dir).failed_shard(shard)


def record_failure(fleet_dir: Path, shard: int, server: Server, reason: str) -> None:
    """Remember that `shard` failed on `server`; kept across relaunches (unlike the unhealthy markers)."""
    path = _failed_path(fleet_dir, shard)
    history = json.loads(path.read_text()) if path.is_file() else []
    history.append({"server": server.index, "gpu": server.gpu, "reason": reason, "at": time.time()})
    atomic.write_json(path, history)


def servers_failed_on(fleet_dir: Path, shard: int) -> dict[int, str]:
    """Server index -> the latest reason `shard` failed there."""
    path = _failed_path(fleet_dir, shard)
    return {h["server"]: h["reason"] for h in json.loads(path.read_text())} if path.is_file() else {}


# ------------------------------------------------------------------------------------------------ a shard
def _shard_failed(shard: int, server: Server, error: BaseException, fleet_dir: Path, api_key: str, kept: int,
                  total: int, status: ShardStatus | None) -> ShardFailed:
    """Record where the shard failed when the server is at fault (unhealthy marker, failure record, the shard's
    status), and build the error: its first line says what happened to which server and what a retry will do;
    the cause and the server's log tail follow."""
    ended = how_it_ended(fleet_dir, server, wait_s=2.0)
    if ended:
        what = f"the server process {ended}"
    elif isinstance(error, ServerUnhealthy):
        what = "the server stopped answering although its process runs (marked unhealthy)"
    else:
        what = "a request kept failing after its retries"
    if ended or isinstance(error, ServerUnhealthy):  # the server is at fault: no other shard should lease it
        mark_unhealthy(fleet_dir, server, f"{what}: {error}")
        record_failure(fleet_dir, shard, server, what)
    first = (f"shard {shard} failed on {server.name}: {what}; {kept:,} of {total:,} samples are kept, a retry or "
             f"a clear of this shard sends only the other {total - kept:,}, to another server")
    failure = ShardFailed(f"{first}\ncause: {type(error).__name__}: {error}\nlast lines of {server.log_path}:\n"
                          f"{log_tail(server.log_path, api_key, 10)}")
    if status:
        status.finish("failed", failure)
    return failure


@dataclass
class ShardPaths:
    shard: int
    prompts: Path  # the planned shard file
    parts: Path  # completions/shard-XXXXX/
    failures: Path  # failures/shard-XXXXX/
    output: Path  # completions/shard-XXXXX.parquet
    failures_output: Path  # failures/shard-XXXXX.parquet
    status: Path | None = None  # status/shard-XXXXX.json (generate/status.py)
    drain: Path | None = None  # the run's drain request (layout.drain_request)

    @classmethod
    def of(cls, layout: RunLayout, shard: int, prompts: Path) -> ShardPaths:
        return cls(shard, prompts, layout.parts(COMPLETIONS, shard), layout.parts(FAILURES, shard),
                   layout.merged(COMPLETIONS, shard), layout.merged(FAILURES, shard), layout.status(shard),
                   layout.drain_request)


# ------------------------------------------------------------------------------------------------ draining
def request_drain(layout: RunLayout, by: str) -> dict:
    """Ask the run to drain: running shards finish their in-flight requests, checkpoint and stop, shards not
    started skip, and the fleet's teardown then stops the servers. A relaunch of the fleet (a clear) cancels it."""
    request = {"by": by, "at": time.time()}
    atomic.write_json(layout.drain_request, request)
    log.info("drain requested by %s", by)
    return request


def drain_request(path: Path | None) -> dict | None:
    """{by, at} while the run is asked to drain, else None."""
    try:
        return json.loads(path.read_text()) if path else None
    except (OSError, ValueError):
        return None


def _drained(shard: int, request: dict, kept: int, total: int) -> Drained:
    when = time.strftime("%H:%M:%S", time.localtime(request.get("at", 0)))
    return Drained(f"shard {shard} drained (asked by {request.get('by', 'the operator')} at {when}): {kept:,} of "
                   f"{total:,} samples are kept; a clear of this shard, or a new run (it reuses them), sends the "
                   f"other {total - kept:,}")


def _server_facts(server: Server, api_key: str) -> tuple[int, str | None, int, Dialect | None]:
    """(effective running-request slots, weight version, context length, SGLang version) of the leased server."""
    api = Api(server.url, api_key)
    try:
        info = api.server_info()
        slots = api.allocation(info=info).running_slots
        version = api.version(info)
        model = api.model_info()
        context = api.context_length()
    except NotRetryable:
        raise
    except (DflashError, ValueError) as exc:
        raise ServerUnhealthy(f"{server.name} did not report its slots and context length ({exc})") from exc
    return slots, model.get("weight_version"), context, Dialect(version) if version else None


def _too_long(rows: list[dict], server: Server, context: int, max_tokens: int) -> dict[str, str]:
    """sample_id -> why, for prompts that cannot fit the server's own context length with max_tokens. Planning
    checked Param context_length; the server may have been launched with less (`--context-length`)."""
    budget = context - max_tokens
    if budget <= 0:
        raise ConfigError(f"{server.name} has a context length of {context:,} tokens, no room for Param max_tokens="
                          f"{max_tokens:,}: lower max_tokens, or relaunch with a larger --context-length")
    counter, found = TokenCounter(), {}  # planning's own count (the tokenizer loads only if a prompt is long)
    for row in rows:
        messages, tools = json.loads(row["messages"]), json.loads(row["tools"]) if row["tools"] else None
        if token_bound(messages, tools) < budget:
            continue
        tokens = row.get("prompt_tokens") or counter.count(Prompt(row["sample_id"], messages, tools, "", 0))
        if tokens >= budget:
            found[row["sample_id"]] = (f"{tokens:,} prompt tokens + max_tokens {max_tokens:,} exceed the context "
                                       f"length {context:,} of {server.name}; not sent. Set Param context_length "
                                       f"to {context:,} so planning quarantines these before any GPU work")
    return found


def _check_refused_share(paths: ShardPaths, prompts: int, refused: int, limit: float) -> None:
    """A fleet that refuses many prompts (a wrong template, a new server version) must not quietly empty a run."""
    if prompts and refused / prompts > limit:
        rows = pq.read_table(paths.failures_output, columns=["sample_id", "reason", "detail"]).to_pylist()
        raise TooManyPromptErrors(
            f"shard {paths.shard}: the servers refused {refused} of {prompts} prompts ({refused / prompts:.1%}), "
            f"above Param max_generate_error_share={limit:.1%}; e.g. {rows[0]['sample_id']}: {rows[0]['reason']} "
            f"({rows[0]['detail'][:300]}). All are in {paths.failures_output}; fix the prompts or the servers, "
            "or raise the Param, then clear the shard")


class _Attempt:
    """This attempt at a shard: what was done before it, what it has done, checkpointed (`flush`) and logged
    (`progress`) as it goes."""

    def __init__(self, paths: ShardPaths, total: int, done_before: int, failed_before: int, todo: int,
                 status: ShardStatus | None, *, in_flight: int, expected_rps: float | None,
                 run_prompts: int | None, servers_sharing: int, started: float):
        self.paths, self.total, self.todo, self.status = paths, total, todo, status
        self.in_flight, self.expected_rps = in_flight, expected_rps  # the ETA's inputs
        self.run_prompts, self.servers_sharing = run_prompts, servers_sharing
        self.done_before, self.failed_before = done_before, failed_before
        self.rows: list[dict] = []
        self.failures: list[dict] = []
        self.stats = {"completed": 0, "output_tokens": 0, "reasoning_tokens": 0, "quarantined": 0}
        self.started = started  # when the task began (reading the shard and asking the server count too)
        self.last_flush = self.last_log = self.last_beat = time.monotonic()
        self.drain: dict | None = None  # the drain request, once seen

    @property
    def kept(self) -> int:
        return self.done_before + self.failed_before + self.stats["completed"] + self.stats["quarantined"]

    def flush(self) -> None:
        write_part(self.paths.parts, self.rows, COMPLETION)
        write_part(self.paths.failures, self.failures, QUARANTINE)
        self.rows.clear()
        self.failures.clear()
        self.last_flush = time.monotonic()
        self.heartbeat()

    def draining(self) -> bool:
        """Whether the operator asked the run to drain (a stat a second; once asked, it stays so)."""
        if self.drain is None and self.paths.drain is not None:
            self.drain = drain_request(self.paths.drain)
        return self.drain is not None

    def heartbeat(self) -> None:
        """The status the Fleet page counts in-flight progress from: at each checkpoint, and every HEARTBEAT_S
        between them (a checkpoint may be 30 s or 50 answers away; a page should not read 0 done that long)."""
        self.last_beat = time.monotonic()
        if self.status:
            self.status.update(self.done_before + self.stats["completed"],
                               self.failed_before + self.stats["quarantined"], self.stats["output_tokens"])

    def progress(self) -> None:
        stats, in_flight, expected_rps = self.stats, self.in_flight, self.expected_rps
        run_prompts, servers_sharing = self.run_prompts, self.servers_sharing
        elapsed = time.monotonic() - self.started
        rate, source = stats["completed"] / elapsed if elapsed else 0.0, "measured"
        # Until two batches have finished, the shard's own completion rate is mostly the batch still filling.
        if expected_rps and stats["completed"] < 2 * in_flight:
            rate, source = expected_rps, "calibrated"
        left = self.todo - stats["completed"] - stats["quarantined"]
        eta = left / rate if rate else float("inf")
        run_eta = ""
        if run_prompts and rate:
            hours = run_prompts / (rate * max(servers_sharing, 1)) / 3600
            run_eta = f"; whole run ~{hours:.1f} h if {servers_sharing} servers keep this rate"
        log.info("shard %d: %d/%d done, %.0f output tok/s (%d reasoning / %d content tokens), ETA %.0f s "
                 "(%s rate)%s", self.paths.shard, self.done_before + stats["completed"], self.total,
                 stats["output_tokens"] / elapsed, stats["reasoning_tokens"],
                 stats["output_tokens"] - stats["reasoning_tokens"], eta, source, run_eta)


def _already_complete(paths: ShardPaths, settings: GenerationSettings) -> Generated | None:
    """The counts of a shard an earlier attempt finished (both merged files written), else None."""
    if not (paths.output.is_file() and paths.failures_output.is_file()):
        return None
    done = pq.read_metadata(paths.output).num_rows
    failed = pq.read_metadata(paths.failures_output).num_rows
    log.info("shard %d already complete: %d completions, %d quarantined", paths.shard, done, failed)
    _check_refused_share(paths, done + failed, failed, settings.max_generate_error_share)
    return {"shard": paths.shard, "completed": done, "quarantined": failed, "generated_now": 0,
            "path": str(paths.output), "server": None}


def _count_prompt_tokens(todo: list[dict]) -> None:
    """Each request's max_tokens under the train-length budget needs its prompt's tokens (planning counts them: a
    shard planned without the budget has only the long ones counted)."""
    counter = TokenCounter()
    for row in todo:
        if row.get("prompt_tokens") is None:
            row["prompt_tokens"] = counter.count(Prompt(row["sample_id"], json.loads(row["messages"]),
                                                        json.loads(row["tools"]) if row["tools"] else None, "", 0))


def _send_all(gen: Generator, todo: list[dict], attempt: _Attempt, settings: GenerationSettings,
              in_flight: int) -> BaseException | None:
    """Send every row with `in_flight` at once, checkpointing as results come; returns the error that stopped the
    shard (the cause, not its echoes in the other workers), or None. Every finished result is flushed either way."""
    # Local names for the attempt's lists and counters: the loop reads as the one it was in generate_shard.
    pending_rows, pending_failures, stats = attempt.rows, attempt.failures, attempt.stats
    flush, progress, paths = attempt.flush, attempt.progress, attempt.paths
    error: BaseException | None = None
    with ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix=f"shard{paths.shard}") as pool:
        # Only the requests in flight are pending: `wait` looks at each pending future every time, so
        # submitting the whole shard up front would cost O(n^2) in this thread.
        queued = iter(todo)
        futures: dict[Future, dict] = {pool.submit(gen.generate, row): row for row in islice(queued, in_flight)}
        try:
            while futures:
                finished, _ = wait(futures, timeout=1.0, return_when=FIRST_COMPLETED)
                for fut in finished:
                    row = futures.pop(fut)
                    try:
                        result = fut.result()
                    except PromptError as exc:
                        pending_failures.append({"location": row["sample_id"], "stage": "generate",
                                                 "reason": f"http_{exc.status}", "detail": str(exc),
                                                 "sample_id": row["sample_id"]})
                        stats["quarantined"] += 1
                        continue
                    except (ServerUnhealthy, TransientError, AuthError) as exc:
                        if error is None or isinstance(error, Stopped):  # keep the cause, not its echoes
                            error = exc
                        gen.stop.set()
                        continue
                    pending_rows.append(result)
                    stats["completed"] += 1
                    stats["output_tokens"] += result["completion_tokens"] or 0
                    stats["reasoning_tokens"] += result["reasoning_tokens"] or 0
                now = time.monotonic()
                if len(pending_rows) + len(pending_failures) >= settings.checkpoint_every or \
                        (now - attempt.last_flush >= settings.checkpoint_s and (pending_rows or pending_failures)):
                    flush()
                elif now - attempt.last_beat >= HEARTBEAT_S:
                    attempt.heartbeat()
                if now - attempt.last_log >= settings.progress_s:
                    attempt.last_log = now
                    progress()
                if error is None and not attempt.draining():  # after an error or a drain request, the
                    # requests in flight end and nothing new starts
                    futures.update((pool.submit(gen.generate, row), row) for row in islice(queued, len(finished)))
        finally:
            flush()  # keep every finished result, whatever happens next
    return error


def generate_shard(paths: ShardPaths, server: Server, api_key: str, settings: GenerationSettings, *,
                   fleet_dir: Path, run_prompts: int | None = None, servers_sharing: int = 1,
                   expected_rps: float | None = None) -> Generated:
    """Complete the shard on `server` (leased for it); returns counts for XCom.

    `expected_rps` (completions per second on one server, from the capacity plan) drives the ETA until the
    shard's own rate means something.
    """
    started = time.monotonic()
    if (complete := _already_complete(paths, settings)) is not None:
        return complete
    table = pq.read_table(paths.prompts, columns=["sample_id", "messages", "tools", "prompt_tokens"])
    done_ids = read_done(paths.parts, paths.output)
    failed_ids = read_done(paths.failures, paths.failures_output)
    todo = [{**row, "shard": paths.shard} for row in table.to_pylist()
            if row["sample_id"] not in done_ids and row["sample_id"] not in failed_ids]
    status = ShardStatus(paths.status, paths.shard, table.num_rows, server.name, len(done_ids),
                                      len(failed_ids)) if paths.status else None
    try:
        slots, revision, context, dialect = _server_facts(server, api_key)
    except ServerUnhealthy as exc:
        raise _shard_failed(paths.shard, server, exc, fleet_dir, api_key, len(done_ids) + len(failed_ids),
                            table.num_rows, status) from None
    if settings.train_budget:
        _count_prompt_tokens(todo)
    too_long = _too_long(todo, server, context, settings.sampling.max_tokens)
    todo = [row for row in todo if row["sample_id"] not in too_long]
    in_flight = settings.concurrency_per_server or slots
    log.info("shard %d on %s: %d prompts, %d done before, %d quarantined before, %d to send, %d in flight",
             paths.shard, server.name, table.num_rows, len(done_ids), len(failed_ids), len(todo), in_flight)
    attempt = _Attempt(paths, table.num_rows, len(done_ids), len(failed_ids), len(todo), status,
                       in_flight=in_flight, expected_rps=expected_rps, run_prompts=run_prompts,
                       servers_sharing=servers_sharing, started=started)
    attempt.failures.extend({"location": sid, "stage": "generate", "reason": "too_long", "detail": why,
                             "sample_id": sid} for sid, why in too_long.items())
    gen = Generator(server, api_key, settings, in_flight, revision, fleet_dir, dialect)
    error = _send_all(gen, todo, attempt, settings, in_flight)
    if isinstance(error, AuthError):
        if status:
            status.finish("failed", error)
        raise error
    if error is not None:
        # from None: the message carries the cause; a chain of requests/urllib3 errors would bury it.
        raise _shard_failed(paths.shard, server, error, fleet_dir, api_key, attempt.kept, table.num_rows,
                            status) from None
    if attempt.drain is not None and attempt.kept < table.num_rows:
        drained = _drained(paths.shard, attempt.drain, attempt.kept, table.num_rows)
        if status:
            status.finish("drained", drained)
        raise drained
    attempt.progress()
    return _merge(paths, server, attempt, settings)


def _merge(paths: ShardPaths, server: Server, attempt: _Attempt, settings: GenerationSettings) -> Generated:
    """The shard's one completion file and one quarantine file, from every part; the counts for XCom."""
    completed = merge_parts(paths.parts, paths.output, COMPLETION)
    quarantined = merge_parts(paths.failures, paths.failures_output, QUARANTINE)
    if attempt.status:
        attempt.status.finish("done")
    log.info("shard %d complete on %s: %d completions, %d quarantined, %.1f s", paths.shard, server.name,
             completed, quarantined, time.monotonic() - attempt.started)
    _check_refused_share(paths, completed + quarantined, quarantined, settings.max_generate_error_share)
    return {"shard": paths.shard, "completed": completed, "quarantined": quarantined,
            "generated_now": attempt.stats["completed"], "output_tokens": attempt.stats["output_tokens"],
            "path": str(paths.output), "server": server.name,
            "seconds": round(time.monotonic() - attempt.started, 2)}


def run_shard(cfg: RunConfig, shard: Shard) -> Generated:
    """The generate task for one shard descriptor (`plan_shards`' dict): lease a server (not one this shard failed
    on while another is healthy), complete the shard there at the capacity plan's rate and, with Param
    apply_advised_concurrency, its advised concurrency; returns counts for XCom."""
    paths = ShardPaths.of(cfg.layout, shard["shard"], Path(shard["path"]))
    if (request := drain_request(paths.drain)) and _already_complete(paths, cfg.generation) is None:
        kept = len(read_done(paths.parts, paths.output)) + len(read_done(paths.failures, paths.failures_output))
        raise _drained(shard["shard"], request, kept, shard["prompts"])  # not started: no server leased
    servers = load_servers(cfg.fleet_dir)
    key = read_api_key(cfg.fleet_dir)
    settings, expected_rps = cfg.generation, None
    planned = capacity.read_report(cfg.node_reports_dir)
    if planned:
        expected_rps = planned["scenarios"][0]["requests_per_s_per_server"]
        if cfg.capacity.apply_advised_concurrency:
            settings = replace(settings, concurrency_per_server=planned["advice"]["concurrency_per_server"])
    with lease(cfg.fleet_dir, servers, shard["shard"], wait_s=cfg.fleet.ready_timeout_s,
               avoid=servers_failed_on(cfg.fleet_dir, shard["shard"])) as server:
        healthy = len(healthy_servers(cfg.fleet_dir, servers))
        return generate_shard(paths, server, key, settings, fleet_dir=cfg.fleet_dir,
                              run_prompts=shard.get("run_prompts"), servers_sharing=healthy,
                              expected_rps=expected_rps)
