"""Server metrics for `GET /metrics`, kept with `prometheus_client` in a registry of our own.

`ServingMetrics` accumulates per-request results (finish reasons, prompt tokens, TTFT,
inter-token latency, end-to-end latency) as the engine thread finishes requests; the library's
metrics are thread-safe. Engine gauges (running, waiting, KV blocks, core calls, ...) are read
from the latest engine snapshot by a collector at scrape time. `render` returns the Prometheus
text. Metric names carry the `loopserve_` prefix and unit suffixes (`_seconds`, `_total`,
`_blocks`). Loop accounting: `loopserve_exit_depth` (a histogram of the loops each output
token used) and `loopserve_generation_loops_total` (their sum: loop-tokens), over finished
requests, so they equal the exit depths the responses report.

vLLM's names beside them (`vllm:` with a `model_name` label, the served model name, with
vLLM's types and units), so the dashboards people run for vLLM show loopserve:
`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` and its
older name `vllm:gpu_cache_usage_perc` (a 0-1 ratio, as vLLM's), `vllm:prompt_tokens_total`,
`vllm:generation_tokens_total`, `vllm:request_success_total{finished_reason}`, and the
histograms `vllm:time_to_first_token_seconds`, `vllm:time_per_output_token_seconds` (and
`vllm:inter_token_latency_seconds`, its V1 name) and `vllm:e2e_request_latency_seconds`.

Multiprocess mode: when `PROMETHEUS_MULTIPROC_DIR` is set (before this module is imported, as
`prometheus_client` requires), the per-request counters and histograms are written to that
directory and `render` aggregates every process's files; the engine gauges are this process's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from loopserve.engine.stats import ROWS_BUCKETS, EngineStats
from loopserve.outputs import RequestOutput

prometheus_client.disable_created_metrics()  # no `_created` samples: names stay as before

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5, 5.0)  # fmt: skip
E2E_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
                 300.0, 600.0)  # fmt: skip
FINISH_REASONS = ("abort", "error", "length", "stop")
# Loops per token: up to Huginn's 32 and beyond (the engine serves up to its num_loops).
EXIT_DEPTH_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 128)
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST


class _EngineCollector:
    """Turns the engine snapshot current at scrape time into metric families."""

    def __init__(self) -> None:
        self.gauges: EngineStats | None = None
        self.num_in_flight = 0
        self.is_ready = False
        self.model_name = "loopserve"

    def describe(self) -> list[Metric]:
        return []  # no up-front description: the families depend on the snapshot

    def collect(self) -> Iterator[Metric]:
        g = self.gauges
        if g is None:
            return
        yield from vllm_engine_families(
            self.model_name,
            running=g.num_running,
            waiting=g.num_waiting,
            kv_usage=g.kv_usage,
            generation_tokens=g.num_output_tokens,
        )
        yield rows_per_call_family([g])
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
                "loopserve_prompt_row_loops",
                "Prompt work executed: prompt rows times the loops each ran.",
                g.num_prompt_row_loops,
            ),
            (
                "loopserve_forked_requests",
                "Requests that shared another's prompt (one prefill for the n choices of a "
                "request or a group rollout) instead of running their own.",
                g.num_forked_requests,
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
                "loopserve_brownout_changes",
                "Overload brownout: changes of its level (up or down).",
                g.num_brownout_changes,
            ),
            (
                "loopserve_leave_batches",
                "Coda batching in time: batches of held tokens' leaves (coda, lm_head, "
                "sampling) run.",
                g.num_leave_batches,
            ),
            (
                "loopserve_leave_batch_rows",
                "Coda batching in time: held tokens those batches carried.",
                g.num_leave_rows,
            ),
            (
                "loopserve_held_token_steps",
                "Coda batching in time: steps those tokens were held, each counting its "
                "leave's step (divided by the rows: the mean wait).",
                g.num_held_steps,
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
            (
                "loopserve_brownout_level",
                "Overload brownout level (0: off; each level takes brownout_step_loops loops "
                "from eligible requests' new tokens).",
                g.brownout_level,
            ),
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


def vllm_engine_families(
    model_name: str, *, running: int, waiting: int, kv_usage: float, generation_tokens: int
) -> Iterator[Metric]:
    """The engine gauges and counters under vLLM's names (the `model_name` label)."""
    for name, help_text, value in (
        ("vllm:num_requests_running", "Requests running (vLLM's name).", running),
        ("vllm:num_requests_waiting", "Requests waiting (vLLM's name).", waiting),
        ("vllm:kv_cache_usage_perc", "KV cache usage, 1 = full (vLLM's name).", kv_usage),
        ("vllm:gpu_cache_usage_perc", "KV cache usage, 1 = full (vLLM's older name).", kv_usage),
    ):
        family = GaugeMetricFamily(name, help_text, labels=["model_name"])
        family.add_metric([model_name], value)
        yield family
    tokens = CounterMetricFamily(
        "vllm:generation_tokens", "Output tokens generated (vLLM's name).", labels=["model_name"]
    )
    tokens.add_metric([model_name], generation_tokens)
    yield tokens


