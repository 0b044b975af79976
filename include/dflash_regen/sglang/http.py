"""The transport under `sglang.api.Api`: the client, the chat payload, SSE streaming and how errors are sorted.

Private to `sglang/api.py`, which re-exports what callers use (tests/architecture/test_import_graph.py keeps
every other module from importing this one); it is apart only to keep each file to one concept (what SGLang
versions say, vs how one request travels).

Streaming: thinking answers can run to 32K tokens (~20 minutes), so a total timeout is the wrong guard:
the response is streamed (SSE) and *silence* is the failure — httpx's read timeout applies to each socket
read, so `httpx.ReadTimeout` means no byte arrived for `stall_s` — with a generous overall cap on top. Errors
are sorted here: `TransientError` (connection refused or reset, 5xx, stall, an error event mid-stream) is worth
retrying; `PromptError` (4xx) is the prompt's fault and goes to quarantine with the server's message;
`AuthError` (401/403) is the configuration's fault (the API key) and fails at once.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import httpx

from dflash_regen.errors import (
    AuthError,
    Cancelled,
    PromptError,
    ServerError,
    TransientError,
)

log = logging.getLogger("dflash_regen.sglang")  # the name operators' log filters know
T = TypeVar("T")
CONNECT_TIMEOUT_S = 10.0


def _auth_error(base_url: str, resp: httpx.Response) -> AuthError:
    return AuthError(f"{base_url} refused the API key with HTTP {resp.status_code} ({_error_message(resp)}): the key "
                     "sent is not the server's --api-key. Relaunch the fleet (clear launch_fleet) so servers and "
                     "clients share one key, or set the secret DFLASH_SGLANG_API_KEY to the key the servers were "
                     "started with")


@dataclass
class ChatResult:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    latency_s: float = 0.0
    first_token_s: float | None = None
    # The server's own token ids, where the version returns them (`Dialect.token_ids_request`); else None.
    prompt_ids: list[int] | None = None
    output_ids: list[int] | None = None


def token_ids(body: dict) -> tuple[list[int] | None, list[int] | None]:
    """(prompt ids, output ids of the first choice) of a chat completion body or stream chunk, in every version's
    form: `sglext.input_ids`/`sglext.output_ids[0]` (0.5.20+), `choices[0].prompt_token_ids` (0.5.13+) and
    `choices[0].response_token_ids` (0.5.18+) or `.token_ids` (0.5.17); None for what the body lacks."""
    ext = body.get("sglext") or {}
    prompt, output = ext.get("input_ids"), (ext.get("output_ids") or [None])[0]
    for choice in (body.get("choices") or ())[:1]:
        prompt = prompt if prompt is not None else choice.get("prompt_token_ids")
        if output is None:
            output = choice.get("response_token_ids", choice.get("token_ids"))
    return (list(prompt) if prompt is not None else None), (list(output) if output is not None else None)


def auth_headers(api_key: str) -> dict[str, str]:
    """SGLang's `--api-key` check: `Authorization: Bearer <key>` on every endpoint but /health, /metrics."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def with_retries(call: Callable[[], T], attempts: int, *, delay_s: float = 1.0, max_delay_s: float = 30.0,
                 on_failure: Callable[[TransientError, int], None] | None = None, name: str = "",
                 level: int = logging.INFO, rng: random.Random | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """The one retry policy (the smoke gate, calibration and every sample's request): a `TransientError` is
    retried, `attempts` tries in all; anything else propagates (a `PromptError` is the prompt's fault; sending it
    again cannot help). Before retry n (1, 2, ...) it waits `backoff_s(n, ...)`: full jitter on a backoff doubling
    from `delay_s` up to `max_delay_s`, so the workers that met one server's fault at once do not retry in step.
    `on_failure(error, attempt)` sees each transient failure first and may raise instead (a server found dead ends
    the retries); the last failure is raised. `name` and `level`: how a retry is logged; `rng` and `sleep`: the
    random source and the wait (tests pass their own)."""
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except TransientError as exc:
            if on_failure is not None:
                on_failure(exc, attempt)
            if attempt == attempts:
                raise
            wait_s = backoff_s(attempt, delay_s, max_delay_s, rng)
            log.log(level, "%sattempt %d of %d failed (%s); retrying in %.1f s", f"{name}: " if name else "",
                    attempt, attempts, exc, wait_s)
            sleep(wait_s)
    raise AssertionError("attempts must be >= 1")


