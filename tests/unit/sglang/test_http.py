"""The SGLang client (`sglang/http.py` under `sglang.api.Api`: streaming, `sse_data`, error sorting, retries).

Most tests use a fake transport (`httpx.MockTransport`) on a real `httpx.Client`: httpx builds the response
while the body arrives in exactly the reads a test gives (`FakeBody`), or fails mid-way with the exception
httpx's own transport raises for that fault (`ReadTimeout` for silence, `RemoteProtocolError` for a cut body).
A few use a real socket (`SilentServer`), so the stall is httpx's read timeout firing, not a raised fake.
"""

from __future__ import annotations

import json
import random
import socket
import threading

import httpx
import pytest

from dflash_regen.errors import AuthError, Cancelled, PromptError, ServerError, TransientError
from dflash_regen.sglang.api import Api, ChatResult, reasoning_tokens, with_retries
from dflash_regen.sglang.http import backoff_s, make_client, sse_data, stream_chat

URL = "http://fake:30000"


class FakeBody(httpx.SyncByteStream):
    """A response body delivered in the given reads; an exception in `reads` is raised at that point."""

    def __init__(self, reads: list):
        self.reads, self.exhausted, self.closed_early = reads, False, False

    def __iter__(self):
        for read in self.reads:
            if isinstance(read, Exception):
                raise read
            yield read
        self.exhausted = True

    def close(self):  # a body closed before its end drops the connection instead of returning it to the pool
        self.closed_early = not self.exhausted


class FakeTransport(httpx.MockTransport):
    """Answers every request with `status` and `reads` (or raises `error`), and keeps what was sent."""

    def __init__(self, status: int = 200, reads: list | None = None, error: Exception | None = None):
        super().__init__(self.answer)
        self.status, self.reads, self.error = status, reads or [], error
        self.sent: list[httpx.Request] = []
        self.bodies: list[FakeBody] = []

    def answer(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        if self.error is not None:
            raise self.error
        self.bodies.append(FakeBody(self.reads))
        return httpx.Response(self.status, stream=self.bodies[-1])


def client_with(transport: FakeTransport) -> httpx.Client:
    return httpx.Client(transport=transport)


def event(delta: dict | None = None, finish: str | None = None, **extra) -> bytes:
    body = {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}], **extra}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "reasoning_tokens": 4}}\n\n'
ANSWER = [event({"role": "assistant", "content": ""}), event({"reasoning_content": "Let me "}),
          event({"reasoning_content": "think."}), event({"content": "Four"}), event({"content": "."}),
          event({}, "stop"), USAGE, b"data: [DONE]\n\n"]


