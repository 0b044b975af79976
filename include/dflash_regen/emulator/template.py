"""The prompt's token ids as SGLang computes them: the request's messages and tools, as the version hands them to the
chat template (`versions.Forms.template_tools`, tool-call arguments parsed), rendered by the model's chat template
with the request's `chat_template_kwargs` and a generation prompt, and encoded without special tokens added
(serving_chat.py `_apply_jinja_template`).

The template is the served model dir's (`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`, the
order transformers reads them in), else Qwen3.6's own as the repository ships it (`chat/chat_template.jinja`, read
as a file: the emulator imports nothing of the library). It is rendered as transformers renders chat templates: a
sandboxed Jinja environment with `trim_blocks`, `lstrip_blocks`, loop controls, a `tojson` that does not escape
HTML, `raise_exception` and `strftime_now`.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from dflash_regen.emulator.prompt import encode

SHIPPED = Path(__file__).resolve().parents[1] / "chat" / "chat_template.jinja"
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@functools.cache
def _template(model_path: str | None) -> tuple[Any, dict]:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    source, special = None, {}
    model = Path(model_path) if model_path else None
    if model is not None and (model / "chat_template.jinja").is_file():
        source = (model / "chat_template.jinja").read_text()
    config_file = model / "tokenizer_config.json" if model is not None else None
    if config_file is not None and config_file.is_file():
        config = json.loads(config_file.read_text())
        source = source or (config.get("chat_template") if isinstance(config.get("chat_template"), str) else None)
        special = {k: v["content"] if isinstance(v, dict) else v for k in _SPECIAL if (v := config.get(k))}
    source = source or SHIPPED.read_text()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source), special


def _messages(messages: list[dict]) -> list[dict]:
    """The messages as the template gets them: content null as "", tool-call arguments parsed from JSON text."""
    out = []
    for message in messages:
        message = {**message, "content": message.get("content") or ""}
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call.get("function") or {})
                if isinstance(function.get("arguments"), str):
                    try:
                        function["arguments"] = json.loads(function["arguments"] or "{}")
                    except ValueError:
                        pass
                calls.append({**call, "function": function})
            message["tool_calls"] = calls
        out.append(message)
    return out


def render(messages: list[dict], tools: list[dict] | None, template_kwargs: dict, model_path: str | None) -> str:
    template, special = _template(model_path)
    return template.render(messages=_messages(messages), tools=tools or None, add_generation_prompt=True,
                           **special, **template_kwargs)


def prompt_ids(messages: list[dict], tools: list[dict] | None, template_kwargs: dict,
               model_path: str | None) -> list[int]:
    return encode(render(messages, tools, template_kwargs, model_path))
