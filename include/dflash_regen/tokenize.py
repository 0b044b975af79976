"""Turn a finished conversation into `input_ids` + `loss_mask` the way SpecForge's `qwen3.5` template does.

SpecForge (the DFlash trainer) re-tokenizes the published conversations itself, so our mask must be the one
it would compute, or the quality gate checks something training never sees:

1. Render with the model's own chat template (`add_generation_prompt=False`, `enable_thinking=True`).
2. Assistant spans start right after the header `<|im_start|>assistant\\n<think>\\n` and run through
   `<|im_end|>\\n`. The Qwen3.5/3.6 template writes that header only for the assistant turns after the last
   user query; earlier turns lose their reasoning and their `<think>`, so they are never supervised.
3. A token is supervised iff its characters lie entirely inside a span. With an empty reasoning the header's
   `\\n` and the reasoning's `\\n` merge into one `\\n\\n` token that straddles the span start; it is left out,
   which is why an empty answer ("OK.") still has exactly 6 supervised tokens:
   `</think>`, `\\n\\n`, `OK`, `.`, `<|im_end|>`, `\\n`. That count is the empty-answer signature the
   quality gate rejects (SpecForge itself only drops masks under 2 tokens).

`tokenize_sample` and `summarize_mask` are pure; `load_tokenizer` is the only I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_regen.errors import TokenizeError

ASSISTANT_HEADER = "<|im_start|>assistant\n<think>\n"
THINK_END = "</think>"
# What the template puts between the reasoning and the answer.
ANSWER_START = THINK_END + "\n\n"
_SPAN = re.compile(re.escape(ASSISTANT_HEADER) + r"([\s\S]*?(?:<\|im_end\|>\n|$))")


@dataclass(frozen=True)
class MaskSummary:
    """Per-sample token counts for the quality table."""

    n_tokens: int
    loss_mask_sum: int
    # Supervised tokens up to and including `</think>`, summed over the supervised turns.
    reasoning_tokens: int
    # Supervised tokens after `</think>`: `\n\n`, the answer, tool calls, `<|im_end|>`, `\n`.
    content_tokens: int


def load_tokenizer(model_dir: Path | str) -> Any:
    """Load the fast tokenizer and chat template of a local model dir (never the network).

    Raises `TokenizeError` naming the dir when the tokenizer files or the chat template are missing, or when
    only a slow tokenizer is available (the mask needs the fast tokenizer's character offsets).
    """
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        found = sorted(p.name for p in model_dir.iterdir()) if model_dir.is_dir() else "the dir does not exist"
        raise TokenizeError(
            f"no tokenizer.json in model dir {model_dir} (found: {found}); stage the full model snapshot "
            "including its tokenizer files, or for the demo use write_demo_model(path, with_tokenizer=True)"
        )
    from transformers import AutoTokenizer  # slow import, only needed here

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise TokenizeError(f"cannot load the tokenizer of model dir {model_dir}: {exc}") from exc
    if not getattr(tokenizer, "is_fast", False):
        raise TokenizeError(
            f"the tokenizer in {model_dir} is not a fast (Rust) tokenizer; the loss mask needs its offset "
            "mapping: make sure tokenizer.json is present and readable"
        )
    if not tokenizer.chat_template:
        raise TokenizeError(
            f"the tokenizer in {model_dir} has no chat template (tokenizer_config.json `chat_template` or "
            "chat_template.jinja); copy the model's own template files into the dir"
        )
    return tokenizer


def _with_parsed_arguments(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copy of `messages` with OpenAI tool-call `arguments` JSON strings parsed into dicts.

    The Qwen3.5/3.6 template iterates `arguments | items`; SGLang and vLLM parse the string before rendering,
    so the rendering (and the tokens) match what the server trained on only if we do the same.
    """
    out = []
    for index, message in enumerate(messages):
        message = dict(message)
        calls = message.get("tool_calls")
        if calls:
            parsed = []
            for call in calls:
                call = dict(call)
                function = dict(call.get("function", call))
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        function["arguments"] = json.loads(arguments) if arguments.strip() else {}
                    except json.JSONDecodeError as exc:
                        raise TokenizeError(
                            f"message {index}: tool call {function.get('name')!r} has arguments that are not "
                            f"JSON ({exc}): {arguments[:200]!r}; quarantine the sample"
                        ) from exc
                    if not isinstance(function["arguments"], dict):
                        raise TokenizeError(
                            f"message {index}: tool call {function.get('name')!r} arguments must be a JSON "
                            f"object, got {arguments[:200]!r}; quarantine the sample"
                        )
                if "function" in call:
                    call["function"] = function
                else:
                    call = function
                parsed.append(call)
            message["tool_calls"] = parsed
        out.append(message)
    return out


def render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping] | None = None) -> str:
    """The training text of a conversation: the chat template with thinking on and no generation prompt."""
    try:
        return tokenizer.apply_chat_template(
            _with_parsed_arguments(messages),
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=False,
            enable_thinking=True,
        )
    except TokenizeError:
        raise
    except Exception as exc:  # jinja's TemplateError and the template's raise_exception
        raise TokenizeError(f"the chat template cannot render this conversation: {exc}") from exc


