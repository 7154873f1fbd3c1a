"""The OpenAI-compatible HTTP server: app factory, middleware, routes and `loopserve serve`.

`build_app` wires an `EngineClient` (engine/client.py) into a FastAPI app: `/v1/completions`,
`/v1/chat/completions` (both with SSE streaming), `/v1/models`, `/tokenize`, `/detokenize` and
`/tokenizer_info` (serving_tokenize.py), `/health` (200 only when the
engine is loaded and alive) and `/metrics` (Prometheus text). Every error uses OpenAI's body
`{"error": {"message", "type", "param", "code"}}`; bodies over `max_body_bytes` get 413 before
they are parsed. `run` serves the app with uvicorn (`loopserve serve`, cli/serve.py, builds
the client and calls it); on SIGTERM/SIGINT the server stops accepting,
lets in-flight requests finish for up to `--shutdown-timeout-s`, aborts the rest and exits 0.
The request handlers live in `serving_completions` and `serving_chat`.

Security (`server/middleware.py`: `SecurityMiddleware`, `HeaderTimeoutH11Protocol`): an optional API key checked on
every `/v1/*` route (and `/metrics` unless it is made public) with the `Authorization: Bearer`
scheme; a Host-header allow-list against DNS rebinding (localhost names by default when bound to
loopback); 415 for a POST whose Content-Type is not JSON (so a web page cannot post without a
CORS preflight); CORS headers only for `--allowed-origins`; connections that do not finish
their request headers within `--header-timeout-s` are closed, bodies that stop arriving get 408
(`--body-timeout-s`), and at most `--max-connections` are open at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from loopserve.engine.client import EngineClient, ModelInfo
from loopserve.engine.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from loopserve.execution import num_planes
from loopserve.server import serving_tokenize
from loopserve.server.api_errors import ApiError
from loopserve.server.args import (
    API_KEY_ENV,
    DEFAULT_BODY_DEADLINE_S,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MODEL_NAME,
)
from loopserve.server.loop_classes import LoopClasses
from loopserve.server.middleware import (
    HEALTH_CONNECTIONS,
    BodySizeLimitMiddleware,
    HeaderTimeoutH11Protocol,
    InternalErrorMiddleware,
    OpenAICORSMiddleware,
    SecurityMiddleware,
    default_allowed_hosts,
)
from loopserve.server.protocol import ModelCard, ModelList
from loopserve.server.serving_chat import create_chat_completion
from loopserve.server.serving_common import ServingContext
from loopserve.server.serving_completions import create_completion
from loopserve.server.serving_messages import count_tokens, create_message
from loopserve.server.serving_responses import create_response
from loopserve.text.reasoning import PARSERS as REASONING_PARSERS
from loopserve.text.tools import PARSERS as TOOL_PARSERS

logger = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 3.0  # after the engine aborts the rest, time for streams to end


SERVED_ENDPOINTS = (
    "POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, POST /v1/messages, "
    "POST /v1/messages/count_tokens, GET /v1/models, POST /tokenize, "
    "POST /detokenize, GET /tokenizer_info, GET /health and GET /metrics"
)


def build_app(
    client: EngineClient,
    served_model_name: str,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    body_deadline_s: float = DEFAULT_BODY_DEADLINE_S,
    shutdown_timeout_s: float = 10.0,
    api_key: str | None = None,
    metrics_public: bool = False,
    allowed_hosts: tuple[str, ...] | None = None,
    allowed_origins: tuple[str, ...] = (),
    allow_client_priority: bool = False,
    default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS,
    request_defaults: dict[str, object] | None = None,
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = "hermes",
    json_schema_closed: bool = False,
    loop_classes: LoopClasses | None = None,
) -> FastAPI:
    """The FastAPI app serving `client` (an `EngineClient`: one engine, or a pool of replicas)
    as `served_model_name`.

    Its lifespan starts the engine thread, logs one line once the model is ready and, at
    shutdown, drains the engine within `shutdown_timeout_s`. `allowed_hosts=None` accepts any
    Host header; `api_key=None` needs no key; `request_defaults` fill the looped-model fields
    a request leaves unset (`--request-defaults`); `reasoning_parser` names a parser of
    `text/reasoning.py` that moves chat answers' reasoning into `reasoning_content`;
    `tool_call_parser` one of `text/tools.py` that reads tool calls from chat answers (None:
    `tool_choice` 'auto' is refused; 'required' and named calls still work);
    `json_schema_closed` closes every JSON schema's objects that say nothing of other keys;
    `loop_classes` are the named loop budgets requests pick by name or API key
    (`server/loop_classes.py`).
    """
    serving_metrics = getattr(client, "metrics", None)
    if serving_metrics is not None:  # the `model_name` label of the vLLM-named metrics
        serving_metrics.model_name = served_model_name
    ctx = ServingContext(
        client,
        served_model_name,
        allow_client_priority=allow_client_priority,
        default_max_tokens_cap=default_max_tokens,
        request_defaults=dict(request_defaults or {}),
        reasoning_parser=None if reasoning_parser is None else REASONING_PARSERS[reasoning_parser],
        tool_call_parser=None if tool_call_parser is None else TOOL_PARSERS[tool_call_parser],
        close_json_objects=json_schema_closed,
        loop_classes=loop_classes,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        client.start()
        ready_log = asyncio.ensure_future(_log_when_ready(client, served_model_name))
        yield
        ready_log.cancel()
        await client.shutdown(shutdown_timeout_s)
        ctx.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="loopserve", lifespan=lifespan)
    app.add_middleware(InternalErrorMiddleware)  # innermost: around the routes only
    app.add_middleware(
        BodySizeLimitMiddleware,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        body_deadline_s=body_deadline_s,
    )
    app.add_middleware(
        SecurityMiddleware,
        api_key=api_key,
        allowed_hosts=allowed_hosts,
        metrics_public=metrics_public,
        class_keys=() if loop_classes is None else loop_classes.keys,
    )
    if allowed_origins:  # outermost, so preflights are answered before the key check
        app.add_middleware(
            OpenAICORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.state.serving = ctx

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        if 400 <= err.status_code < 500:  # one line with the reason; never the body
            logger.warning(
                "%s %s -> %d: %s", request.method, request.url.path, err.status_code,
                err.info.message,
            )  # fmt: skip
        return JSONResponse(err.body, status_code=err.status_code, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        message, code = str(err.detail), None
        if err.status_code == 404:  # name the endpoint, and what is served instead
            message = (
                f"loopserve does not serve {request.method} {request.url.path}; it serves "
                f"{SERVED_ENDPOINTS}"
            )
            code = "unsupported_endpoint"
        error = ApiError(err.status_code, message, type=kind, code=code)
        return JSONResponse(error.body, status_code=err.status_code, headers=err.headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(ctx, await request.body(), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(ctx, await request.body(), request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await create_response(ctx, await request.body(), request)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await create_message(ctx, await request.body(), request)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> dict[str, int]:
        return await count_tokens(ctx, await request.body())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, object]:
        return await serving_tokenize.tokenize(ctx, await request.body())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, object]:
        return await serving_tokenize.detokenize(ctx, await request.body())

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, object]:
        return serving_tokenize.tokenizer_info(ctx)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[_model_card(ctx)])

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        ctx.check_model(model)
        return _model_card(ctx)

    @app.get("/health")
    async def health() -> Response:  # a pool says "degraded" while some replicas restart
        return JSONResponse(client.health(), status_code=200 if client.is_ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(client.render_metrics(), media_type=METRICS_CONTENT_TYPE)

    return app


async def _log_when_ready(client: EngineClient, served_model_name: str) -> None:
    if await client.wait_ready():
        logger.info("%s", ready_line(client.model_info(), served_model_name))


def ready_line(info: ModelInfo, served_model_name: str) -> str:
    """One line saying what is being served and how it is configured."""
    config = info.config
    cache, scheduler = config.cache, config.scheduler
    positions = cache.num_blocks // num_planes(cache.layout, info.num_loops) * cache.block_size
    return (
        f"ready: model={config.model or '(embedded default)'} "
        f"served_name={served_model_name} dtype={config.dtype} "
        f"device={config.device} kv_blocks={cache.num_blocks} "
        f"block_size={cache.block_size} kv_layout={cache.layout} kv_positions={positions} "
        f"max_model_len={info.max_model_len} loops={info.num_loops} "
        f"schedule={scheduler.mode} prefill={scheduler.prefill_mode} "
        f"mixed_prefill_decode={scheduler.mixed_prefill_decode} exit={config.exit.mode}"
    )


def _model_card(ctx: ServingContext) -> ModelCard:
    max_model_len = ctx.client.model_info().max_model_len if ctx.client.is_ready else None
    return ModelCard(id=ctx.served_model_name, max_model_len=max_model_len)


class GracefulServer(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM/SIGINT first stops new submissions and ends in
    a normal return (exit status 0) instead of re-raising the signal after shutdown."""

    def __init__(self, config: uvicorn.Config, on_exit_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit_signal = on_exit_signal

    def handle_exit(self, sig: int, frame: object) -> None:
        self._on_exit_signal()
        super().handle_exit(sig, frame)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def make_server(
    client: EngineClient, args: argparse.Namespace, served_model_name: str
) -> GracefulServer:
    """The uvicorn server for `client`, configured from the server flags of `loopserve serve`
    (server/args.py); SIGTERM/SIGINT stop new submissions and drain within
    `--shutdown-timeout-s`."""
    app = build_app(
        client,
        served_model_name,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout_s,
        body_deadline_s=args.body_deadline_s,
        shutdown_timeout_s=args.shutdown_timeout_s,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        metrics_public=args.metrics_public,
        allowed_hosts=_allowed_hosts(args.allowed_hosts, args.host),
        allowed_origins=tuple(args.allowed_origins),
        allow_client_priority=args.allow_client_priority,
        default_max_tokens=args.default_max_tokens,
        request_defaults=args.request_defaults,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
        json_schema_closed=args.json_schema_closed,
        loop_classes=args.loop_classes,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http=HeaderTimeoutH11Protocol.configured(args.header_timeout_s, args.max_connections),
        # uvicorn answers 503 once connections or tasks reach this (counting the asking
        # connection itself); connections beyond --max-connections and the reserved health
        # connections never get this far.
        limit_concurrency=args.max_connections + HEALTH_CONNECTIONS + 1,
        # A backstop: streams normally end on their own once the engine aborts them.
        timeout_graceful_shutdown=args.shutdown_timeout_s + SHUTDOWN_GRACE_S,
    )

    def on_exit_signal() -> None:
        client.stop_accepting(abort_after_s=args.shutdown_timeout_s)

    return GracefulServer(config, on_exit_signal=on_exit_signal)


def default_model_name(model: str | None) -> str:
    """A Hub id as given (`ByteDance/Ouro-1.4B`), else the directory's base name: the API never
    shows a local filesystem path."""
    if model is None:
        return DEFAULT_MODEL_NAME
    if not Path(model).expanduser().exists() and model.count("/") == 1:
        return model  # a Hub id (resolved from the cache, not a path of this machine)
    return Path(model).resolve().name or DEFAULT_MODEL_NAME


def _allowed_hosts(hosts: list[str] | None, bind_host: str) -> tuple[str, ...] | None:
    if hosts is None:
        return default_allowed_hosts(bind_host)
    return None if "*" in hosts else tuple(hosts)
