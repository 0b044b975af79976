"""The HTTP front: SGLang's endpoints and JSON shapes in the emulated version's forms (`versions.Forms`;
notes/sglang-api.md §2) over the emulated
scheduler and model, with API-key auth, SGLang's flat error bodies, SSE streaming, and the faults.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import secrets
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from dflash_regen.emulator import model as emulated
from dflash_regen.emulator import parsers
from dflash_regen.emulator.allocation import Allocation
from dflash_regen.emulator.cli import ModelConfig, ServerArgs, context_len
from dflash_regen.emulator.faults import Faults, Profile
from dflash_regen.emulator.scheduler import QueueFull, Req, Scheduler
from dflash_regen.emulator.versions import Forms

log = logging.getLogger("sglang.srt.entrypoints.http_server")

HEALTH_POLL_S = 0.02  # SGLang polls every 1 s; the emulator answers sooner so test fleets get ready fast
SPLIT_BY_STREAMING = {"prompt_tokens_total", "generation_tokens_total"}
AUTH_EXEMPT_PREFIXES = ("/health", "/metrics")
AUTH_EXEMPT_PATHS = {"/ping"}
WARMUP_PROMPT = "The capital city of France is"


# --------------------------------------------------------------------------------------------- request
class _Part(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "function", "developer"]
    content: str | list[_Part] | None = None
    tool_calls: list[dict] | None = None
    reasoning_content: str | None = None


class _Function(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict | None = None


class _Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: _Function


class _StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class ChatCompletionRequest(BaseModel):
    """The request fields the emulator honours (others are accepted and ignored, as SGLang ignores
    sampling knobs that cannot change an emulated answer)."""

    model_config = ConfigDict(extra="allow")
    messages: list[_Message]
    model: str = "default"
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: _StreamOptions | None = None
    tools: list[_Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    chat_template_kwargs: dict | None = None
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    reasoning_effort: Literal["none", "low", "medium", "high"] | None = None


def error_response(message: str, err_type: str, code: int) -> JSONResponse:
    """SGLang's flat ErrorResponse (not OpenAI's nested envelope)."""
    return JSONResponse(status_code=code, content={"object": "error", "message": message, "type": err_type,
                                                   "param": None, "code": code})


def validation_error(errors: list[dict]) -> JSONResponse:
    """What SGLang's RequestValidationError handler returns: 400, type "Bad Request"."""
    lines = [f"  {e}" for e in errors]
    message = f"{len(errors)} validation error{'s' if len(errors) != 1 else ''}:\n" + "\n".join(lines)
    return error_response(message, "Bad Request", 400)


# ------------------------------------------------------------------------------------------------ state
@dataclass
class Emulator:
    """Everything the routes share: resolved config, allocation, faults, scheduler, lifecycle status."""

    args: ServerArgs  # as the scheduler sees them (the model runner wrote the sized Mamba slots back)
    launch_args: ServerArgs  # as resolved from the command line: /server_info's top level echoes these
    forms: Forms
    model: ModelConfig
    alloc: Allocation
    faults: Faults
    profile: Profile
    gpu: str
    scheduler: Scheduler
    status: str = "Starting"  # Starting -> Up (after warmup) -> UnHealthy (failed health check)
    shutting_down: bool = False
    started_at: float = field(default_factory=time.time)
    load_weights_s: float = 0.0
    startup_s: float = 0.0
    chat_arrivals: int = 0
    http_server: uvicorn.Server | None = None

    def __post_init__(self):
        # One draw sequence per server, in arrival order: deterministic for tests, fresh on retries.
        self.fault_rng = random.Random(f"dflash-emu-faults-{self.gpu}")

    @property
    def context_len(self) -> int:
        return context_len(self.args, self.model)

    @property
    def max_req_input_len(self) -> int:
        max_req_len = min(self.context_len - 1, self.alloc.max_total_num_tokens - 1)
        return max_req_len - 5

    def server_args_dict(self) -> dict:
        return self.args.as_dict(self.forms)


