"""The emulator as a real process on 127.0.0.1: flags, startup log, endpoints, slots, shutdown, faults.

Every process is started from an explicit argv like the fleet launcher does, and the fixtures always stop
it: SIGTERM must end a live server with exit code 0 within ~2 s, and no process may be left behind.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from dflash_regen.demo.model import write_demo_model
from dflash_regen.emulator.versions import DEFAULT_VERSION

COOKBOOK = ["--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder", "--speculative-algorithm", "EAGLE",
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
            "--mamba-scheduler-strategy", "extra_buffer", "--mem-fraction-static", "0.8"]
FAST = {"decode_tokens_per_s": 20000, "startup_s": 0.05}
KEY = "test-key-123"
PRIME = {"model": "qwen3.6-27b", "max_tokens": 512, "temperature": 0.6, "top_p": 0.95,
         "messages": [{"role": "user", "content": "Write a Python function to check if a number is prime."}]}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
WEATHER = {"model": "m", "max_tokens": 8192, "tools": [WEATHER_TOOL],
           "messages": [{"role": "user", "content": "What's the weather like in Paris right now?"}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Emu:
    proc: subprocess.Popen
    port: int
    out: Path
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.out.read_text(errors="replace")

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, timeout: float = 10, **kw) -> requests.Response:
        return requests.get(self.url + path, headers=self.headers(), timeout=timeout, **kw)

    def chat(self, body: dict, timeout: float = 30, **kw) -> requests.Response:
        return requests.post(self.url + "/v1/chat/completions", json=body, headers=self.headers(), timeout=timeout,
                             **kw)

    def wait_ready(self, timeout: float = 20) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"emulator exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - started
            except requests.ConnectionError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"emulator not ready after {timeout} s:\n{self.log()[-3000:]}")


def _start(model: Path, log_dir: Path, flags, *, faults=None, profile=None, env=None, api_key=None,
           gpu="0") -> Emu:
    port = free_port()
    argv = [sys.executable, "-m", "dflash_regen.emulator", "--model-path", str(model), "--served-model-name",
            "qwen3.6-27b", "--host", "127.0.0.1", "--port", str(port), *flags]
    if api_key:
        argv += ["--api-key", api_key]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_EMU", "SGLANG_"))}
    full_env.update({"CUDA_VISIBLE_DEVICES": gpu, "PYTHONUNBUFFERED": "1",
                     "DFLASH_EMU_PROFILE": json.dumps({**FAST, **(profile or {})})})
    if faults is not None:
        full_env["DFLASH_EMU_FAULTS"] = json.dumps(faults)
    full_env.update(env or {})
    out = log_dir / f"emulator-{port}.log"
    with open(out, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
                                start_new_session=True)
    return Emu(proc, port, out, api_key)


def _stop(emu: Emu, expect_graceful: bool = True) -> None:
    """SIGTERM a live server (it must exit 0, within 10 s even on a loaded 2-core box), SIGKILL anything left, assert
    it is gone."""
    proc = emu.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
            raise AssertionError(f"emulator ignored SIGTERM for 10 s:\n{emu.log()[-2000:]}") from None
        if expect_graceful:
            assert code == 0, f"SIGTERM exit code {code}:\n{emu.log()[-2000:]}"
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # nothing of its process group may survive
    except ProcessLookupError:
        pass
    assert proc.poll() is not None
    assert not Path(f"/proc/{proc.pid}").exists() or "Z" in Path(f"/proc/{proc.pid}/stat").read_text().split()[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("model"), shards=1, shard_bytes=1024)


@pytest.fixture
def launch(model_dir, tmp_path):
    """Start emulator processes for one test; all of them are stopped (and checked gone) afterwards."""
    started: list[Emu] = []

    def start(*flags, wait=True, **kw) -> Emu:
        emu = _start(model_dir, tmp_path, flags, **kw)
        started.append(emu)
        if wait:
            emu.wait_ready()
        return emu

    yield start
    for emu in started:
        _stop(emu)


@pytest.fixture(scope="module")
def cookbook(model_dir, tmp_path_factory):
    """One server launched with the cookbook's flags, an API key and metrics, shared by read-only tests."""
    emu = _start(model_dir, tmp_path_factory.mktemp("cookbook"), [*COOKBOOK, "--enable-metrics"],
                 env={"SGLANG_ENABLE_SPEC_V2": "1"}, api_key=KEY)
    try:
        emu.ready_s = emu.wait_ready()
        yield emu
    finally:
        _stop(emu)


