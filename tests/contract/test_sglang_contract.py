"""The SGLang boundary judged by SGLang's own code, for the oldest and the newest supported version.

For each version the wheel is downloaded (`pip download --no-deps`, cached in ~/.cache/dflash-regen/sglang)
and a judge process imports its `ServerArgs.add_cli_args`, `protocol.py` models, `qwen3` reasoning parser and
`qwen3_coder` tool parser (stand-ins for the GPU stack: see judge.py). Then:
- the pipeline's exact launch argv (cookbook flags, alone and with the capacity planner's advised flags)
  must parse with that version's parser, and an argv with a flag the version lacks must not;
- the emulator, in that version's mode and launched by the pipeline's launcher, must answer with bodies
  that validate against that version's models and carry no field they lack;
- SGLang's parsers, run on the emulator's raw generated text, must give what the emulator returned;
- every series the emulator's /metrics sends in that version's mode, and every metric, label matcher, grouping
  and template variable of the monitoring profile's Grafana dashboards, must be defined so by that version's own
  metrics collector;
- raw-output fidelity: what those parsers make of a raw output, re-rendered by the chat template as the trainer
  renders it, is the raw output when written in the template's form (the emulator's every demo answer too), and
  the measured drifts are not (the tokenize stage marks those it can count);
- what the model saw: each training sample's prompt ids are the pipeline's request as this version hands it to
  the chat template (`Dialect.template_tools` is its `Tool` model's dump, key order included).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from conftest import FAST_PROFILE, free_port_block
from wheels import VERSIONS, Judge, unpacked_wheel

from dflash_regen.fleet import servers as fleet_servers
from dflash_regen.fleet.smoke import PROMPTS
from dflash_regen.settings.run_config import DEFAULTS, RunConfig
from dflash_regen.sglang.api import OLDEST, Dialect

# One xdist worker runs them all, so each version's judge and emulated server start once (module fixtures).
pytestmark = pytest.mark.xdist_group("sglang_contract")

ADVISED = "--max-mamba-cache-size 160 --max-running-requests 32"  # the capacity planner's advice on the seed node


@pytest.fixture(scope="module", params=VERSIONS)
def version(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def judge(version):
    started = time.monotonic()
    j = Judge(version)
    j.ask("flags")  # imports SGLang: the first answer is the slow one
    j.import_s = time.monotonic() - started
    yield j
    j.close()


@pytest.fixture(scope="module")
def emulated(version, tmp_path_factory):
    """One emulated server in `version`'s mode, launched by `fleet.servers.launch_fleet` (the pipeline's argv)."""
    from dflash_regen.demo.model import write_demo_model

    root = tmp_path_factory.mktemp(f"contract-{version}")
    cfg = RunConfig.from_params(params(root, version, "emulator"), f"contract-{version}")
    servers = fleet_servers.launch_fleet(cfg.fleet, write_demo_model(root / "model"), cfg.fleet_dir)
    try:
        yield Server(servers[0].url, fleet_servers.read_api_key(cfg.fleet_dir), servers[0], cfg)
    finally:
        fleet_servers.stop_fleet(cfg.fleet_dir)


def params(root, version: str, command: str, server_flags: str = "") -> dict:
    return {**DEFAULTS, "server_command": command, "num_servers": 1, "base_port": free_port_block(1),
            "output_root": str(root / "out"), "staging_dir": str(root / "model"), "ready_timeout_s": 60.0,
            "server_flags": server_flags, "emulator_profile": {**FAST_PROFILE, "sglang_version": version},
            "emulator_faults": {}}


class Server:
    def __init__(self, url: str, key: str, launched: fleet_servers.Server, cfg: RunConfig):
        self.url, self.key, self.launched, self.cfg = url, key, launched, cfg

    def post(self, body: dict, **kw) -> requests.Response:
        return requests.post(f"{self.url}/v1/chat/completions", json=body, timeout=60,
                             headers={"Authorization": f"Bearer {self.key}"}, **kw)

    def get(self, path: str, auth: bool = True) -> requests.Response:
        return requests.get(self.url + path, timeout=30, headers={"Authorization": f"Bearer {self.key}"} if auth
                            else {})


def conforms(emulated, judged, path: str = "$") -> None:
    """Every field the emulator sent is a field of SGLang's model, with the value SGLang's model keeps."""
    if isinstance(emulated, dict):
        assert isinstance(judged, dict), f"{path}: an object where SGLang's model has {judged!r}"
        for key, value in emulated.items():
            assert key in judged, f"{path}.{key}: not a field of SGLang's model ({sorted(judged)})"
            conforms(value, judged[key], f"{path}.{key}")
    elif isinstance(emulated, list):
        assert isinstance(judged, list) and len(emulated) == len(judged), path
        for i, (a, b) in enumerate(zip(emulated, judged, strict=True)):
            conforms(a, b, f"{path}[{i}]")
    else:
        assert emulated == judged, f"{path}: emulator {emulated!r}, SGLang's model {judged!r}"


def valid(judge: Judge, model: str, body: dict) -> dict:
    verdict = judge.ask("validate", model=model, data=body)
    assert verdict["ok"], f"SGLang {judge.version} {model} rejects the emulator's body: {verdict['error']}"
    conforms(body, verdict["dump"])
    return verdict


# ---------------------------------------------------------------------------------------------- argv
@pytest.mark.parametrize("server_flags", ["", ADVISED], ids=["cookbook", "cookbook+advised"])
def test_the_pipelines_argv_parses_with_sglangs_own_parser(judge, version, tmp_path, server_flags):
    cfg = RunConfig.from_params(params(tmp_path, version, f"{sys.executable} -m sglang.launch_server",
                                       server_flags), "argv")
    [server] = fleet_servers.plan_servers(cfg.fleet, tmp_path / "model", tmp_path, "key", Dialect(version))
    parsed = judge.ask("parse_argv", argv=server.argv[3:])
    assert parsed["exit"] == 0, parsed["stderr"]
    args = parsed["args"]
    strategy = args.get("mamba_radix_cache_strategy") or args.get("mamba_scheduler_strategy")
    assert (strategy, args["speculative_algorithm"], args["reasoning_parser"], args["tool_call_parser"]) == \
        ("extra_buffer", "EAGLE", "qwen3", "qwen3_coder")
    if server_flags:
        assert (args["max_mamba_cache_size"], args["max_running_requests"]) == (160, 32)
    # The environment: SGLANG_ENABLE_SPEC_V2 is set exactly where the version still reads it.
    env = Dialect(version).launch_env(dict(cfg.fleet.env))
    read = judge.ask("source_contains", path="sglang/srt/environ.py", text="SGLANG_ENABLE_SPEC_V2")["found"]
    assert ("SGLANG_ENABLE_SPEC_V2" in env) == read


def test_every_autotune_candidates_argv_parses_with_sglangs_own_parser(judge, version, tmp_path):
    from dflash_regen import capacity
    from dflash_regen.capacity import autotune

    seed_node = capacity.Memory(server="s", kv_tokens=1_140_000, running_slots=16, max_running_requests=48,
                                mamba_slots=80, mamba_ratio=5, kv_gb=34.8, mamba_gb=30.9, reserve_gb=27.9)
    candidates = autotune.default_candidates(seed_node, 2400)
    # The seed's node: Mamba state, not KV, fills the memory: 5 slots and MTP's draft state per request leave room
    # for 32; without MTP's reserve 40; with 1 slot per request (radix cache off) 64, the most tried (4x).
    assert [c.name for c in candidates] == ["current", "mamba pool x2", "radix cache off at 64", "MTP off at 40",
                                            "FP8 KV cache at 32"]
    for cand in candidates:
        cfg = RunConfig.from_params(params(tmp_path, version, f"{sys.executable} -m sglang.launch_server",
                                           cand.flags), "argv")
        [server] = fleet_servers.plan_servers(cfg.fleet, tmp_path / "model", tmp_path, "key", Dialect(version))
        parsed = judge.ask("parse_argv", argv=server.argv[3:])
        assert parsed["exit"] == 0, (cand.name, parsed["stderr"])
        args = parsed["args"]
        if "MTP off" in cand.name:
            assert args["speculative_algorithm"] is None
        if cand.name.startswith("radix cache off"):
            assert args["disable_radix_cache"] is True and args["max_running_requests"] == 64
        if cand.name.startswith("FP8 KV cache"):
            assert args["kv_cache_dtype"] == "fp8_e4m3"


def test_the_argv_check_fails_on_a_flag_the_version_lacks(judge, version, tmp_path):
    other = "--mamba-radix-cache-strategy" if version == OLDEST else "--mamba-scheduler-strategy"
    argv = ["--model-path", str(tmp_path), other, "extra_buffer"]
    parsed = judge.ask("parse_argv", argv=argv)
    assert parsed["exit"] == 2 and f"unrecognized arguments: {other}" in parsed["stderr"]
    # The emulator in that version's mode refuses it the same way.
    env = {"DFLASH_EMU_PROFILE": json.dumps({"sglang_version": version}), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "dflash_regen.emulator", *argv], capture_output=True, text=True,
                          env=env, timeout=60, check=False)
    assert done.returncode == 2 and f"unrecognized arguments: {other}" in done.stderr


# ------------------------------------------------------------------------------------------ responses
def test_non_streaming_answers_validate_against_sglangs_models(judge, version, emulated):
    coding = emulated.post({"model": "qwen3.6-27b", "messages": PROMPTS["coding"]["messages"], "seed": 1}).json()
    valid(judge, "ChatCompletionResponse", coding)
    assert coding["choices"][0]["message"]["reasoning_content"] and coding["usage"]["reasoning_tokens"] > 0
    tool = emulated.post({"model": "m", "seed": 2, **{k: v for k, v in PROMPTS["tool_call"].items()
                                                      if k in ("messages", "tools")}}).json()
    valid(judge, "ChatCompletionResponse", tool)
    assert tool["choices"][0]["finish_reason"] == "tool_calls" and tool["choices"][0]["message"]["tool_calls"]
    cut = emulated.post({"model": "m", "messages": PROMPTS["coding"]["messages"], "max_tokens": 64}).json()
    valid(judge, "ChatCompletionResponse", cut)
    choice, usage = cut["choices"][0], cut["usage"]
    assert choice["finish_reason"] == "length" and usage["reasoning_tokens"] == usage["completion_tokens"] == 64
    # Each version's own forms: empty content, and where reasoning tokens are also reported.
    assert choice["message"]["content"] == (None if version == OLDEST else "")
    assert ("completion_tokens_details" in usage) == (version != OLDEST)


def test_every_sse_chunk_validates_including_the_usage_chunk(judge, emulated):
    body = {"model": "m", "seed": 3, "stream": True, "stream_options": {"include_usage": True},
            **{k: v for k, v in PROMPTS["tool_call"].items() if k in ("messages", "tools")}}
    with emulated.post(body, stream=True) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == b"data: [DONE]"
    chunks = [json.loads(line[len(b"data: "):]) for line in lines[:-1]]
    for chunk in chunks:
        valid(judge, "ChatCompletionStreamResponse", chunk)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_error_bodies_and_the_model_list_are_sglangs(judge, emulated):
    bad = emulated.post({"model": "m", "messages": []})
    assert bad.status_code == 400
    valid(judge, "ErrorResponse", bad.json())
    unauthorized = requests.get(f"{emulated.url}/v1/models", timeout=30)
    assert unauthorized.status_code == 401 and unauthorized.json() == {"error": "Unauthorized"}
    assert judge.ask("source_contains", path="sglang/srt/utils/auth.py", text='"Unauthorized"')["found"]
    missing = emulated.get("/v1/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert judge.ask("source_contains", path="sglang/srt/entrypoints/http_server.py",
                     text='"code": "model_not_found"')["found"]
    valid(judge, "ModelList", emulated.get("/v1/models").json())


def test_health_check_names_the_mamba_binding_although_the_top_level_is_null(version, emulated):
    from dflash_regen.capacity.health import probe_server

    info = emulated.get("/server_info").json()
    assert info["version"] == version and info["max_mamba_cache_size"] is None  # the CLI echo, as SGLang's
    health = probe_server(emulated.launched, emulated.key, emulated.cfg.fleet)
    assert health.healthy and health.version == version
    assert health.allocation["mamba_slots"] == 80 and health.allocation["running_slots"] == 16
    assert health.binding == "Mamba slots (80 // 5 = 16)"
    assert "--max-mamba-cache-size 160 --max-running-requests 32" in health.advice


# ------------------------------------------------------------------------------------------ metrics
DASHBOARDS = Path(__file__).resolve().parents[2] / "deploy" / "monitoring" / "grafana" / "dashboards"
BASE_LABELS = {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"}  # SGLang's `labels` dicts here
TARGET_LABELS = {"instance", "job"}  # the labels Prometheus adds to every scraped series
SAMPLE = re.compile(r"^(sglang:[A-Za-z0-9_]+)(?:\{(.*)\})? \S+$", re.M)


def sglang_metric_families(version: str) -> dict[str, list[tuple[str, set[str]]]]:
    """Every `Gauge`/`Counter`/`Histogram` SGLang `version`'s own metrics collector defines: name -> [(type,
    label names beyond its collector's `labels`)], read from the source (the collector imports the GPU stack)."""
    source = unpacked_wheel(version) / "sglang" / "srt" / "observability" / "metrics_collector.py"
    out: dict[str, list[tuple[str, set[str]]]] = {}
    for node in ast.walk(ast.parse(source.read_text())):
        kind = getattr(getattr(node, "func", None), "id", None) or getattr(getattr(node, "func", None), "attr", None)
        if not isinstance(node, ast.Call) or kind not in ("Gauge", "Counter", "Histogram"):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        if isinstance(kw.get("name"), ast.Constant):
            extras = {n.value for n in ast.walk(kw["labelnames"]) if isinstance(n, ast.Constant)} \
                if "labelnames" in kw else set()
            out.setdefault(kw["name"].value, []).append((kind.lower(), extras))
    return out


