"""HTTP middleware of the server: security checks, connection limits and body limits.

`SecurityMiddleware`: a Host-header allow-list against DNS rebinding (400), an API key with
the `Authorization: Bearer` scheme on `/v1/*`, the tokenizer routes, `/docs` and
`/openapi.json` (and `/metrics` unless public; 401), and 415 for a POST whose Content-Type is not JSON (so a web page cannot post
without a CORS preflight).
`HeaderTimeoutH11Protocol`: uvicorn's h11 protocol that closes connections which do not finish
a request's headers in time and caps open connections. `BodySizeLimitMiddleware`: 413 for
bodies over the limit (by `Content-Length` or by bytes received) and 408 when a body stops
arriving. `api_server` installs them; every error keeps OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import time
import uuid

import h11
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from loopserve.server.api_errors import ApiError
from loopserve.server.args import (
    DEFAULT_BODY_DEADLINE_S,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
)

logger = logging.getLogger(__name__)
# Beside /v1/*, the routes the API key guards: the tokenizer and FastAPI's API description.
KEYED_PATHS = frozenset(
    {"/tokenize", "/detokenize", "/tokenizer_info", "/docs", "/redoc", "/openapi.json",
     "/docs/oauth2-redirect"}
)  # fmt: skip
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
JSON_MEDIA_TYPES = ("application/json",)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str) -> tuple[str, ...] | None:
    """Host names accepted by default: localhost names when bound to loopback, else any (None)."""
    return LOOPBACK_HOSTS if _is_loopback(bind_host) else None


def _host_name(header: str) -> str:
    """The Host header without its port: `[::1]:8000` -> `::1`, `a.b:80` -> `a.b`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def sent_api_key(headers: Headers) -> str | None:
    """The API key a request sends: `Authorization: Bearer KEY`, else `x-api-key: KEY` (as
    Anthropic's clients send it); None when it sends neither."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return token.strip()
    return headers.get("x-api-key", "").strip() or None


class SecurityMiddleware:
    """Host allow-list (400), API key (401) and JSON-only POST bodies (415).

    Order: the Host check first (a rebound DNS name never reaches anything), then the key, then
    the Content-Type. `/health` needs no key; `/metrics` needs it unless `metrics_public`.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        allowed_hosts: tuple[str, ...] | None,
        metrics_public: bool,
        class_keys: tuple[str, ...] = (),
    ) -> None:
        """`class_keys`: the loop classes' API keys, accepted besides `api_key` (which must
        be set for any key to be checked)."""
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.class_keys = tuple(key.encode() for key in class_keys)
        self.allowed_hosts = (
            None if allowed_hosts is None else {h.lower().strip("[]") for h in allowed_hosts}
        )
        self.metrics_public = metrics_public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._check(scope)
        if error is not None:
            await JSONResponse(error.body, status_code=error.status_code, headers=error.headers)(
                scope, receive, send
            )
            return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> ApiError | None:
        headers = dict(scope["headers"])
        if self.allowed_hosts is not None:
            host = _host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.allowed_hosts:
                return ApiError(
                    400,
                    f"host '{host}' is not allowed (see --allowed-hosts)",
                    code="host_not_allowed",
                )
        path: str = scope["path"]
        needs_key = path.startswith("/v1/") or path == "/v1" or path in KEYED_PATHS
        needs_key |= path == "/metrics" and not self.metrics_public
        if self.api_key is not None and needs_key and scope["method"] != "OPTIONS":
            sent = (sent_api_key(Headers(scope=scope)) or "").encode("latin-1")
            known = [hmac.compare_digest(sent, key) for key in (self.api_key, *self.class_keys)]
            if not sent or not any(known):
                return ApiError(
                    401,
                    "invalid or missing API key: send `Authorization: Bearer <key>` "
                    "(or `x-api-key: <key>`)",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        if scope["method"] == "POST":
            content_type = headers.get(b"content-type", b"").decode("latin-1")
            media_type = content_type.split(";", 1)[0].strip().lower()
            if media_type not in JSON_MEDIA_TYPES:
                return ApiError(
                    415,
                    f"Content-Type must be application/json, got '{content_type}'",
                    code="unsupported_media_type",
                )
        return None


HEALTH_CONNECTIONS = 4  # connections beyond --max-connections that may only ask /health


class InternalErrorMiddleware:
    """A route that raises unexpectedly gets one 500 in the OpenAI shape with an error id,
    and its traceback is logged once, here. (As a FastAPI exception handler for `Exception`
    the 500 was sent and the exception then re-raised to the server, which logged the same
    traceback a second time.) After a response has begun nothing can be sent: the exception
    goes on to the server, which logs it and closes the connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception as err:
            if started:
                raise
            error_id = uuid.uuid4().hex[:16]
            logger.error("unhandled error (error id %s)", error_id, exc_info=err)
            error = ApiError(
                500,
                f"internal server error (error id {error_id}; details are in the server log)",
                type="server_error",
                code="internal_error",
            )
            await JSONResponse(error.body, status_code=500)(scope, receive, send)


class HealthOnlyApp:
    """The app of a connection opened beyond `--max-connections` (one of the reserved
    `HEALTH_CONNECTIONS`): `/health` goes through, anything else gets a 503 in the OpenAI
    error shape and the connection closes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") == "/health":
            await self.app(scope, receive, send)
            return
        error = ApiError(
            503,
            "too many open connections: this connection may only ask /health",
            type="server_error",
            code="too_many_connections",
        )
        await JSONResponse(error.body, status_code=503, headers={"Connection": "close"})(
            scope, receive, send
        )


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus: a connection must finish each request's headers within
    `header_timeout_s` of connecting (or of its previous response ending), and connections
    beyond `max_connections` may only ask `/health` (`HEALTH_CONNECTIONS` of them; any more
    are closed at once), so a health probe gets through while ordinary connections fill the
    cap. uvicorn only times out idle keep-alive connections, so without this a client sending
    partial headers holds a descriptor forever.
    """

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    @classmethod
    def configured(cls, header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
        return type(
            "ConfiguredH11Protocol",
            (cls,),
            {"header_timeout_s": header_timeout_s, "max_connections": max_connections},
        )

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        open_connections = len(self.connections)
        if open_connections > self.max_connections + HEALTH_CONNECTIONS:
            logger.warning("over %d connections; closing a new one", self.max_connections)
            transport.close()
            return
        if open_connections > self.max_connections:
            self.app = HealthOnlyApp(self.app)  # this connection's app (uvicorn reads it)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (a malformed request line, headers, Content-Length or
        chunked body; a duplicate Host) gets a 400 in the OpenAI error shape, not uvicorn's
        plain text; then the connection closes."""
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):  # a response has begun
            self.transport.close()
            return
        error = ApiError(
            400,
            f"{msg.rstrip('.')}: malformed HTTP (request line, headers, Content-Length or "
            "chunked body)",
            code="bad_http_request",
        )
        body = JSONResponse(error.body).body
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _arm_header_timer(self) -> None:
        """One timer per connection, from now: the one armed at connecting or at the previous
        response is cancelled, so a keep-alive connection in use is never cut by a timer that
        started before its latest response ended (each fired at its own deadline: a client
        sending a request every 0.3 s lost its connection about every 10 s)."""
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        waiting_for_headers = self.conn.their_state is h11.IDLE and (
            self.cycle is None or self.cycle.response_complete
        )
        if waiting_for_headers and not self.transport.is_closing():
            self.transport.close()