def backoff_s(retry: int, delay_s: float, max_delay_s: float, rng: random.Random | None = None) -> float:
    """The wait before retry `retry` (1, 2, ...): uniform in [0, min(max_delay_s, delay_s * 2**(retry - 1))]
    ("full jitter"), never longer than the plain doubling backoff."""
    return (rng or random).uniform(0.0, min(max_delay_s, delay_s * 2 ** (retry - 1)))


# Sent when set on the settings object (None = the server's default).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty")


def chat_payload(messages: list[dict], tools: list[dict] | None, sampling, *, model: str, max_tokens: int,
                 seed: int | None, extra: dict | None = None) -> dict:
    """The chat request, with the sampling settings from one place: `sampling` is the run's settings object
    (temperature, top_p, enable_thinking; a field added to it goes in `SAMPLING_FIELDS`)."""
    payload = {"model": model, "messages": messages, "max_tokens": max_tokens,
               **{name: getattr(sampling, name) for name in SAMPLING_FIELDS if getattr(sampling, name, None)
                  is not None},
               "chat_template_kwargs": {"enable_thinking": sampling.enable_thinking}}
    if seed is not None:
        payload["seed"] = seed
    if tools:
        payload["tools"] = tools
    return {**payload, **(extra or {})}  # e.g. the version's token-id fields (`Dialect.token_ids_request`)


def make_client(pool_size: int) -> httpx.Client:
    """One client per server and task: its pool must be as large as the in-flight count, or requests queue
    silently (a request waits for a free connection without limit, as the timeouts below leave `pool` unset)."""
    return httpx.Client(limits=httpx.Limits(max_connections=pool_size, max_keepalive_connections=pool_size),
                        verify=_tls_context())


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One per process: building it is most of what a new client costs (the `Api` of a 1-token probe included)."""
    return ssl.create_default_context()


def timeout(total_s: float) -> httpx.Timeout:
    """A plain call's timeout: `total_s` to connect and for each read and write; no limit on waiting for the pool."""
    return httpx.Timeout(total_s, pool=None)


def _error_text(body) -> str:
    """The message of an SGLang error body: flat `{"message": ...}`, `{"error": {...}}` or `{"error": "..."}`."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:500]
        return str(body.get("message") or err)[:500]
    return str(body)[:300]


def _error_message(resp: httpx.Response) -> str:
    try:
        resp.read()  # a streamed answer's body is read only when asked for
        return _error_text(resp.json())
    except ValueError:
        return resp.text[:300]
    except httpx.HTTPError as exc:
        return f"(its body could not be read: {type(exc).__name__}: {exc})"


def _merge_tool_call(calls: list[dict], delta: dict) -> None:
    index = delta.get("index", len(calls))
    while len(calls) <= index:
        calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    call = calls[index]
    if delta.get("id"):
        call["id"] = delta["id"]
    fn = delta.get("function") or {}
    if fn.get("name"):
        call["function"]["name"] += fn["name"]
    if fn.get("arguments"):
        call["function"]["arguments"] += fn["arguments"]


def sse_data(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The `data:` payloads of a server-sent-event byte stream, one per line, whatever the read boundaries.

    Comments (`:` keep-alives), blank lines and other fields are skipped. A last line the stream ends without a
    newline is still yielded, so a body cut inside an event shows up as unparsable JSON, not as silence.
    SGLang writes each event as one `data:` line, so a multi-line event (allowed by SSE) is not joined.
    """
    rest = b""
    for chunk in chunks:
        lines = (rest + chunk).split(b"\n") if rest else chunk.split(b"\n")
        rest = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if rest.startswith(b"data:"):
        yield rest[5:].strip()


class _Assembly:
    """A streamed answer put together from its deltas (lists joined once: `+=` on an attribute copies each time)."""

    def __init__(self, started: float):
        self.started = started
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.result = ChatResult()

    def add(self, chunk: dict) -> None:
        if chunk.get("usage"):
            self.result.usage = chunk["usage"]
        if chunk.get("sglext"):
            prompt, output = token_ids(chunk)
            self.result.prompt_ids = prompt if prompt is not None else self.result.prompt_ids
            self.result.output_ids = output if output is not None else self.result.output_ids
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            piece = delta.get("reasoning_content") or delta.get("reasoning")
            if piece:
                self.reasoning.append(piece)
            if content := delta.get("content"):
                self.content.append(content)
            for call in delta.get("tool_calls") or ():
                _merge_tool_call(self.result.tool_calls, call)
            if (piece or content) and self.result.first_token_s is None:
                self.result.first_token_s = time.monotonic() - self.started
            if choice.get("finish_reason"):
                self.result.finish_reason = choice["finish_reason"]

    def finish(self) -> ChatResult:
        self.result.reasoning, self.result.content = "".join(self.reasoning), "".join(self.content)
        self.result.latency_s = time.monotonic() - self.started
        return self.result


