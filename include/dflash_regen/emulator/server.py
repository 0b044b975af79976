"""The HTTP front: SGLang's endpoints and JSON shapes in the emulated version's forms (`versions.Forms`;
tests/contract/ checks them against SGLang) over the emulated scheduler and model, with API-key auth, warmup and
the health check.
The chat completions (validation, faults, SSE streaming) are `chat`'s; `/metrics` is `metrics`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import time
import uuid

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from dflash_regen.emulator import model as emulated
from dflash_regen.emulator.chat import chat, until_disconnected
from dflash_regen.emulator.metrics import metrics_text
from dflash_regen.emulator.scheduler import Req
from dflash_regen.emulator.state import Emulator, kill_self

__all__ = ["Emulator", "create_app", "serve"]  # Emulator: the CLI builds it from here

log = logging.getLogger("sglang.srt.entrypoints.http_server")

HEALTH_POLL_S = 0.02  # SGLang polls every 1 s; the emulator answers sooner so test fleets get ready fast
AUTH_EXEMPT_PREFIXES = ("/health", "/metrics")
AUTH_EXEMPT_PATHS = {"/ping"}
WARMUP_PROMPT = "The capital city of France is"


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


def _scheduler_died(task: asyncio.Task) -> None:
    """A bug in the emulated scheduler ends the server the way a crashed SGLang scheduler does, loudly."""
    if task.cancelled() or task.exception() is None:
        return
    import traceback

    error = task.exception()
    log.error("Scheduler hit an exception: " + "".join(traceback.format_exception(error)))
    kill_self()


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
            return Response(metrics_text(emu), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await chat(emu, request)

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
        await until_disconnected(request.receive)
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