def exported_families(text: str) -> dict[str, tuple[str, set[str], set[str]]]:
    """/metrics text -> name -> (TYPE, label names beyond the base ones, every label name), histogram series
    under their family."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    out: dict[str, tuple[str, set[str], set[str]]] = {}
    for name, labels in SAMPLE.findall(text):
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        names = set(re.findall(r'(\w+)="', labels)) - {"le"}
        kind, extras, seen = out.get(family, (types[family], set(), set()))
        out[family] = (kind, extras | (names - BASE_LABELS), seen | names)
    return out


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL) of every panel target the monitoring profile provisions, and
    (file, "variable NAME", its label_values() query) of every template variable."""
    out = []
    for path in sorted(DASHBOARDS.rglob("*.json")):
        dashboard = json.loads(path.read_text())
        out += [(path.name, panel["title"], target["expr"])
                for panel in dashboard["panels"] for target in panel.get("targets", [])]
        out += [(path.name, f"variable {v['name']}", v["definition"]) for v in dashboard["templating"]["list"]]
    return out


def test_the_emulators_metrics_are_this_versions_names_and_labels(version, emulated):
    emulated.post({"model": "m", "messages": PROMPTS["coding"]["messages"], "max_tokens": 64})
    families = sglang_metric_families(version)
    exported = exported_families(requests.get(emulated.url + "/metrics", timeout=30).text)
    for name, (kind, extras, _) in exported.items():
        assert name in families, f"SGLang {version} has no metric {name}"
        assert (kind, extras) in families[name], f"SGLang {version} defines {name} as {families[name]}, the " \
                                                 f"emulator sends a {kind} with labels {extras} beyond the base"
    # the is_streaming split and the startup metric's rename at 0.5.18 (emulator/versions.py)
    assert ("sglang:engine_startup_time" in exported) == ("sglang:engine_startup_time" in families)
    assert ("sglang:startup_time_seconds" in exported) == ("sglang:startup_time_seconds" in families)


