"""The one owner of the SGLang boundary: versions, launch argv, and every HTTP call the pipeline makes.

- **Versions.** SGLang 0.5.10 (the first with Qwen3.6) to 0.5.23 (the newest on PyPI when this was
  written) are supported and checked in CI against SGLang's own code (`tests/contract/`). `Dialect` holds
  what differs between them: flag names, environment variables still read, log lines, metric labels,
  response fields. A newer version gets a warning and is tried; known-bad combinations are refused.
- **Calls.** `Api` holds the session with the API key (the only place that writes `Bearer`), one retry
  policy (`with_retries`) and the calls: health, server info and allocation (from `internal_states[0]`
  and the startup log: top-level `/server_info` fields echo the CLI, so `max_mamba_cache_size` is null
  unless passed), metrics (summed over label sets, `sglang:` and `sglang_` names), the chat payload,
  chat (streaming and not), the 1-token liveness probe and the version.

Streaming: thinking answers can run to 32K tokens (~20 minutes), so a total timeout is the wrong guard:
the response is streamed (SSE) and *silence* is the failure — `requests`' read timeout applies to each
socket read, so it fires when no byte arrived for `stall_s` — with a generous overall cap on top. Errors
are sorted here: `TransientError` (connection reset, 5xx, stall, an error event mid-stream) is worth
retrying; `PromptError` (4xx) is the prompt's fault and goes to quarantine with the server's message;
`AuthError` (401/403) is the configuration's fault (the API key) and fails at once.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import requests
from requests.adapters import HTTPAdapter

from dflash_regen.errors import (
    AuthError,
    Cancelled,
    MetricsMissing,
    PromptError,
    ServerError,
    TransientError,
    VersionRefused,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

OLDEST = "0.5.10"  # the first SGLang that runs Qwen3.6 (SGLang's Qwen3.6 cookbook)
NEWEST_CHECKED = "0.5.23"  # the newest on PyPI when the contract tests were last extended
RECOMMENDED = "0.5.16"  # scripts/build-sglang-venv.sh's default: SGLang's Qwen3.6 cookbook benchmarks ran on it
KNOWN_BAD_MTP_HYBRID = ("0.5.13", "0.5.14")  # spec v2 + extra_buffer crash on Qwen3.5/3.6 (sglang#28484, #29516)


def parse_version(text: str) -> tuple[int, ...]:
    """'0.5.10.post1' -> (0, 5, 10); anything unparsable -> ()."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return tuple(int(g) for g in m.groups() if g is not None) if m else ()


@dataclass(frozen=True)
class Dialect:
    """What one SGLang version calls things. Thresholds are the first release seen with the change among
    the wheels read (0.5.10, .12, .13, .14, .16, .18, .20, .21, .22, .23); readers accept every form anyway."""

    version: str

    def at_least(self, other: str) -> bool:
        return parse_version(self.version) >= parse_version(other)

    @property
    def mamba_strategy_flag(self) -> str:
        # 0.5.14 renamed it (old name a deprecated alias until 0.5.20, then gone)
        return "--mamba-radix-cache-strategy" if self.at_least("0.5.14") else "--mamba-scheduler-strategy"

    @property
    def reads_spec_v2_env(self) -> bool:
        # 0.5.14: "SGLANG_ENABLE_SPEC_V2 has been removed: speculative decoding always runs the V2 worker"
        return not self.at_least("0.5.14")

    @property
    def has_cuda_graph_max_bs(self) -> bool:
        return not self.at_least("0.5.20")  # renamed --cuda-graph-max-bs-decode in 0.5.14, alias gone by 0.5.20

    @property
    def is_newer_than_checked(self) -> bool:
        return parse_version(self.version) > parse_version(NEWEST_CHECKED)

    def launch_flags(self, flags: list[str]) -> list[str]:
        """The pipeline's flags (written in 0.5.10's names) in this version's names."""
        renamed = {"--mamba-scheduler-strategy": self.mamba_strategy_flag,
                   "--mamba-radix-cache-strategy": self.mamba_strategy_flag}
        out = []
        for token in flags:
            name, eq, value = token.partition("=")
            out.append(renamed.get(name, name) + eq + value)
        if not self.has_cuda_graph_max_bs:
            out = [t.replace("--cuda-graph-max-bs", "--cuda-graph-max-bs-decode", 1)
                   if t.partition("=")[0] == "--cuda-graph-max-bs" else t for t in out]
        return out

    def launch_env(self, env: dict[str, str]) -> dict[str, str]:
        """Environment for this version: variables it no longer reads are not set (SGLang warns on them)."""
        return {k: v for k, v in env.items() if k != "SGLANG_ENABLE_SPEC_V2" or self.reads_spec_v2_env}

    def refuse(self, flags: list[str], hybrid: bool = True) -> None:
        """Raise `VersionRefused` for a known-bad combination; warn for a version newer than checked."""
        speculative = "--speculative-algorithm" in [t.partition("=")[0] for t in flags]
        base = ".".join(str(p) for p in parse_version(self.version)[:3])
        if speculative and hybrid and base in KNOWN_BAD_MTP_HYBRID:
            raise VersionRefused(
                f"SGLang {self.version} crashes with MTP (speculative decoding + extra_buffer) on hybrid models "
                "such as Qwen3.6-27B (sglang#28484, #29516; fixed by #29449 in 0.5.15). Rebuild the server venv "
                f"with SGLANG_VERSION={RECOMMENDED} scripts/build-sglang-venv.sh, or launch without MTP "
                "(server_flags '--speculative-algorithm off').")
        if not parse_version(self.version):
            raise VersionRefused(f"cannot read the SGLang version {self.version!r}; is the server command SGLang?")
        if parse_version(self.version) < parse_version(OLDEST):
            raise VersionRefused(f"SGLang {self.version} is older than {OLDEST}, the first that runs Qwen3.6; "
                                 f"rebuild the venv with SGLANG_VERSION={RECOMMENDED} scripts/build-sglang-venv.sh")
        if self.is_newer_than_checked:
            log.warning("SGLang %s is newer than %s, the newest version checked against this pipeline; trying "
                        "it (flags and fields as %s)", self.version, NEWEST_CHECKED, NEWEST_CHECKED)


