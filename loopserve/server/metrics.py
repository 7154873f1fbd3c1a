"""Server metrics in the Prometheus text exposition format, written by hand (no dependency).

`ServingMetrics` accumulates per-request results (finish reasons, TTFT, inter-token latency,
end-to-end latency) as the engine thread finishes requests; it is thread-safe. `render` turns
those plus a snapshot of engine gauges into the text served at `GET /metrics`. Metric names
carry the `loopserve_` prefix and unit suffixes (`_seconds`, `_total`, `_blocks`).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import Counter
from typing import Protocol

from loopserve.outputs import RequestOutput

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5, 5.0)  # fmt: skip
E2E_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
                 300.0, 600.0)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error")


class Histogram:
    """Cumulative-bucket histogram; `observe` is not locked (the owner locks)."""

    def __init__(self, buckets_s: tuple[float, ...]) -> None:
        assert list(buckets_s) == sorted(buckets_s), "buckets must be increasing"
        self.buckets_s = buckets_s
        self.counts = [0] * (len(buckets_s) + 1)  # the last slot is +Inf
        self.sum_s = 0.0
        self.count = 0

    def observe(self, value_s: float) -> None:
        self.counts[bisect.bisect_left(self.buckets_s, value_s)] += 1
        self.sum_s += value_s
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip((*self.buckets_s, math.inf), self.counts):
            cumulative += count
            le = "+Inf" if math.isinf(bound) else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {cumulative}')
        out.append(f"{name}_sum {self.sum_s!r}")
        out.append(f"{name}_count {self.count}")
        return out


class EngineGauges(Protocol):
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_output_tokens: int
    num_core_calls: int
    mean_rows_per_core_call: float
    mean_loops_per_token: float

    @property
    def kv_usage(self) -> float: ...


class ServingMetrics:
    """Per-request counters and latency histograms; safe to update from the engine thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.finished = Counter({reason: 0 for reason in FINISH_REASONS})
        self.num_prompt_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.itl = Histogram(ITL_BUCKETS_S)
        self.e2e = Histogram(E2E_BUCKETS_S)

    def observe_finished(self, output: RequestOutput) -> None:
        reason = "error" if output.error is not None else output.finish_reason or "abort"
        metrics = output.metrics
        with self._lock:
            self.finished[reason] += 1
            self.num_prompt_tokens += len(output.prompt_token_ids)
            if metrics.ttft_s is not None:
                self.ttft.observe(metrics.ttft_s)
            for gap_s in metrics.itl_s:
                self.itl.observe(gap_s)
            if metrics.e2e_s is not None and reason != "abort":
                self.e2e.observe(metrics.e2e_s)

    def render(self, gauges: EngineGauges, *, num_in_flight: int, is_ready: bool) -> str:
        """The Prometheus text for these metrics plus the engine's current gauges."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples])

        def gauge(name: str, help_text: str, value: float) -> None:
            metric(name, "gauge", help_text, [f"{name} {value!r}"])

        with self._lock:
            finished = [
                f'loopserve_requests_finished_total{{finish_reason="{reason}"}} {count}'
                for reason, count in sorted(self.finished.items())
            ]
            metric(
                "loopserve_requests_finished_total",
                "counter",
                "Requests finished, by finish reason (error: failed inside the engine).",
                finished,
            )
            metric(
                "loopserve_prompt_tokens_total",
                "counter",
                "Prompt tokens of finished requests.",
                [f"loopserve_prompt_tokens_total {self.num_prompt_tokens}"],
            )
            for name, hist, help_text in (
                ("loopserve_time_to_first_token_seconds", self.ttft, "Time to first token."),
                ("loopserve_inter_token_latency_seconds", self.itl, "Time between tokens."),
                ("loopserve_e2e_request_latency_seconds", self.e2e, "Arrival to finish."),
            ):
                metric(name, "histogram", help_text, hist.lines(name))
        metric(
            "loopserve_generation_tokens_total",
            "counter",
            "Output tokens generated.",
            [f"loopserve_generation_tokens_total {gauges.num_output_tokens}"],
        )
        metric(
            "loopserve_core_calls_total",
            "counter",
            "Core calls (one forward of the shared layers over a batch of rows).",
            [f"loopserve_core_calls_total {gauges.num_core_calls}"],
        )
        gauge("loopserve_ready", "1 when the engine is loaded and alive.", int(is_ready))
        gauge("loopserve_num_requests_running", "Requests running.", gauges.num_running)
        gauge("loopserve_num_requests_waiting", "Requests waiting.", gauges.num_waiting)
        gauge("loopserve_num_requests_in_flight", "Requests accepted, not done.", num_in_flight)
        gauge("loopserve_kv_blocks_free", "Free KV blocks.", gauges.num_free_blocks)
        gauge("loopserve_kv_blocks_total", "KV blocks in the pool.", gauges.num_total_blocks)
        gauge("loopserve_kv_cache_usage_ratio", "Share of KV blocks in use.", gauges.kv_usage)
        gauge(
            "loopserve_mean_loops_per_token",
            "Mean loops of the shared core per output token.",
            gauges.mean_loops_per_token,
        )
        gauge(
            "loopserve_mean_rows_per_core_call",
            "Mean rows (tokens) per core call.",
            gauges.mean_rows_per_core_call,
        )
        return "\n".join(lines) + "\n"