def test_every_dashboard_query_names_metrics_and_labels_this_version_exports(version, emulated):
    families = sglang_metric_families(version)
    exported = exported_families(requests.get(emulated.url + "/metrics", timeout=30).text)
    queries = dashboard_queries()
    assert {file for file, _, _ in queries} == {"fleet.json", "pipeline.json"}
    assert {"variable instance", "variable model_name"} <= {title for file, title, _ in queries if file == "fleet.json"}
    for file, title, expr in queries:
        labels = set(TARGET_LABELS)  # every label the query's SGLang series carry
        for name, matchers in re.findall(r"(sglang:[A-Za-z0-9_]+)(?:\{([^}]*)\})?", expr):
            family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in families else name
            assert family in families, f"{file} '{title}': SGLang {version} has no metric {name}"
            assert family in exported, f"{file} '{title}': the emulator in {version}'s mode does not export {name}"
            for label in set(re.findall(r"(\w+)\s*[=!]~?", matchers)) - TARGET_LABELS:
                assert label in exported[family][2], f"{file} '{title}': {name} has no label {label}"
            labels |= exported[family][2] | ({"le"} if name.endswith("_bucket") else set())
        for grouping in re.findall(r"\bby\s*\(([^)]*)\)", expr) if "sglang:" in expr else []:  # sum by (le)
            for label in filter(None, re.split(r"\s*,\s*", grouping.strip())):
                assert label in labels, f"{file} '{title}': groups by {label}, which its series do not carry"