# ------------------------------------------------------------------------------------------ log lines
# Forms of every supported version: 0.5.13+ puts "dtype: ..., " before #tokens; a TP/DP prefix may precede.
KV_LINE = re.compile(r"KV Cache is allocated\. (?:dtype: [^,]+, )?#tokens: (\d+), "
                     r"(?:K size: ([\d.]+) GB, V size: ([\d.]+) GB|KV size: ([\d.]+) GB)")
MAMBA_LINE = re.compile(r"Mamba Cache is allocated\. max_mamba_cache_size: (\d+),")
MAMBA_SIZES = re.compile(r"Mamba Cache is allocated\. max_mamba_cache_size: \d+, conv_state size: ([\d.]+) ?GB, "
                         r"ssm_state size: ([\d.]+) ?GB(?: intermediate_ssm_state_cache size: ([\d.]+) ?GB "
                         r"intermediate_conv_window_cache size: ([\d.]+) ?GB)?")
SCHEDULER_LINE = re.compile(r"max_total_num_tokens=(\d+), chunked_prefill_size=(-?\d+), max_prefill_tokens=(\d+), "
                            r"max_running_requests=(\d+), context_len=(\d+)")
CAPPED_LINE = re.compile(r"max_running_requests is capped to (\d+) by the mamba state cache "
                         r"\(max_mamba_cache_size=(\d+), (\d+) state slots per request\)")


def parse_startup_log(text: str) -> dict:
    """Allocation figures from SGLang's startup lines (first KV line is the target model's pool)."""
    found: dict = {}
    if m := KV_LINE.search(text):
        found["kv_tokens"] = int(m.group(1))
        k, v, kv = m.group(2), m.group(3), m.group(4)
        found["kv_cache_gb"] = round(float(k) + float(v), 2) if k else float(kv)
    if m := MAMBA_LINE.search(text):
        found["mamba_slots"] = int(m.group(1))
    if m := MAMBA_SIZES.search(text):
        # Memory per Mamba slot and the speculative reserve (sized by --max-running-requests): the capacity
        # planner uses them to say how many KV tokens other Mamba settings would leave.
        found["mamba_gb"] = round(float(m.group(1)) + float(m.group(2)), 2)
        found["mamba_reserve_gb"] = round(float(m.group(3) or 0) + float(m.group(4) or 0), 2)
    if m := SCHEDULER_LINE.search(text):
        found["running_slots"] = int(m.group(4))
        found["context_len"] = int(m.group(5))
    if m := CAPPED_LINE.search(text):  # 0.5.18+ says the Mamba ratio outright
        found["mamba_ratio"] = int(m.group(3))
    return found


# ------------------------------------------------------------------------------------------- metrics
METRIC_LINE = re.compile(r"^sglang[:_]([A-Za-z0-9_]+?)(?:\{[^}]*\})? ([0-9.eE+-]+|NaN|[+-]Inf)$", re.M)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value summed over every label set}. Both `sglang:x` and `sglang_x` (a
    Prometheus that stores names with '_'); 0.5.18+ splits counters by `is_streaming`, so one series alone
    could be just the warm-up's 8 tokens."""
    totals: dict[str, float] = {}
    for name, value in METRIC_LINE.findall(text):
        totals[name] = totals.get(name, 0.0) + float(value)
    return totals