def sse_events(resp: requests.Response) -> list:
    events = []
    for line in resp.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def joined(events: list, field: str) -> str:
    return "".join(e["choices"][0]["delta"].get(field) or "" for e in events
                   if isinstance(e, dict) and e["choices"])


# --------------------------------------------------------------------------------------- launch flags
def run_to_exit(model_dir, *flags, env=None, timeout=20) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_EMU", "SGLANG_"))}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "dflash_regen.emulator", "--model-path", str(model_dir),
                           "--port", str(free_port()), *flags], capture_output=True, text=True, timeout=timeout,
                          env=full_env, check=False)


def test_unknown_flag_and_bad_choice_fail_like_argparse(model_dir):
    done = run_to_exit(model_dir, "--no-such-flag")
    assert done.returncode == 2 and done.stderr.startswith("usage: ")
    assert "error: unrecognized arguments: --no-such-flag" in done.stderr
    done = run_to_exit(model_dir, "--tool-call-parser", "qwen3")
    assert done.returncode == 2
    assert "error: argument --tool-call-parser: invalid choice: 'qwen3'" in done.stderr


def test_speculative_decoding_with_no_buffer_and_radix_cache_is_sglangs_value_error(model_dir):
    done = run_to_exit(model_dir, "--speculative-algorithm", "EAGLE")
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr
    assert "ValueError: Speculative decoding for Qwen3_5ForConditionalGeneration is not compatible with radix " \
           "cache when using --mamba-scheduler-strategy no_buffer." in done.stderr
    assert "Max running requests is reset to 48 for speculative decoding" in done.stderr


def test_a_model_dir_without_config_json_and_bad_fault_json_exit_1_with_a_clear_message(model_dir, tmp_path):
    done = run_to_exit(tmp_path / "nowhere")
    assert done.returncode == 1 and "a directory containing a config.json file" in done.stderr
    done = run_to_exit(model_dir, env={"DFLASH_EMU_FAULTS": '{"0": {"crash_now": true}}'})
    assert done.returncode == 1 and "DFLASH_EMU_FAULTS: unknown key 'crash_now'" in done.stderr


# ------------------------------------------------------------------------------------- cookbook server
def test_seed_allocation_in_server_info_and_startup_log(cookbook):
    from dflash_regen.capacity.health import parse_startup_log

    info = cookbook.get("/server_info").json()
    state = info["internal_states"][0]
    assert abs(info["max_total_num_tokens"] - 1_140_000) / 1_140_000 < 0.02
    # The top level echoes the command line (as SGLang's does); the sized pool is in the scheduler's state.
    assert info["max_mamba_cache_size"] is None and info["max_running_requests"] == 48
    assert state["max_mamba_cache_size"] == 80 and state["effective_max_running_requests_per_dp"] == 16
    assert 33 <= state["memory_usage"]["kvcache"] <= 37
    assert state["memory_usage"]["token_capacity"] == info["max_total_num_tokens"]
    assert info["version"] == DEFAULT_VERSION and info["status"] == "ready" and info["speculative_algorithm"] == "EAGLE"
    assert info["max_req_input_len"] == min(262143, info["max_total_num_tokens"] - 1) - 5
    log = cookbook.log()
    figures = parse_startup_log(log)
    assert figures == {"kv_tokens": info["max_total_num_tokens"], "kv_cache_gb": pytest.approx(34.78, abs=0.05),
                       "mamba_slots": 80, "running_slots": 16, "context_len": 262144,
                       "mamba_gb": pytest.approx(30.94, abs=0.05), "mamba_reserve_gb": pytest.approx(27.9, abs=0.05)}
    assert re.search(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] Load weight end\. elapsed=[\d.]+ s, "
                     r"type=Qwen3_5ForConditionalGeneration, ", log, re.M)
    assert log.index("max_total_num_tokens=") < log.index("Uvicorn running on") < log.index(
        "The server is fired up and ready to roll!")
    assert "api_key='***'" in log and KEY not in log


