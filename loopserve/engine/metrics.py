"""Server metrics for `GET /metrics`, kept with `prometheus_client` in a registry of our own.

`ServingMetrics` accumulates per-request results (finish reasons, prompt tokens, TTFT,
inter-token latency, end-to-end latency) as the engine thread finishes requests; the library's
metrics are thread-safe. Engine gauges (running, waiting, KV blocks, core calls, ...) are read
from the latest engine snapshot by a collector at scrape time. `render` returns the Prometheus
text. Metric names carry the `loopserve_` prefix and unit suffixes (`_seconds`, `_total`,
`_blocks`).

Multiprocess mode: when `PROMETHEUS_MULTIPROC_DIR` is set (before this module is imported, as
`prometheus_client` requires), the per-request counters and histograms are written to that
directory and `render` aggregates every process's files; the engine gauges are this process's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from loopserve.engine.stats import EngineStats
from loopserve.outputs import RequestOutput

prometheus_client.disable_created_metrics()  # no `_created` samples: names stay as before

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5, 5.0)  # fmt: skip
E2E_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
                 300.0, 600.0)  # fmt: skip
FINISH_REASONS = ("abort", "error", "length", "stop")
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST


class _EngineCollector:
    """Turns the engine snapshot current at scrape time into metric families."""

    def __init__(self) -> None:
        self.gauges: EngineStats | None = None
        self.num_in_flight = 0
        self.is_ready = False

    def describe(self) -> list[Metric]:
        return []  # no up-front description: the families depend on the snapshot

    def collect(self) -> Iterator[Metric]:
        g = self.gauges
        if g is None:
            return
        yield CounterMetricFamily(
            "loopserve_generation_tokens", "Output tokens generated.", value=g.num_output_tokens
        )
        yield CounterMetricFamily(
            "loopserve_core_calls",
            "Core calls (one forward of the shared layers over a batch of rows).",
            value=g.num_core_calls,
        )
        preemptions = CounterMetricFamily(
            "loopserve_preemptions",
            "Requests preempted for KV or priority, by mode.",
            labels=["mode"],
        )
        preemptions.add_metric(["recompute"], g.num_preemptions_recompute)
        preemptions.add_metric(["swap"], g.num_preemptions_swap)
        yield preemptions
        for name, help_text, value in (
            (
                "loopserve_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                g.num_prefix_cache_queried_tokens,
            ),
            (
                "loopserve_prefix_cache_hits",
                "Prompt tokens served by the prefix cache.",
                g.num_prefix_cache_hit_tokens,
            ),
            (
                "loopserve_prompt_positions_scored",
                "Prompt positions scored for prompt logprobs (echo + logprobs, prompt_logprobs).",
                g.num_scored_prompt_positions,
            ),
            (
                "loopserve_prompt_scored_loops",
                "Sum of the loops whose outputs scored those positions (the last loop, or the "
                "exit rule's with prompt_logprobs_loop=exit).",
                g.num_scored_prompt_loops,
            ),
            (
                "loopserve_spec_drafted",
                "Self-speculative decoding: drafts of a next token made.",
                g.num_spec_drafted,
            ),
            (
                "loopserve_spec_accepted",
                "Self-speculative decoding: drafts the real token confirmed.",
                g.num_spec_accepted,
            ),
            (
                "loopserve_spec_rejected",
                "Self-speculative decoding: drafts the real token rejected (rolled back).",
                g.num_spec_rejected,
            ),
            (
                "loopserve_spec_redrafted",
                "Self-speculative decoding: drafts a deeper loop's different draft replaced.",
                g.num_spec_redrafted,
            ),
            (
                "loopserve_kv_swapped_bytes",
                "KV bytes copied between device and host by swap preemption (both ways).",
                g.num_swapped_bytes,
            ),
        ):
            yield CounterMetricFamily(name, help_text, value=value)
        for name, help_text, value in (
            ("loopserve_ready", "1 when the engine is loaded and alive.", int(self.is_ready)),
            ("loopserve_num_requests_running", "Requests running.", g.num_running),
            ("loopserve_num_requests_waiting", "Requests waiting.", g.num_waiting),
            (
                "loopserve_num_requests_in_flight",
                "Requests accepted, not done.",
                self.num_in_flight,
            ),
            ("loopserve_kv_blocks_free", "Free KV blocks.", g.kv_blocks_free),
            ("loopserve_kv_blocks_total", "KV blocks in the pool.", g.kv_blocks_total),
            ("loopserve_kv_cache_usage_ratio", "Share of KV blocks in use.", g.kv_usage),
            (
                "loopserve_mean_loops_per_token",
                "Mean loops of the shared core per output token.",
                g.mean_loops_per_token,
            ),
            (
                "loopserve_mean_rows_per_core_call",
                "Mean rows (tokens) per core call.",
                g.mean_rows_per_core_call,
            ),
        ):
            yield GaugeMetricFamily(name, help_text, value=value)


class ServingMetrics:
    """Per-request counters and latency histograms in a private registry; thread-safe."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._multiproc_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        self.finished = Counter(
            "loopserve_requests_finished",
            "Requests finished, by finish reason (error: failed inside the engine).",
            ["finish_reason"],
            registry=self.registry,
        )
        for reason in FINISH_REASONS:
            self.finished.labels(finish_reason=reason)  # present at 0 from the start
        self.prompt_tokens = Counter(
            "loopserve_prompt_tokens", "Prompt tokens of finished requests.", registry=self.registry
        )
        self.ttft = Histogram(
            "loopserve_time_to_first_token_seconds",
            "Time to first token.",
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self.itl = Histogram(
            "loopserve_inter_token_latency_seconds",
            "Time between tokens.",
            buckets=ITL_BUCKETS_S,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "loopserve_e2e_request_latency_seconds",
            "Arrival to finish.",
            buckets=E2E_BUCKETS_S,
            registry=self.registry,
        )
        self._engine = _EngineCollector()
        self._scrape_registry = self.registry
        if self._multiproc_dir:
            from prometheus_client import multiprocess

            self._scrape_registry = CollectorRegistry(auto_describe=False)
            multiprocess.MultiProcessCollector(self._scrape_registry, path=self._multiproc_dir)
        self._scrape_registry.register(self._engine)

    def observe_finished(self, output: RequestOutput) -> None:
        reason = "error" if output.error is not None else output.finish_reason or "abort"
        metrics = output.metrics
        self.finished.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        if metrics.ttft_s is not None:
            self.ttft.observe(metrics.ttft_s)
        for gap_s in metrics.itl_s:
            self.itl.observe(gap_s)
        if metrics.e2e_s is not None and reason != "abort":
            self.e2e.observe(metrics.e2e_s)

    def finished_count(self, reason: str) -> int:
        """Requests finished so far with `reason` (this process only)."""
        return int(self.finished.labels(finish_reason=reason)._value.get())

    def render(self, gauges: EngineStats, *, num_in_flight: int, is_ready: bool) -> str:
        """The Prometheus text for these metrics plus the engine's current gauges."""
        self._engine.gauges = gauges
        self._engine.num_in_flight = num_in_flight
        self._engine.is_ready = is_ready
        return prometheus_client.generate_latest(self._scrape_registry).decode()
