"""The SGLang client (`sglang.http.stream_chat`, `sse_data`, error sorting) through a fake `requests` transport.

`FakeAdapter` is mounted on a real `requests.Session`: `requests` builds the response and translates the
transport's errors as it does for a socket, while the body arrives in exactly the reads a test gives
(`FakeBody.stream`, what urllib3's response offers `requests.iter_content`), or fails mid-way.
"""

from __future__ import annotations

import json
import threading

import pytest
import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import ProtocolError, ReadTimeoutError

from dflash_regen.errors import AuthError, Cancelled, PromptError, ServerError, TransientError
from dflash_regen.sglang.api import Api
from dflash_regen.sglang.http import ChatResult, reasoning_tokens, sse_data, stream_chat, with_retries

URL = "http://fake:30000"


class FakeBody:
    """A response body delivered in the given reads; an exception in `reads` is raised at that point."""

    def __init__(self, reads: list):
        self.reads, self.exhausted, self.closed_early = reads, False, False

    def stream(self, chunk_size=None, decode_content=True):
        for read in self.reads:
            if isinstance(read, Exception):
                raise read
            yield read
        self.exhausted = True

    def close(self):  # `requests` calls this only for a body it did not read to the end: the socket is dropped
        self.closed_early = True

    def release_conn(self):
        pass


class FakeAdapter(HTTPAdapter):
    """Answers every request with `status` and `reads` (or raises `error`), and keeps what was sent."""

    def __init__(self, status: int = 200, reads: list | None = None, error: Exception | None = None):
        super().__init__()
        self.status, self.reads, self.error = status, reads or [], error
        self.sent: list[requests.PreparedRequest] = []
        self.bodies: list[FakeBody] = []

    def send(self, request, **kwargs):
        self.sent.append(request)
        if self.error is not None:
            raise self.error
        resp = requests.Response()
        resp.status_code, resp.url, resp.request = self.status, request.url, request
        resp.raw = FakeBody(self.reads)
        self.bodies.append(resp.raw)
        return resp


def session_with(adapter: FakeAdapter) -> requests.Session:
    session = requests.Session()
    session.mount("http://", adapter)
    return session


def event(delta: dict | None = None, finish: str | None = None, **extra) -> bytes:
    body = {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}], **extra}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "reasoning_tokens": 4}}\n\n'
ANSWER = [event({"role": "assistant", "content": ""}), event({"reasoning_content": "Let me "}),
          event({"reasoning_content": "think."}), event({"content": "Four"}), event({"content": "."}),
          event({}, "stop"), USAGE, b"data: [DONE]\n\n"]


def stream(adapter: FakeAdapter, **kwargs) -> ChatResult:
    return stream_chat(session_with(adapter), URL, "key-1", {"model": "m", "messages": []},
                       stall_s=kwargs.pop("stall_s", 5), cap_s=kwargs.pop("cap_s", 60), **kwargs)


# ------------------------------------------------------------------------------------------ SSE parsing
def test_sse_payloads_are_the_same_however_the_reads_cut_the_stream():
    whole = b"".join(ANSWER)
    expected = list(sse_data([whole]))
    assert len(expected) == len(ANSWER) and expected[-1] == b"[DONE]"
    for size in (1, 2, 7, 64):
        assert list(sse_data([whole[i:i + size] for i in range(0, len(whole), size)])) == expected


def test_sse_comments_keep_alives_other_fields_and_crlf_are_skipped():
    reads = [b": keep-alive\n\n", b"event: message\r\nid: 3\r\ndata: {\"a\": 1}\r\n\r\n", b"\n\n",
             b"data:{\"b\": 2}\n", b": ping\n", b"\ndata: [DONE]\n\n"]
    assert list(sse_data(reads)) == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]


def test_sse_a_last_line_without_its_newline_is_still_yielded():
    assert list(sse_data([b'data: {"a": 1}\n\ndata: {"cut', b" here"])) == [b'{"a": 1}', b'{"cut here']


