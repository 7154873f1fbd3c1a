"""Server hardening, end to end, against real server processes.

One "secured" server (API key from `LOOPSERVE_API_KEY`, a CORS origin, a 1 s header timeout,
at most 4 connections, client priority allowed, `--default-max-tokens 3`, no
`--served-model-name`) serves most tests here. Short-lived servers check the missing-model
error, and the non-streaming shutdown status. In-process tests cover what is awkward to reach
over HTTP (a public `/metrics`, the metrics registry).
"""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import contextlib
import http.client
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.optional import require

require("serve")
import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from loopserve.engine.async_llm import AsyncLLM
from loopserve.engine.metrics import ServingMetrics
from loopserve.runner.sampler import make_generator
from tests.fault_runner import FAIL_SEED, FAULT_TEXT
from tests.server_utils import ServerProcess, metrics, sse_payloads, wait_all_blocks_free

API_KEY = "sk-test-4c1d"
AUTH = {"authorization": f"Bearer {API_KEY}"}
ORIGIN = "https://app.example"
SECURED_FLAGS = [
    "--dtype", "float32", "--num-blocks", "256", "--block-size", "16",
    "--allowed-origins", ORIGIN, "--header-timeout-s", "1", "--max-connections", "4",
    "--body-timeout-s", "2", "--body-deadline-s", "3",
    "--allow-client-priority", "--default-max-tokens", "3", "--log-level", "info",
]  # fmt: skip
GOOD = {"prompt": "hello", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def secured(tiny_tok_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("secured") / "server.log"
    proc = ServerProcess(
        ["--model", str(tiny_tok_dir), *SECURED_FLAGS],
        log_path,
        env={"LOOPSERVE_API_KEY": API_KEY},
    )
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


# ---- item 7: API key -----------------------------------------------------------------------

# (method, path, body, headers, status)
AUTH_MATRIX = {
    "completions_no_key": ("POST", "/v1/completions", GOOD, {}, 401),
    "completions_wrong_key": (
        "POST",
        "/v1/completions",
        GOOD,
        {"authorization": "Bearer sk-wrong"},
        401,
    ),
    "completions_basic_scheme": (
        "POST",
        "/v1/completions",
        GOOD,
        {"authorization": f"Basic {API_KEY}"},
        401,
    ),
    "chat_no_key": ("POST", "/v1/chat/completions", CHAT, {}, 401),
    "models_no_key": ("GET", "/v1/models", None, {}, 401),
    "model_card_no_key": ("GET", "/v1/models/tiny", None, {}, 401),
    "metrics_no_key": ("GET", "/metrics", None, {}, 401),
    "unknown_v1_route_no_key": ("GET", "/v1/files", None, {}, 401),
    # With the key, the other checks still apply (items 4 and 8).
    "key_but_text_plain": (
        "POST",
        "/v1/completions",
        GOOD,
        {**AUTH, "content-type": "text/plain"},
        415,
    ),
    "key_but_rebound_host": ("GET", "/v1/models", None, {**AUTH, "host": "evil.test"}, 400),
    "key_but_never_admissible": (
        "POST",
        "/v1/completions",
        GOOD | {"prompt": ["a"] * 20, "n": 64},
        AUTH,
        400,
    ),
}


@pytest.mark.parametrize("case", sorted(AUTH_MATRIX))
def test_auth_matrix_gets_status_and_openai_error_shape(secured, case):
    method, path, body, headers, status = AUTH_MATRIX[case]
    with httpx.Client(base_url=secured.base_url, timeout=30.0) as http:
        content = None if body is None else json.dumps(body).encode()
        request = http.build_request(method, path, content=content)
        if content is not None:
            request.headers["content-type"] = "application/json"
        request.headers.update(headers)
        response = http.send(request)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if status == 401:
        assert error["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
        assert API_KEY not in response.text


def test_the_key_opens_v1_and_metrics_and_health_stays_open(secured):
    assert httpx.get(secured.base_url + "/health", timeout=10.0).status_code == 200
    models = httpx.get(secured.base_url + "/v1/models", headers=AUTH, timeout=10.0)
    assert models.status_code == 200
    done = httpx.post(secured.base_url + "/v1/completions", json=GOOD, headers=AUTH, timeout=30)
    assert done.status_code == 200, done.text
    assert metrics(secured.base_url, AUTH)["loopserve_ready"] == 1.0


def test_metrics_public_serves_metrics_without_the_key():
    from loopserve.server.api_server import build_app

    async_llm = AsyncLLM(lambda: None)  # never started: only the middleware is exercised
    public = build_app(async_llm, "m", api_key=API_KEY, metrics_public=True)
    private = build_app(async_llm, "m", api_key=API_KEY)

    def get(app, path: str) -> int:
        import asyncio

        async def call() -> int:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                return (await client.get(path)).status_code

        return asyncio.run(call())

    assert get(public, "/metrics") == 200
    assert get(private, "/metrics") == 401
    assert get(public, "/v1/models") == 401  # only /metrics is made public


# ---- item 8: CORS ---------------------------------------------------------------------------


def test_cors_preflight_is_answered_for_an_allowed_origin_only(secured):
    preflight = {
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization,content-type",
    }
    ok = httpx.options(
        secured.base_url + "/v1/completions", headers={"origin": ORIGIN, **preflight}
    )
    assert ok.status_code == 200, ok.text
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    evil = httpx.options(
        secured.base_url + "/v1/completions",
        headers={"origin": "https://evil.example", **preflight},
    )
    assert evil.status_code == 400
    assert "access-control-allow-origin" not in evil.headers
    assert evil.headers["content-type"] == "application/json"
    error = evil.json()["error"]
    assert error["code"] == "cors_rejected" and "origin" in error["message"]


# ---- item 6: header timeout and connection cap -----------------------------------------------


def _closed_by_server_within(sock: socket.socket, bound_s: float) -> bool:
    """True if the server closes `sock` (recv returns b"" or resets) within `bound_s`."""
    sock.settimeout(bound_s)
    try:
        while True:
            if sock.recv(4096) == b"":
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_partial_headers_are_cut_off_after_the_header_timeout(secured):
    with socket.create_connection(("127.0.0.1", secured.port)) as slow:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        # The timeout is 1 s; 15 s leaves room for a loaded machine without being unbounded.
        assert _closed_by_server_within(slow, 15.0)
    # A complete request on a fresh connection is unaffected.
    assert httpx.get(secured.base_url + "/health", timeout=10.0).status_code == 200


def test_a_keep_alive_connection_in_use_outlives_the_header_timeout(secured):
    """A client without retries (http.client) sends a request every 0.2 s on one keep-alive
    connection for 2.5 times the 1 s header timeout: every request succeeds on the same
    socket. (The header timers were never cancelled: the one armed at connecting cut the
    connection at 1 s, between two requests.)"""
    conn = http.client.HTTPConnection("127.0.0.1", secured.port, timeout=10.0)
    try:
        sock = None
        deadline_s = time.monotonic() + 2.5
        sent = 0
        while time.monotonic() < deadline_s:
            conn.request("GET", "/health")
            response = conn.getresponse()
            response.read()
            assert response.status == 200
            if sock is None:
                sock = conn.sock
            assert conn.sock is sock, f"reconnected after {sent} requests"
            sent += 1
            time.sleep(0.2)
        assert sent >= 8
    finally:
        conn.close()


def test_a_body_that_stops_arriving_gets_408_and_the_connection_closes(secured):
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: 100\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", secured.port)) as slow:
        slow.sendall(head + b'{"prompt": ')
        slow.settimeout(30.0)  # the body timeout is 2 s; 30 s bounds the wait on a loaded box
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := slow.recv(4096):
                received += chunk
    assert received.startswith(b"HTTP/1.1 408 "), received
    assert b'"code":"body_timeout"' in received


def test_a_trickled_body_gets_408_at_the_body_deadline(secured):
    """One byte every 0.25 s never trips the 2 s per-part timeout; the 3 s deadline for the
    whole body closes it anyway."""
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: 1000\r\n\r\n"
    ).encode()
    received = b""
    with socket.create_connection(("127.0.0.1", secured.port)) as slow:
        slow.sendall(head)
        slow.settimeout(0.25)
        for _ in range(240):  # at most 60 s of trickling
            try:
                slow.sendall(b" ")
                chunk = slow.recv(4096)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if not chunk:
                break
            received += chunk
            if b"\r\n\r\n" in received and b"body_timeout" in received:
                break
    assert received.startswith(b"HTTP/1.1 408 "), received
    assert b"within 3.0 s" in received


def _exchange(port: int, request: bytes) -> bytes:
    """Send one raw request on a new connection; everything received until it closes."""
    received = b""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(request)
        sock.settimeout(15.0)
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(4096):
                received += chunk
                if b"\r\n\r\n" in received and b"Connection: close" not in received:
                    head, _, body = received.partition(b"\r\n\r\n")
                    length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
                    if len(body) >= length:
                        break
    return received


MALFORMED_HTTP = {
    "bad_chunk_size": b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b"Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\nZZ\r\n{}\r\n0\r\n\r\n",
    "bad_content_length": b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b"Content-Length: 12abc\r\n\r\n{}",
    "duplicate_host": b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: 127.0.0.1\r\n\r\n",
    "bad_request_line": b"GET /health HTTP/1.1 extra\r\nHost: 127.0.0.1\r\n\r\n",
}


@pytest.mark.parametrize("raw", MALFORMED_HTTP.values(), ids=MALFORMED_HTTP.keys())
def test_requests_the_http_parser_rejects_get_an_openai_shaped_400(secured, raw):
    answer = _exchange(secured.port, raw)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:300]
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "bad_http_request" and error["type"] == "invalid_request_error"


def test_a_full_server_still_answers_health_then_closes_what_is_beyond_its_reserve(secured):
    """Four connections that sent a request's headers but not its body fill
    `--max-connections 4` (the header timeout does not apply to them). A fifth connection
    may only ask /health: it gets its answer (a probe sees a full server as alive), anything
    else a 503 in the OpenAI shape. Four such reserved connections at most: beyond them a
    new connection is closed without an answer."""
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: 100\r\n\r\n"
    ).encode()
    health = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    held = [socket.create_connection(("127.0.0.1", secured.port)) for _ in range(4)]
    reserved: list[socket.socket] = []
    try:
        for sock in held:
            sock.sendall(head)
        time.sleep(0.5)  # not a bound: the server must have read them before the next come
        answer = _exchange(secured.port, health)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        refused = _exchange(
            secured.port, head.replace(b"Content-Length: 100", b"Content-Length: 2") + b"{}"
        )
        assert refused.startswith(b"HTTP/1.1 503"), refused[:200]
        error = json.loads(refused.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "too_many_connections" and set(error) == {
            "message", "type", "param", "code",
        }  # fmt: skip
        assert error["type"] == "server_error"  # a 5xx: not the client's request at fault
        reserved = [socket.create_connection(("127.0.0.1", secured.port)) for _ in range(4)]
        for sock in reserved:  # held like the first four: a body that does not come
            sock.sendall(head.replace(b"/v1/completions", b"/health"))
        time.sleep(0.5)
        assert _exchange(secured.port, health) == b""  # beyond the reserve: closed unanswered
    finally:
        for sock in held + reserved:
            sock.close()
    deadline_s = time.monotonic() + 20
    while True:  # the held ones are gone; service resumes
        try:
            if httpx.get(secured.base_url + "/health", timeout=5.0).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline_s
        time.sleep(0.1)


# ---- items 9, 10, 12, 14: priority, served name, ready line, default max_tokens ------------


def test_priority_is_accepted_with_allow_client_priority(secured):
    body = GOOD | {"priority": -5}
    response = httpx.post(secured.base_url + "/v1/completions", json=body, headers=AUTH)
    assert response.status_code == 200, response.text


def test_served_name_is_the_directory_base_name_not_its_path(secured, tiny_tok_dir):
    data = httpx.get(secured.base_url + "/v1/models", headers=AUTH).json()["data"]
    assert [card["id"] for card in data] == [Path(tiny_tok_dir).name]
    assert str(Path(tiny_tok_dir).parent) not in json.dumps(data)


def test_ready_line_names_model_and_configuration(secured, tiny_tok_dir):
    lines = [line for line in secured.log().splitlines() if "ready: model=" in line]
    assert len(lines) == 1, secured.log()
    line = lines[0]
    for part in (
        f"served_name={Path(tiny_tok_dir).name}",
        "dtype=float32",
        "device=cpu",
        "kv_blocks=256",
        "block_size=16",
        "max_model_len=",
        "schedule=refill",
    ):
        assert part in line, line


def test_chat_without_max_tokens_stops_at_default_max_tokens(secured):
    body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    response = httpx.post(
        secured.base_url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_serve_with_a_missing_model_prints_one_line_and_exits_2(tmp_path):
    missing = tmp_path / "no-such-model"
    result = subprocess.run(
        [sys.executable, "-m", "loopserve.cli.main", "serve", "--model", str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"loopserve serve: error: model '{missing}' is neither a local directory nor a Hub id"
    ]
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--pd", "prefill=1,decode=1", "--kv-handoff", "stream"],  # before any Ray cluster
    ],
    ids=["one-engine", "pd"],
)
def test_serve_with_flags_the_engine_rejects_prints_one_line_and_exits_2(flags):
    """Engine flags that do not go together (wavefront prompts need LAST_EXITED) fail at the
    command line with the engine's own message, before a port is bound, a Ray cluster starts
    or a model loads; not as a traceback from the engine thread or a replica after start-up."""
    result = subprocess.run(
        [sys.executable, "-m", "loopserve.cli.main", "serve", *flags,
         "--prefill-mode", "wavefront", "--layout", "shared"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "loopserve serve: error: wavefront and mixed prompt work need layout='last_exited': "
        "under SHARED a prompt position must be final before later positions read it"
    ]
    assert "Uvicorn running" not in result.stderr + result.stdout
    assert "Ray" not in result.stderr + result.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-model-len", "99999"],
         "max_model_len=99999 is longer than the model's 4096 positions (max_position_embeddings "
         "in its config.json): pass at most 4096, or set LOOPSERVE_ALLOW_LONG_MAX_MODEL_LEN=1 to "
         "run positions it was not trained on"),
        (["--speculative-tokens", "2", "--draft-loops", "4"],
         "draft_loops (4) must be below the model's loops (4): a draft is verified by the loops "
         "after it"),
        (["--chat-template", "{% for %}"],
         "chat_template does not compile: "),  # then Jinja's own words
    ],
    ids=["positions", "loops", "chat-template"],
)  # fmt: skip
def test_serve_with_flags_the_checkpoint_rules_out_prints_one_line_and_exits_2(
    flags, message, monkeypatch
):
    """Flags that only the checkpoint's config.json rules out (a context past its positions,
    a draft as deep as its loops), and a chat template that does not compile, fail at the
    command line too, before a port is bound: not
    after start-up (the draft, exit 1 from the engine thread) or never (the context, which
    sized tables by it and served positions the model has no rotary table for)."""
    monkeypatch.delenv("LOOPSERVE_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    result = subprocess.run(
        [sys.executable, "-m", "loopserve.cli.main", "serve", *flags],  # the embedded model
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"loopserve serve: error: {message}"), line
    assert "Uvicorn running" not in result.stderr + result.stdout