def rows_per_call_family(snapshots: list[EngineStats]) -> Metric:
    """`loopserve_rows_per_call{stage}`: rows per prelude, core and coda call, summed over
    the engines' snapshots (a pool's replicas)."""
    family = HistogramMetricFamily(
        "loopserve_rows_per_call",
        "Rows per call by stage: a step's prelude (rows embedded at loop 0), each core call, "
        "and its coda (tokens sampled).",
        labels=["stage"],
    )
    merged: dict[str, tuple[list[int], int]] = {}
    for snapshot in snapshots:
        for stage, counts, total in snapshot.rows_per_call:
            before, before_total = merged.get(stage, ([0] * len(counts), 0))
            merged[stage] = ([a + b for a, b in zip(before, counts)], before_total + total)
    for stage, (counts, total) in merged.items():
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, ROWS_BUCKETS), "+Inf"], counts):
            cumulative += count
            buckets.append((bound, cumulative))
        family.add_metric([stage], buckets, total)
    return family


class ServingMetrics:
    """Per-request counters and latency histograms in a private registry; thread-safe.
    `model_name`: the `model_name` label of the `vllm:` families (the served model name; the
    server sets it)."""

    def __init__(self) -> None:
        self.model_name = "loopserve"
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
        self.exit_depth = Histogram(
            "loopserve_exit_depth",
            "Loops each output token used (its exit depth), over finished requests.",
            buckets=EXIT_DEPTH_BUCKETS,
            registry=self.registry,
        )
        self.loop_tokens = Counter(
            "loopserve_generation_loops",
            "Loops over output tokens of finished requests (the sum of their exit depths).",
            registry=self.registry,
        )
        self.vllm = _VllmRequestMetrics(self.registry)
        # Per loop class (`--loop-classes`): the server registers each request's class at
        # submission (request id -> class), the count happens when it finishes.
        self.request_classes: dict[str, str] = {}
        self.class_requests = Counter(
            "loopserve_class_requests",
            "Finished requests per loop class.",
            ["loop_class"],
            registry=self.registry,
        )
        self.class_loops = Counter(
            "loopserve_class_generation_loops",
            "Loop-tokens (sum of output tokens' exit depths) per loop class.",
            ["loop_class"],
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
        depths = output.exit_depths
        for depth in depths:
            self.exit_depth.observe(depth)
        self.loop_tokens.inc(sum(depths))
        self.vllm.observe(self.model_name, output, reason)
        loop_class = self.request_classes.pop(output.request_id, None)
        if loop_class is not None:
            self.class_requests.labels(loop_class).inc()
            self.class_loops.labels(loop_class).inc(sum(depths))

    def finished_count(self, reason: str) -> int:
        """Requests finished so far with `reason` (this process only)."""
        return int(self.finished.labels(finish_reason=reason)._value.get())

    def render(self, gauges: EngineStats, *, num_in_flight: int, is_ready: bool) -> str:
        """The Prometheus text for these metrics plus the engine's current gauges."""
        self._engine.gauges = gauges
        self._engine.num_in_flight = num_in_flight
        self._engine.is_ready = is_ready
        self._engine.model_name = self.model_name
        return prometheus_client.generate_latest(self._scrape_registry).decode()


class _VllmRequestMetrics:
    """The per-request families under vLLM's names, labelled with the served model name."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, help_text: str, buckets) -> Histogram:
            return Histogram(name, help_text, ["model_name"], buckets=buckets, registry=registry)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              TTFT_BUCKETS_S)  # fmt: skip
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Time per output token.",
                              ITL_BUCKETS_S)  # fmt: skip
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between tokens.",
                             ITL_BUCKETS_S)  # fmt: skip
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.",
                             E2E_BUCKETS_S)  # fmt: skip
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.",
                                     ["model_name"], registry=registry)  # fmt: skip
        self.success = Counter("vllm:request_success", "Requests finished, by reason.",
                               ["model_name", "finished_reason"], registry=registry)  # fmt: skip

    def observe(self, model_name: str, output: RequestOutput, reason: str) -> None:
        metrics = output.metrics
        if metrics.ttft_s is not None:
            self.ttft.labels(model_name).observe(metrics.ttft_s)
        for gap_s in metrics.itl_s:
            self.tpot.labels(model_name).observe(gap_s)
            self.itl.labels(model_name).observe(gap_s)
        if metrics.e2e_s is not None and reason != "abort":
            self.e2e.labels(model_name).observe(metrics.e2e_s)
        self.prompt_tokens.labels(model_name).inc(len(output.prompt_token_ids))
        if reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason).inc()
