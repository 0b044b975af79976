"""The one owner of the SGLang boundary: versions, launch argv, and every HTTP call the pipeline makes.

- **Versions.** SGLang 0.5.10 (the first with Qwen3.6) to 0.5.23 (the newest on PyPI when this was
  written) are supported and checked in CI against SGLang's own code (`tests/contract/`). `Dialect` holds
  what differs between them: flag names, environment variables still read, log lines, metric labels,
  response fields. A newer version gets a warning and is tried; known-bad combinations are refused.
- **Calls.** `Api` holds the client with the API key (the only place that writes `Bearer`), one retry
  policy (`with_retries`) and the calls: health, server info and allocation (from `internal_states[0]`
  and the startup log: top-level `/server_info` fields echo the CLI, so `max_mamba_cache_size` is null
  unless passed), metrics (summed over label sets, `sglang:` and `sglang_` names), the chat payload,
  chat (streaming and not), the 1-token liveness probe and the version.

The transport under `Api` (client, payload, SSE streaming, error sorting) is `sglang/http.py`, private to this
module: what callers use of it (`ChatResult`, `chat_payload`, `reasoning_tokens`, `token_ids`, `with_retries`) is
re-exported here, so callers ask this module only (tests/architecture/test_import_graph.py holds them to it).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import TypeVar

import httpx

from dflash_regen.errors import (
    MetricsMissing,
    TransientError,
    VersionRefused,
)
from dflash_regen.sglang.http import ChatResult as ChatResult
from dflash_regen.sglang.http import auth_headers, make_client, read_json, stream_chat, timeout
from dflash_regen.sglang.http import chat_payload as chat_payload
from dflash_regen.sglang.http import reasoning_tokens as reasoning_tokens
from dflash_regen.sglang.http import token_ids as token_ids
from dflash_regen.sglang.http import with_retries as with_retries

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

    def template_tools(self, tools: list[dict] | None) -> list[dict] | None:
        """The tools as this version's server hands them to the chat template (`item.model_dump()` of its `Tool`
        model, serving_chat.py): the `<tools>` block the model was prompted with, so training renders the same.
        Known fields only; before 0.5.23 the function's fields in the model's order with `strict` false unless
        sent, from 0.5.23 in the order sent; from 0.5.12 a `defer_loading` (null unless sent) on each tool."""
        return [self._template_tool(tool) for tool in tools] if tools else tools

    def _template_tool(self, tool: dict) -> dict:
        sent = tool.get("function") or {}
        defer = tool.get("defer_loading")
        function = {"description": sent.get("description"), "name": sent.get("name"),
                    "parameters": sent.get("parameters")}
        if not self.at_least("0.5.12"):
            return {"type": tool.get("type", "function"), "function": {**function,
                                                                       "strict": bool(sent.get("strict", False))}}
        function_defer = sent.get("defer_loading", defer)  # the tool's flag is copied to its function
        if self.at_least("0.5.23"):
            known = {**function, "strict": sent.get("strict"), "defer_loading": function_defer}
            known = {k: v for k, v in known.items() if v is not None or k not in ("strict", "defer_loading")}
            function = {k: known[k] for k in [*sent, *known] if k in known}
        else:
            function["strict"] = bool(sent.get("strict", False))
            if function_defer is not None:
                function["defer_loading"] = function_defer
        return {"type": tool.get("type", "function"), "function": function, "defer_loading": defer}

    # ------------------------------------------------------------------------------- token ids
    # Read from each version's protocol.py (request and response models) and serving_chat.py (what fills them):
    # - 0.5.13: `return_prompt_token_ids` -> `choices[i].prompt_token_ids`; refused with `stream` (a 400);
    # - 0.5.17: `return_token_ids` -> `choices[i].token_ids` (the output's ids) and the prompt ids; refused with
    #   `stream`;
    # - 0.5.18: that output field renamed `choices[i].response_token_ids`;
    # - 0.5.20: `return_input_ids_in_sglext` / `return_output_ids_in_sglext` -> top-level `sglext.input_ids` and
    #   `sglext.output_ids` (one list per choice), streaming too: one chunk with `choices: []` after the finish
    #   chunk, before the usage chunk.
    # The output ids are `req.output_ids_through_stop` (schedule_batch.py: `finished_len = matched_pos + 1`), so
    # they end with the matched stop token (`<|im_end|>`), which `completion_tokens` (their length) counts too.
    @property
    def prompt_ids_without_stream(self) -> bool:
        return self.at_least("0.5.13")

    @property
    def output_ids_without_stream(self) -> bool:
        return self.at_least("0.5.17")

    @property
    def ids_in_sglext(self) -> bool:
        return self.at_least("0.5.20")

    def token_ids_request(self, stream: bool) -> dict:
        """The request fields that ask this version for the prompt's and the output's token ids (none before
        0.5.13, and none when streaming before 0.5.20, which refuses them with `stream`)."""
        if self.ids_in_sglext:
            return {"return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True}
        if stream:
            return {}
        if self.output_ids_without_stream:
            return {"return_token_ids": True}  # the prompt's ids come with it (serving_chat.py)
        if self.prompt_ids_without_stream:
            return {"return_prompt_token_ids": True}
        return {}

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



class Api:
    """One SGLang server's HTTP API, as the pipeline uses it: the only door to a server.

    It holds one connection pool of `pool_size` connections (as many as the requests its caller has in flight at
    once); `close()` it, or use it as a context manager, when the caller is done with the server. `client`: a
    ready client instead (tests pass one with a fake transport)."""

    def __init__(self, url: str, api_key: str, *, pool_size: int = 4, client: httpx.Client | None = None,
                 timeout_s: float = 30.0):
        self.url, self.api_key, self.timeout_s = url, api_key, timeout_s
        self.client = client or make_client(pool_size)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get(self, path: str, timeout_s: float | None = None, auth: bool = True) -> httpx.Response:
        try:
            return self.client.get(f"{self.url}{path}", timeout=timeout(timeout_s or self.timeout_s),
                                   headers=auth_headers(self.api_key) if auth else {})
        except httpx.HTTPError as exc:
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
            resp = self.client.post(f"{self.url}/v1/chat/completions", json={**payload, "stream": False},
                                    timeout=timeout(timeout_s), headers=auth_headers(self.api_key))
        except httpx.HTTPError as exc:
            raise TransientError(f"no answer from {self.url} within {timeout_s:.0f} s ({type(exc).__name__})") \
                from exc
        return read_json(resp, f"{self.url}/v1/chat/completions"), time.monotonic() - started

    def stream(self, payload: dict, *, stall_s: float, cap_s: float,
               stop: threading.Event | None = None) -> ChatResult:
        """A streamed chat completion: `stall_s` the longest silence between two bytes, `cap_s` the whole answer's
        limit, `stop` the caller's cancel (`Cancelled`)."""
        return stream_chat(self.client, self.url, self.api_key, payload, stall_s=stall_s, cap_s=cap_s, stop=stop)

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
                status = self.client.post(f"{self.url}/v1/chat/completions", json=probe, timeout=timeout(timeout_s),
                                          headers=auth_headers(self.api_key)).status_code
            except httpx.HTTPError:
                continue
            if status == 200:
                break
        return status

    def answers(self, model: str, timeout_s: float) -> bool:
        """The liveness probe: any HTTP answer, even a 5xx, means the scheduler is there."""
        return self.probe(model, timeout_s) is not None