# ----------------------------------------------------------------------------------------- assembling
def test_reasoning_content_usage_and_the_request_sent():
    adapter = FakeAdapter(reads=ANSWER)
    result = stream(adapter)
    assert (result.reasoning, result.content, result.finish_reason) == ("Let me think.", "Four.", "stop")
    assert result.usage == {"prompt_tokens": 5, "completion_tokens": 9, "reasoning_tokens": 4}
    assert reasoning_tokens(result.usage) == 4
    assert result.first_token_s is not None and result.latency_s >= result.first_token_s
    sent = adapter.sent[0]
    assert sent.headers["Authorization"] == "Bearer key-1" and sent.url == f"{URL}/v1/chat/completions"
    body = json.loads(sent.body)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_the_older_reasoning_field_is_read_too():
    result = stream(FakeAdapter(reads=[event({"reasoning": "hm"}), event({"content": "ok"}, "stop")]))
    assert (result.reasoning, result.content) == ("hm", "ok")


def test_tool_call_deltas_are_assembled_across_chunks_by_index():
    reads = [
        event({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}),
        event({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        event({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        event({"tool_calls": [{"index": 1, "id": "call_b", "function": {"name": "get_", "arguments": "{}"}}]}),
        event({"tool_calls": [{"index": 1, "function": {"name": "time"}}]}),
        event({}, "tool_calls"), b"data: [DONE]\n\n",
    ]
    result = stream(FakeAdapter(reads=reads))
    assert result.finish_reason == "tool_calls" and result.content == ""
    assert result.tool_calls == [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]


def test_the_stream_is_read_past_done_to_its_end_so_the_connection_is_reused():
    adapter = FakeAdapter(reads=ANSWER + [b": trailing keep-alive\n\n", b'data: {"ignored": true}\n\n'])
    assert stream(adapter).content == "Four."
    body = adapter.bodies[0]
    assert body.exhausted and not body.closed_early


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("status", [400, 404, 422])
def test_a_4xx_is_the_prompts_fault_with_the_servers_message(status):
    adapter = FakeAdapter(status, [b'{"object": "error", "message": "prompt too long", "code": 400}'])
    with pytest.raises(PromptError, match="prompt too long") as info:
        stream(adapter)
    assert info.value.status == status and not isinstance(info.value, TransientError)


@pytest.mark.parametrize("status", [500, 503])
def test_a_5xx_is_a_server_error_worth_retrying(status):
    with pytest.raises(ServerError, match="scheduler died") as info:
        stream(FakeAdapter(status, [b'{"error": {"message": "scheduler died"}}']))
    assert info.value.status == status and isinstance(info.value, TransientError)


def test_429_is_transient_not_the_prompts_fault():
    with pytest.raises(TransientError, match="HTTP 429") as info:
        stream(FakeAdapter(429, [b'{"message": "too many requests"}']))
    assert not isinstance(info.value, ServerError)


@pytest.mark.parametrize("status", [401, 403])
def test_401_and_403_are_the_api_keys_fault_and_say_how_to_fix_it(status):
    with pytest.raises(AuthError, match=rf"HTTP {status} .*DFLASH_SGLANG_API_KEY") as info:
        stream(FakeAdapter(status, [b'{"error": "Unauthorized"}']))
    assert not isinstance(info.value, TransientError)


def test_a_connection_refused_or_reset_before_the_answer_is_transient():
    error = requests.ConnectionError("Connection reset by peer")
    with pytest.raises(TransientError, match=r"ConnectionError connecting to http://fake:30000"):
        stream(FakeAdapter(error=error))


def test_a_stall_mid_stream_is_transient_and_named():
    stall = ReadTimeoutError(None, URL, "Read timed out. (read timeout=5)")
    with pytest.raises(TransientError, match=r"stream stalled .*no data for 5 s"):
        stream(FakeAdapter(reads=ANSWER[:3] + [stall]))


def test_a_connection_reset_mid_stream_is_transient():
    reset = ProtocolError("Connection broken: ConnectionResetError(104, 'Connection reset by peer')")
    with pytest.raises(TransientError, match="broken stream .*ChunkedEncodingError"):
        stream(FakeAdapter(reads=ANSWER[:3] + [reset]))


def test_a_body_cut_inside_an_event_is_transient():
    cut = b"".join(ANSWER[:5]) + b'data: {"choices": [{"index": 0, "delta": {"con'
    with pytest.raises(TransientError, match="broken stream .*JSONDecodeError"):
        stream(FakeAdapter(reads=[cut]))


def test_a_stream_that_ends_without_a_finish_reason_is_transient():
    with pytest.raises(TransientError, match="without a finish_reason"):
        stream(FakeAdapter(reads=ANSWER[:5] + [b"data: [DONE]\n\n"]))


def test_an_error_event_mid_stream_is_transient_with_its_message():
    with pytest.raises(TransientError, match="server aborted the stream: out of memory"):
        stream(FakeAdapter(reads=ANSWER[:3] + [b'data: {"error": {"message": "out of memory"}}\n\n']))


def test_the_overall_cap_and_the_callers_stop_end_a_stream():
    with pytest.raises(TransientError, match="overall cap of -1 s"):
        stream(FakeAdapter(reads=ANSWER), cap_s=-1)
    stop = threading.Event()
    stop.set()
    with pytest.raises(Cancelled, match="stopped by the caller"):
        stream(FakeAdapter(reads=ANSWER), stop=stop)


def test_non_streaming_calls_sort_errors_the_same_way():
    api = Api(URL, "k", session=session_with(FakeAdapter(503, [b'{"message": "warming up"}'])))
    with pytest.raises(TransientError, match="HTTP 503: warming up"):
        api.server_info()
    api = Api(URL, "k", session=session_with(FakeAdapter(401, [b"{}"])))
    with pytest.raises(AuthError):
        api.server_info()
    api = Api(URL, "k", session=session_with(FakeAdapter(400, [b'{"message": "bad"}'])))
    with pytest.raises(PromptError, match="bad"):
        api.chat({"model": "m"}, timeout_s=5)


def flaky(failures: list[Exception], answer="ok"):
    """A call that raises each of `failures` in turn, then answers; its `.calls` counts the tries."""
    def call():
        call.calls += 1
        if failures:
            raise failures.pop(0)
        return answer
    call.calls = 0
    return call


def test_the_retry_policy_retries_transient_errors_and_raises_the_last_when_tries_run_out():
    call = flaky([TransientError("reset"), ServerError(503, "busy", URL)])
    assert with_retries(call, 3, delay_s=0) == "ok" and call.calls == 3
    call = flaky([TransientError("a"), ServerError(503, "the last", URL)])
    with pytest.raises(ServerError, match="the last"):
        with_retries(call, 2, delay_s=0)
    assert call.calls == 2


def test_the_retry_policy_sends_a_prompts_fault_once():
    call = flaky([PromptError(400, "bad prompt")])
    with pytest.raises(PromptError):
        with_retries(call, 5, delay_s=0)
    assert call.calls == 1


def test_the_retry_policy_lets_its_caller_judge_each_failure_and_end_the_retries():
    """Generation probes the server after each failed try: a dead server ends the retries at once."""
    seen = []

    def judge(exc, attempt):
        seen.append((str(exc), attempt))
        if attempt == 2:
            raise Cancelled("server dead")

    call = flaky([TransientError("one"), TransientError("two"), TransientError("three")])
    with pytest.raises(Cancelled, match="server dead"):
        with_retries(call, 5, delay_s=0, on_failure=judge)
    assert seen == [("one", 1), ("two", 2)] and call.calls == 2
