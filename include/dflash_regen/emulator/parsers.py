"""SGLang's output parsers as 0.5.10 applies them: the qwen3 reasoning split and the qwen3_coder tool calls.

The non-stream split is SGLang's `detect_and_parse` (strip, then everything is reasoning unless `</think>`
is present; the answer after it is stripped). The streaming detector follows `parse_streaming_increment`:
reasoning streams as it arrives, the delta holding `</think>` is right-stripped, the text after it goes
on as content unstripped, so streamed and non-streamed answers can differ in surrounding whitespace
exactly as they do with SGLang.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_START_TEXT = "<think>"
THINK_END_TEXT = "</think>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# Reasoning parsers whose detector splits on <think>...</think> (the only tags the emulated model emits);
# the others (gpt-oss channels, kimi's markers, ...) leave its output whole in `content`.
THINK_TAG_PARSERS = {"qwen3", "qwen3-thinking", "deepseek-r1", "deepseek-v3", "glm45", "step3"}
ALWAYS_REASONING_PARSERS = {"qwen3-thinking", "deepseek-r1", "step3"}

_TOOL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_FUNCTION = re.compile(r"<function=([^>\s]+)>\s*(.*?)\s*</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)


def force_reasoning(reasoning_parser: str | None, chat_template_kwargs: dict | None) -> bool:
    """qwen3: thinking is assumed on unless the request says `enable_thinking: false`."""
    if reasoning_parser in ALWAYS_REASONING_PARSERS:
        return True
    return not chat_template_kwargs or chat_template_kwargs.get("enable_thinking") is not False


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str]:
    """(reasoning, answer) of a complete output; reasoning None when there was no reasoning block."""
    if not (in_reasoning or THINK_START_TEXT in text):
        return None, text
    processed = text.replace(THINK_START_TEXT, "").strip()
    if THINK_END_TEXT not in processed:
        return processed, ""  # truncated inside thinking: all of it is reasoning
    reasoning, answer = processed.split(THINK_END_TEXT, 1)
    return reasoning, answer.strip()


class ReasoningStream:
    """Incremental reasoning split (SGLang's BaseReasoningFormatDetector with stream_reasoning=True)."""

    def __init__(self, in_reasoning: bool):
        self.in_reasoning = in_reasoning
        self.buffer = ""
        self.stripped_think_start = False

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning delta, answer delta) for the next piece of decoded text."""
        self.buffer += text
        current = self.buffer
        if any(tag.startswith(current) and tag != current for tag in (THINK_START_TEXT, THINK_END_TEXT)):
            return "", ""  # maybe the start of a tag: wait for more
        if not self.stripped_think_start and THINK_START_TEXT in current:
            current = current.replace(THINK_START_TEXT, "")
            self.stripped_think_start = True
            self.in_reasoning = True
        if self.in_reasoning and THINK_END_TEXT in current:
            end = current.find(THINK_END_TEXT)
            self.buffer = ""
            self.in_reasoning = False
            return current[:end].rstrip(), current[end + len(THINK_END_TEXT):]
        self.buffer = ""
        return (current, "") if self.in_reasoning else ("", current)

    def flush(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        return (rest, "") if self.in_reasoning else ("", rest)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    index: int = 0
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_json(self) -> dict:
        return {"id": self.id, "index": self.index, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _convert(value: str, schema: dict):
    """Parameter text to the type the tool's JSON schema declares (qwen3_coder's conversion)."""
    kind = (schema or {}).get("type", "string")
    if kind == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _schemas(tools: list[dict] | None) -> dict[str, dict]:
    out = {}
    for tool in tools or []:
        fn = tool.get("function") or {}
        out[fn.get("name", "")] = ((fn.get("parameters") or {}).get("properties") or {})
    return out


def parse_tool_calls(text: str, tools: list[dict] | None) -> tuple[str, list[ToolCall]]:
    """(remaining text, tool calls) from Qwen3-coder XML; unparseable text stays as text."""
    if TOOL_CALL_START not in text:
        return text, []
    schemas = _schemas(tools)
    calls: list[ToolCall] = []
    for block in _TOOL_BLOCK.finditer(text):
        fn = _FUNCTION.search(block.group(1))
        if not fn:
            continue
        props = schemas.get(fn.group(1), {})
        args = {m.group(1): _convert(m.group(2), props.get(m.group(1), {})) for m in _PARAMETER.finditer(fn.group(2))}
        calls.append(ToolCall(fn.group(1), json.dumps(args, ensure_ascii=False), index=len(calls)))
    if not calls:
        return text, []
    before = text[:text.find(TOOL_CALL_START)].strip()
    after = _TOOL_BLOCK.sub("", text[text.find(TOOL_CALL_START):]).strip()
    return " ".join(p for p in (before, after) if p), calls


class ToolCallStream:
    """Streaming qwen3_coder: text flows as content until `<tool_call>`; each complete call is sent as a
    name delta then an arguments delta (what SGLang's detector emits, coarser-grained)."""

    def __init__(self, tools: list[dict] | None):
        self.tools = tools
        self.buffer = ""
        self.holding = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content delta, tool-call deltas)."""
        self.buffer += text
        content = ""
        deltas: list[dict] = []
        while self.buffer:
            if not self.holding:
                start = self.buffer.find(TOOL_CALL_START)
                if start < 0:
                    keep = _partial_suffix(self.buffer, TOOL_CALL_START)
                    content += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content += self.buffer[:start]
                self.buffer = self.buffer[start:]
                self.holding = True
            end = self.buffer.find(TOOL_CALL_END)
            if end < 0:
                break
            block = self.buffer[:end + len(TOOL_CALL_END)]
            self.buffer = self.buffer[end + len(TOOL_CALL_END):].lstrip("\n")
            self.holding = False
            _, calls = parse_tool_calls(block, self.tools)
            for call in calls:
                call.index = len(self.calls)
                self.calls.append(call)
                deltas.append({"index": call.index, "id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
                deltas.append({"index": call.index, "function": {"arguments": call.arguments}})
        return content, deltas

    def flush(self) -> str:
        """Text still held (an unfinished tool call when max_tokens cut it): it stays content."""
        rest, self.buffer, self.holding = self.buffer, "", False
        return rest


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