# ------------------------------------------------------------------------------------------ parsers
@pytest.mark.parametrize("prompt", ["coding", "tool_call"])
def test_sglangs_parsers_on_the_raw_text_give_what_the_emulator_returned(judge, version, emulated, prompt):
    from dflash_regen.emulator import model as emulated_model
    from dflash_regen.emulator.faults import load_profile

    spec = PROMPTS[prompt]
    tools = spec.get("tools")
    gen = emulated_model.generate(emulated_model.ModelInput(messages=spec["messages"], tools=tools, seed=7),
                                  load_profile({"DFLASH_EMU_PROFILE": json.dumps(FAST_PROFILE)}), limit=16384)
    raw = emulated_model.decode([i for i in gen.token_ids if i != emulated_model.IM_END])
    answer = emulated.post({"model": "m", "messages": spec["messages"], "seed": 7, "max_tokens": 16384,
                            **({"tools": tools} if tools else {})}).json()["choices"][0]["message"]
    split = judge.ask("reasoning", text=raw, force=True)
    assert answer["reasoning_content"] == split["reasoning"]
    content = split["content"]
    if tools:
        parsed = judge.ask("tools", text=content, tools=tools)
        content = parsed["content"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answer["tool_calls"]] == \
            [(c["name"], c["arguments"]) for c in parsed["calls"]] != []
    assert (answer["content"] or "") == (content or "").strip()


