"""Turn raw rows into validated prompts with a stable `sample_id`, whatever chat format they are written in.

Formats (`FORMATS`; Param `prompt_format` picks one, `auto` detects it per row):
- `openai`: `{"id"?, "messages": [{"role", "content", "tool_calls"?, "tool_call_id"?}], "tools"?}`, including
  the legacy `function_call` / role `function` shape;
- `sharegpt`: `{"conversations": [{"from": "human"|"gpt"|"system"|"function_call"|"observation"|..., "value"}],
  "system"?, "tools"?}` (LLaMA-Factory's function-calling variant included);
- `specforge`: `{"id", "conversations": [{"role", "content", "reasoning_content"?, "tool_calls"?}], "tools"?}`,
  what this pipeline publishes, so a published dataset can be regenerated;
- `prompt`: a `prompt` column, text (one user turn, after an optional `system` column) or a list of turns.
Nested fields may be JSON strings (parquet, CSV). Assistant turns are kept as history; the final answer, if
the row ends with one, is dropped (it is what gets regenerated). Tool schemas are repaired as
`tool_schemas` says. Each row becomes a `Prompt` (with the repairs made, by kind) or a `Rejection` with its
location and a reason, in the style of datatrove's filters: keep, or say why not.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from dflash_regen.errors import SchemaError
from dflash_regen.prompts.tool_schemas import normalize_tool

ROLES = {"system", "user", "assistant", "tool"}
# ShareGPT speakers and the chat role each one is; `function_call` turns carry a tool call as JSON.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "chatgpt": "assistant", "system": "system", "function_call": "assistant",
                  "observation": "tool", "tool": "tool", "function_response": "tool", "function": "tool"}
ROW_REPAIRS = {
    "final_answer_dropped": "the row ended with an assistant answer; it was dropped to be regenerated",
    "think_in_content": "an assistant turn's inline <think>...</think> became its reasoning_content",
    "legacy_function_call": "OpenAI's legacy function_call / role 'function' became tool_calls / a tool turn",
}


@dataclass(frozen=True)
class Prompt:
    sample_id: str
    messages: list[dict]
    tools: list[dict] | None
    location: str
    text_bytes: int  # UTF-8 size of all message text: an upper bound on its token count
    format: str = "openai"
    repairs: tuple[str, ...] = ()  # kinds, one entry per repair made (tool_schemas.REPAIRS, ROW_REPAIRS)


@dataclass(frozen=True)
class Rejection:
    location: str
    reason: str  # a short stable code, e.g. "bad_role"
    detail: str
    sample_id: str | None = None


class _Bad(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def prompt_digest(messages: str, tools: str | None) -> str:
    """Which prompt a completion answers: a digest of a planned shard row's `messages` and `tools` JSON text (one
    `id` given two texts is two prompts to the completion store)."""
    return hashlib.sha256(f"{messages}\0{tools or ''}".encode()).hexdigest()[:16]


def canonical_id(messages: list[dict], tools: list[dict] | None) -> str:
    blob = json.dumps({"messages": messages, "tools": tools or None}, sort_keys=True, ensure_ascii=False,
                      separators=(",", ":"))
    return "h" + hashlib.sha256(blob.encode()).hexdigest()[:24]


def _decoded(value, field: str, reason: str = "not_json"):
    """A nested field that parquet or CSV stored as a JSON string, decoded."""
    if not isinstance(value, str):
        return value
    if not value.strip():
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise _Bad(reason, f"{field} is a string but not JSON ({exc.msg})") from exc


def _text_of(content, where: str) -> str:
    """Message content as text: a string, or OpenAI content parts of type text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type", "text") != "text" or not isinstance(part.get("text"),
                                                                                                   str):
                raise _Bad("bad_content", f"{where}.content[{i}] must be {{'type': 'text', 'text': str}} "
                                          f"(only text parts are supported), got {str(part)[:80]}")
            texts.append(part["text"])
        return "".join(texts)
    raise _Bad("bad_content", f"{where}.content must be a string or a list of text parts, got "
                              f"{type(content).__name__}")


