"""Serving benchmark client: an OpenAI-compatible streaming load generator (like vLLM's).

Sends `SampledRequest`s to `/v1/completions` or `/v1/chat/completions` with Poisson arrivals
(optionally capped by a concurrency limit), reads the SSE stream of each, and records TTFT,
inter-token latencies and end-to-end latency per request; `compute_metrics` turns the records
into throughput, latency percentiles and goodput. It does not start or manage the server, and
it never retries: every request is bounded by a timeout and a failure is recorded as such.
Records, metrics and the table live in `serve_metrics`, files and figures in `serve_report`.
Mounted by the project CLI as `loopserve bench serve`; `python -m loopserve.bench.serve_client`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from datetime import datetime
from typing import Any

import httpx
import numpy as np

from loopserve.bench.args import add_serve_args as add_cli_args  # noqa: F401
from loopserve.bench.serve_metrics import (
    SLO_KEYS,
    RequestRecord,
    compute_metrics,
    format_table,
)
from loopserve.bench.serve_report import BenchmarkResult, write_results
from loopserve.workloads.datasets import SampledRequest, sample_random, sample_sharegpt
from loopserve.workloads.progress import make_progress

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def arrival_offsets_s(
    num_requests: int, request_rate: float, rng: np.random.Generator
) -> np.ndarray:
    """Send times relative to the start: Poisson process at `request_rate`, first at 0.

    An infinite rate sends everything at once.
    """
    if request_rate <= 0:
        raise ValueError(f"request_rate must be positive, got {request_rate}")
    if num_requests == 0 or math.isinf(request_rate):
        return np.zeros(num_requests)
    gaps_s = rng.exponential(1.0 / request_rate, size=num_requests - 1)
    return np.concatenate(([0.0], np.cumsum(gaps_s)))


def build_payload(request: SampledRequest, model: str, endpoint: str, ignore_eos: bool) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line, or None for blank, comment and other field lines."""
    return line[5:].strip() if line.startswith("data:") else None


def chunk_text(payload: dict) -> str:
    """Text of a completions (`text`) or chat (`delta.content`) stream chunk."""
    choices = payload.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send_request(
    client: httpx.AsyncClient, url: str, body: dict, prompt_len: int, start_s: float
) -> RequestRecord:
    """Stream one request and time its chunks; failures become records, never exceptions."""
    start = time.perf_counter()
    chunk_times: list[float] = []
    usage: dict = {}
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", errors="replace")
                raise httpx.HTTPStatusError(
                    f"HTTP {response.status_code}: {text[:300]}",
                    request=response.request,
                    response=response,
                )
            async for line in response.aiter_lines():
                data = sse_data(line)
                if data is None:
                    continue
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if not isinstance(payload, dict):
                    raise ValueError(f"stream chunk is not a JSON object: {data[:100]}")
                if "error" in payload:
                    raise ValueError(f"stream error: {payload['error']}")
                usage = payload.get("usage") or usage
                if chunk_text(payload):
                    chunk_times.append(time.perf_counter())
    except (httpx.HTTPError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        error = str(exc) or type(exc).__name__
        return RequestRecord(False, error, start_s, prompt_len, e2e_s=time.perf_counter() - start)
    e2e_s = time.perf_counter() - start
    if not chunk_times:
        return RequestRecord(False, "no text in response", start_s, prompt_len, e2e_s=e2e_s)
    return RequestRecord(
        success=True,
        error="",
        start_s=start_s,
        prompt_tokens=int(usage.get("prompt_tokens") or prompt_len),
        output_tokens=int(usage.get("completion_tokens") or len(chunk_times)),
        ttft_s=chunk_times[0] - start,
        e2e_s=e2e_s,
        itl_s=tuple(float(gap) for gap in np.diff(chunk_times)),
    )


async def run_benchmark(
    base_url: str,
    model: str,
    requests: list[SampledRequest],
    *,
    endpoint: str = "completions",
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    ignore_eos: bool = True,
    progress: bool = True,
    timeout_s: float = 600.0,
    slo: dict[str, float] | None = None,
) -> BenchmarkResult:
    """Send all requests with Poisson arrivals and an optional concurrency cap; no retries."""
    url = base_url.rstrip("/") + ENDPOINT_PATHS[endpoint]
    offsets_s = arrival_offsets_s(len(requests), request_rate, np.random.default_rng(seed))
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # The connection pool must not queue requests itself, or pool waits would count as TTFT.
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=None)
    bar = make_progress(progress, total=len(requests), desc="requests", unit="req")
    started_at = datetime.now().isoformat(timespec="seconds")
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        bench_start = time.perf_counter()

        async def one(request: SampledRequest, offset_s: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, offset_s - (time.perf_counter() - bench_start)))
            async with semaphore or contextlib.nullcontext():
                start_s = time.perf_counter() - bench_start
                body = build_payload(request, model, endpoint, ignore_eos)
                send = send_request(client, url, body, request.prompt_len, start_s)
                try:
                    record = await asyncio.wait_for(send, timeout_s)
                except asyncio.TimeoutError:
                    error = f"timed out after {timeout_s} s"
                    record = RequestRecord(
                        False, error, start_s, request.prompt_len, e2e_s=timeout_s
                    )
            bar.update(1)
            return record

        records = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets_s)))
        duration_s = time.perf_counter() - bench_start
    bar.close()
    config = {
        "base_url": base_url,
        "model": model,
        "endpoint": endpoint,
        "num_requests": len(requests),
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "max_concurrency": max_concurrency,
        "seed": seed,
        "ignore_eos": ignore_eos,
        "timeout_s": timeout_s,
        "slo": dict(slo or {}),
    }
    metrics = compute_metrics(records, duration_s, slo)
    return BenchmarkResult(config, started_at, duration_s, metrics, list(records))


def first_model_id(base_url: str, timeout_s: float) -> str:
    """The id of the first model the server lists at GET /v1/models."""
    response = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=timeout_s)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def _sample_requests(args: argparse.Namespace) -> list[SampledRequest]:
    if args.dataset == "random":
        return sample_random(
            args.num_prompts,
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            range_ratio=args.random_range_ratio,
            seed=args.seed,
        )
    count_tokens = None
    if args.tokenizer:
        from tokenizers import Tokenizer  # lazy: only needed for exact ShareGPT lengths

        tokenizer = Tokenizer.from_file(args.tokenizer)
        count_tokens = lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)  # noqa: E731
    return sample_sharegpt(args.num_prompts, count_tokens=count_tokens, seed=args.seed)


def main_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark described by `add_cli_args` flags; 0 when any request completed."""
    try:
        model = args.model or first_model_id(args.base_url, min(args.timeout_s, 30.0))
    except (httpx.HTTPError, KeyError, IndexError) as exc:
        print(f"cannot get a model id from {args.base_url}/v1/models: {exc}", file=sys.stderr)
        return 2
    requests = _sample_requests(args)
    if len(requests) < args.num_prompts:
        print(
            f"warning: dataset yielded {len(requests)} of {args.num_prompts} prompts",
            file=sys.stderr,
        )
    slo = {
        key: value
        for key, value in zip(SLO_KEYS, (args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms))
        if value is not None
    }
    result = asyncio.run(
        run_benchmark(
            args.base_url,
            model,
            requests,
            endpoint=args.endpoint,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            progress=not getattr(args, "no_progress", False),
            timeout_s=args.timeout_s,
            slo=slo,
        )
    )
    print(format_table(result.metrics))
    paths = write_results(result, args.output_dir)
    print(f"results: {paths.json_path}\nplots:   {paths.png_path}")
    return 0 if result.metrics.num_completed > 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
