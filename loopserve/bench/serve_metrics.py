"""Serving-benchmark records and metrics: what each request did, and the aggregate
throughput, latency percentiles and goodput `loopserve bench serve` reports."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SLO_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")


@dataclass(frozen=True)
class RequestRecord:
    """What one request did. Times in seconds; `start_s` is relative to the benchmark start."""

    success: bool
    error: str
    start_s: float
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: tuple[float, ...] = ()  # gaps between successive text chunks


@dataclass(frozen=True)
class LatencyStats:
    """Mean and percentiles (linear interpolation) in milliseconds; zeros when empty."""

    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float

    @classmethod
    def of(cls, values_ms: list[float]) -> LatencyStats:
        if not values_ms:
            return cls(0.0, 0.0, 0.0, 0.0)
        p50, p90, p99 = np.percentile(values_ms, [50, 90, 99])
        return cls(float(np.mean(values_ms)), float(p50), float(p90), float(p99))


@dataclass(frozen=True)
class BenchmarkMetrics:
    num_completed: int
    num_failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput_rps: float
    input_tokens_per_s: float
    output_tokens_per_s: float
    goodput_rps: float | None  # None when no SLO was given
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats


def tpot_ms(record: RequestRecord) -> float | None:
    """Time per output token after the first, or None for requests with at most one token."""
    if record.output_tokens <= 1:
        return None
    return (record.e2e_s - record.ttft_s) / (record.output_tokens - 1) * 1000.0


def _meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    tpot = tpot_ms(record)
    return (
        record.ttft_s * 1000.0 <= slo.get("ttft_ms", math.inf)
        and record.e2e_s * 1000.0 <= slo.get("e2e_ms", math.inf)
        and (tpot is None or tpot <= slo.get("tpot_ms", math.inf))
    )


def compute_metrics(
    results: list[RequestRecord], duration_s: float, slo: dict[str, float] | None = None
) -> BenchmarkMetrics:
    """Aggregate request records; `slo` keys are `ttft_ms`, `tpot_ms`, `e2e_ms`."""
    slo = slo or {}
    if unknown := set(slo) - set(SLO_KEYS):
        raise ValueError(f"unknown SLO keys {sorted(unknown)}; expected {SLO_KEYS}")
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [t for r in ok if (t := tpot_ms(r)) is not None]
    goodput = sum(_meets_slo(r, slo) for r in ok) / duration_s if slo else None
    return BenchmarkMetrics(
        num_completed=len(ok),
        num_failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput_rps=len(ok) / duration_s,
        input_tokens_per_s=input_tokens / duration_s,
        output_tokens_per_s=output_tokens / duration_s,
        goodput_rps=goodput,
        ttft=LatencyStats.of([r.ttft_s * 1000.0 for r in ok]),
        tpot=LatencyStats.of(tpots),
        itl=LatencyStats.of([gap * 1000.0 for r in ok for gap in r.itl_s]),
        e2e=LatencyStats.of([r.e2e_s * 1000.0 for r in ok]),
    )


def format_table(metrics: BenchmarkMetrics) -> str:
    """A human-readable summary in the layout of vLLM's benchmark_serving."""
    lines = ["{:=^60}".format(" Serving Benchmark Result ")]

    def row(label: str, value: float | int) -> None:
        lines.append(
            f"{label:<44}{value:>16.2f}" if isinstance(value, float) else f"{label:<44}{value:>16}"
        )

    row("Successful requests:", metrics.num_completed)
    row("Failed requests:", metrics.num_failed)
    row("Benchmark duration (s):", metrics.duration_s)
    row("Total input tokens:", metrics.total_input_tokens)
    row("Total generated tokens:", metrics.total_output_tokens)
    row("Request throughput (req/s):", metrics.request_throughput_rps)
    if metrics.goodput_rps is not None:
        row("Request goodput (req/s):", metrics.goodput_rps)
    row("Output token throughput (tok/s):", metrics.output_tokens_per_s)
    row("Total token throughput (tok/s):", metrics.input_tokens_per_s + metrics.output_tokens_per_s)
    for name, title, stats in (
        ("TTFT", "Time to First Token", metrics.ttft),
        ("TPOT", "Time per Output Token (excl. 1st token)", metrics.tpot),
        ("ITL", "Inter-token Latency", metrics.itl),
        ("E2EL", "End-to-end Latency", metrics.e2e),
    ):
        lines.append(f"{title:-^60}")
        row(f"Mean {name} (ms):", stats.mean_ms)
        row(f"Median {name} (ms):", stats.p50_ms)
        row(f"P90 {name} (ms):", stats.p90_ms)
        row(f"P99 {name} (ms):", stats.p99_ms)
    lines.append("=" * 60)
    return "\n".join(lines)