def test_the_seeds_512_token_prime_case_streamed_and_not(cookbook):
    body = cookbook.chat(PRIME).json()
    choice, usage = body["choices"][0], body["usage"]
    assert usage["completion_tokens"] == 512 and usage["reasoning_tokens"] == 512
    assert usage["total_tokens"] == usage["prompt_tokens"] + 512 and usage["prompt_tokens_details"] is None
    # 0.5.13+ (the default 0.5.16): an empty answer is "" (0.5.10: null; tests/contract checks both)
    assert choice["message"]["content"] == "" and choice["finish_reason"] == "length"
    assert choice["matched_stop"] is None and 1200 <= len(choice["message"]["reasoning_content"]) <= 1900
    assert re.fullmatch(r"[0-9a-f]{32}", body["id"]) and body["model"] == "qwen3.6-27b"

    with cookbook.chat({**PRIME, "stream": True, "stream_options": {"include_usage": True}}, stream=True) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert joined(events, "reasoning_content") == choice["message"]["reasoning_content"]
    assert joined(events, "content") == ""
    finish = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["choices"] == [] and events[-2]["usage"] == usage


def test_a_production_max_tokens_answer_has_reasoning_then_content(cookbook):
    body = cookbook.chat({**PRIME, "max_tokens": 8192}).json()
    choice, usage = body["choices"][0], body["usage"]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == 248046
    assert choice["message"]["reasoning_content"] and "```python" in choice["message"]["content"]
    assert 600 < usage["reasoning_tokens"] < usage["completion_tokens"] < 8192
    with cookbook.chat({**PRIME, "max_tokens": 8192, "stream": True}, stream=True) as resp:
        events = sse_events(resp)
    assert joined(events, "content").strip() == choice["message"]["content"]
    assert joined(events, "reasoning_content").strip() == choice["message"]["reasoning_content"].strip()
    assert len(events) < 200  # coalesced: not one SSE chunk per token at 20,000 tokens/s


def test_tool_call_is_parsed_by_qwen3_coder(cookbook):
    body = cookbook.chat(WEATHER).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["matched_stop"] is None
    assert choice["message"]["content"] == "" and choice["message"]["reasoning_content"]
    (call,) = choice["message"]["tool_calls"]
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"]) and call["index"] == 0 and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    with cookbook.chat({**WEATHER, "stream": True}, stream=True) as resp:
        events = sse_events(resp)
    deltas = [d for e in events[:-1] if e["choices"] for d in e["choices"][0]["delta"].get("tool_calls") or []]
    assert deltas[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"city": "Paris"}
    assert [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]][0]["choices"][0][
        "finish_reason"] == "tool_calls"
    after = {**WEATHER, "messages": WEATHER["messages"] + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "18 C and sunny"}]}
    answer = cookbook.chat(after).json()["choices"][0]
    assert answer["finish_reason"] == "stop" and "18 C and sunny" in answer["message"]["content"]


def test_thinking_off_gives_no_reasoning(cookbook):
    body = cookbook.chat({**PRIME, "max_tokens": 8192, "chat_template_kwargs": {"enable_thinking": False}}).json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"].startswith("Here's a Python function")
    assert body["usage"]["reasoning_tokens"] == 0 and body["choices"][0]["finish_reason"] == "stop"
    with_thinking = cookbook.chat({**PRIME, "max_tokens": 8192}).json()
    assert with_thinking["usage"]["prompt_tokens"] < body["usage"]["prompt_tokens"]  # the empty think block