def stream_chat(client: httpx.Client, base_url: str, api_key: str, payload: dict, *, stall_s: float,
                cap_s: float, stop: threading.Event | None = None) -> ChatResult:
    body = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    started = time.monotonic()
    answer = _Assembly(started)
    # `read`: the longest silence between two bytes of the answer (the stall); the overall cap is `_checked`'s.
    limits = httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=stall_s, write=stall_s, pool=None)
    request = client.build_request("POST", f"{base_url}/v1/chat/completions", json=body, timeout=limits,
                                   headers=auth_headers(api_key))
    try:
        resp = client.send(request, stream=True)
    except httpx.HTTPError as exc:  # refused, reset, or no answer's headers within `stall_s`
        raise TransientError(f"{type(exc).__name__} connecting to {base_url}: {exc}") from exc
    try:
        _check_status(resp, base_url)
        done = False
        try:
            for data in sse_data(_checked(resp.iter_bytes(), started, cap_s, stop)):
                # Read on past `[DONE]` to the body's end: only a fully read response goes back to the pool.
                if done or data == b"[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    raise TransientError(f"server aborted the stream: {_error_text(chunk)}")
                answer.add(chunk)
        except httpx.ReadTimeout as exc:
            raise TransientError(f"stream stalled after {time.monotonic() - started:.0f} s "
                                 f"(no data for {stall_s:.0f} s?): {exc}") from exc
        except (httpx.HTTPError, httpx.StreamError, json.JSONDecodeError) as exc:
            raise TransientError(f"broken stream from {base_url}: {type(exc).__name__}: {exc}") from exc
    finally:
        resp.close()
    if answer.result.finish_reason is None:
        raise TransientError("stream ended without a finish_reason")
    return answer.finish()


def _check_status(resp: httpx.Response, base_url: str) -> None:
    """Sort a streamed answer's error status: 429 and 5xx are transient, 401/403 the key's, other 4xx the prompt's."""
    if resp.status_code == 429:
        raise TransientError(f"HTTP {resp.status_code} from {base_url}: {_error_message(resp)}")
    if resp.status_code >= 500:
        raise ServerError(resp.status_code, _error_message(resp), base_url)
    if resp.status_code in (401, 403):
        raise _auth_error(base_url, resp)
    if resp.status_code >= 400:
        raise PromptError(resp.status_code, _error_message(resp))


def _checked(chunks: Iterable[bytes], started: float, cap_s: float, stop: threading.Event | None
             ) -> Iterator[bytes]:
    """`chunks`, with the overall cap and the caller's stop event checked before each one is used."""
    for chunk in chunks:
        if time.monotonic() - started > cap_s:
            raise TransientError(f"request exceeded the overall cap of {cap_s:.0f} s")
        if stop is not None and stop.is_set():
            raise Cancelled(f"stopped by the caller after {time.monotonic() - started:.1f} s")
        yield chunk


def reasoning_tokens(usage: dict) -> int:
    """Top-level `usage.reasoning_tokens` (every version), else `completion_tokens_details` (0.5.23+)."""
    if usage.get("reasoning_tokens") is not None:
        return int(usage["reasoning_tokens"])
    return int((usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)


def read_json(resp: httpx.Response, what: str) -> dict:
    if resp.status_code >= 500 or resp.status_code == 429:
        raise TransientError(f"{what} answered HTTP {resp.status_code}: {_error_message(resp)}")
    if resp.status_code in (401, 403):
        raise _auth_error(what, resp)
    if resp.status_code >= 400:
        raise PromptError(resp.status_code, f"{what}: {_error_message(resp)}")
    try:
        return resp.json()
    except ValueError as exc:
        raise TransientError(f"{what} answered non-JSON: {resp.text[:200]!r}") from exc