# ---- item 5: a non-streaming request aborted at shutdown -----------------------------------


def test_non_streaming_request_aborted_by_shutdown_gets_503(tiny_tok_dir, tmp_path):
    """Two requests, one running (it produces tokens) and one queued behind it
    (`--max-num-seqs 1`); SIGTERM with a 1 s drain aborts both: the queued one produced
    nothing and gets 503, the running one its partial text with finish_reason "abort"."""
    import threading

    flags = ["--dtype", "float32", "--num-blocks", "512", "--max-num-seqs", "1"]
    flags += ["--shutdown-timeout-s", "1", "--log-level", "warning"]
    proc = ServerProcess(["--model", str(tiny_tok_dir), *flags], tmp_path / "server.log")
    results: dict[str, httpx.Response] = {}
    body = {"prompt": "hello", "max_tokens": 1900, "ignore_eos": True}

    def post(name: str) -> None:
        results[name] = httpx.post(proc.base_url + "/v1/completions", json=body, timeout=60)

    try:
        proc.wait_healthy()
        threads = [threading.Thread(target=post, args=(name,)) for name in ("first", "second")]
        threads[0].start()
        deadline_s = time.monotonic() + 20
        while metrics(proc.base_url)["loopserve_num_requests_running"] < 1:
            assert time.monotonic() < deadline_s
            time.sleep(0.05)
        threads[1].start()
        while metrics(proc.base_url)["loopserve_num_requests_waiting"] < 1:
            assert time.monotonic() < deadline_s
            time.sleep(0.05)
        proc.terminate()
        for thread in threads:
            thread.join(60)
        assert proc.process.wait(30) == 0
    finally:
        proc.stop()
    first, second = results["first"], results["second"]
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["finish_reason"] == "abort"
    assert first.json()["usage"]["completion_tokens"] > 0
    assert second.status_code == 503, second.text
    assert second.json()["error"]["code"] == "shutting_down"