def test_api_key_is_required_except_on_health_metrics_and_ping(cookbook):
    url = cookbook.url
    assert requests.get(f"{url}/v1/models", timeout=5).status_code == 401
    assert requests.get(f"{url}/v1/models", timeout=5).json() == {"error": "Unauthorized"}
    assert requests.get(f"{url}/server_info", timeout=5, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert requests.post(f"{url}/v1/chat/completions", json=PRIME, timeout=5).status_code == 401
    assert requests.get(f"{url}/v1/models", timeout=5, headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    for path in ("/health", "/health_generate", "/ping", "/metrics"):
        assert requests.get(url + path, timeout=5).status_code == 200, path
    models = cookbook.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "qwen3.6-27b"
    assert models["data"][0]["owned_by"] == "sglang" and models["data"][0]["max_model_len"] == 262144
    assert cookbook.get("/v1/models/qwen3.6-27b").json()["id"] == "qwen3.6-27b"
    missing = cookbook.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    info = cookbook.get("/model_info").json()
    assert info["architectures"] == ["Qwen3_5ForConditionalGeneration"] and info["is_generation"] is True
    assert cookbook.get("/get_model_info").json() == info


def test_bad_requests_get_sglangs_flat_400_errors(cookbook):
    empty = cookbook.chat({"model": "m", "messages": []})
    assert empty.status_code == 400
    assert empty.json() == {"object": "error", "message": "Messages cannot be empty.", "type": "BadRequestError",
                            "param": None, "code": 400}
    wrong_type = requests.post(cookbook.url + "/v1/chat/completions", data=json.dumps(PRIME), timeout=5,
                               headers={**cookbook.headers(), "Content-Type": "text/plain"})
    assert wrong_type.status_code == 400 and wrong_type.json()["type"] == "Bad Request"
    assert "Only 'application/json' is allowed" in wrong_type.json()["message"]
    bad_role = cookbook.chat({"model": "m", "messages": [{"role": "robot", "content": "hi"}]})
    assert bad_role.status_code == 400 and bad_role.json()["code"] == 400
    too_long = cookbook.chat({**PRIME, "max_tokens": 262144})
    assert too_long.status_code == 400
    assert too_long.json()["message"].startswith("Requested token count exceeds the model's maximum context length "
                                                 "of 262144 tokens. You requested a total of ")


def test_metrics_use_sglangs_names_and_labels(cookbook):
    cookbook.chat({**PRIME, "max_tokens": 64})
    text = requests.get(cookbook.url + "/metrics", timeout=5).text
    labels = 'engine_type="unified",model_name="qwen3.6-27b",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    for gauge in ("num_running_reqs", "num_queue_reqs", "gen_throughput", "max_total_num_tokens"):
        assert re.search(rf"^sglang:{gauge}\{{{re.escape(labels)}\}} [\d.e+-]+$", text, re.M), gauge
    for counter in ("prompt_tokens_total", "generation_tokens_total", "num_requests_total"):
        match = re.search(rf'^sglang:{counter}\{{model_name="qwen3.6-27b"\}} ([\d.]+)$', text, re.M)
        assert match and float(match.group(1)) > 0, counter


# ------------------------------------------------------------------------------- other configurations
def test_nextn_becomes_eagle_with_48_requests_and_no_metrics_without_the_flag(launch):
    emu = launch("--speculative-algorithm", "NEXTN", "--disable-radix-cache", "--context-length", "8192")
    info = emu.get("/server_info").json()
    assert info["speculative_algorithm"] == "EAGLE" and info["max_running_requests"] == 48
    assert (info["speculative_num_steps"], info["speculative_eagle_topk"], info["speculative_num_draft_tokens"]) == \
        (3, 1, 4)
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 48  # no radix: ratio 1
    assert "Max running requests is reset to 48 for speculative decoding." in emu.log()
    assert emu.get("/metrics").status_code == 404
    long_prompt = {"model": "m", "messages": [{"role": "user", "content": "word " * 9000}]}
    over = emu.chat(long_prompt)
    assert over.status_code == 400 and re.fullmatch(
        r"The input \(\d+ tokens\) is longer than the model's context length \(8192 tokens\)\.", over.json()["message"])
    too_many = emu.chat({**PRIME, "max_tokens": 9000})
    assert too_many.json()["message"] == "max_completion_tokens is too large: 9000.This model supports at most " \
                                         "8192 completion tokens."
    # No --reasoning-parser and no --tool-call-parser: the raw output, thinking and XML, is the content.
    raw = emu.chat({**WEATHER, "max_tokens": 6000}).json()["choices"][0]
    assert raw["message"]["tool_calls"] is None and raw["finish_reason"] == "stop"
    assert raw["message"]["reasoning_content"] is None
    assert raw["message"]["content"].endswith("</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                                              "Paris\n</parameter>\n</function>\n</tool_call>")


def test_slots_cap_running_requests_and_extra_requests_queue_fifo(launch):
    emu = launch("--max-running-requests", "2", "--disable-radix-cache", "--max-queued-requests", "4",
                 "--enable-metrics", profile={"decode_tokens_per_s": 1000})
    body = {**PRIME, "max_tokens": 300}
    seen = {"running": 0, "queued": 0}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            text = requests.get(emu.url + "/metrics", timeout=5).text
            for key, name in (("running", "num_running_reqs"), ("queued", "num_queue_reqs")):
                value = float(re.search(rf"^sglang:{name}\{{.*\}} ([\d.]+)$", text, re.M).group(1))
                seen[key] = max(seen[key], value)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: emu.chat(body), range(6)))
    elapsed = time.monotonic() - started
    stop.set()
    watcher.join()
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 300 for r in results)
    assert seen["running"] == 2 and seen["queued"] >= 2
    assert elapsed >= 0.8  # 3 waves of 0.3 s: never more than 2 at once
    assert emu.get("/server_info").json()["internal_states"][0]["effective_max_running_requests_per_dp"] == 2

    with ThreadPoolExecutor(9) as pool:  # 2 running + 4 queued fit; the rest are refused
        codes = list(pool.map(lambda _: emu.chat(body), range(9)))
    full = [r for r in codes if r.status_code == 503]
    assert full and full[0].json() == {"object": "error", "message": "The request queue is full.", "type": "503",
                                       "param": None, "code": 503}
    assert sum(r.status_code == 200 for r in codes) >= 6


