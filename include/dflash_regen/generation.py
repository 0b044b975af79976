"""Generate one shard's completions on one leased server, exactly once and resumably.

- **Lease**: the task takes an exclusive `flock` on one healthy server (`fleet/lease-<i>.lock`). The lock
  dies with the process, so a killed task never leaves a server leased.
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
  answers are); a 401/403 fails the shard at once (the API key). Quarantines above `max_error_share` of a
  shard fail it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_regen import atomic, sglang, shard_status
from dflash_regen.config import GenerationSettings
from dflash_regen.errors import (
    AuthError,
    ConfigError,
    DflashError,
    NoServerFree,
    NotRetryable,
    PromptError,
    ServerError,
    ServerUnhealthy,
    ShardFailed,
    TooManyPromptErrors,
    TransientError,
)
from dflash_regen.fleet import Server, healthy_servers, how_it_ended, is_alive, load_servers, log_tail, mark_unhealthy
from dflash_regen.planning import QUARANTINE_SCHEMA, TokenCounter
from dflash_regen.prompts import Prompt
from dflash_regen.sglang import ChatResult, make_session, stream_chat

log = logging.getLogger(__name__)

THINK_MARKERS = ("<think>", "</think>")
# A cut answer is closed by the chat template (`</think>`, `\n\n`, `<|im_end|>`, `\n`): leave it room within the
# training length, so a sample cut by Param budget train_length still fits train_max_length once tokenized.
TRAIN_BUDGET_RESERVE = 8
COMPLETION_SCHEMA = pa.schema([
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
])


class _Stopped(ServerUnhealthy):
    """Raised in the other workers once one of them found the server dead: not the cause, only its echo."""


# ---------------------------------------------------------------------------------- where a shard failed
def _failed_path(fleet_dir: Path, shard: int) -> Path:
    return fleet_dir / f"failed-shard-{shard:05d}.json"


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


# ------------------------------------------------------------------------------------------------- leases
class Lease:
    """An exclusive hold on one server for the life of this process (flock)."""

    def __init__(self, server: Server, fd: int):
        self.server, self._fd = server, fd

    def release(self) -> None:
        os.close(self._fd)


def lease_server(fleet_dir: Path, servers: list[Server], shard: int, wait_s: float,
                 avoid: dict[int, str] | None = None) -> Lease:
    """Lease a healthy server, never one in `avoid` (where this shard failed before) while another is healthy."""
    deadline = time.monotonic() + wait_s
    avoid = avoid or {}
    while True:
        candidates = healthy_servers(fleet_dir, servers)
        if not candidates:
            raise NoServerFree(f"no healthy server left in {fleet_dir} ({len(servers)} launched); check the "
                               "server logs there, then clear launch_fleet to relaunch the fleet")
        if any(s.index not in avoid for s in candidates):  # waiting for another server beats a faulty GPU
            candidates = [s for s in candidates if s.index not in avoid]
        # Start at a shard-dependent server so parallel tasks spread out instead of racing for server 0.
        ordered = sorted(candidates, key=lambda s: (s.index - shard) % len(servers))
        for server in ordered:
            fd = os.open(fleet_dir / f"lease-{server.index}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"shard {shard} pid {os.getpid()}\n".encode())
            for index, reason in sorted(avoid.items()):
                verdict = "leased it again: no other server is healthy" if index == server.index else \
                    f"leased {server.name} instead"
                log.warning("shard %d failed on server %d before (%s); %s", shard, index, reason, verdict)
            return Lease(server, fd)
        if time.monotonic() > deadline:
            raise NoServerFree(f"all {len(candidates)} healthy servers stayed leased for {wait_s:.0f} s")
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------------- checkpoints
def _sources(folder: Path, target: Path) -> list[Path]:
    """A merged shard file (if a crash hit between two merges) and every checkpoint part."""
    parts = sorted(folder.glob("part-*.parquet")) if folder.is_dir() else []
    return ([target] if target.is_file() else []) + parts


def read_done(folder: Path, target: Path) -> set[str]:
    done: set[str] = set()
    for path in _sources(folder, target):
        done.update(pq.read_table(path, columns=["sample_id"]).column("sample_id").to_pylist())
    return done


def write_part(folder: Path, rows: list[dict], schema: pa.Schema) -> None:
    if rows:
        table = pa.Table.from_pylist(rows, schema=schema)
        atomic.write_table(table, folder / f"part-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet")


def merge_parts(folder: Path, target: Path, schema: pa.Schema) -> int:
    """One file, each sample once (first write wins), written atomically; parts removed afterwards.

    Duplicates are real: two attempts of one shard can run at once (a zombie task and its retry), and a
    kill between the rename and the unlinks leaves the merged rows in their parts too.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(f".{target.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent attempts merge one at a time (the lock dies with them)
        sources = _sources(folder, target)
        tables = [pq.read_table(p, schema=schema) for p in sources]
        table = pa.concat_tables(tables) if tables else schema.empty_table()
        ids = table.column("sample_id").to_pylist()
        seen: set = set()
        keep = [i for i, sid in enumerate(ids) if not (sid in seen or seen.add(sid))]
        table = table.take(pa.array(keep, pa.int64())) if len(keep) != len(ids) else table
        atomic.write_table(table, target)
        for p in sources:
            if p != target:
                p.unlink()
    return table.num_rows


# ---------------------------------------------------------------------------------------------- requests
def sample_seed(sample_id: str, run_seed: int) -> int:
    return (int(hashlib.sha256(sample_id.encode()).hexdigest()[:8], 16) + run_seed) % (2**31)


def chat_payload(messages: list[dict], tools: list[dict] | None, settings: GenerationSettings, seed: int,
                 max_tokens: int) -> dict:
    return sglang.chat_payload(messages, tools, settings.sampling, model=settings.served_model, max_tokens=max_tokens,
                               seed=seed)


def _turn(result: ChatResult) -> dict:
    turn: dict = {"role": "assistant", "content": result.content}
    if result.reasoning:
        turn["reasoning_content"] = result.reasoning
    if result.tool_calls:
        turn["tool_calls"] = result.tool_calls
    return turn


class Generator:
    """Sends one sample's requests with per-request retries; shared by the shard's worker threads."""

    def __init__(self, server: Server, api_key: str, settings: GenerationSettings, in_flight: int,
                 model_revision: str | None, fleet_dir: Path | None = None):
        self.server, self.api_key, self.settings, self.fleet_dir = server, api_key, settings, fleet_dir
        self.model_revision = model_revision
        self.session = make_session(in_flight)
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._consecutive_failures = 0
        self.failure_limit = max(2 * in_flight, 8)

    def _request(self, payload: dict) -> tuple[ChatResult, int, str]:
        """(result, attempts, name of the server that answered)."""
        delay = 1.0
        for attempt in range(1, self.settings.request_retries + 2):
            if self.stop.is_set():
                raise _Stopped("stopping: another request found the server unhealthy")
            try:
                result = stream_chat(self.session, self.server.url, self.api_key, payload,
                                     stall_s=self.settings.stall_s, cap_s=self.settings.request_cap_s)
            except TransientError as exc:
                with self._lock:
                    self._consecutive_failures += 1
                    too_many = self._consecutive_failures >= self.failure_limit
                if too_many or not self._server_answers():
                    self.stop.set()
                    raise ServerUnhealthy(f"{self.server.name} stopped answering "
                                          f"({self._consecutive_failures} failures in a row; last: {exc})") from exc
                if attempt > self.settings.request_retries:
                    if isinstance(exc, ServerError):
                        result, served_by = self._second_opinion(payload, exc)
                        return result, attempt + 1, served_by
                    raise
                log.warning("%s: attempt %d failed (%s); retrying in %.0f s", self.server.name, attempt, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 30)
                continue
            with self._lock:
                self._consecutive_failures = 0
            return result, attempt, self.server.name
        raise AssertionError("unreachable")

    def _probe(self, server: Server) -> int | None:
        """HTTP status of a real 1-token generation (None: no answer). `/health` can answer while the
        scheduler is wedged (sglang#6624)."""
        if not is_alive(server):
            return None
        return sglang.Api(server.url, self.api_key).probe(self.settings.served_model,
                                                          timeout_s=min(30.0, self.settings.stall_s))

    def _server_answers(self) -> bool:
        return self._probe(self.server) is not None  # any answer, even a 5xx, means the scheduler is there

    def _second_opinion(self, payload: dict, first: ServerError) -> tuple[ChatResult, str]:
        """Every retry of this prompt met `first`: whose fault is it? The server's if it fails a plain probe
        too (ServerUnhealthy); the prompt's if a second server fails it as well (PromptError, quarantined);
        else the second server's answer is the result."""
        if self._probe(self.server) != 200:
            raise ServerUnhealthy(f"{self.server.name} fails other prompts too (a 1-token probe got no 200); "
                                  f"last: {first}")
        with self._lock:
            self._consecutive_failures = 0  # it answers other prompts: this one is the suspect
        mine = f"{self.server.name}: HTTP {first.status}: {first.message}"
        others = [s for s in healthy_servers(self.fleet_dir, load_servers(self.fleet_dir))
                  if s.index != self.server.index] if self.fleet_dir else []
        if not others:
            raise PromptError(first.status, f"{mine} (on all {self.settings.request_retries + 1} tries; no other "
                                            "healthy server to ask)")
        other = others[0]
        with make_session(1) as session:  # not the shard's pool, which is sized for the leased server
            try:
                result = stream_chat(session, other.url, self.api_key, payload, stall_s=self.settings.stall_s,
                                     cap_s=self.settings.request_cap_s)
            except (ServerError, PromptError) as exc:
                raise PromptError(exc.status, f"{mine}; and {other.name}: {exc}") from exc
            except TransientError:
                raise first from None  # no verdict from the second server: still a transient failure
        log.warning("%s failed one prompt on every try (%s) but %s answered it: its answer is kept",
                    self.server.name, first, other.name)
        return result, other.name

    def generate(self, sample: dict) -> dict:
        """One completion row for a shard row (sample_id, messages, tools)."""
        s = self.settings
        messages, tools = json.loads(sample["messages"]), json.loads(sample["tools"]) if sample["tools"] else None
        seed = sample_seed(sample["sample_id"], s.seed)
        turns: list[dict] = []
        history: list[dict] = []
        targets = messages
        if s.regenerate_history:
            # Regenerate every assistant turn in order from the model's own earlier answers.
            for msg in messages:
                if msg["role"] == "assistant":
                    result, _, _ = self._request(chat_payload(history, tools, s, seed, s.sampling.max_tokens))
                    turns.append(_turn(result))
                    history.append({"role": "assistant", "content": result.content,
                                    **({"tool_calls": result.tool_calls} if result.tool_calls else {})})
                else:
                    history.append(msg)
            targets = history
        max_tokens = s.sampling.max_tokens
        if s.train_budget:  # what the trainer reads: train_max_length - this prompt's tokens (planning's count)
            room = s.train_budget - (sample.get("prompt_tokens") or 0) - TRAIN_BUDGET_RESERVE
            max_tokens = max(1, min(s.sampling.max_tokens, room))
        result, attempt, served_by = self._request(chat_payload(targets, tools, s, seed, max_tokens))
        at_train_length = result.finish_reason == "length" and max_tokens < s.sampling.max_tokens
        if s.retry_truncated and not at_train_length and (result.finish_reason == "length"
                                                          or not (result.content or result.tool_calls)):
            max_tokens = 2 * s.sampling.max_tokens
            result, extra, served_by = self._request(chat_payload(targets, tools, s, seed, max_tokens))
            attempt += extra
        turns.append(_turn(result))
        usage = result.usage or {}
        return {
            "sample_id": sample["sample_id"], "shard": sample["shard"], "server": served_by,
            "reasoning_content": result.reasoning or None, "content": result.content or None,
            "tool_calls": json.dumps(result.tool_calls) if result.tool_calls else None,
            "finish_reason": result.finish_reason, "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"), "reasoning_tokens": sglang.reasoning_tokens(usage),
            "latency_s": result.latency_s, "finished_at": time.time(), "attempt": attempt, "max_tokens": max_tokens,
            "temperature": s.sampling.temperature, "top_p": s.sampling.top_p, "top_k": s.sampling.top_k,
            "min_p": s.sampling.min_p, "presence_penalty": s.sampling.presence_penalty, "seed": seed,
            "enable_thinking": s.sampling.enable_thinking,
            "served_model": s.served_model, "model_revision": self.model_revision,
            "reasoning_parser": s.reasoning_parser,
            "think_marker_leak": any(m in (result.content or "") for m in THINK_MARKERS),
            "empty_content": not (result.content or "").strip() and not result.tool_calls,
            "assistant_turns": json.dumps(turns, ensure_ascii=False),
            # Cut where the trainer stops reading (Param budget train_length): kept as training text, not a failure.
            "truncated_at_train_length": at_train_length,
        }