# ---- items 1 and 5: one request's setup fails in the runner ---------------------------------


def test_setup_failure_is_500_for_that_request_and_a_running_stream_survives(
    tiny_tok_dir, tmp_path
):
    """`tests.fault_runner` serves with a runner whose setup raises for requests seeded
    FAIL_SEED (a valid seed). With --mixed-prefill-decode such a request joins the core call
    of a running stream: it gets 500 with an error id (non-streaming) or an error event
    (streaming), and the stream runs on to max_tokens with the same text and exit depths as
    when it runs alone."""
    import threading

    flags = ["--dtype", "float32", "--num-blocks", "512", "--mixed-prefill-decode"]
    proc = ServerProcess(
        ["--model", str(tiny_tok_dir), *flags, "--log-level", "warning"],
        tmp_path / "server.log",
        module="tests.fault_runner",
    )
    body = {"prompt": "hello there", "max_tokens": 120, "ignore_eos": True, "temperature": 0}
    body["exit_threshold"] = 0.6  # varied exit depths
    first_chunk, done = threading.Event(), threading.Event()
    chunks: list[dict] = []

    def stream() -> None:
        url = proc.base_url + "/v1/completions"
        with httpx.stream("POST", url, json=body | {"stream": True}, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line.removeprefix("data: ")))
                    first_chunk.set()
        done.set()

    bad = {"prompt": "hi", "max_tokens": 4, "seed": FAIL_SEED}
    try:
        proc.wait_healthy()
        thread = threading.Thread(target=stream)
        thread.start()
        assert first_chunk.wait(60), proc.log()
        failed = httpx.post(proc.base_url + "/v1/completions", json=bad, timeout=60)
        failed_stream = httpx.post(
            proc.base_url + "/v1/completions", json=bad | {"stream": True}, timeout=60
        )
        overlapped = not done.is_set()  # the stream was still running meanwhile
        thread.join(120)
        alone = httpx.post(proc.base_url + "/v1/completions", json=body, timeout=120)
        blocks = wait_all_blocks_free(proc.base_url)
    finally:
        proc.stop()
    assert overlapped
    assert failed.status_code == 500, failed.text
    error = failed.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "engine_error")
    error_id = error["message"].split("error id ")[1].split(";")[0]
    assert FAULT_TEXT not in failed.text and FAULT_TEXT not in failed_stream.text
    events = sse_payloads(failed_stream.text.splitlines())
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_error"
    log = proc.log()
    assert error_id in log and FAULT_TEXT in log  # the details are in the server log only
    # The stream ran to max_tokens, equal to the same request alone.
    text = "".join(c["choices"][0]["text"] for c in chunks)
    depths = [d for c in chunks for d in c["choices"][0]["exit_depths"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(depths) == 120 and len(set(depths)) > 1
    assert alone.status_code == 200, alone.text
    assert (text, depths) == (
        alone.json()["choices"][0]["text"],
        alone.json()["choices"][0]["exit_depths"],
    )
    assert blocks["loopserve_kv_blocks_free"] == blocks["loopserve_kv_blocks_total"]


# ---- item 1 (runner part), item 11, item 16 --------------------------------------------------


def test_generator_setup_never_raises_for_a_64_bit_seed():
    """torch takes seeds in [-2**63, 2**64 - 1] and treats -1 as 2**64 - 1; the runner's setup
    must not raise for any seed (one request's seed must not fail a whole batch)."""
    same = [make_generator(seed).initial_seed() for seed in (-1, 2**64 - 1)]
    assert same == [2**64 - 1, 2**64 - 1]
    assert make_generator(2**64).initial_seed() == 0  # reduced mod 2**64, no OverflowError
    draws = [torch.rand(3, generator=make_generator(seed)) for seed in (-1, 2**64 - 1)]
    assert torch.equal(draws[0], draws[1])


def test_test_process_runs_torch_with_one_thread():
    assert torch.get_num_threads() == 1


def test_metrics_use_prometheus_client_in_a_private_registry():
    from prometheus_client import REGISTRY

    from loopserve.engine.stats import EngineStats

    first, second = ServingMetrics(), ServingMetrics()  # no duplicate-name clash
    assert first.registry is not REGISTRY and first.registry is not second.registry
    text = first.render(EngineStats(kv_blocks_total=8, kv_blocks_used=2), num_in_flight=2,
                        is_ready=True)  # fmt: skip
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert families["loopserve_time_to_first_token_seconds"].type == "histogram"
    assert families["loopserve_requests_finished"].type == "counter"
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in families.values()
        for s in family.samples
    }
    assert samples[("loopserve_requests_finished_total", (("finish_reason", "stop"),))] == 0
    assert samples[("loopserve_kv_cache_usage_ratio", ())] == 0.25
    assert samples[("loopserve_num_requests_in_flight", ())] == 2
    assert samples[("loopserve_kv_blocks_total", ())] == 8


# ---- item 15 --------------------------------------------------------------------------------


# ---- item 10: no internal exception text in responses --------------------------------------


def test_dead_engine_answers_503_without_the_exception_text(tiny_tok_dir):
    import asyncio

    from loopserve.engine.llm_engine import LLMEngine
    from loopserve.server.api_server import build_app

    engine = LLMEngine.from_engine_args(model=str(tiny_tok_dir), dtype="float32", num_blocks=32)

    def broken_step():
        raise RuntimeError("secret-detail /home/alice/model")

    async def main() -> list[httpx.Response]:
        async_llm = AsyncLLM(engine)
        async_llm.start()
        assert await async_llm.wait_ready(timeout_s=30)
        engine.step = broken_step
        app = build_app(async_llm, "tiny")
        transport = httpx.ASGITransport(app=app)
        body = {"prompt": "hello", "max_tokens": 4}
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                first = await client.post("/v1/completions", json=body)
                later = await client.post("/v1/completions", json=body)
        finally:
            await async_llm.shutdown(1.0)
        return [first, later]

    for response in asyncio.run(main()):
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "engine_dead"
        assert "secret-detail" not in response.text


def test_runner_keeps_no_state_of_a_request_whose_setup_fails(tiny_model, monkeypatch):
    """Item 1, runner part: each new request is set up on its own; the one whose setup raises
    is reported with its error and keeps no sampler, the others are installed."""
    from loopserve.contracts import NewRequestData, RequestFailure, SampleSpec, SchedulerOutput
    from loopserve.runner import model_runner
    from loopserve.runner.options import RunnerOptions

    runner = model_runner.ModelRunner(tiny_model, RunnerOptions(num_blocks=8, block_size=16))

    def flaky_generator(seed, device):
        if seed == 13:
            raise RuntimeError("device lost")
        return make_generator(seed, device)

    monkeypatch.setattr(model_runner, "make_generator", flaky_generator)
    spec = SampleSpec(temperature=1.0)
    new = tuple(
        NewRequestData(rid, spec, seed) for rid, seed in (("ok", 1), ("bad", 13), ("ok2", 2))
    )
    output = runner.execute(SchedulerOutput(1, (), new_requests=new))
    assert output.failed_requests == (RequestFailure("bad", "RuntimeError: device lost"),)
    assert set(runner.samplers) == {"ok", "ok2"}
    assert runner.samplers["ok2"][1].initial_seed() == 2
