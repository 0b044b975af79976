"""Token ids judged by SGLang's own code, on each version with a different form (issue 37).

Read from the wheels (protocol.py's request and response models, serving_chat.py that fills them):
0.5.10 has none; 0.5.13 `return_prompt_token_ids` -> `choices[i].prompt_token_ids` (0.5.16 here: the default
version); 0.5.17 `return_token_ids` -> `choices[i].token_ids`; 0.5.18 renames it `response_token_ids`; 0.5.20
`return_input_ids_in_sglext`/`return_output_ids_in_sglext` -> `sglext.input_ids`/`sglext.output_ids`, streamed
too (0.5.23 here: the newest). For each, the emulator in that version's mode:
- answers a request asking for every id field with a body SGLang's `ChatCompletionResponse` accepts and keeps
  field for field, the id fields present exactly where the version has them;
- its prompt ids are the request, as that version's models dump it, rendered by the model's template; its output
  ids are the raw generation through `<|im_end|>`, as many as `completion_tokens`;
- streams chunks SGLang's `ChatCompletionStreamResponse` accepts, the ids in a chunk of their own after the finish
  chunk and before usage, and refuses the choice-level ids with `stream` as serving_chat.py does;
- the pipeline's own request (`Dialect.token_ids_request`) asks only for fields the version's request model has,
  and `sglang.api` reads them back.
"""

from __future__ import annotations

import json

import pytest
import requests
from test_sglang_contract import Server, params, valid
from wheels import Judge

from dflash_regen.fleet import servers as fleet_servers
from dflash_regen.fleet.smoke import PROMPTS
from dflash_regen.settings.run_config import RunConfig
from dflash_regen.sglang.api import Api, Dialect, token_ids

pytestmark = pytest.mark.xdist_group("sglang_contract")

ID_VERSIONS = ["0.5.10", "0.5.16", "0.5.17", "0.5.23"]
ASK_ALL = {"return_prompt_token_ids": True, "return_token_ids": True, "return_input_ids_in_sglext": True,
           "return_output_ids_in_sglext": True}
IM_END = 248046