def _turns(raw: dict, fmt: str) -> tuple[str, list]:
    """(format name, chat turns in OpenAI shape) of a row, in the format `fmt` or the one it is written in."""
    column = {"openai": "messages", "sharegpt": "conversations", "specforge": "conversations",
              "prompt": "prompt"}.get(fmt)
    if column is None:
        column = next((c for c in ("messages", "conversations", "prompt") if raw.get(c) is not None), None)
        if column is None:
            raise _Bad("unknown_format", f"row has keys {sorted(raw)[:8]} but no 'messages' (OpenAI), "
                                         "'conversations' (ShareGPT or SpecForge) or 'prompt'; rename the column "
                                         "holding the chat, or convert the rows")
    elif raw.get(column) is None:
        raise _Bad("wrong_format", f"Param prompt_format is {fmt!r} but the row has no '{column}' (keys: "
                                   f"{sorted(raw)[:8]}); set prompt_format to 'auto' or to the rows' format")
    if column == "prompt":
        value = raw["prompt"]
        turns = [{"role": "user", "content": value}] if isinstance(value, str) else _decoded(value, "prompt")
        name = "prompt"
    else:
        turns = _decoded(raw[column], column)
        name = "openai"
        if column == "conversations":
            shared = isinstance(turns, list) and any(isinstance(t, dict) and "from" in t for t in turns)
            name = "sharegpt" if shared else "specforge"
            if fmt in ("sharegpt", "specforge") and fmt != name:
                raise _Bad("wrong_format", f"Param prompt_format is {fmt!r} but the conversation turns are "
                                           f"{'from/value' if shared else 'role/content'} turns ({name}); set "
                                           "prompt_format to 'auto' or to the rows' format")
            if shared:
                turns = _from_sharegpt(turns)
    system = raw.get("system")
    if isinstance(turns, list) and isinstance(system, str) and system.strip() and not (
            turns and isinstance(turns[0], dict) and turns[0].get("role") == "system"):
        turns = [{"role": "system", "content": system}, *turns]
    return name, turns


def _from_sharegpt(turns: list) -> list[dict]:
    out: list[dict] = []
    pending: list[str] = []  # ids of tool calls whose results have not come yet
    for i, turn in enumerate(turns):
        where = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise _Bad("bad_shape", f"{where} must be an object, got {type(turn).__name__}")
        speaker = turn.get("from")
        kind = speaker.lower() if isinstance(speaker, str) else ""
        role = SHAREGPT_ROLES.get(kind)
        if role is None:
            raise _Bad("bad_role", f"{where}.from is {speaker!r}; must be one of {sorted(SHAREGPT_ROLES)}")
        value = turn.get("value")
        if kind == "function_call":
            calls = _decoded(value, f"{where}.value", "bad_tool_call")
            calls = calls if isinstance(calls, list) else [calls]
            if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
                raise _Bad("bad_tool_call", f"{where}.value is {str(value)[:80]!r}; a function_call turn must hold "
                                            "a JSON object {'name': ..., 'arguments': {...}} (or a list of them)")
            ids = [f"call_{i}_{k}" for k in range(len(calls))]
            pending += ids
            out.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": cid, "type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}}
                for cid, c in zip(ids, calls, strict=True)]})
        elif role == "tool":
            out.append({"role": "tool", "content": value, "tool_call_id": pending.pop(0) if pending else f"call_{i}"})
        else:
            out.append({"role": role, "content": value})
    return out