# ---------------------------------------------------------------------------------------- raw-output fidelity
def _call_xml(params: list[tuple[str, str]]) -> str:
    return ("<tool_call>\n<function=f>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
            + "</function>\n</tool_call>")


FIDELITY_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}, "x": {"type": "number"}, "s": {"type": "string"}, "o": {"type": "object"},
    "b": {"type": "boolean"}}}}}]
# Raw generated text (after the prompt's `<think>\n`) in the form the template writes: it round-trips. Measured with
# both versions' parsers (docs/sglang-versions.md's raw-output fidelity figures), these do not: whitespace around
# `</think>` other than "\n</think>\n\n", trailing whitespace in the answer (the template trims it), and tool-call
# values the parser re-types: `1.50` -> 1.5, `{"a":1}` -> {"a": 1}, `True` -> true.
ROUND_TRIPS = {
    "answer": "I think.\n</think>\n\nThe answer.",
    "empty reasoning": "\n</think>\n\nThe answer.",
    "call": "I call.\n</think>\n\n" + _call_xml([("n", "3"), ("s", "hi")]),
    "call after text": "I call.\n</think>\n\nLet me check.\n\n" + _call_xml([("n", "3")]),
    "call values": "I call.\n</think>\n\n" + _call_xml([("x", "2.5"), ("s", "line one\nline two"), ("o", '{"a": 1}'),
                                                       ("b", "true")]),
}
DRIFTS = {
    "no newline before </think>": "I think.</think>\n\nThe answer.",
    "one newline after </think>": "I think.\n</think>\nThe answer.",
    "trailing space": "I think.\n</think>\n\nThe answer. ",
    "float 1.50": "I call.\n</think>\n\n" + _call_xml([("x", "1.50")]),
    "compact object": "I call.\n</think>\n\n" + _call_xml([("o", '{"a":1}')]),
}


