"""The demo's prompt set, written by the project itself: coding, maths, multi-turn, tool calling (half of it with
Python-style tool schemas, which planning repairs), long prompts, and two malformed rows (a duplicate id, a bad
role) that planning must quarantine.

Deterministic: the same call writes the same file, so demo runs and tests are reproducible.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from dflash_regen import atomic
from dflash_regen.layout import demo_prompts_file
from dflash_regen.settings.run_config import DEMO_PROMPTS, RunConfig

CODING = ["Write a Python function to check if a number is prime.",
          "Implement an LRU cache in Python without functools.",
          "Write a SQL query that returns the second highest salary per department.",
          "Explain and fix the bug: `for i in range(len(xs)): xs.remove(xs[i])`.",
          "Write a Rust function that reverses the words of a sentence in place."]
MATHS = ["What is the sum of the first 100 odd numbers? Show your reasoning.",
         "Solve for x: 3x^2 - 12x + 9 = 0.",
         "A train leaves at 9:40 and arrives at 13:05. How long is the trip in minutes?",
         "Prove that the square root of 2 is irrational.",
         "How many ways can 5 people sit around a round table?"]
TOOLS = [{"type": "function", "function": {
            "name": "get_weather", "description": "Current weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {
            "name": "search_flights", "description": "Find flights between two airports on a date.",
            "parameters": {"type": "object", "properties": {"origin": {"type": "string"},
                                                            "destination": {"type": "string"},
                                                            "date": {"type": "string"}},
                           "required": ["origin", "destination", "date"]}}}]
# The same tools as many function-calling datasets write them (Python type names, no type on the parameters,
# a required name without a property): planning repairs them, and the plan report counts the repairs.
PYTHON_STYLE_TOOLS = [{"name": "get_weather", "description": "Current weather for a city.",
                       "parameters": {"properties": {"city": {"type": "str"}, "days": {"type": "int"}},
                                      "required": ["city", "country"]}},
                      {"name": "search_flights", "description": "Find flights between two airports on a date.",
                       "parameters": {"type": "dict", "properties": {"origin": {"type": "str"},
                                                                     "destination": {"type": "str"},
                                                                     "date": {"type": "str"}},
                                      "required": ["origin", "destination", "date"]}}]
TOOL_ASKS = ["What's the weather in Lisbon today?", "Find me a flight from SFO to JFK on 2026-12-24.",
             "Is it raining in Tokyo right now?"]


def demo_rows(n: int = 120, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows: list[dict] = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            messages = [{"role": "user", "content": rng.choice(CODING)}]
            rows.append({"id": f"demo-{i:05d}", "messages": messages})
        elif kind == 1:
            messages = [{"role": "user", "content": rng.choice(MATHS)}]
            rows.append({"id": f"demo-{i:05d}", "messages": messages})
        elif kind == 2:
            messages = [{"role": "system", "content": "You are a patient tutor."},
                        {"role": "user", "content": rng.choice(MATHS)},
                        {"role": "assistant", "content": "Let's work through it step by step."},
                        {"role": "user", "content": "Now explain it to a ten-year-old."}]
            rows.append({"id": f"demo-{i:05d}", "messages": messages})
        elif kind == 3:
            rows.append({"id": f"demo-{i:05d}", "tools": TOOLS if i % 10 == 3 else PYTHON_STYLE_TOOLS,
                         "messages": [{"role": "user", "content": rng.choice(TOOL_ASKS)}]})
        else:
            document = " ".join(rng.choice(CODING + MATHS) for _ in range(rng.randint(40, 120)))
            rows.append({"id": f"demo-{i:05d}", "messages": [
                {"role": "user", "content": f"Summarise the following notes in five bullet points:\n\n{document}"}]})
    # Two rows the planner must quarantine, so the demo shows that nothing is dropped silently.
    rows.append({"id": "demo-00000", "messages": [{"role": "user", "content": "A duplicate id."}]})
    rows.append({"id": "demo-bad-role", "messages": [{"role": "narrator", "content": "Not a chat role."}]})
    return rows


def write_demo_prompts(path: Path, n: int = 120) -> Path:
    atomic.write_lines(path, [json.dumps(r, ensure_ascii=False) for r in demo_rows(n)])
    return path


def prompt_source(cfg: RunConfig) -> Path:
    """The prompts a run plans: Param prompt_source, or for `demo` the demo's prompts (written on first use)."""
    if cfg.prompt_source != DEMO_PROMPTS:
        return Path(cfg.prompt_source)
    return write_demo_prompts(demo_prompts_file(cfg.output_root))