def test_a_client_disconnect_frees_its_slot(launch):
    # A looping answer runs to max_tokens: the held request would keep the one slot for ~200 s, so a quick request
    # answered within its (generous) timeout proves the disconnect freed it, however busy the machine is.
    emu = launch("--max-running-requests", "1", "--disable-radix-cache", profile={"decode_tokens_per_s": 300},
                 faults={"*": {"loop_substring": "prime"}})
    slow = {**PRIME, "max_tokens": 60000, "stream": True}
    with emu.chat(slow, stream=True) as resp:
        next(resp.iter_lines())  # generating; the one slot is taken
    assert emu.chat({**PRIME, "max_tokens": 30}, timeout=90).status_code == 200
    try:
        emu.chat({**PRIME, "max_tokens": 60000}, timeout=0.3)  # non-streaming client gives up
    except requests.Timeout:
        pass
    assert emu.chat({**PRIME, "max_tokens": 30}, timeout=90).status_code == 200


def test_decode_and_prefill_lines_are_logged_at_runtime(launch):
    emu = launch(*COOKBOOK, "--decode-log-interval", "4", env={"SGLANG_ENABLE_SPEC_V2": "1"},
                 profile={"decode_tokens_per_s": 3000})
    emu.chat({**PRIME, "max_tokens": 1500})
    log = emu.log()
    decode = re.findall(r"Decode batch, #running-req: (\d+), #full token: \d+, full token usage: [\d.]+, mamba num: "
                        r"\d+, mamba usage: [\d.]+, accept len: ([\d.]+), accept rate: [\d.]+, cuda graph: True, "
                        r"gen throughput \(token/s\): ([\d.]+), #queue-req: 0", log)
    assert decode and all(r == "1" for r, _, _ in decode)
    assert 2.5 < float(decode[-1][1]) < 3.6 and float(decode[-1][2]) > 1000
    assert re.search(r"Prefill batch, #new-seq: 1, #new-token: \d+, #cached-token: 0, ", log)


