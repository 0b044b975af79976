"""Smoke gate: representative prompts on every server at the production `max_tokens`.

The seed tested one server with one prompt at `max_tokens=512` and got 512 reasoning tokens and
0 characters of content. This gate sends a coding, a multi-turn and a tool-calling prompt to **every**
server with the run's real sampling settings and fails, naming the server and the fix, on HTTP errors,
empty answers, reasoning-only answers, truncation (`finish_reason == "length"`) and missing tool calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from dflash_regen.errors import GateFailed, PromptError, TransientError
from dflash_regen.fleet.servers import Server, servers_of
from dflash_regen.layout import RunLayout
from dflash_regen.payloads import Fleet, Smoke
from dflash_regen.settings.run_config import FleetConfig, RunConfig, SamplingConfig
from dflash_regen.sglang.api import Api, chat_payload, reasoning_tokens, with_retries
from dflash_regen.tables import Column, text_table

log = logging.getLogger(__name__)

SMOKE_ATTEMPTS = 3

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. Paris"},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}

PROMPTS: dict[str, dict] = {
    "coding": {"messages": [{"role": "user", "content": "Write a Python function to check if a number is prime."}]},
    "multi_turn": {"messages": [
        {"role": "system", "content": "You are a concise maths tutor."},
        {"role": "user", "content": "What is the derivative of x^3 + 2x?"},
        {"role": "assistant", "content": "The derivative is 3x^2 + 2."},
        {"role": "user", "content": "And the second derivative? Explain in one sentence."},
    ]},
    "tool_call": {"messages": [{"role": "user", "content": "What's the weather like in Paris right now?"}],
                  "tools": [WEATHER_TOOL], "expect_tool_call": True},
}


@dataclass
class SmokeResult:
    server: str
    prompt: str
    ok: bool = False
    problem: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    content_chars: int = 0
    reasoning_chars: int = 0
    tool_calls: int = 0
    latency_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.latency_s if self.latency_s > 0 else 0.0


@dataclass
class ServerSmoke:
    server: str
    results: list[SmokeResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)


def judge(spec: dict, body: dict, sampling: SamplingConfig) -> str:
    """'' when the answer is usable, else what is wrong and what to change."""
    choice = (body.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    usage = body.get("usage") or {}
    content = (message.get("content") or "").strip()
    reasoning = (message.get("reasoning_content") or message.get("reasoning") or "").strip()
    tool_calls = message.get("tool_calls") or []
    finish = choice.get("finish_reason")
    completion = usage.get("completion_tokens", 0)
    if finish == "length":
        where = "inside its reasoning" if not content and reasoning else "in its answer"
        return (f"ran out of tokens {where}: finish_reason 'length' after {completion} completion tokens "
                f"({reasoning_tokens(usage)} reasoning, {len(content)} chars of content) at "
                f"max_tokens={sampling.max_tokens}; raise Param max_tokens (thinking needs >= 4096; 16384 is "
                "a safe default)")
    if spec.get("expect_tool_call") and not tool_calls:
        return (f"no parsed tool call (finish_reason {finish!r}, {len(content)} chars of content); launch SGLang "
                "with --tool-call-parser qwen3_coder (the parser for Qwen3.5/3.6)")
    if not content and not tool_calls:
        if reasoning:
            return (f"reasoning only: {len(reasoning)} chars of reasoning, 0 chars of content "
                    f"(finish_reason {finish!r}); the model closed its thinking without answering")
        return f"empty answer: no content, no reasoning, no tool call (finish_reason {finish!r})"
    if sampling.enable_thinking and not reasoning:
        return ("no reasoning_content although thinking is on; launch SGLang with --reasoning-parser qwen3 "
                "or check that the chat template enables thinking")
    return ""


def smoke_one(server: Server, api_key: str, prompt: str, spec: dict, sampling: SamplingConfig,
              served_model: str, timeout_s: float) -> SmokeResult:
    result = SmokeResult(server=server.name, prompt=prompt)
    payload = chat_payload(spec["messages"], spec.get("tools"), sampling, model=served_model,
                           max_tokens=sampling.max_tokens, seed=0)
    api = Api(server.url, api_key)
    # A transient 5xx or reset is retried (SGLang answers 503 when its queue is full); a server that keeps
    # failing, or any 4xx, fails the gate.
    try:
        body, result.latency_s = with_retries(lambda: api.chat(payload, timeout_s), SMOKE_ATTEMPTS)
    except TransientError as exc:
        result.problem = f"{exc} (in {SMOKE_ATTEMPTS} attempts); the server is down or wedged; log: {server.log_path}"
        return result
    except PromptError as exc:
        result.problem = str(exc)
        return result
    choice = (body.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    usage = body.get("usage") or {}
    result.finish_reason = choice.get("finish_reason")
    result.completion_tokens = usage.get("completion_tokens", 0)
    result.reasoning_tokens = reasoning_tokens(usage)
    result.content_chars = len(message.get("content") or "")
    result.reasoning_chars = len(message.get("reasoning_content") or message.get("reasoning") or "")
    result.tool_calls = len(message.get("tool_calls") or [])
    result.problem = judge(spec, body, sampling)
    result.ok = not result.problem
    return result


TABLE_COLUMNS = (Column("server", 40), Column("prompt", 10), Column("result", 6), Column("finish", 10),
                 Column("tokens", 6, ">"), Column("reason", 6, ">"), Column("chars", 6, ">"), Column("tools", 5, ">"),
                 Column("secs", 6, ">", ".2f"), Column("tok/s", 7, ">", ".0f"))


def format_table(smokes: list[ServerSmoke]) -> str:
    return text_table(TABLE_COLUMNS, [(r.server, r.prompt, "ok" if r.ok else "FAIL", r.finish_reason or "-",
                               r.completion_tokens, r.reasoning_tokens, r.content_chars, r.tool_calls, r.latency_s,
                               r.tokens_per_s) for smoke in smokes for r in smoke.results])


def smoke_gate(servers: list[Server], api_key: str, sampling: SamplingConfig, fleet: FleetConfig) -> dict:
    """Every prompt on every server, in parallel (the fleet's served model name and smoke timeout); raise
    `GateFailed` naming each failing server."""
    jobs = [(s, name, spec) for s in servers for name, spec in PROMPTS.items()]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(lambda j: smoke_one(j[0], api_key, j[1], j[2], sampling, fleet.served_model_name,
                                                    fleet.smoke_timeout_s), jobs))
    by_server = {s.name: ServerSmoke(s.name) for s in servers}
    for r in results:
        by_server[r.server].results.append(r)
    smokes = list(by_server.values())
    log.info("smoke test at max_tokens=%d, temperature=%s, top_p=%s, top_k=%s, min_p=%s, presence_penalty=%s, "
             "thinking=%s:\n%s", sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k,
             sampling.min_p, sampling.presence_penalty, sampling.enable_thinking, format_table(smokes))
    report = {"passed": all(s.ok for s in smokes), "max_tokens": sampling.max_tokens,
              "servers": [{"server": s.server, "ok": s.ok,
                           "results": [{**asdict(r), "tokens_per_s": round(r.tokens_per_s, 1)} for r in s.results]}
                          for s in smokes]}
    bad = [s for s in smokes if not s.ok]
    if bad:
        lines = [f"- {r.server} [{r.prompt}]: {r.problem}" for s in bad for r in s.results if not r.ok]
        raise GateFailed(f"smoke test failed on {len(bad)} of {len(smokes)} servers:\n" + "\n".join(lines))
    return report


def gated(layout: RunLayout, name: str, check: Callable[[], dict]) -> dict:
    """A fleet gate's report, written whether it passed or failed (the Fleet page shows why it failed)."""
    try:
        report = check()
    except GateFailed as exc:
        layout.write_report(name, {"passed": False, "error": str(exc)})
        raise
    layout.write_report(name, report)
    return report


def smoke_fleet(cfg: RunConfig, fleet: Fleet) -> Smoke:
    """The smoke gate on every server of `fleet` (a fleet value), its report in reports/smoke.json."""
    servers, key = servers_of(fleet, cfg.fleet.num_servers)
    gated(cfg.layout, "smoke", lambda: smoke_gate(servers, key, cfg.sampling, cfg.fleet))
    return {"servers": len(servers), "passed": True}
