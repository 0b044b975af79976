"""One sample's requests on one server: the payload and per-sample seed (calibration sends the same), retries with
backoff, and a second server's opinion when every retry of one prompt meets a 5xx (whose fault is it?).

The `Generator` is shared by a shard's worker threads (`generate/shard.py`); a server that stops answering sets its
`stop` event, so the other workers end with `Stopped`, the echo of that cause.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from dflash_regen.errors import PromptError, ServerError, ServerUnhealthy, TransientError
from dflash_regen.fleet.servers import Server, healthy_servers, is_alive, load_servers
from dflash_regen.prompts.formats import prompt_digest
from dflash_regen.settings.run_config import GenerationSettings, sample_seed
from dflash_regen.sglang import api
from dflash_regen.sglang.api import Api, ChatResult, Dialect

log = logging.getLogger(__name__)

THINK_MARKERS = ("<think>", "</think>")
# A cut answer is closed by the chat template (`</think>`, `\n\n`, `<|im_end|>`, `\n`): leave it room within the
# training length, so a sample cut by Param budget train_length still fits train_max_length once tokenized.
TRAIN_BUDGET_RESERVE = 8


class Stopped(ServerUnhealthy):
    """Raised in the other workers once one of them found the server dead: not the cause, only its echo."""


def chat_payload(messages: list[dict], tools: list[dict] | None, settings: GenerationSettings, seed: int,
                 max_tokens: int, dialect: Dialect | None = None) -> dict:
    """`dialect`: the serving version, asked for the prompt's and the output's token ids where it streams them."""
    return api.chat_payload(messages, tools, settings.sampling, model=settings.served_model_name,
                            max_tokens=max_tokens, seed=seed,
                            extra=dialect.token_ids_request(stream=True) if dialect else None)


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
                 model_revision: str | None, fleet_dir: Path | None = None, dialect: Dialect | None = None):
        self.server, self.api_key, self.settings, self.fleet_dir = server, api_key, settings, fleet_dir
        self.dialect = dialect
        self.model_revision = model_revision
        self.api = Api(server.url, api_key, pool_size=in_flight)
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._consecutive_failures = 0
        self.failure_limit = max(2 * in_flight, 8)

    def _request(self, payload: dict) -> tuple[ChatResult, int, str]:
        """(result, attempts, name of the server that answered), by the one retry policy (`api.with_retries`)."""
        attempts = 0

        def send() -> ChatResult:
            nonlocal attempts
            if self.stop.is_set():
                raise Stopped("stopping: another request found the server unhealthy")
            attempts += 1
            return self.api.stream(payload, stall_s=self.settings.stall_timeout_s, cap_s=self.settings.request_cap_s)

        try:
            result = api.with_retries(send, self.settings.request_retries + 1, on_failure=self._judge_server,
                                      name=self.server.name, level=logging.WARNING)
        except ServerError as exc:  # every try met a 5xx
            result, served_by = self._second_opinion(payload, exc)
            return result, attempts + 1, served_by
        with self._lock:
            self._consecutive_failures = 0
        return result, attempts, self.server.name

    def _judge_server(self, exc: TransientError, attempt: int) -> None:
        """A request failed: is its server still alive? Liveness is judged by the server, not by how often prompts
        fail: a probe without an answer marks it unhealthy, and so does one without a 200 after many failures in a
        row. A cluster of poison prompts (every slot failing, each retry again) leaves it healthy while the probe
        gets its 200."""
        with self._lock:
            self._consecutive_failures += 1
            failing = self._consecutive_failures
        status = self._probe(self.server)
        if status is None or (failing >= self.failure_limit and status != 200):
            self.stop.set()
            raise ServerUnhealthy(f"{self.server.name} stopped answering ({failing} failures in a row, a 1-token "
                                  f"probe got {status or 'no answer'}; last: {exc})") from exc

    def _probe(self, server: Server) -> int | None:
        """HTTP status of a real 1-token generation (None: no answer). `/health` can answer while the
        scheduler is wedged (sglang#6624)."""
        if not is_alive(server):
            return None
        return Api(server.url, self.api_key).probe(self.settings.served_model_name,
                                                          timeout_s=min(30.0, self.settings.stall_timeout_s))

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
        with Api(other.url, self.api_key, pool_size=1) as second:  # not the shard's pool, sized for the leased server
            try:
                result = second.stream(payload, stall_s=self.settings.stall_timeout_s,
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
                    result, _, _ = self._request(chat_payload(history, tools, s, seed, s.sampling.max_tokens,
                                                                  self.dialect))
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
        result, attempt, served_by = self._request(chat_payload(targets, tools, s, seed, max_tokens, self.dialect))
        at_train_length = result.finish_reason == "length" and max_tokens < s.sampling.max_tokens
        if s.retry_truncated and not at_train_length and (result.finish_reason == "length"
                                                          or not (result.content or result.tool_calls)):
            max_tokens = 2 * s.sampling.max_tokens
            result, extra, served_by = self._request(chat_payload(targets, tools, s, seed, max_tokens, self.dialect))
            attempt += extra
        turns.append(_turn(result))
        usage = result.usage or {}
        return {
            "sample_id": sample["sample_id"], "shard": sample["shard"], "server": served_by,
            "reasoning_content": result.reasoning or None, "content": result.content or None,
            "tool_calls": json.dumps(result.tool_calls) if result.tool_calls else None,
            "finish_reason": result.finish_reason, "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"), "reasoning_tokens": api.reasoning_tokens(usage),
            "latency_s": result.latency_s, "finished_at": time.time(), "attempt": attempt, "max_tokens": max_tokens,
            "temperature": s.sampling.temperature, "top_p": s.sampling.top_p, "top_k": s.sampling.top_k,
            "min_p": s.sampling.min_p, "presence_penalty": s.sampling.presence_penalty, "seed": seed,
            "enable_thinking": s.sampling.enable_thinking,
            "served_model": s.served_model_name, "model_revision": self.model_revision,
            "reasoning_parser": s.reasoning_parser,
            "think_marker_leak": any(m in (result.content or "") for m in THINK_MARKERS),
            "empty_content": not (result.content or "").strip() and not result.tool_calls,
            "assistant_turns": json.dumps(turns, ensure_ascii=False),
            # Cut where the trainer stops reading (Param budget train_length): kept as training text, not a failure.
            "truncated_at_train_length": at_train_length,
            "source_run": s.run, "prompt_digest": prompt_digest(sample["messages"], sample["tools"]),
            "server_prompt_ids": result.prompt_ids, "server_output_ids": result.output_ids,
        }