def test_health_fails_when_a_long_prefill_starves_the_scheduler_past_the_timeout(launch):
    emu = launch(env={"SGLANG_HEALTH_CHECK_TIMEOUT": "1"}, profile={"prefill_tokens_per_s": 1000})
    long_prompt = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "word " * 3000}]}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(lambda: emu.chat(long_prompt, timeout=20))
        # Once its ~3 s prefill runs, no token comes out of the scheduler: /health's probe waits 1 s, then 503.
        # A probe admitted before the long prompt answers 200 at once: ask again until one meets the prefill.
        deadline = time.monotonic() + 10
        while True:
            started = time.monotonic()
            status = requests.get(emu.url + "/health", timeout=5).status_code
            took = time.monotonic() - started
            if status == 503 or time.monotonic() > deadline or pending.done():
                break
        assert status == 503 and took >= 0.9, (status, took)  # it waited its 1 s for a token first
        assert pending.result().status_code == 200
    assert requests.get(emu.url + "/health", timeout=5).status_code == 200  # busy, not dead (sglang#22511)
    assert "Health check failed. Server couldn't get a response from detokenizer for last 1 seconds." in emu.log()
    assert emu.chat({**PRIME, "max_tokens": -1}).status_code == 400


def test_sigterm_while_a_request_runs_exits_0_quickly(launch):
    emu = launch("--enable-metrics", profile={"decode_tokens_per_s": 100})
    worker = ThreadPoolExecutor(1)
    pending = worker.submit(lambda: emu.chat({**PRIME, "max_tokens": 5000}, timeout=10))
    deadline = time.monotonic() + 10
    while re.search(r"^sglang:num_running_reqs\{.*\} 1(\.0)?$", emu.get("/metrics").text, re.M) is None:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.02)
    emu.proc.send_signal(signal.SIGTERM)
    assert emu.proc.wait(timeout=5) == 0
    with pytest.raises(requests.RequestException):
        pending.result().raise_for_status()
    worker.shutdown()


# ------------------------------------------------------------------------------------------- faults
def test_low_kv_and_mamba_allocation_faults_are_reported_everywhere(launch):
    emu = launch(*COOKBOOK, env={"SGLANG_ENABLE_SPEC_V2": "1"}, gpu="3",
                 faults={"3": {"kv_tokens": 200_000, "max_mamba_slots": 40}, "4": {"crash_at_start": True}})
    info = emu.get("/server_info").json()
    state = info["internal_states"][0]
    assert info["max_total_num_tokens"] == 200_000 and state["max_mamba_cache_size"] == 40
    assert state["effective_max_running_requests_per_dp"] == 8
    assert "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 200000, K size: 3.05 GB, V size: 3.05 GB" \
        in emu.log()
    assert "max_running_requests=8," in emu.log()


def test_empty_content_closes_thinking_without_an_answer(launch):
    emu = launch(*COOKBOOK, env={"SGLANG_ENABLE_SPEC_V2": "1"}, faults={"*": {"empty_content": True}})
    choice = emu.chat({**PRIME, "max_tokens": 8192}).json()["choices"][0]
    assert choice["message"]["content"] == "" and choice["message"]["reasoning_content"]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == 248046


def test_crash_at_start_prints_a_traceback_and_exits_1(launch):
    emu = launch(wait=False, faults={"0": {"crash_at_start": True}})
    assert emu.proc.wait(timeout=20) == 1
    log = emu.log()
    assert "Capture cuda graph begin" in log and "Capture cuda graph failed: CUDA out of memory" in log
    assert "Traceback (most recent call last)" in log and "RuntimeError: CUDA out of memory" in log
    assert "Uvicorn running" not in log


def test_start_delay_keeps_the_server_down_that_long(launch):
    emu = launch(wait=False, faults={"0": {"start_delay_s": 1.5}})
    assert emu.wait_ready() >= 1.5


def test_crash_after_requests_kills_the_process_on_the_next_arrival(launch):
    emu = launch(faults={"0": {"crash_after_requests": 2}})
    for _ in range(2):
        assert emu.chat({**PRIME, "max_tokens": 20}).status_code == 200
    with pytest.raises(requests.ConnectionError):
        emu.chat({**PRIME, "max_tokens": 20})
    assert emu.proc.wait(timeout=5) == -signal.SIGKILL
    assert "Received sigquit from a child process. It usually means the child failed." in emu.log()