class ApiKeyAuth:
    """Bearer-token check on every endpoint but /health*, /metrics* and /ping (pure ASGI: streams pass)."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.api_key and scope["method"] != "OPTIONS":
            path = scope["path"]
            if not (path.startswith(AUTH_EXEMPT_PREFIXES) or path in AUTH_EXEMPT_PATHS):
                header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
                scheme, _, token = header.partition(" ")
                if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                            self.api_key.encode()):
                    await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


async def _until_disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _forever() -> None:
    await asyncio.Event().wait()


def _kill_self() -> None:
    """An abrupt death, as when SGLang's scheduler child dies and takes the server with it."""
    log.error("Received sigquit from a child process. It usually means the child failed.")
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _scheduler_died(task: asyncio.Task) -> None:
    """A bug in the emulated scheduler ends the server the way a crashed SGLang scheduler does, loudly."""
    if task.cancelled() or task.exception() is None:
        return
    import traceback

    error = task.exception()
    log.error("Scheduler hit an exception: " + "".join(traceback.format_exception(error)))
    _kill_self()


# ------------------------------------------------------------------------------------------------ app
def create_app(emu: Emulator):
    """The ASGI app (FastAPI behind the API-key check)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        loop_task = asyncio.create_task(emu.scheduler.run(), name="scheduler")
        loop_task.add_done_callback(_scheduler_died)
        warm_task = asyncio.create_task(_warmup(emu), name="warmup")
        yield
        emu.shutting_down = True
        for task in (warm_task, loop_task):
            task.cancel()

    app = FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/health")
    @app.get("/health_generate")
    async def health(request: Request):
        return await _health(emu)

    @app.get("/ping")
    async def ping():
        return Response(status_code=200)

    @app.get("/model_info")
    async def model_info():
        return _model_info(emu)

    @app.get("/get_model_info")
    async def get_model_info():
        log.warning("Endpoint '/get_model_info' is deprecated and will be removed in a future version. "
                    "Please use '/model_info' instead.")
        return _model_info(emu)

    @app.get("/server_info")
    async def server_info(request: Request):
        return await _server_info(emu, request)

    @app.get("/get_server_info")
    async def get_server_info(request: Request):
        log.warning("Endpoint '/get_server_info' is deprecated and will be removed in a future version. "
                    "Please use '/server_info' instead.")
        return await _server_info(emu, request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(emu)]}

    @app.get("/v1/models/{model:path}")
    async def one_model(model: str):
        if model != emu.args.served_model_name:
            return JSONResponse(status_code=404, content={"error": {
                "message": f"The model '{model}' does not exist", "type": "invalid_request_error",
                "param": "model", "code": "model_not_found"}})
        return _model_card(emu)

    if emu.args.enable_metrics:
        @app.get("/metrics")
        async def metrics():
            return Response(_metrics_text(emu), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _chat(emu, request)

    return ApiKeyAuth(app, emu.args.api_key)


async def _warmup(emu: Emulator) -> None:
    """SGLang's warmup: once HTTP is up, one short generation; only then is the server 'Up'."""
    while emu.http_server is not None and not emu.http_server.started:
        await asyncio.sleep(0.01)
    if not emu.args.skip_server_warmup:
        prompt = emulated.count_prompt_tokens([{"role": "user", "content": WARMUP_PROMPT}], None, True)
        req = Req(rid=f"warmup_{uuid.uuid4().hex}", prompt_tokens=prompt, output=emulated.encode(" Paris")[:1] * 8,
                  max_new_tokens=8)
        emu.scheduler.submit(req)
        await req.wait()
    emu.status = "Up"
    log.info("The server is fired up and ready to roll!")


async def _health(emu: Emulator) -> Response:
    if emu.shutting_down:
        log.info("Health check request received during shutdown. Returning 503.")
        return Response(status_code=503)
    if emu.status == "Starting":
        return Response(status_code=503)
    sched = emu.scheduler
    if sched.wedged:
        # sglang#6624: the health probe keeps answering 200 although the scheduler produces nothing.
        return Response(status_code=200)
    timeout = int(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))
    tic, tic_wall = time.monotonic(), time.time()
    probe = Req(rid=f"HEALTH_CHECK_{tic_wall}", prompt_tokens=1, output=[0], max_new_tokens=1, counted=False)
    sched.submit(probe)
    try:
        while time.monotonic() < tic + timeout:
            await asyncio.sleep(HEALTH_POLL_S)
            if sched.last_output_at > tic:  # any output from the scheduler proves it is alive
                emu.status = "Up"
                return Response(status_code=200)
        log.error(f"Health check failed. Server couldn't get a response from detokenizer for last {timeout} "
                  f"seconds. tic start time: {tic_wall:.2f}. last_heartbeat time: {sched.last_output_wall:.2f}")
        emu.status = "UnHealthy"
        return Response(status_code=503)
    finally:
        sched.abort(probe)