@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory):
    from dflash_regen.chat.template import load_tokenizer
    from dflash_regen.demo.model import default_tokenizer_cache, write_demo_model

    return load_tokenizer(write_demo_model(tmp_path_factory.mktemp("model"), shards=1, shard_bytes=1024,
                                           with_tokenizer=True, tokenizer_cache=default_tokenizer_cache()))


def rerendered(judge: Judge, tok, raw: str, tools: list[dict] | None = FIDELITY_TOOLS,
               prompt: list[dict] | None = None) -> tuple[str, int | None]:
    """(the assistant span the trainer renders from what SGLang's qwen3 and qwen3_coder parsers make of `raw`, the
    tokenize stage's `rerender_token_delta` for it, with the server's count: `raw`'s tokens and its `<|im_end|>`)."""
    from dflash_regen.chat.template import ASSISTANT_HEADER, render, tokenize_batch
    from dflash_regen.training.tokenize import rerender_token_delta

    parsed = judge.ask("reasoning", text=raw, force=True)
    calls = judge.ask("tools", text=parsed["content"] or "", tools=tools) if tools else {"calls": []}
    turn = {"role": "assistant", "reasoning_content": parsed["reasoning"],
            "content": calls["content"] if calls["calls"] else parsed["content"] or ""}
    if calls["calls"]:
        turn["tool_calls"] = [{"id": f"c{i}", "type": "function", "function": {
            "name": c["name"], "arguments": json.dumps(c["arguments"])}} for i, c in enumerate(calls["calls"])]
    conversation = [*(prompt or [{"role": "user", "content": "q"}]), turn]
    text = render(tok, conversation, tools)
    [(ids, _)] = tokenize_batch(tok, [(conversation, tools)])
    generated = len(tok.backend_tokenizer.encode(raw, add_special_tokens=False).ids) + 1
    delta = rerender_token_delta(ids, {"enable_thinking": True, "finish_reason": "stop",
                                       "completion_tokens": generated},
                                 tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("<|im_end|>"))
    return text[text.rindex(ASSISTANT_HEADER) + len(ASSISTANT_HEADER):text.rindex("<|im_end|>")], delta


def test_raw_output_in_the_templates_form_round_trips_through_sglangs_parsers_and_the_template(judge,
                                                                                               demo_tokenizer):
    back = {name: rerendered(judge, demo_tokenizer, raw) for name, raw in ROUND_TRIPS.items()}
    assert {name: text for name, (text, _) in back.items()} == ROUND_TRIPS
    # The per-sample mark counts tokens: 0 for each, but an empty reasoning's "\n" (the server's first token, after
    # the prompt's "\n") merges with the prompt's into one "\n\n" in the trainer's ids.
    assert {name: delta for name, (_, delta) in back.items()} == {**dict.fromkeys(ROUND_TRIPS, 0),
                                                                  "empty reasoning": -1}
    drifted = {name: rerendered(judge, demo_tokenizer, raw) for name, raw in DRIFTS.items()}
    assert all(drifted[name][0] != raw for name, raw in DRIFTS.items()), drifted
    # The count sees a drift that changes the token count; "\n" and "\n\n" are one token each, so a newline
    # fewer after `</think>` is re-rendered unseen (a lower bound: docs/sglang-versions.md).
    assert {name for name, (_, delta) in drifted.items() if delta} == set(DRIFTS) - {"one newline after </think>"}