@pytest.fixture(scope="module", params=ID_VERSIONS)
def id_version(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def id_judge(id_version):
    j = Judge(id_version)  # protocol models only: 0.5.16's ServerArgs does not import beside this transformers
    yield j
    j.close()


@pytest.fixture(scope="module")
def id_server(id_version, tmp_path_factory):
    from dflash_regen.demo.model import default_tokenizer_cache, write_demo_model

    root = tmp_path_factory.mktemp(f"ids-{id_version}")
    cfg = RunConfig.from_params(params(root, id_version, "emulator"), f"ids-{id_version}")
    model = write_demo_model(root / "model", with_tokenizer=True, tokenizer_cache=default_tokenizer_cache())
    servers = fleet_servers.launch_fleet(cfg.fleet, model, cfg.fleet_dir)
    try:
        yield Server(servers[0].url, fleet_servers.read_api_key(cfg.fleet_dir), servers[0], cfg)
    finally:
        fleet_servers.stop_fleet(cfg.fleet_dir)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from dflash_regen.chat.template import load_tokenizer
    from dflash_regen.demo.model import default_tokenizer_cache, write_demo_model

    return load_tokenizer(write_demo_model(tmp_path_factory.mktemp("tok"), shards=1, shard_bytes=1024,
                                           with_tokenizer=True, tokenizer_cache=default_tokenizer_cache()))


def expected_fields(version: str) -> dict[str, bool]:
    """Which id fields this version's response carries (the forms read from its wheel)."""
    d = Dialect(version)
    return {"prompt_token_ids": d.at_least("0.5.13"), "token_ids": d.at_least("0.5.17") and not d.at_least("0.5.18"),
            "response_token_ids": d.at_least("0.5.18"), "sglext": d.at_least("0.5.20")}


def sglang_prompt_ids(judge: Judge, tok, payload: dict) -> list[int]:
    """The prompt as this version's server renders it: the request as its `ChatCompletionRequest` dumps it, through
    the model's template with the request's `chat_template_kwargs` and a generation prompt (serving_chat.py)."""
    from dflash_regen.chat import template

    verdict = judge.ask("validate", model="ChatCompletionRequest", data=payload)
    assert verdict["ok"], verdict
    request = verdict["dump"]
    text = tok.apply_chat_template(
        template._with_parsed_arguments([{**m, "content": m.get("content") or ""} for m in request["messages"]]),
        tools=request.get("tools"), tokenize=False, add_generation_prompt=True,
        **(payload.get("chat_template_kwargs") or {}))
    return tok.backend_tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("prompt", ["coding", "tool_call"])
def test_non_streaming_ids_validate_and_are_present_exactly_where_the_version_has_them(id_judge, id_version,
                                                                                      id_server, tok, prompt):
    spec = PROMPTS[prompt]
    payload = {"model": "m", "seed": 5, "max_tokens": 4096, "messages": spec["messages"],
               "chat_template_kwargs": {"enable_thinking": True}, **({"tools": spec["tools"]} if spec.get("tools")
                                                                     else {}), **ASK_ALL}
    # Every version's request model takes the fields (older ones ignore those they lack).
    assert id_judge.ask("validate", model="ChatCompletionRequest", data=payload)["ok"]
    body = id_server.post(payload).json()
    valid(id_judge, "ChatCompletionResponse", body)  # every field sent is one of the model's, with its value
    choice = body["choices"][0]
    present = {"prompt_token_ids": "prompt_token_ids" in choice, "token_ids": "token_ids" in choice,
               "response_token_ids": "response_token_ids" in choice, "sglext": "sglext" in body}
    assert present == expected_fields(id_version)
    prompt_ids, output_ids = token_ids(body)
    if not any(present.values()):
        assert (prompt_ids, output_ids) == (None, None)
        return
    assert prompt_ids == sglang_prompt_ids(id_judge, tok, payload)
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    if present["token_ids"] or present["response_token_ids"] or present["sglext"]:
        assert output_ids[-1] == IM_END and len(output_ids) == body["usage"]["completion_tokens"]
        if present["sglext"]:
            assert body["sglext"] == {"input_ids": prompt_ids, "output_ids": [output_ids]}
            assert choice.get("response_token_ids") == output_ids
    else:
        assert output_ids is None


def test_streamed_ids_come_in_a_chunk_of_their_own_after_the_finish_chunk(id_judge, id_version, id_server, tok):
    dialect = Dialect(id_version)
    payload = {"model": "m", "seed": 6, "max_tokens": 4096, "messages": PROMPTS["coding"]["messages"],
               "chat_template_kwargs": {"enable_thinking": True}, **dialect.token_ids_request(stream=True)}
    asked = set(dialect.token_ids_request(stream=True))
    assert asked == ({"return_input_ids_in_sglext", "return_output_ids_in_sglext"} if dialect.at_least("0.5.20")
                     else set())
    fields = valid(id_judge, "ChatCompletionRequest", payload)["fields"]
    assert asked <= set(fields)
    body = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    with id_server.post(body, stream=True) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == b"data: [DONE]"
    chunks = [json.loads(line[len(b"data: "):]) for line in lines[:-1]]
    for chunk in chunks:
        valid(id_judge, "ChatCompletionStreamResponse", chunk)
    with_ids = [i for i, c in enumerate(chunks) if "sglext" in c]
    if not asked:
        assert with_ids == []
        return
    finish = next(i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0].get("finish_reason"))
    assert with_ids == [finish + 1] and chunks[-1]["usage"] and finish + 1 == len(chunks) - 2
    ext = chunks[finish + 1]["sglext"]
    assert chunks[finish + 1]["choices"] == []
    assert ext["input_ids"] == sglang_prompt_ids(id_judge, tok, payload)
    assert ext["output_ids"][0][-1] == IM_END and len(ext["output_ids"][0]) == chunks[-1]["usage"]["completion_tokens"]
    # The pipeline's reader puts them in its result.
    with Api(id_server.url, id_server.key, pool_size=1) as api:
        result = api.stream(payload, stall_s=30, cap_s=60)
    assert (result.prompt_ids, result.output_ids) == (ext["input_ids"], ext["output_ids"][0])


def test_choice_level_ids_are_refused_with_stream_where_serving_chat_refuses_them(id_judge, id_version, id_server):
    """0.5.13+ refuses `return_prompt_token_ids` with `stream`, 0.5.17+ `return_token_ids` too (a ValueError in
    serving_chat.py: a 400); before, the fields do not exist and are ignored."""
    dialect = Dialect(id_version)
    for field, since, words in (("return_prompt_token_ids", "0.5.13", "return_prompt_token_ids is not supported "
                                 "with streaming"),
                                ("return_token_ids", "0.5.17", "return_token_ids is not supported with streaming")):
        resp = id_server.post({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                               "stream": True, field: True}, stream=True)
        with resp:
            if dialect.at_least(since):
                assert resp.status_code == 400 and words in resp.json()["message"]
                valid(id_judge, "ErrorResponse", resp.json())
                assert id_judge.ask("source_contains", path="sglang/srt/entrypoints/openai/serving_chat.py",
                                    text=words)["found"]
            else:
                assert resp.status_code == 200
                assert b"sglext" not in b"".join(resp.iter_content(None))