def _model_info(emu: Emulator) -> dict:
    return {"model_path": emu.args.model_path, "tokenizer_path": emu.args.tokenizer_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default",
            "has_image_understanding": emu.model.has_image_understanding, "has_audio_understanding": False,
            "model_type": emu.model.model_type, "architectures": [emu.model.architecture]}


def _model_card(emu: Emulator) -> dict:
    name = emu.args.served_model_name
    return {"id": name, "object": "model", "created": int(emu.started_at), "owned_by": "sglang", "root": name,
            "parent": None, "max_model_len": emu.context_len}


async def _server_info(emu: Emulator, request: Request):
    if emu.scheduler.wedged:
        # internal_states is a round trip to the scheduler: it never comes back (sglang#4191).
        await _until_disconnected(request.receive)
        return Response(status_code=499)
    alloc = emu.alloc
    state = {
        **emu.server_args_dict(),
        "last_gen_throughput": emu.scheduler.last_gen_throughput,
        "memory_usage": {"weight": round(alloc.weights_gb + alloc.draft_weights_gb, 2),
                         "kvcache": round(alloc.kv_cache_gb, 2), "token_capacity": alloc.max_total_num_tokens,
                         "graph": round(alloc.graph_gb, 2)},
        "effective_max_running_requests_per_dp": alloc.effective_max_running_requests,
    }
    if emu.scheduler.avg_spec_accept_length is not None:
        state["avg_spec_accept_length"] = emu.scheduler.avg_spec_accept_length
    return {**emu.launch_args.as_dict(emu.forms), "status": "ready",
            "max_total_num_tokens": alloc.max_total_num_tokens, "max_req_input_len": emu.max_req_input_len,
            "internal_states": [state], "version": emu.forms.version}