def test_every_emulated_demo_answer_re_renders_as_the_emulator_generated_it(judge, demo_tokenizer, tmp_path):
    """The emulator writes the template's own form: on the demo's prompts, each raw output (thinking on, not cut)
    parsed by this version's parsers and re-rendered by the template is the raw output, text and token count."""
    from dflash_regen.demo.prompts import write_demo_prompts
    from dflash_regen.emulator import model as emulated_model
    from dflash_regen.emulator.faults import load_profile
    from dflash_regen.prompts.formats import Prompt, parse_row

    profile = load_profile({"DFLASH_EMU_PROFILE": json.dumps(FAST_PROFILE)})
    lines = write_demo_prompts(tmp_path / "prompts.jsonl").read_text().splitlines()
    rows = [p for i, line in enumerate(lines) if isinstance(p := parse_row(f"l{i}", line), Prompt)]
    differ, compared = [], 0
    for seed, p in enumerate(rows):
        gen = emulated_model.generate(emulated_model.ModelInput(messages=p.messages, tools=p.tools, seed=seed),
                                      profile, limit=16384)
        if gen.think_end_index is None:
            continue
        raw = emulated_model.decode([i for i in gen.token_ids if i != emulated_model.IM_END])
        compared += 1
        if rerendered(judge, demo_tokenizer, raw, p.tools, p.messages) != (raw, 0):
            differ.append(p.sample_id)
    assert compared > 100 and differ == []


# ------------------------------------------------------------------ what the model saw = what training renders
SEEN_TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": {  # `type` last: a repaired schema's order
        "properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}}},
    {"type": "function", "function": {"description": "Réserve — 预订", "name": "book", "strict": True, "parameters": {
        "type": "object", "properties": {"unit": {"type": "string", "enum": ["metric", "imperial"]},
                                         "rooms": {"type": "array", "items": {"type": "object"}}}}}},
    {"type": "function", "function": {"name": "search"}},  # no description, no parameters
]
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]}
SEEN = [  # (prompt messages as planning keeps them, tools, the generated turn)
    ([{"role": "user", "content": "Weather in Paris?"}], SEEN_TOOLS,
     {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": CALL["tool_calls"]}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}, CALL,
      {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "c1"}, {"role": "user", "content": "東京は?"}],
     SEEN_TOOLS[:2], {"role": "assistant", "content": "曇り。", "reasoning_content": "No tool needed."}),
    ([{"role": "user", "content": "Hi"}], None, {"role": "assistant", "content": "Hello.", "reasoning_content": "Hi."}),
]


def test_each_training_samples_prompt_is_the_prompt_sglang_rendered_for_the_model(judge, version, demo_tokenizer,
                                                                                   tmp_path):
    """The pipeline's request, as this SGLang version's own models hand it to the chat template (messages and
    `tools` model-dumped, serving_chat.py), rendered by the model's template with the request's
    `chat_template_kwargs`, is token for token the start of the training sample's `input_ids` (the tokenize
    stage, its tools from `Dialect.template_tools`), and its loss mask starts right after it."""
    from dflash_regen.chat import template
    from dflash_regen.generate.samples import chat_payload
    from dflash_regen.training.tokenize import training_conversations

    cfg = RunConfig.from_params(params(tmp_path, version, "emulator"), "seen")
    dialect = Dialect(version)
    for messages, tools, turn in SEEN:
        payload = chat_payload(messages, tools, cfg.generation, seed=1, max_tokens=64)
        request = valid(judge, "ChatCompletionRequest", payload)["dump"]
        if tools:
            assert dialect.template_tools(tools) == request["tools"]  # key order too: compared as JSON text
            assert json.dumps(dialect.template_tools(tools)) == json.dumps(request["tools"])
        prompt = demo_tokenizer.apply_chat_template(
            template._with_parsed_arguments([{**m, "content": m.get("content") or ""} for m in request["messages"]]),
            tools=request.get("tools"), tokenize=False, add_generation_prompt=True, **payload["chat_template_kwargs"])
        prompt_ids = demo_tokenizer.backend_tokenizer.encode(prompt, add_special_tokens=False).ids
        # The tokenize stage's own conversation: the shard's prompt row and the completion row, as parquet holds them.
        prompt_row = {"sample_id": "s", "messages": json.dumps(messages), "tools": json.dumps(tools) if tools else None}
        completion_row = {"sample_id": "s", "assistant_turns": json.dumps([turn])}
        [(ids, mask)] = template.tokenize_batch(demo_tokenizer, training_conversations(
            {"s": prompt_row}, [completion_row], dialect))
        assert ids[:len(prompt_ids)].tolist() == prompt_ids, (version, prompt[-300:])
        assert mask[:len(prompt_ids)].sum() == 0 and mask[len(prompt_ids)] == 1