def test_the_pipelines_non_streaming_request_asks_only_for_fields_the_version_has(id_judge, id_version, id_server):
    dialect = Dialect(id_version)
    asked = dialect.token_ids_request(stream=False)
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, **asked}
    assert set(asked) <= set(valid(id_judge, "ChatCompletionRequest", payload)["fields"])
    body = id_server.post(payload).json()
    prompt_ids, output_ids = token_ids(body)
    assert (prompt_ids is not None) == dialect.at_least("0.5.13")
    assert (output_ids is not None) == dialect.at_least("0.5.17")


def test_a_wrong_prompt_ids_fault_changes_only_the_ids(tmp_path, tok):
    """The sabotage the prompt-id gate must catch: the ids the server reports are not the client's rendering."""
    from dflash_regen.demo.model import default_tokenizer_cache, write_demo_model

    cfg = RunConfig.from_params({**params(tmp_path, "0.5.23", "emulator"), "emulator_faults": {
        "*": {"wrong_prompt_ids_substring": "SABOTAGE"}}}, "ids-fault")
    model = write_demo_model(tmp_path / "model", with_tokenizer=True, tokenizer_cache=default_tokenizer_cache())
    [server] = fleet_servers.launch_fleet(cfg.fleet, model, cfg.fleet_dir)
    try:
        key = fleet_servers.read_api_key(cfg.fleet_dir)
        ask = {"model": "m", "max_tokens": 16, "seed": 1, **Dialect("0.5.23").token_ids_request(stream=False)}
        post = lambda text: requests.post(f"{server.url}/v1/chat/completions", timeout=30,  # noqa: E731
                                          headers={"Authorization": f"Bearer {key}"},
                                          json={**ask, "messages": [{"role": "user", "content": text}]}).json()
        good, bad = post("hello there"), post("hello SABOTAGE")
        rendered = tok.apply_chat_template([{"role": "user", "content": "hello SABOTAGE"}], tokenize=False,
                                           add_generation_prompt=True, enable_thinking=True)
        ids = tok.backend_tokenizer.encode(rendered, add_special_tokens=False).ids
        assert token_ids(bad)[0] != ids and len(token_ids(bad)[0]) == len(ids) + 1
        assert token_ids(good)[0] == tok.backend_tokenizer.encode(tok.apply_chat_template(
            [{"role": "user", "content": "hello there"}], tokenize=False, add_generation_prompt=True,
            enable_thinking=True), add_special_tokens=False).ids
    finally:
        fleet_servers.stop_fleet(cfg.fleet_dir)


# ------------------------------------------------------------------ measured: re-render vs token-exact vs online
def _call(params: list[tuple[str, str]]) -> str:
    return ("<tool_call>\n<function=f>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
            + "</function>\n</tool_call>")


CRAFTED_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}, "x": {"type": "number"}, "s": {"type": "string"}, "o": {"type": "object"},
    "b": {"type": "boolean"}}}}}]
_T, _C = "I think.\n</think>\n\n", "I call.\n</think>\n\n"
# Raw generations (after the prompt's `<think>\n`) and the cause a re-render from the parsed fields has to differ.
CRAFTED = {
    "answer": (_T + "The answer.", "none"),
    "call": (_C + _call([("n", "3"), ("s", "hi")]), "none"),
    "call after text": (_C + "Let me check.\n\n" + _call([("n", "3")]), "none"),
    "call values": (_C + _call([("x", "2.5"), ("s", "line one\nline two"), ("o", '{"a": 1}'), ("b", "true")]),
                    "none"),
    "non-ASCII answer": ("Je réfléchis — 考虑.\n</think>\n\nRéponse : 東京 🌸.", "none"),
    "non-ASCII value": (_C + _call([("s", "東京 — Zürich"), ("o", '{"city": "東京"}')]), "none"),
    "two calls": (_C + _call([("n", "1")]) + "\n" + _call([("n", "2")]), "none"),
    "empty reasoning": ("\n</think>\n\nThe answer.", "whitespace"),
    "no newline before </think>": ("I think.</think>\n\nThe answer.", "whitespace"),
    "one newline after </think>": ("I think.\n</think>\nThe answer.", "whitespace"),
    "three newlines after </think>": ("I think.\n</think>\n\n\nThe answer.", "whitespace"),
    "blank line before </think>": ("I think.\n\n</think>\n\nThe answer.", "whitespace"),
    "leading newline in reasoning": ("\nI think.\n</think>\n\nThe answer.", "whitespace"),
    "trailing space": (_T + "The answer. ", "whitespace"),
    "trailing newline": (_T + "The answer.\n", "whitespace"),
    "float 1.50": (_C + _call([("x", "1.50")]), "tool_value"),
    "compact object": (_C + _call([("o", '{"a":1}')]), "tool_value"),
    "Python True": (_C + _call([("b", "True")]), "tool_value"),
    "nested compact JSON": (_C + _call([("o", '{"a":{"b":[1,2]}}')]), "tool_value"),
    "integer 007": (_C + _call([("n", "007")]), "tool_value"),
    "float 1e3": (_C + _call([("x", "1e3")]), "tool_value"),
}


