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

`tokenize_batch`, `tokenize_sample` and `summarize_mask` are pure; `load_tokenizer` is the only I/O. Speed: the
texts of a batch are encoded together by the Rust tokenizer (`encode_batch`, all cores) and each mask is two
slices, found by a binary search of the token offsets at the span edges: no Python walk over the tokens.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash_regen.errors import TokenizeError

# Qwen3.6's own chat template (the demo model ships it; planning counts tokens with it before any model is staged).
QWEN_TEMPLATE = Path(__file__).with_name("chat_template.jinja")
ASSISTANT_HEADER = "<|im_start|>assistant\n<think>\n"
THINK_END = "</think>"
# What the template puts between the reasoning and the answer.
ANSWER_START = THINK_END + "\n\n"
# Special tokens the template may read (HF passes `special_tokens_map` to it).
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Texts encoded per `encode_batch` call: enough to keep every core busy, few enough to bound the Encodings' memory.
BATCH = 64
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

    Built from `tokenizer.json` with `tokenizers` directly (~1 s for Qwen3.6's 33 MB file): transformers 5's
    `AutoTokenizer` parses the same file with Python's json several times and rebuilds the vocabulary in Python
    (~2.5 s more, paid by every tokenize task). The chat template is `chat_template.jinja` if the dir has one,
    else `tokenizer_config.json`'s `chat_template` (the order transformers reads them in).

    Raises `TokenizeError` naming the dir when the tokenizer files or the chat template are missing or unreadable.
    """
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        found = sorted(p.name for p in model_dir.iterdir()) if model_dir.is_dir() else "the dir does not exist"
        raise TokenizeError(
            f"no tokenizer.json in model dir {model_dir} (found: {found}); stage the full model snapshot "
            "including its tokenizer files, or for the demo use write_demo_model(path, with_tokenizer=True)"
        )
    from transformers import PreTrainedTokenizerFast  # slow import, only needed here

    try:
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = model_dir / "chat_template.jinja"
        template = template_path.read_text() if template_path.is_file() else config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = {t["name"]: t["template"] for t in template}
        extra = {key: value["content"] if isinstance(value, dict) else value
                 for key in (*_SPECIAL_TOKEN_KEYS, "model_max_length") if (value := config.get(key))}
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), chat_template=template,
                                            **extra)
    except Exception as exc:  # OSError, a bad JSON file (tokenizers raises a plain Exception), a bad config
        raise TokenizeError(f"cannot load the tokenizer of model dir {model_dir}: {type(exc).__name__}: {exc}") \
            from exc
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


def tokenize_batch(
    tokenizer: Any,
    conversations: Sequence[tuple[Sequence[Mapping[str, Any]], Sequence[Mapping] | None]],
    include_reasoning: bool = True,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`(input_ids int32, loss_mask int8)` arrays of each `(messages, tools)` conversation, in order.

    `loss_mask[i]` is 1 iff token i lies entirely inside an assistant span (see the module docstring).
    With `include_reasoning=False` the reasoning and `</think>\\n\\n` are 0 and only the answer is supervised.
    """
    backend = tokenizer.backend_tokenizer
    out = []
    for first in range(0, len(conversations), BATCH):
        texts = [render(tokenizer, messages, tools) for messages, tools in conversations[first:first + BATCH]]
        for text, encoding in zip(texts, backend.encode_batch(texts, add_special_tokens=False), strict=True):
            ids = np.array(encoding.ids, dtype=np.int32)
            mask = np.zeros(len(ids), dtype=np.int8)
            for start, end in supervised_char_spans(text, include_reasoning=include_reasoning):
                mask[_token_range(encoding, start, end)] = 1
            out.append((ids, mask))
    return out


def _token_range(encoding: Any, start: int, end: int) -> slice:
    """The tokens whose characters lie entirely inside `[start, end)`: from the first that starts at or after
    `start` to the first that ends after `end`. Token offsets only grow along the text (byte-level BPE), so two
    binary searches find them."""
    tokens = range(len(encoding))
    first = bisect.bisect_left(tokens, start, key=lambda i: encoding.token_to_chars(i)[0])
    stop = bisect.bisect_right(tokens, end, key=lambda i: encoding.token_to_chars(i)[1])
    return slice(first, max(first, stop))


def tokenize_sample(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping] | None = None,
    include_reasoning: bool = True,
) -> tuple[list[int], list[int]]:
    """`(input_ids, loss_mask)` lists of one conversation, as SpecForge's `qwen3.5` template would compute them
    (`tokenize_batch` of one)."""
    [(ids, mask)] = tokenize_batch(tokenizer, [(messages, tools)], include_reasoning)
    return ids.tolist(), mask.tolist()


def summarize_mask(input_ids: Sequence[int] | np.ndarray, loss_mask: Sequence[int] | np.ndarray,
                   think_end_id: int) -> MaskSummary:
    """Counts of one sample: total, supervised, and the supervised split at each turn's `</think>`.

    Each run of consecutive 1s is one assistant turn; its reasoning is everything up to and including its
    first `</think>` (a run without one, as with `include_reasoning=False`, has no reasoning tokens).
    """
    if len(input_ids) != len(loss_mask):
        raise ValueError(f"input_ids has {len(input_ids)} tokens but loss_mask has {len(loss_mask)}")
    ids, mask = np.asarray(input_ids), np.asarray(loss_mask, dtype=np.int8)
    edges = np.diff(np.concatenate(([0], mask, [0])))
    run_starts, run_ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    think_ends = np.flatnonzero((ids == think_end_id) & (mask == 1))
    # The first supervised `</think>` at or after each run's start, if it lies inside that run.
    nearest = np.searchsorted(think_ends, run_starts)
    found = nearest < len(think_ends)
    first = think_ends[np.minimum(nearest, len(think_ends) - 1)] if len(think_ends) else run_starts
    inside = found & (first < run_ends)
    reasoning = int(((first - run_starts + 1) * inside).sum())
    total = int(mask.sum())
    return MaskSummary(len(ids), total, reasoning, total - reasoning)
