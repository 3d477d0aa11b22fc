"""`moeferry serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over one Engine.

The event loop thread does HTTP, JSON and tokenisation; the engine thread (EngineLoop) runs
the model. Routes are thin: the logic lives in openai_api.py, the shapes in protocol.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import logging
import time
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from moeferry.server.engine_loop import EngineLoop
from moeferry.server.metrics import ActivityLogger, ServerMetrics
from moeferry.config import ConfigError
from moeferry.server.openai_api import BODY_READ_TIMEOUT_S, ClientGone, ModelInfo, OpenAIEndpoints, Pools
from moeferry.server.openapi import openapi_schema
from moeferry.server.protocol import MAX_BODY_BYTES, APIError
from moeferry.server.responses import ResponsesEndpoint
from moeferry.reasoning import family_reasoning
from moeferry.tools import family_parser

logger = logging.getLogger("moeferry.server")

CLIENT_GONE = 499  # the status counted for a request whose client left before its answer (nginx's)
# Shutdown (SIGINT/SIGTERM): open connections get this long to finish once every live request
# was ended (streams end at once, waiting clients get a 503), then the engine thread this long
# to stop; the process exits within their sum whatever the load (pool threads are daemons).
GRACEFUL_SHUTDOWN_S = 5
ENGINE_STOP_S = 10.0
_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/v1/stats", "/health",
              "/metrics", "/tokenize", "/detokenize", "/version", "/ping")


@dataclass(frozen=True)
class ServerConfig:
    """The server's own options (the engine's live in EngineConfig); `served_model_name`
    None means the engine's model name: the built-in name, the Hugging Face id, or the
    directory's base name (model_source.ModelSource)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    log_interval: float = 10.0
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = BODY_READ_TIMEOUT_S  # the whole body must arrive within this (408 after)
    tool_call_parser: str | None = None  # None: the model family's (tools.FAMILY_PARSERS)
    reasoning_parser: str | None = None  # None: the model family's (reasoning.FAMILY_REASONING)

    @classmethod
    def from_args(cls, args, environ=os.environ) -> "ServerConfig":
        """The serve command's flags; the API key, when --api-key is not given, from
        MOEFERRY_API_KEY, else VLLM_API_KEY (vLLM's). An empty key is refused."""
        if args.api_key is not None and not args.api_key.strip():
            raise ConfigError("--api-key is empty: give the key clients must send, or leave the flag out to serve "
                              "without one")
        api_key = args.api_key or environ.get("MOEFERRY_API_KEY") or environ.get("VLLM_API_KEY") or None
        return cls(host=args.host, port=args.port, api_key=api_key,
                   served_model_name=args.served_model_name, log_interval=args.log_interval,
                   tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)


def served_model_name(engine, config: ServerConfig) -> str:
    return config.served_model_name or engine.model_name


# ---- the app ---------------------------------------------------------------------------------
def build_app(engine, config: ServerConfig) -> FastAPI:
    """The ASGI app over `engine`; its lifespan starts and stops the engine thread."""
    metrics = ServerMetrics()
    engine_loop = EngineLoop(engine, metrics, ActivityLogger(config.log_interval))
    info = ModelInfo(served_model_name(engine, config), engine.scheduler.context_limit, engine.mc.vocab_size,
                     int(time.time()), family_parser(engine.mc.model_type, config.tool_call_parser),
                     family_reasoning(engine.mc.model_type, engine.tokenizer, config.reasoning_parser))
    pools = Pools.create()
    api = OpenAIEndpoints(engine_loop, engine.tokenizer, info, config.max_body_bytes, pools, config.body_timeout_s)
    responses = ResponsesEndpoint(api)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine_loop.start(asyncio.get_running_loop())
        pools.start()
        yield
        pools.close()
        await asyncio.to_thread(engine_loop.stop, ENGINE_STOP_S)

    from moeferry import __version__

    app = FastAPI(title="moeferry", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.engine_loop, app.state.metrics, app.state.model_info = engine_loop, metrics, info
    app.state.pools = pools
    app.state.responses = responses
    _add_routes(app, api, engine_loop, metrics)
    app.add_api_route("/v1/responses", responses.create, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"])
    app.add_api_route("/v1/responses/{response_id}/input_items", responses.input_items, methods=["GET"])
    _add_error_handlers(app)
    app.openapi = lambda: openapi_schema(app, secured=config.api_key is not None)
    app.add_middleware(AccessMiddleware, api_key=config.api_key, metrics=metrics)
    return app


def _add_routes(app: FastAPI, api: OpenAIEndpoints, engine_loop: EngineLoop, metrics: ServerMetrics) -> None:
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])

    @app.get("/v1/models")
    async def list_models():
        return api.models()

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id != api.info.name:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return api.model_card()

    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])

    @app.get("/version")
    async def version():
        from moeferry import __version__

        return {"version": __version__}

    async def ping():  # vLLM's (and SageMaker's) liveness probe: /health under another name
        if not engine_loop.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    app.add_api_route("/ping", ping, methods=["GET"], operation_id="ping_get")
    app.add_api_route("/ping", ping, methods=["POST"], operation_id="ping_post")

    @app.get("/health")
    async def health():
        if not engine_loop.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/stats")
    async def stats():
        return await engine_loop.call(lambda engine: engine.stats())

    @app.get("/metrics")
    async def prometheus_metrics():
        try:
            snapshot = await engine_loop.call(lambda engine: engine.stats())
        except (APIError, asyncio.TimeoutError):
            snapshot = None  # still serve the front end's own metrics
        return Response(metrics.render(snapshot), media_type=CONTENT_TYPE_LATEST)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)
    async def client_gone(_request: Request, _exc: Exception):
        return Response(status_code=CLIENT_GONE)  # never read: counted apart from the server's errors

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(APIError(400, first.get("msg", "invalid request"), param=param).body(), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception):
        logger.exception("unhandled error", exc_info=exc)
        return JSONResponse(APIError(500, "internal server error; see the server log").body(), status_code=500)