def _metrics_text(emu: Emulator) -> str:
    sched, alloc = emu.scheduler, emu.alloc
    labels = (f'engine_type="unified",model_name="{emu.args.served_model_name}",moe_ep_rank="0",pp_rank="0",'
              'tp_rank="0"')
    tokenizer_labels = f'model_name="{emu.args.served_model_name}"'
    kv_used = sched.kv_used
    accept = sched.avg_spec_accept_length or 0.0
    draft = emu.args.speculative_num_draft_tokens or 1
    gauges = [
        ("num_running_reqs", "The number of running requests.", len(sched.running)),
        ("num_queue_reqs", "The number of requests in the waiting queue.", len(sched.waiting)),
        ("num_used_tokens", "The number of used tokens.", kv_used),
        ("token_usage", "The token usage.", kv_used / alloc.max_total_num_tokens),
        ("full_token_usage", "The token usage for full attention layers.", kv_used / alloc.max_total_num_tokens),
        ("mamba_usage", "The token usage for Mamba layers.",
         sched.mamba_used / alloc.mamba_slots if alloc.mamba_slots else 0.0),
        ("gen_throughput", "The generation throughput (token/s).", sched.last_gen_throughput),
        ("cache_hit_rate", "The prefix cache hit rate.", 0.0),
        ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", alloc.max_total_num_tokens),
        ("spec_accept_length", "The average acceptance length of speculative decoding.", accept),
        ("spec_accept_rate", "The average acceptance rate of speculative decoding.", accept / draft),
        ("num_retracted_reqs", "The number of retracted requests.", 0),
        ("num_paused_reqs", "The number of paused requests by async weight sync.", 0),
        ("is_cuda_graph", "Whether the batch is using CUDA graph.", 1),
        ("engine_startup_time", "The time taken for the engine to start up.", emu.startup_s),
        ("engine_load_weights_time", "The time taken for the engine to load weights.", emu.load_weights_s),
    ]
    counters = [
        ("prompt_tokens_total", "Number of prefill tokens processed.", sched.prompt_tokens_total),
        ("generation_tokens_total", "Number of generation tokens processed.", sched.generation_tokens_total),
        ("cached_tokens_total", "Number of cached prompt tokens.", 0),
        ("num_requests_total", "Number of requests processed.", sched.num_requests_total),
        ("num_aborted_requests_total", "Number of requests aborted.", sched.num_aborted_requests_total),
    ]
    lines = []
    for name, help_text, value in gauges:
        lines += [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} gauge",
                  f"sglang:{name}{{{labels}}} {float(value)}"]
    for name, help_text, value in counters:
        lines += [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} counter"]
        if emu.forms.is_streaming_label and name in SPLIT_BY_STREAMING:
            # 0.5.18+: one series per is_streaming value (the warm-up is a non-streaming request)
            streamed = getattr(sched, f"streamed_{name}", 0)
            lines += [f'sglang:{name}{{{tokenizer_labels},is_streaming="true"}} {float(streamed)}',
                      f'sglang:{name}{{{tokenizer_labels},is_streaming="false"}} {float(value - streamed)}']
        else:
            lines.append(f"sglang:{name}{{{tokenizer_labels}}} {float(value)}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ chat completions
@dataclass(frozen=True)
class _Plan:
    """Per-request decisions taken at arrival (fault draws happen for every arrival, in order)."""

    http_error: int | None
    hang: bool


def _arrival(emu: Emulator) -> _Plan:
    emu.chat_arrivals += 1
    faults, n = emu.faults, emu.chat_arrivals
    if faults.crash_after_requests is not None and n > faults.crash_after_requests:
        _kill_self()
    if faults.dead_scheduler_after_requests is not None and n > faults.dead_scheduler_after_requests \
            and not emu.scheduler.wedged:
        emu.scheduler.wedge()
    rng = emu.fault_rng
    error_draw, kind_draw, hang_draw = rng.random(), rng.random(), rng.random()
    http_error = (500 if kind_draw < 0.5 else 503) if error_draw < faults.http_error_rate else None
    return _Plan(http_error=http_error, hang=hang_draw < faults.hang_rate)


def _injected_error(code: int) -> JSONResponse:
    if code == 500:
        return error_response("Internal server error: CUDA error: an illegal memory access was encountered "
                              "(injected by DFLASH_EMU_FAULTS http_error_rate)", "InternalServerError", 500)
    return error_response("Request aborted by the scheduler: service temporarily unavailable (injected by "
                          "DFLASH_EMU_FAULTS http_error_rate)", "503", 503)


def _loops(emu: Emulator, messages: list[dict], seed: int | None) -> bool:
    faults = emu.faults
    text = emulated.last_user_text(messages)
    if faults.loop_substring and faults.loop_substring in text:
        return True
    if faults.loop_rate <= 0:
        return False
    key = json.dumps({"m": messages, "s": seed}, sort_keys=True, default=str)
    return random.Random(f"loop:{key}").random() < faults.loop_rate


async def _chat(emu: Emulator, request: Request):
    plan = _arrival(emu)
    media_type = request.headers.get("content-type", "").lower().split(";", 1)[0].strip()
    if media_type != "application/json":
        return validation_error([{"loc": ["header", "content-type"], "type": "value_error",
                                  "msg": "Unsupported Media Type: Only 'application/json' is allowed"}])
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        return validation_error([{"type": "json_invalid", "loc": ["body", exc.pos if hasattr(exc, "pos") else 0],
                                  "msg": "JSON decode error", "input": {}, "ctx": {"error": str(exc)}}])
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        return validation_error(exc.errors(include_url=False))
    messages: list[dict] = body["messages"]
    tools: list[dict] | None = body.get("tools") or None

    if not req.messages:
        return error_response("Messages cannot be empty.", "BadRequestError", 400)
    if req.tool_choice == "required" and not tools:
        return error_response("Tools cannot be empty if tool choice is set to required.", "BadRequestError", 400)
    if req.n != 1:
        return error_response("n > 1 is not supported by the SGLang emulator; send n separate requests.",
                              "BadRequestError", 400)
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_new is not None and max_new < 0:
        return error_response(f"max_new_tokens must be at least 0, got {max_new}.", "BadRequestError", 400)
    if emu.args.context_length and max_new is not None and max_new > emu.args.context_length:
        return error_response(f"max_completion_tokens is too large: {max_new}.This model supports at most "
                              f"{emu.args.context_length} completion tokens.", "BadRequestError", 400)

    kwargs = req.chat_template_kwargs or {}
    enable_thinking = kwargs.get("enable_thinking", req.reasoning_effort != "none") is not False
    template_kwargs = kwargs if "enable_thinking" in kwargs or req.reasoning_effort != "none" else \
        {**kwargs, "enable_thinking": False}
    prompt_tokens = emulated.count_prompt_tokens(messages, tools, enable_thinking)
    ctx = emu.context_len
    if prompt_tokens >= ctx:
        return error_response(f"The input ({prompt_tokens} tokens) is longer than the model's context length "
                              f"({ctx} tokens).", "BadRequestError", 400)
    if max_new is not None and max_new + prompt_tokens >= ctx:
        return error_response(
            f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested a "
            f"total of {max_new + prompt_tokens} tokens: {prompt_tokens} tokens from the input messages and "
            f"{max_new} tokens for the completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit.", "BadRequestError", 400)
    if plan.http_error:
        return _injected_error(plan.http_error)
    poison = emu.faults.error_substring
    if poison and poison in emulated.last_user_text(messages):
        status = emu.faults.error_status
        return error_response(f"Failed to apply the chat template to this request: unexpected text {poison!r} "
                              "(injected by DFLASH_EMU_FAULTS error_substring)",
                              "InternalServerError" if status >= 500 else "BadRequestError", status)
    if plan.hang:
        if req.stream:
            return StreamingResponse(_silence(), media_type="text/event-stream")
        await _until_disconnected(request.receive)
        return Response(status_code=499)

    gen = emulated.generate(emulated.ModelInput(
        messages=messages, tools=tools, tool_choice=req.tool_choice, seed=req.seed, enable_thinking=enable_thinking,
        loop=_loops(emu, messages, req.seed), empty_content=emu.faults.empty_content,
    ), emu.profile, limit=max_new if max_new is not None else max(ctx - prompt_tokens - 1, 0))
    sreq = Req(rid=uuid.uuid4().hex, prompt_tokens=prompt_tokens, output=gen.token_ids, max_new_tokens=max_new,
               streaming=req.stream)
    try:
        emu.scheduler.submit(sreq)
    except QueueFull as exc:
        return error_response(str(exc), "503", 503)
    answer = _Answer(emu, req, tools, gen, sreq, force=parsers.force_reasoning(emu.args.reasoning_parser,
                                                                               template_kwargs))
    if req.stream:
        return StreamingResponse(answer.stream(), media_type="text/event-stream")
    done = asyncio.create_task(sreq.wait())
    gone = asyncio.create_task(_until_disconnected(request.receive))
    await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    for task in (done, gone):
        task.cancel()
    if not sreq.done or sreq.state == "aborted":
        emu.scheduler.abort(sreq)  # the client left: free the slot
        return Response(status_code=499)
    return JSONResponse(answer.complete())


async def _silence():
    await _forever()
    yield b""  # never reached: the generator only exists to hold the stream open


class _Answer:
    """Turns a finished (or streaming) request into SGLang's chat completion JSON / SSE chunks."""

    def __init__(self, emu: Emulator, req: ChatCompletionRequest, tools: list[dict] | None,
                 gen: emulated.Generation, sreq: Req, force: bool):
        self.emu, self.req, self.tools, self.gen, self.sreq = emu, req, tools, gen, sreq
        self.created = int(time.time())
        parser = emu.args.reasoning_parser
        self.split = bool(parser in parsers.THINK_TAG_PARSERS and req.separate_reasoning)
        self.force = force
        self.require_reasoning = bool(parser in parsers.THINK_TAG_PARSERS and force)
        self.parse_tools = bool(tools and req.tool_choice != "none" and emu.args.tool_call_parser == "qwen3_coder")

    # -------------------------------------------------------------------------------------- common
    def _ids(self) -> list[int]:
        return self.gen.token_ids[:self.sreq.emitted]

    def _finish(self) -> tuple[str, int | None]:
        ids = self._ids()
        if ids and ids[-1] == emulated.IM_END:
            return "stop", emulated.IM_END
        return "length", None

    def usage(self) -> dict:
        ids = self._ids()
        reasoning = 0
        if self.require_reasoning:
            end = self.gen.think_end_index
            reasoning = end + 1 if end is not None and end < len(ids) else len(ids)
        prompt = self.sreq.prompt_tokens
        usage = {"prompt_tokens": prompt, "total_tokens": prompt + len(ids), "completion_tokens": len(ids),
                 "prompt_tokens_details": None, "reasoning_tokens": reasoning}
        if self.emu.forms.completion_tokens_details:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning} if reasoning else None
        return usage

    @staticmethod
    def _text(ids: list[int]) -> str:
        return emulated.decode([i for i in ids if i != emulated.IM_END])

    # ---------------------------------------------------------------------------------- non-stream
    def complete(self) -> dict:
        text = self._text(self._ids())
        reasoning, content = None, text
        if self.split:
            reasoning, content = parsers.split_reasoning(text, self.force)
        finish, matched = self._finish()
        tool_calls = None
        if self.parse_tools:
            content, calls = parsers.parse_tool_calls(content, self.tools)
            if calls:
                tool_calls = [c.as_json() for c in calls]
                if finish == "stop":
                    finish, matched = "tool_calls", None
        empty = "" if self.emu.forms.empty_content_is_string else None
        message = {"role": "assistant", "content": content or empty, "reasoning_content": reasoning or None,
                   "tool_calls": tool_calls}
        if tool_calls is None and self.emu.forms.omits_null_tool_calls:
            del message["tool_calls"]
        return {"id": self.sreq.rid, "object": "chat.completion", "created": self.created, "model": self.req.model,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish,
                             "matched_stop": matched}],
                "usage": self.usage(), "metadata": {"weight_version": "default"}}

    # -------------------------------------------------------------------------------------- stream
    def _chunk(self, delta: dict, finish: str | None = None, matched: int | None = None) -> bytes:
        body = {"id": self.sreq.rid, "object": "chat.completion.chunk", "created": self.created,
                "model": self.req.model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                       "finish_reason": finish, "matched_stop": matched}],
                "usage": None}
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    async def stream(self):
        reasoning_stream = parsers.ReasoningStream(self.force) if self.split else None
        tool_stream = parsers.ToolCallStream(self.tools) if self.parse_tools else None
        streamed_tool = False
        started = False
        try:
            async for ids in self.sreq.updates():
                if not started:
                    started = True
                    yield self._chunk({"role": "assistant", "content": ""})
                text = self._text(ids)
                reasoning, content = reasoning_stream.feed(text) if reasoning_stream else ("", text)
                if reasoning:
                    yield self._chunk({"reasoning_content": reasoning})
                for piece in self._content_pieces(content, tool_stream):
                    streamed_tool = streamed_tool or "tool_calls" in piece
                    yield self._chunk(piece)
            if self.sreq.state == "aborted":
                return
            if reasoning_stream:
                reasoning, content = reasoning_stream.flush()
                if reasoning:
                    yield self._chunk({"reasoning_content": reasoning})
                for piece in self._content_pieces(content, tool_stream):
                    yield self._chunk(piece)
            if tool_stream and (rest := tool_stream.flush()):
                yield self._chunk({"content": rest})
            finish, matched = self._finish()
            if streamed_tool and finish == "stop":
                finish, matched = "tool_calls", None
            yield self._chunk({}, finish, matched)
            if self.req.stream_options and self.req.stream_options.include_usage:
                body = {"id": self.sreq.rid, "object": "chat.completion.chunk", "created": self.created,
                        "model": self.req.model, "choices": [], "usage": self.usage()}
                yield b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            self.emu.scheduler.abort(self.sreq)  # no-op when finished; frees the slot when the client left

    @staticmethod
    def _content_pieces(content: str, tool_stream: parsers.ToolCallStream | None) -> list[dict]:
        if not content:
            return []
        if tool_stream is None:
            return [{"content": content}]
        text, deltas = tool_stream.feed(content)
        pieces = [{"content": text}] if text else []
        return pieces + [{"tool_calls": [d]} for d in deltas]


