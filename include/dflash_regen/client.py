"""A streaming chat-completions client for SGLang's OpenAI-compatible endpoint.

Thinking answers can run to 32K tokens (~20 minutes), so a total timeout is the wrong guard: the
response is streamed (SSE) and *silence* is the failure — `requests`' read timeout applies to each socket
read, so it fires when no byte arrived for `stall_s` — with a generous overall cap on top. Errors are
sorted at this boundary: `TransientError` (connection reset, 5xx, stall, an error event mid-stream) is
worth retrying; `PromptError` (4xx) is the prompt's fault and goes to quarantine with the server's message;
`AuthError` (401/403) is the configuration's fault (the API key) and fails at once.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import requests
from requests.adapters import HTTPAdapter

from dflash_regen.errors import DflashError, NotRetryable


class TransientError(DflashError):
    """The request may succeed if sent again (possibly to another server)."""


class ServerError(TransientError):
    """HTTP 5xx: usually transient, but the same answer to one prompt on two servers makes it the prompt's."""

    def __init__(self, status: int, message: str, base_url: str):
        super().__init__(f"HTTP {status} from {base_url}: {message}")
        self.status, self.message = status, message


class AuthError(NotRetryable):
    """HTTP 401/403: the server refuses our API key; no prompt and no retry can fix that."""

    @classmethod
    def of(cls, base_url: str, resp: requests.Response) -> AuthError:
        return cls(f"{base_url} refused the API key with HTTP {resp.status_code} ({_error_message(resp)}): the key "
                   "sent is not the server's --api-key. Relaunch the fleet (clear launch_fleet) so servers and "
                   "clients share one key, or set the secret DFLASH_SGLANG_API_KEY to the key the servers were "
                   "started with")


class Cancelled(DflashError):
    """The caller's stop event was set mid-stream; the connection is closed, so SGLang aborts the request."""


class PromptError(DflashError):
    """The server rejected this prompt (HTTP 4xx); sending it again will not help."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass
class ChatResult:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    latency_s: float = 0.0
    first_token_s: float | None = None


def make_session(pool_size: int) -> requests.Session:
    """One session per task; its pool must be as large as the in-flight count, or requests queue silently."""
    session = requests.Session()
    adapter = HTTPAdapter(pool_connections=1, pool_maxsize=pool_size, pool_block=True, max_retries=0)
    session.mount("http://", adapter)
    return session


def _error_text(body) -> str:
    """The message of an SGLang error body: flat `{"message": ...}`, `{"error": {...}}` or `{"error": "..."}`."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:500]
        return str(body.get("message") or err)[:500]
    return str(body)[:300]


def _error_message(resp: requests.Response) -> str:
    try:
        return _error_text(resp.json())
    except ValueError:
        return resp.text[:300]


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


def stream_chat(session: requests.Session, base_url: str, api_key: str, payload: dict, *, stall_s: float,
                cap_s: float, stop: threading.Event | None = None) -> ChatResult:
    body = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    started = time.monotonic()
    result = ChatResult()
    try:
        resp = session.post(f"{base_url}/v1/chat/completions", json=body, stream=True, timeout=(10, stall_s),
                            headers={"Authorization": f"Bearer {api_key}"})
    except requests.RequestException as exc:
        raise TransientError(f"{type(exc).__name__} connecting to {base_url}: {exc}") from exc
    with resp:
        if resp.status_code == 429:
            raise TransientError(f"HTTP {resp.status_code} from {base_url}: {_error_message(resp)}")
        if resp.status_code >= 500:
            raise ServerError(resp.status_code, _error_message(resp), base_url)
        if resp.status_code in (401, 403):
            raise AuthError.of(base_url, resp)
        if resp.status_code >= 400:
            raise PromptError(resp.status_code, _error_message(resp))
        try:
            for line in resp.iter_lines(chunk_size=None):
                if time.monotonic() - started > cap_s:
                    raise TransientError(f"request exceeded the overall cap of {cap_s:.0f} s")
                if stop is not None and stop.is_set():
                    raise Cancelled(f"stopped by the caller after {time.monotonic() - started:.1f} s")
                if not line or not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise TransientError(f"server aborted the stream: {_error_text(chunk)}")
                if chunk.get("usage"):
                    result.usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    piece = delta.get("reasoning_content") or delta.get("reasoning")
                    if piece:
                        result.reasoning += piece
                    if delta.get("content"):
                        result.content += delta["content"]
                    for call in delta.get("tool_calls") or []:
                        _merge_tool_call(result.tool_calls, call)
                    if (piece or delta.get("content")) and result.first_token_s is None:
                        result.first_token_s = time.monotonic() - started
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
        except requests.exceptions.ConnectionError as exc:  # includes read timeouts while streaming
            kind = "stalled" if "timed out" in str(exc).lower() else "connection lost"
            raise TransientError(f"stream {kind} after {time.monotonic() - started:.0f} s "
                                 f"(no data for {stall_s:.0f} s?): {exc}") from exc
        except (requests.RequestException, json.JSONDecodeError) as exc:
            raise TransientError(f"broken stream from {base_url}: {type(exc).__name__}: {exc}") from exc
    if result.finish_reason is None:
        raise TransientError("stream ended without a finish_reason")
    result.latency_s = time.monotonic() - started
    return result