class AccessMiddleware:
    """Pure ASGI middleware in front of every route. Invariants: with an API key set, a /v1
    request without `Authorization: Bearer <key>` (the scheme in any case, RFC 9110) gets 401
    and never reaches a route; every
    HTTP request is counted once in metrics, by endpoint (unknown paths pooled as "other") and
    by the status it was answered with (500 if it raised before answering)."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics
        self.expected = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_counting(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self._refused(scope):
                body = APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                                code="invalid_api_key").body()
                await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send_counting)
            else:
                await self.app(scope, receive, send_counting)
        finally:
            self.metrics.count_request(_endpoint_label(scope["path"]), status)

    def _refused(self, scope) -> bool:
        if self.expected is None or not scope["path"].startswith("/v1"):
            return False
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
        return scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected)


def _endpoint_label(path: str) -> str:
    if path in _ENDPOINTS:
        return path
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}"
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


# ---- the process -----------------------------------------------------------------------------
class MoeferryServer(uvicorn.Server):
    """uvicorn's server, plus: on shutdown (SIGINT/SIGTERM), every in-flight request is ended
    first, so each stream gets its final chunk and `data: [DONE]` and its connection closes
    promptly, and every request waiting on a pool (templating, a grammar compile) gets the
    shutdown 503 at once; and the signal is not re-raised afterwards, so `serve` returns normally."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, pools: Pools):
        super().__init__(config)
        self.engine_loop, self.pools = engine_loop, pools

    async def shutdown(self, sockets=None) -> None:
        self.engine_loop.finish_all()
        self.pools.close()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            captured = getattr(self, "_captured_signals", None)
            if captured:
                logger.info("stopped by signal %s", ", ".join(str(s) for s in captured))
                captured.clear()  # uvicorn re-raises them at exit; we have already shut down cleanly


def make_server(app: FastAPI, config: ServerConfig) -> MoeferryServer:
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level="info", access_log=False,
                        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="on")
    return MoeferryServer(uv, app.state.engine_loop, app.state.pools)


def log_plan(engine, config: ServerConfig, name: str) -> None:
    runner, ec, mc = engine.runner, engine.ec, engine.mc
    graphs = runner.graphs.sizes if getattr(runner, "graphs", None) is not None else None
    logger.info("serving %s (%s) on http://%s:%d%s", name, ec.model, config.host, config.port,
                ", API key required" if config.api_key else "")
    logger.info("model %s: %d layers, %d experts, top-%d; strategy %s, dtype %s, device %s", mc.model_type,
                mc.num_layers, mc.num_experts, mc.top_k if mc.num_experts else 0, ec.moe_strategy,
                str(runner.dtype).replace("torch.", ""), runner.device)
    logger.info("KV cache %d pages x %d tokens = %d tokens; context limit %d; max batch %d; max prefill tokens %d; "
                "CUDA graphs %s", runner.kv.num_pages, ec.page_size, runner.kv.capacity_tokens,
                engine.scheduler.context_limit, ec.max_running_requests, ec.max_prefill_tokens,
                f"for batch sizes {graphs}" if graphs else "off")


def serve(engine_config, args) -> int:
    """Load the model, print the plan, serve until SIGINT/SIGTERM; returns the exit status."""
    from moeferry.engine.ranks import create_engine

    config = ServerConfig.from_args(args)
    engine = create_engine(engine_config)
    try:
        return serve_engine(engine, config)
    finally:
        engine.close()


def serve_engine(engine, config: ServerConfig) -> int:
    """Serve a loaded engine until SIGINT/SIGTERM, or until the engine fails for good (a rank of
    several died: exit status 1, after every live request got a 503); `serve`'s second half."""
    app = build_app(engine, config)
    log_plan(engine, config, app.state.model_info.name)
    server = make_server(app, config)
    engine_loop = app.state.engine_loop
    engine_loop.on_failure = lambda: setattr(server, "should_exit", True)  # uvicorn polls it
    server.run()
    if engine_loop.failure is not None:
        logger.error("stopped: the engine failed: %s", engine_loop.failure)
        return 1
    return 0