def stream(transport: FakeTransport, **kwargs) -> ChatResult:
    return stream_chat(client_with(transport), URL, "key-1", {"model": "m", "messages": []},
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
    transport = FakeTransport(reads=ANSWER)
    result = stream(transport)
    assert (result.reasoning, result.content, result.finish_reason) == ("Let me think.", "Four.", "stop")
    assert result.usage == {"prompt_tokens": 5, "completion_tokens": 9, "reasoning_tokens": 4}
    assert reasoning_tokens(result.usage) == 4
    assert result.first_token_s is not None and result.latency_s >= result.first_token_s
    sent = transport.sent[0]
    assert sent.headers["Authorization"] == "Bearer key-1" and sent.url == f"{URL}/v1/chat/completions"
    body = json.loads(sent.content)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_the_older_reasoning_field_is_read_too():
    result = stream(FakeTransport(reads=[event({"reasoning": "hm"}), event({"content": "ok"}, "stop")]))
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
    result = stream(FakeTransport(reads=reads))
    assert result.finish_reason == "tool_calls" and result.content == ""
    assert result.tool_calls == [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]


def test_the_stream_is_read_past_done_to_its_end_so_the_connection_is_reused():
    transport = FakeTransport(reads=ANSWER + [b": trailing keep-alive\n\n", b'data: {"ignored": true}\n\n'])
    assert stream(transport).content == "Four."
    body = transport.bodies[0]
    assert body.exhausted and not body.closed_early


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("status", [400, 404, 422])
def test_a_4xx_is_the_prompts_fault_with_the_servers_message(status):
    transport = FakeTransport(status, [b'{"object": "error", "message": "prompt too long", "code": 400}'])
    with pytest.raises(PromptError, match="prompt too long") as info:
        stream(transport)
    assert info.value.status == status and not isinstance(info.value, TransientError)


@pytest.mark.parametrize("status", [500, 503])
def test_a_5xx_is_a_server_error_worth_retrying(status):
    with pytest.raises(ServerError, match="scheduler died") as info:
        stream(FakeTransport(status, [b'{"error": {"message": "scheduler died"}}']))
    assert info.value.status == status and isinstance(info.value, TransientError)


def test_429_is_transient_not_the_prompts_fault():
    with pytest.raises(TransientError, match="HTTP 429") as info:
        stream(FakeTransport(429, [b'{"message": "too many requests"}']))
    assert not isinstance(info.value, ServerError)


@pytest.mark.parametrize("status", [401, 403])
def test_401_and_403_are_the_api_keys_fault_and_say_how_to_fix_it(status):
    with pytest.raises(AuthError, match=rf"HTTP {status} .*DFLASH_SGLANG_API_KEY") as info:
        stream(FakeTransport(status, [b'{"error": "Unauthorized"}']))
    assert not isinstance(info.value, TransientError)


def test_a_connection_reset_before_the_answer_is_transient():
    error = httpx.ReadError("[Errno 104] Connection reset by peer")
    with pytest.raises(TransientError, match=r"ReadError connecting to http://fake:30000"):
        stream(FakeTransport(error=error))


def test_a_stall_mid_stream_is_transient_and_named():
    with pytest.raises(TransientError, match=r"stream stalled .*no data for 5 s"):
        stream(FakeTransport(reads=ANSWER[:3] + [httpx.ReadTimeout("timed out")]))


@pytest.mark.parametrize("error", [httpx.RemoteProtocolError("peer closed connection without sending complete "
                                                             "message body (incomplete chunked read)"),
                                   httpx.ReadError("[Errno 104] Connection reset by peer")])
def test_a_connection_cut_or_reset_mid_stream_is_a_broken_stream_not_a_stall(error):
    with pytest.raises(TransientError, match=f"broken stream .*{type(error).__name__}") as info:
        stream(FakeTransport(reads=ANSWER[:3] + [error]))
    assert "stalled" not in str(info.value)


def test_a_body_cut_inside_an_event_is_transient():
    cut = b"".join(ANSWER[:5]) + b'data: {"choices": [{"index": 0, "delta": {"con'
    with pytest.raises(TransientError, match="broken stream .*JSONDecodeError"):
        stream(FakeTransport(reads=[cut]))


def test_a_stream_that_ends_without_a_finish_reason_is_transient():
    with pytest.raises(TransientError, match="without a finish_reason"):
        stream(FakeTransport(reads=ANSWER[:5] + [b"data: [DONE]\n\n"]))


def test_an_error_event_mid_stream_is_transient_with_its_message():
    with pytest.raises(TransientError, match="server aborted the stream: out of memory"):
        stream(FakeTransport(reads=ANSWER[:3] + [b'data: {"error": {"message": "out of memory"}}\n\n']))


def test_the_overall_cap_and_the_callers_stop_end_a_stream():
    with pytest.raises(TransientError, match="overall cap of -1 s"):
        stream(FakeTransport(reads=ANSWER), cap_s=-1)
    stop = threading.Event()
    stop.set()
    with pytest.raises(Cancelled, match="stopped by the caller"):
        stream(FakeTransport(reads=ANSWER), stop=stop)


def test_non_streaming_calls_sort_errors_the_same_way():
    api = Api(URL, "k", client=client_with(FakeTransport(503, [b'{"message": "warming up"}'])))
    with pytest.raises(TransientError, match="HTTP 503: warming up"):
        api.server_info()
    api = Api(URL, "k", client=client_with(FakeTransport(401, [b"{}"])))
    with pytest.raises(AuthError):
        api.server_info()
    api = Api(URL, "k", client=client_with(FakeTransport(400, [b'{"message": "bad"}'])))
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


def test_the_backoff_is_full_jitter_under_the_doubling_and_its_cap():
    """Each wait is uniform in [0, min(cap, base * 2**(n-1))]: the bounds, taken from a random source the test
    holds, and waits that differ from run to run (two seeds) rather than stepping in lockstep."""
    class Ends(random.Random):
        def __init__(self, end):
            super().__init__()
            self.end = end

        def uniform(self, a, b):
            return b if self.end else a

    assert [backoff_s(n, 1.0, 30.0, Ends(True)) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert [backoff_s(n, 1.0, 30.0, Ends(False)) for n in range(1, 8)] == [0] * 7
    for seed in range(20):
        rng = random.Random(seed)
        assert all(0 <= backoff_s(n, 2.0, 10.0, rng) <= min(10.0, 2.0 * 2 ** (n - 1)) for n in range(1, 10))
    assert [backoff_s(3, 1.0, 30.0, random.Random(1)) for _ in range(2)] != \
        [backoff_s(3, 1.0, 30.0, random.Random(2)) for _ in range(2)]


def test_the_retry_policy_waits_the_jittered_backoff_between_tries():
    waits: list[float] = []
    call = flaky([TransientError("a"), TransientError("b"), TransientError("c")])
    assert with_retries(call, 4, delay_s=1.0, max_delay_s=3.0, rng=random.Random(7), sleep=waits.append) == "ok"
    rng = random.Random(7)
    assert waits == [backoff_s(n, 1.0, 3.0, rng) for n in (1, 2, 3)]
    assert len(set(waits)) == 3 and all(0 <= w <= 3.0 for w in waits)


# ------------------------------------------------------------------------------------- real sockets
class SilentServer:
    """A socket that accepts, reads the request, sends `head` (if any) and then goes silent until closed."""

    def __init__(self, head: bytes = b""):
        self.head = head
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.conns.append(conn)
            conn.recv(65536)
            if self.head:
                conn.sendall(self.head)

    def close(self):
        for conn in self.conns:
            conn.close()
        self.sock.close()


STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
               + b"%x\r\n%s\r\n" % (len(ANSWER[1]), ANSWER[1]))


@pytest.fixture
def silent():
    servers: list[SilentServer] = []
    yield lambda head=b"": servers.append(SilentServer(head)) or servers[-1]
    for server in servers:
        server.close()


def test_silence_after_the_first_bytes_is_httpx_read_timeout_named_a_stall(silent):
    server = silent(STREAM_HEAD)
    with pytest.raises(TransientError, match=r"^stream stalled after \d+ s \(no data for 0 s\?\)") as info:
        Api(server.url, "k").stream({"model": "m", "messages": []}, stall_s=0.3, cap_s=60)
    assert isinstance(info.value.__cause__, httpx.ReadTimeout)


def test_no_answer_at_all_is_transient_before_the_stream(silent):
    server = silent()
    with pytest.raises(TransientError, match=r"^ReadTimeout connecting to http://127\.0\.0\.1"):
        Api(server.url, "k").stream({"model": "m", "messages": []}, stall_s=0.3, cap_s=60)
    with pytest.raises(TransientError, match=r"/server_info did not answer within 0 s \(ReadTimeout\)"):
        Api(server.url, "k", timeout_s=0.3).server_info()


def test_a_refused_connection_is_httpx_connect_error():
    with socket.create_server(("127.0.0.1", 0)) as closed:
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    with pytest.raises(TransientError, match=rf"^ConnectError connecting to {url}") as info:
        Api(url, "k").stream({"model": "m", "messages": []}, stall_s=1, cap_s=60)
    assert isinstance(info.value.__cause__, httpx.ConnectError)
    assert Api(url, "k").probe("m", timeout_s=1) is None and not Api(url, "").is_ready(1)


def test_a_client_pools_as_many_connections_as_it_is_sized_for(silent):
    """A shard's client holds one connection per request in flight, no more: with both connections of a pool of
    two busy, a third request waits for one (here until its pool timeout) instead of opening a third."""
    server = silent()
    client = make_client(2)
    busy = [threading.Thread(target=lambda: pytest.raises(httpx.HTTPError, client.get, server.url + "/busy",
                                                          timeout=httpx.Timeout(30.0, pool=None)))
            for _ in range(2)]
    for t in busy:
        t.start()
    for _ in range(300):
        if server.accepted == 2:
            break
        threading.Event().wait(0.05)
    assert server.accepted == 2
    with pytest.raises(httpx.PoolTimeout):
        client.get(server.url + "/third", timeout=httpx.Timeout(30.0, pool=0.2))
    assert server.accepted == 2
    server.close()  # the busy requests end (connection closed)
    for t in busy:
        t.join()
