"""The published dataset judged by its consumer's own code: SpecForge 0.2.0's parser, its online path (`specforge
train`) and its offline path (`prepare_hidden_states.py`), in a side venv (tests/specforge_check.py), on records
written as real data holds them; the demo's published set is judged the same way in tests/e2e/test_dag_run.py.

Each row is tokenized here by the pipeline's own code (`tokenize.tokenize_batch`, as the tokenize stage does) and
published by `conversation.specforge_record`; SpecForge must give the same ids and masks for every row, on every
path, dropping none. Two files, each a trap for `load_dataset("json")` (SpecForge's online path):
- every row, those without tool calls first (a big file is read in blocks; types come from the first);
- only schemas with the same keys in another order (`datasets` gives every row the first row's key order; where
  key sets differ, as in the first file, it keeps such a column as JSON, older versions fill nulls).
"""

from __future__ import annotations

import json

import pytest
from specforge_check import assert_specforge_reproduces, judged

from dflash_regen.chat.conversation import build, specforge_record
from dflash_regen.chat.template import load_tokenizer, tokenize_batch
from dflash_regen.demo.model import default_tokenizer_cache, write_demo_model

pytestmark = pytest.mark.xdist_group("specforge_contract")

MAX_LENGTH = 4096  # SpecForge's Qwen3.6-27B DFlash recipe (examples/configs/qwen3.6-27b-dflash-online.yaml)


def tool(name: str, parameters: dict, description: str | None = None) -> dict:
    function = {"name": name, **({"description": description} if description else {}), "parameters": parameters}
    return {"type": "function", "function": function}


def call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


CITY = {"city": {"type": "string"}}
WEATHER_TYPE_FIRST = tool("weather", {"type": "object", "properties": CITY, "required": ["city"]})
# The same keys in the order `tool_schemas.py` leaves a repaired schema (`type` appended).
WEATHER_TYPE_LAST = tool("weather", {"properties": CITY, "required": ["city"], "type": "object"})
BOOKING = tool("book", {"type": "object", "properties": {
    "unit": {"type": "string", "enum": ["metric", "imperial"]},  # an enum here, none in the other schemas
    "guest": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}},
    "rooms": {"type": "array", "items": {"type": "object", "properties": {"beds": {"type": "integer"}}}}},
    "required": ["guest"]}, description="Réserve une chambre — 预订房间")
SEARCH = tool("search", {"type": "object", "properties": {"q": {"type": "string"}, "limit": {"type": "number"}}})

USER = {"role": "user", "content": "What's the weather in Paris?"}
THINK = "The user wants the weather.\nI should call the tool."


def answer(content: str, reasoning: str = "Easy.") -> dict:
    return {"role": "assistant", "content": content, "reasoning_content": reasoning}


def calls(*tool_calls: dict, content: str = "") -> dict:
    return {"role": "assistant", "content": content, "reasoning_content": THINK, "tool_calls": list(tool_calls)}


def result(call_id: str, text: str) -> dict:
    return {"role": "tool", "content": text, "tool_call_id": call_id}


