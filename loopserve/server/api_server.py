"""The OpenAI-compatible HTTP server: app factory, middleware, routes and `loopserve serve`.

`build_app` wires an `AsyncLLM` into a FastAPI app: `/v1/completions`,
`/v1/chat/completions` (both with SSE streaming), `/v1/models`, `/health` (200 only when the
engine is loaded and alive) and `/metrics` (Prometheus text). Every error uses OpenAI's body
`{"error": {"message", "type", "param", "code"}}`; bodies over `max_body_bytes` get 413 before
they are parsed. `main_from_args` runs uvicorn; on SIGTERM/SIGINT the server stops accepting,
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
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from loopserve.distributed.args import build_pool, check_distributed_args, uses_ray
from loopserve.distributed.pool import ReplicaPool
from loopserve.engine_args import engine_args_from
from loopserve.server.args import (
    API_KEY_ENV,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MODEL_NAME,
    add_cli_args,
)
from loopserve.server.async_engine import AsyncLLM
from loopserve.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from loopserve.server.middleware import (
    BodySizeLimitMiddleware,
    HeaderTimeoutH11Protocol,
    SecurityMiddleware,
    default_allowed_hosts,
)
from loopserve.server.protocol import ModelCard, ModelList
from loopserve.server.serving_chat import create_chat_completion
from loopserve.server.serving_common import ApiError, ServingContext
from loopserve.server.serving_completions import create_completion

logger = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 3.0  # after the engine aborts the rest, time for streams to end


def build_app(
    async_llm: AsyncLLM | ReplicaPool,
    served_model_name: str,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    shutdown_timeout_s: float = 10.0,
    api_key: str | None = None,
    metrics_public: bool = False,
    allowed_hosts: tuple[str, ...] | None = None,
    allowed_origins: tuple[str, ...] = (),
    allow_client_priority: bool = False,
    default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS,
) -> FastAPI:
    """The FastAPI app serving `async_llm` (one engine, or a `ReplicaPool` of replicas with
    the same interface) as `served_model_name`.

    Its lifespan starts the engine thread, logs one line once the model is ready and, at
    shutdown, drains the engine within `shutdown_timeout_s`. `allowed_hosts=None` accepts any
    Host header; `api_key=None` needs no key.
    """
    ctx = ServingContext(
        async_llm,
        served_model_name,
        allow_client_priority=allow_client_priority,
        default_max_tokens_cap=default_max_tokens,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async_llm.start()
        ready_log = asyncio.ensure_future(_log_when_ready(async_llm, served_model_name))
        yield
        ready_log.cancel()
        await async_llm.shutdown(shutdown_timeout_s)

    app = FastAPI(title="loopserve", lifespan=lifespan)
    app.add_middleware(
        BodySizeLimitMiddleware, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s
    )
    app.add_middleware(
        SecurityMiddleware,
        api_key=api_key,
        allowed_hosts=allowed_hosts,
        metrics_public=metrics_public,
    )
    if allowed_origins:  # outermost, so preflights are answered before the key check
        app.add_middleware(
            CORSMiddleware,
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
    async def http_error(_request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        error = ApiError(err.status_code, str(err.detail), type=kind)
        return JSONResponse(error.body, status_code=err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, err: Exception) -> JSONResponse:
        error_id = uuid.uuid4().hex[:16]
        logger.error("unhandled error (error id %s)", error_id, exc_info=err)
        error = ApiError(
            500,
            f"internal server error (error id {error_id}; details are in the server log)",
            type="server_error",
            code="internal_error",
        )
        return JSONResponse(error.body, status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(ctx, await request.body(), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(ctx, await request.body(), request)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[_model_card(ctx)])

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        ctx.check_model(model)
        return _model_card(ctx)

    @app.get("/health")
    async def health() -> Response:
        if isinstance(async_llm, ReplicaPool):  # "degraded" while some replicas restart
            details = async_llm.health()
            return JSONResponse(details, status_code=200 if async_llm.is_ready else 503)
        if async_llm.is_ready:
            return JSONResponse({"status": "ok"})
        status = "dead" if async_llm.is_dead else "loading"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = async_llm.metrics.render(
            async_llm.snapshot,
            num_in_flight=async_llm.num_in_flight,
            is_ready=async_llm.is_ready,
        )
        return PlainTextResponse(text, media_type=METRICS_CONTENT_TYPE)

    return app


async def _log_when_ready(async_llm: AsyncLLM, served_model_name: str) -> None:
    if await async_llm.wait_ready():
        logger.info("%s", ready_line(async_llm.engine, served_model_name))


def ready_line(engine: object, served_model_name: str) -> str:
    """One line saying what is being served and how it is configured."""
    config = getattr(engine, "config", None)
    cache = getattr(config, "cache", None)
    num_blocks = getattr(cache, "num_blocks", None)
    block_size = getattr(cache, "block_size", None)
    layout = getattr(cache, "layout", None)
    num_loops = getattr(engine, "num_loops", 1)
    positions = None
    if num_blocks is not None and block_size is not None:
        positions = num_blocks // (1 if layout == "shared" else num_loops) * block_size
    scheduler = getattr(config, "scheduler", None)
    policies = (
        ""
        if scheduler is None
        else (
            f"schedule={scheduler.mode} prefill={scheduler.prefill_mode} "
            f"mixed_prefill_decode={scheduler.mixed_prefill_decode} "
        )
    )
    exit_mode = getattr(getattr(config, "exit", None), "mode", None)
    return (
        f"ready: model={getattr(config, 'model', None) or '(embedded default)'} "
        f"served_name={served_model_name} dtype={getattr(config, 'dtype', None)} "
        f"device={getattr(config, 'device', None)} kv_blocks={num_blocks} "
        f"block_size={block_size} kv_layout={layout} kv_positions={positions} "
        f"max_model_len={getattr(engine, 'max_model_len', None)} loops={num_loops} "
        f"{policies}exit={exit_mode}"
    )


def _model_card(ctx: ServingContext) -> ModelCard:
    max_model_len = ctx.async_llm.engine.max_model_len if ctx.async_llm.is_ready else None
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


def _set_torch_threads(args: argparse.Namespace) -> None:
    """On CPU, keep a core free for the event loop: torch's workers otherwise fight it (on
    2 cores we measured ~17x lower throughput with 2 torch threads than with 1)."""
    if not str(args.device).startswith("cpu"):
        return
    threads = args.torch_threads
    if threads is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return
        threads = max(1, (os.cpu_count() or 1) - 1)
    import torch

    torch.set_num_threads(threads)


def main_from_args(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a graceful shutdown, 1 if the model failed to load,
    2 (with a one-line error) if the model directory does not exist."""
    check_distributed_args(args)  # flag combinations first: a usage error costs nothing
    if args.model is not None and not Path(args.model).exists():
        print(f"loopserve serve: error: model directory not found: {args.model}", file=sys.stderr)
        return 2
    from loopserve.engine.llm_engine import LLMEngine  # lazy: keeps `loopserve --help` fast

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _set_torch_threads(args)
    engine_args = engine_args_from(args)
    served_model_name = args.served_model_name or _default_model_name(args.model)
    server: GracefulServer | None = None

    def stop_server(_err: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    async_llm: AsyncLLM | ReplicaPool
    if uses_ray(args):
        async_llm = build_pool(args, engine_args, on_load_error=stop_server)
    else:
        async_llm = AsyncLLM(
            lambda: LLMEngine.from_engine_args(**engine_args),
            max_pending_requests=args.max_pending_requests,
            on_load_error=stop_server,
        )
    app = build_app(
        async_llm,
        served_model_name,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout_s,
        shutdown_timeout_s=args.shutdown_timeout_s,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        metrics_public=args.metrics_public,
        allowed_hosts=_allowed_hosts(args.allowed_hosts, args.host),
        allowed_origins=tuple(args.allowed_origins),
        allow_client_priority=args.allow_client_priority,
        default_max_tokens=args.default_max_tokens,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http=HeaderTimeoutH11Protocol.configured(args.header_timeout_s, args.max_connections),
        # uvicorn answers 503 once connections or tasks reach this (counting the asking
        # connection itself); connections beyond --max-connections never get this far.
        limit_concurrency=args.max_connections + 1,
        # A backstop: streams normally end on their own once the engine aborts them.
        timeout_graceful_shutdown=args.shutdown_timeout_s + SHUTDOWN_GRACE_S,
    )

    def on_exit_signal() -> None:
        async_llm.stop_accepting(abort_after_s=args.shutdown_timeout_s)

    server = GracefulServer(config, on_exit_signal=on_exit_signal)
    if isinstance(async_llm, ReplicaPool):
        async_llm.init_ray()  # in the main thread, before uvicorn takes the signals
    server.run()
    if async_llm.load_error is not None:
        logger.error("the model failed to load: %s", async_llm.load_error)
        return 1
    return 0


def _default_model_name(model: str | None) -> str:
    """The directory's base name: the API never shows a local filesystem path."""
    if model is None:
        return DEFAULT_MODEL_NAME
    return Path(model).resolve().name or DEFAULT_MODEL_NAME


def _allowed_hosts(hosts: list[str] | None, bind_host: str) -> tuple[str, ...] | None:
    if hosts is None:
        return default_allowed_hosts(bind_host)
    return None if "*" in hosts else tuple(hosts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_cli_args(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