# ------------------------------------------------------------------------------------------------ a shard
def _shard_failed(shard: int, server: Server, error: BaseException, fleet_dir: Path, api_key: str, kept: int,
                  total: int, status: shard_status.ShardStatus | None) -> ShardFailed:
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
    status: Path | None = None  # status/shard-XXXXX.json (shard_status)

    @classmethod
    def of(cls, run_dir: Path, shard: int, prompts: Path) -> ShardPaths:
        name = f"shard-{shard:05d}"
        return cls(shard, prompts, run_dir / "completions" / name, run_dir / "failures" / name,
                   run_dir / "completions" / f"{name}.parquet", run_dir / "failures" / f"{name}.parquet",
                   shard_status.status_path(run_dir, shard))


def _server_facts(server: Server, api_key: str) -> tuple[int, str | None, int]:
    """(effective running-request slots, weight version, context length) of the leased server."""
    api = sglang.Api(server.url, api_key)
    try:
        slots = api.allocation().running_slots
        model = api.model_info()
        context = api.context_length()
    except NotRetryable:
        raise
    except (DflashError, ValueError) as exc:
        raise ServerUnhealthy(f"{server.name} did not report its slots and context length ({exc})") from exc
    return slots, model.get("weight_version"), context


def _too_long(rows: list[dict], server: Server, context: int, max_tokens: int) -> dict[str, str]:
    """sample_id -> why, for prompts that cannot fit the server's own context length with max_tokens. Planning
    checked Param context_length; the server may have been launched with less (`--context-length`)."""
    budget = context - max_tokens
    if budget <= 0:
        raise ConfigError(f"{server.name} has a context length of {context:,} tokens, no room for Param max_tokens="
                          f"{max_tokens:,}: lower max_tokens, or relaunch with a larger --context-length")
    counter, found = TokenCounter(), {}  # planning's own count (the tokenizer loads only if a prompt is long)
    for row in rows:
        size = len(row["messages"].encode()) + len((row["tools"] or "").encode())  # a token is at least a byte
        if size + 64 < budget:
            continue
        tokens = row.get("prompt_tokens") or counter.count(Prompt(
            row["sample_id"], json.loads(row["messages"]), json.loads(row["tools"]) if row["tools"] else None, "", 0))
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