# (sample id, prompt messages, generated assistant turns, tools): generated turns after the prompt, as generation
# returns them (one per tool round; with regenerated history, one per input assistant turn too).
ROWS = [
    ("plain", [USER], [answer("Sunny, 21 °C.")], None),
    ("empty-tools", [USER], [answer("I cannot look it up.")], []),
    ("system-no-tools", [{"role": "system", "content": "Réponds en français."}, USER], [answer("Ensoleillé.")], None),
    ("reasoning-in-history",
     [USER, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Tomorrow?"}],
     [answer("Sunny.", "Old thoughts."), answer("Rain.", "Forecast says rain.")], None),
    ("type-first", [USER, calls(call("c1", "weather", {"city": "Paris"})), result("c1", '{"temp": 21}')],
     [answer("21 °C.")], [WEATHER_TYPE_FIRST]),
    ("type-last", [USER, calls(call("c1", "weather", {"city": "Paris"})), result("c1", '{"temp": 21}')],
     [answer("21 °C.")], [WEATHER_TYPE_LAST]),
    ("generated-call", [USER], [calls(call("call_0", "weather", {"city": "Zürich"}), content="Let me check.")],
     [WEATHER_TYPE_LAST, SEARCH]),
    ("key-sets-differ", [{"role": "user", "content": "Book a room for Ana (34), 2 rooms, metric."}],
     [calls(call("c9", "book", {"guest": {"name": "Ana", "age": 34}, "rooms": [{"beds": 2}, {"beds": 1}],
                                "unit": "metric", "note": "line one\nline two"}))], [BOOKING, WEATHER_TYPE_FIRST]),
    ("multi-turn-tools", [{"role": "system", "content": "Be brief."}, USER,
                          calls(call("a", "weather", {"city": "Paris"}),
                                call("b", "search", {"q": "Paris", "limit": 3})),
                          result("a", "sunny"), result("b", "[]"), answer("Sunny.", ""),
                          {"role": "user", "content": "And in 東京? 🌸"}],
     [answer("Sunny.", "Repeat."), calls(call("c", "weather", {"city": "東京"})), answer("Cloudy in 東京 🌥.")],
     [SEARCH, WEATHER_TYPE_FIRST]),
    ("non-ascii", [{"role": "user", "content": "Привет! Ça va? 你好 — “quotes” \u2028 ünïcödé"}],
     [answer("Très bien, merci! 谢谢 🙂", "Répondre poliment.\n礼貌地回答。")], []),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("model"), shards=1, shard_bytes=1024, with_tokenizer=True,
                            tokenizer_cache=default_tokenizer_cache())


SAME_KEYS = ("type-last", "plain", "type-first")  # a row with tools first here, one without in the other file


def publish_rows(tok, rows, path) -> dict[str, tuple[list[int], list[int]]]:
    """The rows as the tokenize stage writes them: our ids and masks, and `conversations.jsonl` beside them."""
    conversations = [(build(messages, turns, regenerated_history=len(turns) > 1), tools)
                     for _, messages, turns, tools in rows]
    tokenized = tokenize_batch(tok, conversations)
    path.write_text("".join(json.dumps(specforge_record(sid, turns, tools), ensure_ascii=False) + "\n"
                            for (sid, *_), (turns, tools) in zip(rows, conversations, strict=True)), encoding="utf-8")
    return {sid: (ids.tolist(), mask.tolist()) for (sid, *_), (ids, mask) in zip(rows, tokenized, strict=True)}


@pytest.fixture(scope="module")
def published(model_dir, tmp_path_factory):
    """[(our ids and masks, the JSONL, SpecForge's verdict on it)] per file: one judge run (~15 s) for the module."""
    root, tok = tmp_path_factory.mktemp("published"), load_tokenizer(model_dir)
    files = {"all.jsonl": ROWS, "same-keys.jsonl": [r for key in SAME_KEYS for r in ROWS if r[0] == key]}
    ours = [publish_rows(tok, rows, root / name) for name, rows in files.items()]
    verdicts = judged([root / name for name in files], model_dir, MAX_LENGTH, root / "verdict.json")
    return [(o, root / name, v) for o, name, v in zip(ours, files, verdicts, strict=True)]


def test_specforge_reproduces_our_tokens_on_every_path_for_what_real_data_holds(published):
    for ours, path, verdict in published:
        assert verdict["versions"]["specforge"] == "0.2.0" and verdict["rows"] == len(ours), path
        assert_specforge_reproduces(verdict, ours, MAX_LENGTH)
    ours = published[0][0]
    # The reasoning of the history is not trained on, the generated turns after the last user query are.
    assert sum(ours["reasoning-in-history"][1]) < sum(ours["multi-turn-tools"][1])


def test_the_published_form_reads_back_whole_in_datasets_and_pandas(published):
    """`datasets` (whole, and in 1 KB blocks as a big file is read) and pandas give back each row as written."""
    for _, path, verdict in published:
        assert verdict["readers"] == {"datasets": [], "datasets_chunked": [], "pandas": []}, path
    path = published[0][1]
    record = json.loads(path.read_text(encoding="utf-8").splitlines()[7])
    assert json.loads(record["tools"])[0] == BOOKING  # the JSON text holds the schema as the model was given it
    assert json.loads(record["conversations"][-1]["tool_calls"])[0]["function"]["name"] == "book"