# ---------------------------------------------------------------------------------------- allocation
@dataclass
class Allocation:
    kv_tokens: int
    running_slots: int  # what the scheduler will actually run at once (Mamba-capped)
    max_running_requests: int | None  # the server-args value before the Mamba cap
    mamba_slots: int | None
    kv_cache_gb: float | None
    radix_cache: bool
    mamba_strategy: str | None

    @classmethod
    def from_server_info(cls, info: dict, log_figures: dict | None = None) -> Allocation:
        """Computed values from `internal_states[0]` (the scheduler's resolved args) and the startup log;
        never the top-level fields, which echo the command line."""
        figures = log_figures or {}
        try:
            state = info["internal_states"][0]
            memory = state.get("memory_usage") or {}
            kv_tokens = info.get("max_total_num_tokens") or memory.get("token_capacity") or figures["kv_tokens"]
            mamba = state.get("max_mamba_cache_size") or figures.get("mamba_slots")
            strategy = state.get("mamba_radix_cache_strategy") or state.get("mamba_scheduler_strategy")
            return cls(
                kv_tokens=int(kv_tokens),
                running_slots=int(state["effective_max_running_requests_per_dp"]),
                max_running_requests=state.get("max_running_requests", info.get("max_running_requests")),
                mamba_slots=int(mamba) if mamba else None,
                kv_cache_gb=memory.get("kvcache"),
                radix_cache=not state.get("disable_radix_cache", False),
                mamba_strategy=strategy,
            )
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ValueError(f"/server_info lacks allocation field {exc}; is this SGLang >= {OLDEST}?") from exc


def _auth_error(base_url: str, resp: requests.Response) -> AuthError:
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