class BodySizeLimitMiddleware:
    """Answers 413 to bodies over `max_body_bytes`, by Content-Length and by bytes received,
    and 408 when the next part of a body does not arrive within `body_timeout_s` or the whole
    body not within `body_deadline_s` (a body trickled a byte at a time is closed too).

    The body is read here (bounded) and replayed to the app; later `receive` calls go to the
    server, so handlers can still observe a client disconnect.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
        body_deadline_s: float = DEFAULT_BODY_DEADLINE_S,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.body_deadline_s = body_deadline_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await self._too_large(scope, receive, send, declared)
            return
        chunks: list[bytes] = []
        num_bytes = 0
        deadline_s = time.monotonic() + self.body_deadline_s
        while True:
            remaining_s = deadline_s - time.monotonic()
            try:
                message = await asyncio.wait_for(
                    receive(), max(0.0, min(self.body_timeout_s, remaining_s))
                )
            except asyncio.TimeoutError:
                late = remaining_s <= self.body_timeout_s
                error = ApiError(
                    408,
                    f"request body not received within {self.body_deadline_s} s"
                    if late
                    else f"request body part not received within {self.body_timeout_s} s",
                    code="body_timeout",
                )
                await JSONResponse(error.body, status_code=408, headers={"Connection": "close"})(
                    scope, receive, send
                )
                return
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            num_bytes += len(chunks[-1])
            if num_bytes > self.max_body_bytes:
                await self._too_large(scope, receive, send, None)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(
        self, scope: Scope, receive: Receive, send: Send, declared: bytes | None
    ) -> None:
        if declared is not None and not declared.isdigit():
            error = ApiError(400, "invalid Content-Length header")
        else:
            error = ApiError(
                413,
                f"request body exceeds {self.max_body_bytes} bytes",
                code="request_too_large",
            )
        await JSONResponse(error.body, status_code=error.status_code)(scope, receive, send)


class OpenAICORSMiddleware(CORSMiddleware):
    """Starlette's CORS middleware whose rejected preflight (an origin, method or header not
    allowed) answers 400 in the OpenAI error shape instead of plain text."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        reason = bytes(response.body).decode("utf-8", "replace")  # "Disallowed CORS origin"
        error = ApiError(400, f"CORS preflight rejected: {reason}", code="cors_rejected")
        headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
        headers.pop("content-type", None)
        return JSONResponse(error.body, status_code=400, headers=headers)