def generate_shard(paths: ShardPaths, lease: Lease, api_key: str, settings: GenerationSettings, *,
                   fleet_dir: Path, run_prompts: int | None = None, servers_sharing: int = 1,
                   expected_rps: float | None = None) -> dict:
    """Complete the shard on the leased server; returns counts for XCom.

    `expected_rps` (completions per second on one server, from the capacity plan) drives the ETA until the
    shard's own rate means something.
    """
    started = time.monotonic()
    if paths.output.is_file() and paths.failures_output.is_file():
        done = pq.read_metadata(paths.output).num_rows
        failed = pq.read_metadata(paths.failures_output).num_rows
        log.info("shard %d already complete: %d completions, %d quarantined", paths.shard, done, failed)
        _check_refused_share(paths, done + failed, failed, settings.max_error_share)
        return {"shard": paths.shard, "completed": done, "quarantined": failed, "generated_now": 0,
                "path": str(paths.output), "server": None}
    table = pq.read_table(paths.prompts, columns=["sample_id", "messages", "tools", "prompt_tokens"])
    done_ids = read_done(paths.parts, paths.output)
    failed_ids = read_done(paths.failures, paths.failures_output)
    todo = [{**row, "shard": paths.shard} for row in table.to_pylist()
            if row["sample_id"] not in done_ids and row["sample_id"] not in failed_ids]
    server = lease.server
    status = shard_status.ShardStatus(paths.status, paths.shard, table.num_rows, server.name, len(done_ids),
                                      len(failed_ids)) if paths.status else None
    try:
        slots, revision, context = _server_facts(server, api_key)
    except ServerUnhealthy as exc:
        raise _shard_failed(paths.shard, server, exc, fleet_dir, api_key, len(done_ids) + len(failed_ids),
                            table.num_rows, status) from None
    if settings.train_budget:  # each request's max_tokens needs its prompt's tokens (planning counts them: a
        # shard planned without the budget has only the long ones counted)
        counter = TokenCounter()
        for row in todo:
            if row.get("prompt_tokens") is None:
                row["prompt_tokens"] = counter.count(Prompt(row["sample_id"], json.loads(row["messages"]),
                                                            json.loads(row["tools"]) if row["tools"] else None, "", 0))
    too_long = _too_long(todo, server, context, settings.sampling.max_tokens)
    todo = [row for row in todo if row["sample_id"] not in too_long]
    in_flight = settings.in_flight or slots
    log.info("shard %d on %s: %d prompts, %d done before, %d quarantined before, %d to send, %d in flight",
             paths.shard, server.name, table.num_rows, len(done_ids), len(failed_ids), len(todo), in_flight)
    gen = Generator(server, api_key, settings, in_flight, revision, fleet_dir)
    pending_rows: list[dict] = []
    pending_failures: list[dict] = []
    stats = {"completed": 0, "output_tokens": 0, "reasoning_tokens": 0, "quarantined": 0}
    pending_failures.extend({"location": sid, "stage": "generate", "reason": "too_long", "detail": why,
                             "sample_id": sid} for sid, why in too_long.items())
    last_flush = last_log = time.monotonic()

    def flush() -> None:
        nonlocal last_flush
        write_part(paths.parts, pending_rows, COMPLETION_SCHEMA)
        write_part(paths.failures, pending_failures, QUARANTINE_SCHEMA)
        pending_rows.clear()
        pending_failures.clear()
        last_flush = time.monotonic()
        if status:  # the heartbeat the Fleet page counts in-flight progress from
            status.update(len(done_ids) + stats["completed"], len(failed_ids) + stats["quarantined"],
                          stats["output_tokens"])

    def progress() -> None:
        elapsed = time.monotonic() - started
        rate, source = stats["completed"] / elapsed if elapsed else 0.0, "measured"
        # Until two batches have finished, the shard's own completion rate is mostly the batch still filling.
        if expected_rps and stats["completed"] < 2 * in_flight:
            rate, source = expected_rps, "calibrated"
        left = len(todo) - stats["completed"] - stats["quarantined"]
        eta = left / rate if rate else float("inf")
        run_eta = ""
        if run_prompts and rate:
            hours = run_prompts / (rate * max(servers_sharing, 1)) / 3600
            run_eta = f"; whole run ~{hours:.1f} h if {servers_sharing} servers keep this rate"
        log.info("shard %d: %d/%d done, %.0f output tok/s (%d reasoning / %d content tokens), ETA %.0f s "
                 "(%s rate)%s", paths.shard, len(done_ids) + stats["completed"], table.num_rows,
                 stats["output_tokens"] / elapsed, stats["reasoning_tokens"],
                 stats["output_tokens"] - stats["reasoning_tokens"], eta, source, run_eta)

    error: BaseException | None = None
    with ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix=f"shard{paths.shard}") as pool:
        futures: dict[Future, dict] = {pool.submit(gen.generate, row): row for row in todo}
        not_done = set(futures)
        try:
            while not_done:
                finished, not_done = wait(not_done, timeout=1.0, return_when=FIRST_COMPLETED)
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
                        if error is None or isinstance(error, _Stopped):  # keep the cause, not its echoes
                            error = exc
                        gen.stop.set()
                        continue
                    pending_rows.append(result)
                    stats["completed"] += 1
                    stats["output_tokens"] += result["completion_tokens"] or 0
                    stats["reasoning_tokens"] += result["reasoning_tokens"] or 0
                now = time.monotonic()
                if len(pending_rows) + len(pending_failures) >= settings.checkpoint_every or \
                        (now - last_flush >= settings.checkpoint_s and (pending_rows or pending_failures)):
                    flush()
                if now - last_log >= settings.progress_s:
                    last_log = now
                    progress()
                if error is not None:
                    for fut in not_done:
                        fut.cancel()
        finally:
            flush()  # keep every finished result, whatever happens next
    if isinstance(error, AuthError):
        if status:
            status.finish("failed", error)
        raise error
    if error is not None:
        kept = len(done_ids) + len(failed_ids) + stats["completed"] + stats["quarantined"]
        # from None: the message carries the cause; a chain of requests/urllib3 errors would bury it.
        raise _shard_failed(paths.shard, server, error, fleet_dir, api_key, kept, table.num_rows, status) from None
    progress()
    completed = merge_parts(paths.parts, paths.output, COMPLETION_SCHEMA)
    quarantined = merge_parts(paths.failures, paths.failures_output, QUARANTINE_SCHEMA)
    if status:
        status.finish("done")
    log.info("shard %d complete on %s: %d completions, %d quarantined, %.1f s", paths.shard, server.name,
             completed, quarantined, time.monotonic() - started)
    _check_refused_share(paths, completed + quarantined, quarantined, settings.max_error_share)
    return {"shard": paths.shard, "completed": completed, "quarantined": quarantined,
            "generated_now": stats["completed"], "output_tokens": stats["output_tokens"],
            "path": str(paths.output), "server": server.name, "seconds": round(time.monotonic() - started, 2)}