def test_crafted_outputs_through_sglangs_parsers_drift_when_re_rendered_and_not_when_token_exact(id_judge, tok,
                                                                                                 tmp_path):
    """Each crafted raw output split by this version's `qwen3` and `qwen3_coder` parsers into the fields the server
    returns, then through the real tokenize stage with the server's ids: the re-render from the parsed fields drifts
    by the expected cause; the published ids are the model's, every one; the published `conversations` record
    re-renders (SpecForge's online path) to them except where the template normalizes whitespace. The figures are
    docs/sglang-versions.md's and the README's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflash_regen.layout import RunLayout
    from dflash_regen.training.tokenize import tokenize_shard

    user = [{"role": "user", "content": "q"}]
    prompt_ids = tok.backend_tokenizer.encode(tok.apply_chat_template(
        user, tools=CRAFTED_TOOLS, tokenize=False, add_generation_prompt=True, enable_thinking=True),
        add_special_tokens=False).ids
    prompts, rows, outputs = [], [], {}
    for name, (raw, _) in CRAFTED.items():
        parsed = id_judge.ask("reasoning", text=raw, force=True)
        calls = id_judge.ask("tools", text=parsed["content"] or "", tools=CRAFTED_TOOLS)
        turn = {"role": "assistant", "reasoning_content": parsed["reasoning"],
                "content": calls["content"] if calls["calls"] else parsed["content"] or ""}
        if calls["calls"]:
            turn["tool_calls"] = [{"id": f"c{i}", "type": "function", "function": {
                "name": c["name"], "arguments": json.dumps(c["arguments"])}} for i, c in enumerate(calls["calls"])]
        outputs[name] = tok.backend_tokenizer.encode(raw, add_special_tokens=False).ids + [IM_END]
        prompts.append({"sample_id": name, "messages": json.dumps(user), "tools": json.dumps(CRAFTED_TOOLS)})
        rows.append({"sample_id": name, "finish_reason": "tool_calls" if calls["calls"] else "stop",
                     "content": turn["content"], "reasoning_content": turn["reasoning_content"],
                     "tool_calls": json.dumps(turn.get("tool_calls")) if calls["calls"] else None,
                     "think_marker_leak": False, "enable_thinking": True, "completion_tokens": len(outputs[name]),
                     "assistant_turns": json.dumps([turn]), "server_prompt_ids": prompt_ids,
                     "server_output_ids": outputs[name]})
    pq.write_table(pa.Table.from_pylist(prompts), tmp_path / "prompts.parquet")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "completions.parquet")
    layout = RunLayout(tmp_path / "run")
    layout.tokenized(0).parent.mkdir(parents=True)
    tokenize_shard(tmp_path / "prompts.parquet", tmp_path / "completions.parquet", layout, 0, tok,
                   include_reasoning=True)
    summary = {r["sample_id"]: r for r in pq.read_table(layout.summary(0)).to_pylist()}
    tokens = {r["sample_id"]: r["input_ids"] for r in pq.read_table(layout.tokenized(0)).to_pylist()}
    assert {name: summary[name]["rerender_drift"] for name in CRAFTED} == {n: c for n, (_, c) in CRAFTED.items()}
    newline = tok.backend_tokenizer.encode("\n", add_special_tokens=False).ids
    assert all(tokens[name] == prompt_ids + outputs[name] + newline for name in CRAFTED)  # token-exact: 0 drift
    online = {name for name in CRAFTED if summary[name]["record_exact"]}
    assert online == {n for n, (_, cause) in CRAFTED.items() if cause != "whitespace"}
    # 21 outputs: re-rendered, 14 drift (8 whitespace, 6 tool values); token-exact 0; the online path 8 (whitespace).
    assert (len(CRAFTED), sum(c != "none" for _, c in CRAFTED.values()), len(CRAFTED) - len(online)) == (21, 14, 8)
