"""Read prompt rows as a stream, validate them, and give each a stable `sample_id`.

Sources: `.jsonl`, `.jsonl.gz` or `.parquet`, a file or a directory of them (read in sorted order).
A row is `{"id"?: str, "messages": [...OpenAI chat turns...], "tools"?: [...OpenAI function schemas...]}`.
Each row becomes either a `Prompt` or a `Rejection` with its location (file:line) and a reason, in the
style of datatrove's filters: keep, or say why not. Nothing is dropped silently.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROLES = {"system", "user", "assistant", "tool"}
SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")


@dataclass(frozen=True)
class Prompt:
    sample_id: str
    messages: list[dict]
    tools: list[dict] | None
    location: str
    text_bytes: int  # UTF-8 size of all message text: an upper bound on its token count


@dataclass(frozen=True)
class Rejection:
    location: str
    reason: str  # a short stable code, e.g. "bad_role"
    detail: str
    sample_id: str | None = None


class PromptSourceError(ValueError):
    """The prompt source itself is unusable (missing, no supported files)."""


def source_files(source: Path) -> list[Path]:
    if source.is_file():
        files = [source]
    elif source.is_dir():
        files = sorted(p for p in source.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES))
    else:
        raise PromptSourceError(f"prompt source {source} does not exist; set Param prompt_source to a .jsonl, "
                                ".jsonl.gz or .parquet file or a directory of them")
    bad = [p for p in files if not p.name.endswith(SUFFIXES)]
    if bad or not files:
        raise PromptSourceError(f"prompt source {source} has no readable files (need {', '.join(SUFFIXES)}); "
                                f"found {[p.name for p in bad][:3] or 'nothing'}")
    return files


def iter_raw(source: Path, batch_rows: int = 4096) -> Iterator[tuple[str, str | dict]]:
    """(location, raw row) pairs: a text line for JSONL, a dict for parquet. Memory stays flat."""
    for path in source_files(source):
        name = path.name
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            row = 0
            for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows):
                for record in batch.to_pylist():
                    row += 1
                    yield f"{name}#{row}", record
        else:
            opener = gzip.open if name.endswith(".gz") else open
            with opener(path, "rt", encoding="utf-8", errors="replace") as f:
                for lineno, line in enumerate(f, 1):
                    yield f"{name}:{lineno}", line


def canonical_id(messages: list[dict], tools: list[dict] | None) -> str:
    blob = json.dumps({"messages": messages, "tools": tools or None}, sort_keys=True, ensure_ascii=False,
                      separators=(",", ":"))
    return "h" + hashlib.sha256(blob.encode()).hexdigest()[:24]


def _text_of(content, where: str) -> str:
    """Message content as text: a string, or OpenAI content parts of type text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _Bad("bad_content", f"{where}.content[{i}] must be {{'type': 'text', 'text': str}} "
                                          f"(only text parts are supported), got {str(part)[:80]}")
            texts.append(part["text"])
        return "".join(texts)
    raise _Bad("bad_content", f"{where}.content must be a string or a list of text parts, got "
                              f"{type(content).__name__}")


class _Bad(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def normalize_tool(tool, index: int) -> dict:
    """An OpenAI function tool; common non-standard shapes are repaired, others rejected."""
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise _Bad("bad_tool", f"{where} must be an object, got {type(tool).__name__}")
    if "function" not in tool and "name" in tool:  # bare function schema: wrap it
        tool = {"type": "function", "function": tool}
    fn = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(fn, dict):
        raise _Bad("bad_tool", f"{where} must be {{'type': 'function', 'function': {{...}}}}")
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise _Bad("bad_tool", f"{where}.function.name must be a non-empty string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if isinstance(params, str):  # schemas serialised as a JSON string: parse them
        try:
            params = json.loads(params)
        except json.JSONDecodeError as exc:
            raise _Bad("bad_tool", f"{where}.function.parameters is a string but not JSON ({exc.msg})") from exc
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise _Bad("bad_tool", f"{where}.function.parameters must be a JSON schema of type 'object'")
    params = {"type": "object", **params}
    out = {"name": name.strip(), "parameters": params}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    return {"type": "function", "function": out}


def normalize_messages(messages) -> tuple[list[dict], int]:
    if not isinstance(messages, list) or not messages:
        raise _Bad("empty", "messages must be a non-empty list of chat turns")
    out, size = [], 0
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _Bad("bad_shape", f"{where} must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise _Bad("bad_role", f"{where}.role is {role!r}; must be one of {sorted(ROLES)}")
        text = _text_of(msg.get("content"), where)
        turn: dict = {"role": role, "content": text}
        if role == "assistant" and msg.get("tool_calls"):
            calls = msg["tool_calls"]
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
            if not isinstance(msg.get("tool_call_id"), str) and not isinstance(msg.get("name"), str):
                raise _Bad("bad_tool_turn", f"{where} is a tool result without tool_call_id")
            turn["tool_call_id"] = msg.get("tool_call_id") or msg.get("name")
        if isinstance(msg.get("reasoning_content"), str) and role == "assistant":
            turn["reasoning_content"] = msg["reasoning_content"]
        if not text.strip() and role in {"user", "system"}:
            raise _Bad("empty", f"{where} ({role}) has empty content")
        size += len(text.encode())
        out.append(turn)
    if not any(m["role"] == "user" for m in out):
        raise _Bad("no_user_turn", "messages have no user turn to answer")
    if out[-1]["role"] == "assistant":
        raise _Bad("ends_with_assistant", "the last turn is an assistant turn; nothing is left to answer "
                                          "(drop the final answer to regenerate it)")
    return out, size


def _arguments(args, where: str) -> str:
    if isinstance(args, str):
        return args
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    raise _Bad("bad_tool_call", f"{where}.tool_calls[].function.arguments must be a JSON string or object")


def parse_row(location: str, raw: str | dict) -> Prompt | Rejection:
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
    try:
        messages = raw.get("messages", raw.get("conversations"))
        if isinstance(messages, str):  # parquet sources often store nested fields as JSON strings
            try:
                messages = json.loads(messages)
            except json.JSONDecodeError as exc:
                raise _Bad("not_json", f"messages is a string but not JSON ({exc.msg})") from exc
        messages, size = normalize_messages(messages)
        tools_raw = raw.get("tools")
        if isinstance(tools_raw, str):
            try:
                tools_raw = json.loads(tools_raw) if tools_raw.strip() else None
            except json.JSONDecodeError as exc:
                raise _Bad("bad_tool", f"tools is a string but not JSON ({exc.msg})") from exc
        if tools_raw is not None and not isinstance(tools_raw, list):
            raise _Bad("bad_tool", f"tools must be a list of tool schemas, got {type(tools_raw).__name__}")
        tools = [normalize_tool(t, i) for i, t in enumerate(tools_raw)] if tools_raw else None
    except _Bad as bad:
        sid = str(given_id) if given_id is not None else None
        return Rejection(location, bad.reason, bad.detail, sid)
    if tools:
        size += len(json.dumps(tools).encode())
    sample_id = str(given_id) if given_id is not None else canonical_id(messages, tools)
    return Prompt(sample_id, messages, tools, location, size)
