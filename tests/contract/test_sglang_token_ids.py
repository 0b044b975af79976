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
  and `sglang.http` reads them back.
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
from dflash_regen.sglang.api import Dialect
from dflash_regen.sglang.http import make_session, stream_chat, token_ids

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
    result = stream_chat(make_session(1), id_server.url, id_server.key, payload, stall_s=30, cap_s=60)
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