def normalize_messages(messages, repairs: list[str] | None = None) -> tuple[list[dict], int]:
    """Validated OpenAI chat turns and their text size; repairs made are appended to `repairs`."""
    repairs = [] if repairs is None else repairs
    if not isinstance(messages, list) or not messages:
        raise _Bad("empty", "messages must be a non-empty list of chat turns")
    out, size = [], 0
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        msg = _decoded(msg, where)  # datasets may store each turn as JSON text
        if not isinstance(msg, dict):
            raise _Bad("bad_shape", f"{where} must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        if role == "function" or (role == "assistant" and msg.get("function_call") and not msg.get("tool_calls")):
            msg = _from_legacy_function(msg, i)
            repairs.append("legacy_function_call")
            role = msg["role"]
        if role not in ROLES:
            raise _Bad("bad_role", f"{where}.role is {role!r}; must be one of {sorted(ROLES)}")
        text = _text_of(msg.get("content"), where)
        turn: dict = {"role": role, "content": text}
        calls = _decoded(msg.get("tool_calls"), f"{where}.tool_calls", "bad_tool_call")
        if role == "assistant" and calls:
            if not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict) and c["function"].get("name")
                    for c in calls):
                raise _Bad("bad_tool_call", f"{where}.tool_calls must be a list of {{'function': {{'name', "
                                            "'arguments'}}}}")
            turn["tool_calls"] = [{"id": c.get("id") or f"call_{i}_{j}", "type": "function",
                                   "function": {"name": c["function"]["name"],
                                                "arguments": _arguments(c["function"].get("arguments"), where)}}
                                  for j, c in enumerate(calls)]
        if role == "tool":
            call_id = msg.get("tool_call_id") or msg.get("name")
            if not isinstance(call_id, str) or not call_id:
                raise _Bad("bad_tool_turn", f"{where} is a tool result without tool_call_id")
            turn["tool_call_id"] = call_id
        if role == "assistant":
            reasoning = msg.get("reasoning_content")
            if isinstance(reasoning, str) and reasoning:
                turn["reasoning_content"] = reasoning
            elif "</think>" in text:  # split as the chat template would, so the conversation says it outright
                turn["reasoning_content"] = text.split("</think>")[0].rstrip("\n").split("<think>")[-1].strip()
                turn["content"] = text.split("</think>")[-1].lstrip("\n")
                repairs.append("think_in_content")
        if not text.strip() and role in {"user", "system"}:
            raise _Bad("empty", f"{where} ({role}) has empty content")
        size += len(text.encode())
        out.append(turn)
    if out[-1]["role"] == "assistant":
        while out and out[-1]["role"] == "assistant":
            out.pop()
        repairs.append("final_answer_dropped")
    if not any(m["role"] == "user" for m in out):
        raise _Bad("no_user_turn", "messages have no user turn to answer")
    return out, size


def _from_legacy_function(msg: dict, i: int) -> dict:
    if msg.get("role") == "function":
        return {"role": "tool", "content": msg.get("content"), "tool_call_id": msg.get("name")}
    call = msg["function_call"]
    return {**msg, "tool_calls": [{"id": f"call_{i}_0", "type": "function", "function": call}]}


def _arguments(args, where: str) -> str:
    if isinstance(args, str):
        return args
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    if args is None:
        return "{}"
    raise _Bad("bad_tool_call", f"{where}.tool_calls[].function.arguments must be a JSON string or object, got "
                                f"{json.dumps(args)[:80]}")


def parse_row(location: str, raw: object, fmt: str = "auto") -> Prompt | Rejection:
    if isinstance(raw, str):
        if not raw.strip():
            return Rejection(location, "empty", "blank line")
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            return Rejection(location, "not_json", f"not JSON: {exc.msg} at column {exc.colno}")
    if not isinstance(raw, dict):
        return Rejection(location, "bad_shape", f"row must be a JSON object, got {type(raw).__name__}")
    given_id = raw.get("id")
    if given_id is not None and not isinstance(given_id, str | int):
        return Rejection(location, "bad_id", f"id must be a string or integer, got {type(given_id).__name__}")
    sid = str(given_id) if given_id is not None else None
    repairs: list[str] = []
    try:
        name, turns = _turns(raw, fmt)
        messages, size = normalize_messages(turns, repairs)
        tools_raw = _decoded(raw.get("tools"), "tools", "bad_tool")
        if tools_raw is not None and not isinstance(tools_raw, list):
            raise _Bad("bad_tool", f"tools must be a list of tool schemas, got {type(tools_raw).__name__}")
        tools = [normalize_tool(t, f"tools[{i}]", repairs) for i, t in enumerate(tools_raw)] if tools_raw else None
    except _Bad as bad:
        return Rejection(location, bad.reason, bad.detail, sid)
    except SchemaError as exc:
        return Rejection(location, "bad_tool", str(exc), sid)
    if tools:
        size += len(json.dumps(tools).encode())
    sample_id = sid if sid is not None else canonical_id(messages, tools)
    return Prompt(sample_id, messages, tools, location, size, name, tuple(repairs))