# ------------------------------------------------------------------------------------------------ serve
class _Uvicorn(uvicorn.Server):
    """uvicorn, but a SIGTERM/SIGINT marks the server as shutting down (health -> 503) and ends the process
    with exit code 0 instead of re-raising the signal after the graceful shutdown."""

    def __init__(self, config: uvicorn.Config, emu: Emulator):
        super().__init__(config)
        self.emu = emu

    def handle_exit(self, sig, frame) -> None:
        self.emu.shutting_down = True
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


def uvicorn_log_config() -> dict:
    """uvicorn's logging config with SGLang's timestamped formats (`set_uvicorn_logging_configs`)."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"]["default"]["fmt"] = "[%(asctime)s] %(levelprefix)s %(message)s"
    config["formatters"]["default"]["datefmt"] = "%Y-%m-%d %H:%M:%S"
    config["formatters"]["access"]["fmt"] = '[%(asctime)s] %(levelprefix)s %(client_addr)s - "%(request_line)s" ' \
                                            '%(status_code)s'
    config["formatters"]["access"]["datefmt"] = "%Y-%m-%d %H:%M:%S"
    return config


def serve(emu: Emulator) -> None:
    """Run the HTTP server until SIGTERM/SIGINT (graceful: in-flight work gets ~1 s, then is cancelled)."""
    config = uvicorn.Config(create_app(emu), host=emu.args.host, port=emu.args.port,
                            log_config=uvicorn_log_config(), log_level=(emu.args.log_level_http or
                                                                       emu.args.log_level).lower(),
                            timeout_keep_alive=5, timeout_graceful_shutdown=1, access_log=True)
    server = _Uvicorn(config, emu)
    emu.http_server = server
    server.run()