def supervised_char_spans(text: str, *, include_reasoning: bool = True) -> list[tuple[int, int]]:
    """Character ranges `[start, end)` of `text` that are trained on, one per assistant turn with a header."""
    spans = []
    for match in _SPAN.finditer(text):
        start, end = match.span(1)
        if not include_reasoning:
            answer = text.find(ANSWER_START, start, end)
            if answer != -1:
                start = answer + len(ANSWER_START)
        spans.append((start, end))
    return spans


def tokenize_sample(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping] | None = None,
    include_reasoning: bool = True,
) -> tuple[list[int], list[int]]:
    """`(input_ids, loss_mask)` of a conversation, as SpecForge's `qwen3.5` template would compute them.

    `loss_mask[i]` is 1 iff token i lies entirely inside an assistant span (see the module docstring).
    With `include_reasoning=False` the reasoning and `</think>\\n\\n` are 0 and only the answer is supervised.
    """
    text = render(tokenizer, messages, tools)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding["input_ids"])
    offsets = encoding["offset_mapping"]
    spans = supervised_char_spans(text, include_reasoning=include_reasoning)
    loss_mask = [0] * len(input_ids)
    # Spans and offsets both increase along the text, so one forward walk does it.
    k = 0
    for i, (tok_start, tok_end) in enumerate(offsets):
        while k < len(spans) and spans[k][1] <= tok_start:
            k += 1
        if k == len(spans):
            break
        span_start, span_end = spans[k]
        if span_start <= tok_start and tok_end <= span_end:
            loss_mask[i] = 1
    return input_ids, loss_mask


def summarize_mask(input_ids: Sequence[int], loss_mask: Sequence[int], think_end_id: int) -> MaskSummary:
    """Counts of one sample: total, supervised, and the supervised split at each turn's `</think>`.

    Each run of consecutive 1s is one assistant turn; its reasoning is everything up to and including its
    first `</think>` (a run without one, as with `include_reasoning=False`, has no reasoning tokens).
    """
    if len(input_ids) != len(loss_mask):
        raise ValueError(f"input_ids has {len(input_ids)} tokens but loss_mask has {len(loss_mask)}")
    reasoning = 0
    run_length = 0
    seen_think_end = False
    for token, bit in zip(input_ids, loss_mask, strict=True):
        if not bit:
            run_length, seen_think_end = 0, False
            continue
        run_length += 1
        if token == think_end_id and not seen_think_end:
            reasoning += run_length
            seen_think_end = True
    total = sum(loss_mask)
    return MaskSummary(len(input_ids), total, reasoning, total - reasoning)