def auth_headers(api_key: str) -> dict[str, str]:
    """SGLang's `--api-key` check: `Authorization: Bearer <key>` on every endpoint but /health, /metrics."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def with_retries(call: Callable[[], T], attempts: int, *, delay_s: float = 1.0, max_delay_s: float = 30.0) -> T:
    """The retry policy: a `TransientError` is retried with doubling delays, anything else propagates
    (a `PromptError` is the prompt's fault; sending it again cannot help)."""
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except TransientError as exc:
            if attempt == attempts:
                raise
            log.info("attempt %d of %d failed (%s); retrying in %.0f s", attempt, attempts, exc, delay_s)
            time.sleep(delay_s)
            delay_s = min(delay_s * 2, max_delay_s)
    raise AssertionError("attempts must be >= 1")


# Sent when set on the settings object (None = the server's default).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty")


def chat_payload(messages: list[dict], tools: list[dict] | None, sampling, *, model: str, max_tokens: int,
                 seed: int | None) -> dict:
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
    return payload


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
        self.started, self.reasoning, self.content = started, [], []
        self.result = ChatResult()

    def add(self, chunk: dict) -> None:
        if chunk.get("usage"):
            self.result.usage = chunk["usage"]
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


def stream_chat(session: requests.Session, base_url: str, api_key: str, payload: dict, *, stall_s: float,
                cap_s: float, stop: threading.Event | None = None) -> ChatResult:
    body = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    started = time.monotonic()
    answer = _Assembly(started)
    try:
        resp = session.post(f"{base_url}/v1/chat/completions", json=body, stream=True, timeout=(10, stall_s),
                            headers=auth_headers(api_key))
    except requests.RequestException as exc:
        raise TransientError(f"{type(exc).__name__} connecting to {base_url}: {exc}") from exc
    with resp:
        if resp.status_code == 429:
            raise TransientError(f"HTTP {resp.status_code} from {base_url}: {_error_message(resp)}")
        if resp.status_code >= 500:
            raise ServerError(resp.status_code, _error_message(resp), base_url)
        if resp.status_code in (401, 403):
            raise _auth_error(base_url, resp)
        if resp.status_code >= 400:
            raise PromptError(resp.status_code, _error_message(resp))
        done = False
        try:
            for data in sse_data(_checked(resp.iter_content(chunk_size=None), started, cap_s, stop)):
                # Read on past `[DONE]` to the body's end: only a fully read response goes back to the pool.
                if done or data == b"[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    raise TransientError(f"server aborted the stream: {_error_text(chunk)}")
                answer.add(chunk)
        except requests.exceptions.ConnectionError as exc:  # includes read timeouts while streaming
            kind = "stalled" if "timed out" in str(exc).lower() else "connection lost"
            raise TransientError(f"stream {kind} after {time.monotonic() - started:.0f} s "
                                 f"(no data for {stall_s:.0f} s?): {exc}") from exc
        except (requests.RequestException, json.JSONDecodeError) as exc:
            raise TransientError(f"broken stream from {base_url}: {type(exc).__name__}: {exc}") from exc
    if answer.result.finish_reason is None:
        raise TransientError("stream ended without a finish_reason")
    return answer.finish()


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


def read_json(resp: requests.Response, what: str) -> dict:
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


class Api:
    """One SGLang server's HTTP API, as the pipeline uses it."""

    def __init__(self, url: str, api_key: str, *, session: requests.Session | None = None, timeout_s: float = 30.0):
        self.url, self.api_key, self.timeout_s = url, api_key, timeout_s
        self.session = session or make_session(4)

    def _get(self, path: str, timeout_s: float | None = None, auth: bool = True) -> requests.Response:
        try:
            return self.session.get(f"{self.url}{path}", timeout=timeout_s or self.timeout_s,
                                    headers=auth_headers(self.api_key) if auth else {})
        except requests.RequestException as exc:
            raise TransientError(f"{self.url}{path} did not answer within {timeout_s or self.timeout_s:.0f} s "
                                 f"({type(exc).__name__})") from exc

    def health(self, timeout_s: float | None = None) -> int:
        """HTTP status of /health (a 1-token generation in SGLang: 200 means the scheduler answered)."""
        return self._get("/health", timeout_s, auth=False).status_code

    def is_ready(self, timeout_s: float = 5.0) -> bool:
        try:
            return self.health(timeout_s) == 200
        except TransientError:
            return False

    def server_info(self) -> dict:
        """`/server_info` (a round trip to the scheduler: a hang here means the scheduler is stuck)."""
        return read_json(self._get("/server_info"), f"{self.url}/server_info")

    def model_info(self) -> dict:
        return read_json(self._get("/model_info"), f"{self.url}/model_info")

    def version(self, info: dict | None = None) -> str:
        return str((info or self.server_info()).get("version") or "")

    def allocation(self, log_figures: dict | None = None, info: dict | None = None) -> Allocation:
        return Allocation.from_server_info(info or self.server_info(), log_figures)

    def metrics(self) -> dict[str, float]:
        """Every `sglang` metric, summed over its label sets; `None`-free. Raises `MetricsMissing` on 404."""
        resp = self._get("/metrics", 10, auth=False)
        if resp.status_code == 404:
            raise MetricsMissing(f"{self.url}/metrics answered 404: the server runs without --enable-metrics")
        if resp.status_code >= 400:
            raise TransientError(f"{self.url}/metrics answered HTTP {resp.status_code}")
        return parse_metrics(resp.text)

    def chat(self, payload: dict, timeout_s: float) -> tuple[dict, float]:
        """A non-streaming chat completion: (response body, seconds)."""
        started = time.monotonic()
        try:
            resp = self.session.post(f"{self.url}/v1/chat/completions", json={**payload, "stream": False},
                                     timeout=timeout_s, headers=auth_headers(self.api_key))
        except requests.RequestException as exc:
            raise TransientError(f"no answer from {self.url} within {timeout_s:.0f} s ({type(exc).__name__})") \
                from exc
        return read_json(resp, f"{self.url}/v1/chat/completions"), time.monotonic() - started

    def stream(self, payload: dict, *, stall_s: float, cap_s: float,
               stop: threading.Event | None = None) -> ChatResult:
        return stream_chat(self.session, self.url, self.api_key, payload, stall_s=stall_s, cap_s=cap_s, stop=stop)

    def context_length(self) -> int:
        """The served model's context length (`/v1/models` `max_model_len`: the server's `--context-length`)."""
        body = read_json(self._get("/v1/models"), f"{self.url}/v1/models")
        try:
            return int(body["data"][0]["max_model_len"])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise TransientError(f"{self.url}/v1/models lacks max_model_len ({exc!r})") from exc

    def probe(self, model: str, timeout_s: float) -> int | None:
        """HTTP status of a real 1-token generation (None: no answer). `/health` can answer while the
        scheduler is wedged (sglang#6624)."""
        probe = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                 "chat_template_kwargs": {"enable_thinking": False}}
        status = None
        for _ in range(2):  # one probe may meet the same transient fault as the request it checks
            try:
                status = self.session.post(f"{self.url}/v1/chat/completions", json=probe, timeout=timeout_s,
                                           headers=auth_headers(self.api_key)).status_code
            except requests.RequestException:
                continue
            if status == 200:
                break
        return status

    def answers(self, model: str, timeout_s: float) -> bool:
        """The liveness probe: any HTTP answer, even a 5xx, means the scheduler is there."""
        return self.probe(model, timeout_s) is not None