def test_http_error_rate_answers_5xx_with_sglang_error_bodies(launch):
    emu = launch(faults={"*": {"http_error_rate": 1.0}})
    codes = set()
    for _ in range(8):
        resp = emu.chat({**PRIME, "max_tokens": 20})
        body = resp.json()
        assert resp.status_code in (500, 503) and body["code"] == resp.status_code and body["object"] == "error"
        codes.add(resp.status_code)
    assert codes == {500, 503}
    assert emu.chat({"model": "m", "messages": []}).status_code == 400  # validation still comes first


def test_half_error_rate_is_deterministic_per_arrival(launch):
    first = launch(faults={"*": {"http_error_rate": 0.5}})
    second = launch(faults={"*": {"http_error_rate": 0.5}})
    runs = [[e.chat({**PRIME, "max_tokens": 5}).status_code for _ in range(12)] for e in (first, second)]
    assert runs[0] == runs[1] and 200 in runs[0] and set(runs[0]) - {200}


def test_hang_holds_the_connection_silent(launch):
    emu = launch(faults={"0": {"hang_rate": 1.0}})
    with pytest.raises(requests.Timeout):
        emu.chat({**PRIME, "max_tokens": 20}, timeout=0.5)
    with emu.chat({**PRIME, "max_tokens": 20, "stream": True}, stream=True, timeout=(2, 0.5)) as resp:
        assert resp.status_code == 200  # headers arrived...
        with pytest.raises(requests.ConnectionError):  # ...then nothing (requests wraps the read timeout)
            next(resp.iter_lines())
    assert requests.get(emu.url + "/health", timeout=5).status_code == 200


def test_dead_scheduler_hangs_generation_and_server_info_while_health_says_200(launch):
    emu = launch(faults={"0": {"dead_scheduler_after_requests": 1}})
    assert emu.chat({**PRIME, "max_tokens": 20}).status_code == 200
    with pytest.raises(requests.Timeout):
        emu.chat({**PRIME, "max_tokens": 20}, timeout=0.5)
    with pytest.raises(requests.Timeout):
        emu.get("/server_info", timeout=0.5)
    assert requests.get(emu.url + "/health", timeout=5).status_code == 200
    assert requests.get(emu.url + "/health_generate", timeout=5).status_code == 200
    assert emu.get("/model_info", timeout=5).status_code == 200


def test_loop_repeats_one_sentence_until_max_tokens(launch):
    emu = launch("--reasoning-parser", "qwen3", faults={"*": {"loop_substring": "prime"}})
    body = emu.chat({**PRIME, "max_tokens": 3000}).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3000
    reasoning = choice["message"]["reasoning_content"]
    assert choice["message"]["content"] == "" and reasoning.count("Wait, let me re-check that step again") > 100
    other = emu.chat({**PRIME, "max_tokens": 8192, "messages": [{"role": "user", "content": "Say hi."}]}).json()
    assert other["choices"][0]["finish_reason"] == "stop"


def test_any_prompt_text_gets_an_answer_over_http_streamed_and_not(cookbook):
    # Braces and format specs once made the answer generator raise (HTTP 500 for every such prompt).
    for i, text in enumerate(["{", "unmatched '{' in {format} spec {0:>{w}} %s", '{"type": "object"}', "}{",
                              "\ud800 lone surrogate", "\u202e\u200b e\u0301 \U0001F600 日本語？", "<think></think>"]):
        body = {**PRIME, "max_tokens": 300, "seed": i, "messages": [{"role": "user", "content": text}],
                **({"tools": [WEATHER_TOOL]} if i % 2 else {})}
        resp = cookbook.chat(body)
        assert resp.status_code == 200, (text, resp.text)
        assert resp.json()["choices"][0]["finish_reason"] in {"stop", "length", "tool_calls"}
        with cookbook.chat({**body, "stream": True}, stream=True) as streamed:
            events = sse_events(streamed)
        assert events[-1] == "[DONE]" and any(e["choices"][0]["finish_reason"] for e in events[:-1]
                                              if e["choices"]), text
