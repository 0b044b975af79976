"""`/v1/chat/completions`: the request's validation with SGLang's messages and flat error bodies, the faults drawn
at arrival, and the answer as one JSON body or as SSE chunks streamed while the scheduler decodes."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from dflash_regen.emulator import model as emulated
from dflash_regen.emulator import parsers, template
from dflash_regen.emulator.scheduler import QueueFull, Req
from dflash_regen.emulator.state import Emulator, kill_self


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
    # Token ids, honoured from the version that has each (versions.Forms)
    return_prompt_token_ids: bool = False
    return_token_ids: bool = False
    return_input_ids_in_sglext: bool = False
    return_output_ids_in_sglext: bool = False


def error_response(message: str, err_type: str, code: int) -> JSONResponse:
    """SGLang's flat ErrorResponse (not OpenAI's nested envelope)."""
    return JSONResponse(status_code=code, content={"object": "error", "message": message, "type": err_type,
                                                   "param": None, "code": code})


def validation_error(errors: Sequence[Mapping[str, object]]) -> JSONResponse:
    """What SGLang's RequestValidationError handler returns: 400, type "Bad Request"."""
    lines = [f"  {e}" for e in errors]
    message = f"{len(errors)} validation error{'s' if len(errors) != 1 else ''}:\n" + "\n".join(lines)
    return error_response(message, "Bad Request", 400)


async def until_disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _forever() -> None:
    await asyncio.Event().wait()


@dataclass(frozen=True)
class _Plan:
    """Per-request decisions taken at arrival (fault draws happen for every arrival, in order)."""

    http_error: int | None
    hang: bool


def _arrival(emu: Emulator) -> _Plan:
    emu.chat_arrivals += 1
    faults, n = emu.faults, emu.chat_arrivals
    if faults.crash_after_requests is not None and n > faults.crash_after_requests:
        kill_self()
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


async def chat(emu: Emulator, request: Request):
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
    ids = _IdsAsked(emu, req)
    if req.stream and (refused := ids.refused_with_stream()):
        return error_response(refused, "BadRequestError", 400)
    prompt_ids = None
    if ids.prompt:
        prompt_ids = template.prompt_ids(messages, emu.forms.template_tools(tools), template_kwargs,
                                         emu.args.model_path)
        wrong = emu.faults.wrong_prompt_ids_substring
        if wrong and wrong in emulated.last_user_text(messages) and prompt_ids:
            middle = len(prompt_ids) // 2  # the server saw another prompt than the client rendered
            prompt_ids = [*prompt_ids[:middle], emulated.encode(" ")[0], *prompt_ids[middle:]]
    prompt_tokens = len(prompt_ids) if prompt_ids is not None else \
        emulated.count_prompt_tokens(messages, tools, enable_thinking)
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
        await until_disconnected(request.receive)
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
                                                                               template_kwargs),
                     ids=ids, prompt_ids=prompt_ids)
    if req.stream:
        return StreamingResponse(answer.stream(), media_type="text/event-stream")
    done = asyncio.create_task(sreq.wait())
    gone = asyncio.create_task(until_disconnected(request.receive))
    await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    for task in (done, gone):
        task.cancel()
    if not sreq.done or sreq.state == "aborted":
        emu.scheduler.abort(sreq)  # the client left: free the slot
        return Response(status_code=499)
    return JSONResponse(answer.complete())


class _IdsAsked:
    """Which token ids the request asks for, of those this version returns (versions.Forms)."""

    def __init__(self, emu: Emulator, req: ChatCompletionRequest):
        forms = emu.forms
        self.token_ids_field = forms.output_token_ids_field if req.return_token_ids else None
        self.choice_prompt = forms.return_prompt_token_ids and (req.return_prompt_token_ids
                                                                or self.token_ids_field is not None)
        self.sglext_prompt = forms.ids_in_sglext and req.return_input_ids_in_sglext
        self.sglext_output = forms.ids_in_sglext and req.return_output_ids_in_sglext
        self.prompt = self.choice_prompt or self.sglext_prompt
        self.req = req
        self.forms = forms

    def refused_with_stream(self) -> str | None:
        """serving_chat.py's refusal of the choice-level ids with `stream` (a ValueError, hence a 400)."""
        if self.forms.return_prompt_token_ids and self.req.return_prompt_token_ids:
            return ("return_prompt_token_ids is not supported with streaming. Please set stream=false when using "
                    "return_prompt_token_ids=true.")
        if self.token_ids_field:
            return ("return_token_ids is not supported with streaming on /v1/chat/completions. Please set "
                    "stream=false when using return_token_ids=true.")
        return None


async def _silence():
    await _forever()
    yield b""  # never reached: the generator only exists to hold the stream open


class _Answer:
    """Turns a finished (or streaming) request into SGLang's chat completion JSON / SSE chunks."""

    def __init__(self, emu: Emulator, req: ChatCompletionRequest, tools: list[dict] | None,
                 gen: emulated.Generation, sreq: Req, force: bool, ids: _IdsAsked | None = None,
                 prompt_ids: list[int] | None = None):
        self.emu, self.req, self.tools, self.gen, self.sreq = emu, req, tools, gen, sreq
        self.ids, self.prompt_ids = ids or _IdsAsked(emu, req), prompt_ids
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
        usage: dict = {"prompt_tokens": prompt, "total_tokens": prompt + len(ids), "completion_tokens": len(ids),
                 "prompt_tokens_details": None, "reasoning_tokens": reasoning}
        if self.emu.forms.completion_tokens_details:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning} if reasoning else None
        return usage

    def sglext(self) -> dict | None:
        """`sglext` with the ids asked for (SglExt drops unset fields); None when none were."""
        ext: dict = {}
        if self.ids.sglext_prompt and self.prompt_ids is not None:
            ext["input_ids"] = self.prompt_ids
        if self.ids.sglext_output:
            ext["output_ids"] = [self._ids()]  # one list per choice
        return ext or None

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
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "matched_stop": matched}
        if self.ids.choice_prompt and self.prompt_ids is not None:
            choice["prompt_token_ids"] = self.prompt_ids
        if self.ids.token_ids_field:
            choice[self.ids.token_ids_field] = self._ids()
        body = {"id": self.sreq.rid, "object": "chat.completion", "created": self.created, "model": self.req.model,
                "choices": [choice], "usage": self.usage(), "metadata": {"weight_version": "default"}}
        if ext := self.sglext():
            body["sglext"] = ext
        return body

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
            if ext := self.sglext():  # after the finish chunk, before the usage chunk (serving_chat.py)
                body = {"id": self.sreq.rid, "object": "chat.completion.chunk", "created": self.created,
                        "model": self.req.model, "choices": [], "usage": None, "sglext": ext}
                yield b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
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
