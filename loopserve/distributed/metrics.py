"""`/metrics` for a replica pool: per-replica gauges with a `replica` label.

`PoolMetrics` keeps the server's per-request counters and histograms (`ServingMetrics`,
observed in the server process as requests finish) and replaces the single engine's gauges by
one sample per replica: the engine gauges of its latest snapshot (running, waiting, KV blocks,
generated tokens, core calls, preemptions by mode, prefix-cache queries and hits, swapped
bytes, ...) plus the router's view (outstanding tokens, requests routed,
prefix hits) and its health (state, restarts, failed requests). Pool-wide samples
(`loopserve_ready`, `loopserve_num_requests_in_flight`, `loopserve_replicas_serving`) carry no
label. Sum over `replica` for totals.

A prefill/decode pool (`--pd`) labels every per-replica sample with the replica's `role`
(`prefill` or `decode`) as well, and adds `loopserve_pd_handoffs_total`: requests a prefill
replica exported, or a decode replica imported; `loopserve_kv_transport_bytes_total{replica,
role,direction}`: K/V bytes the replica's torch KV transport sent or received (0 on the
object-store path); and `loopserve_kv_transport_fallback`: 1 once hand-offs fell back from
the torch transport to the object store; `loopserve_kv_stream_chunks_total{replica,role,
direction}`: chunks of streamed hand-offs sent or written into reserved blocks;
`loopserve_kv_landings_total{replica,role,where}`: hand-offs' and chunks' K/V a decode
replica landed before importing it, on the GPU (`device`) or left on the host (`host`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from loopserve.engine.metrics import ServingMetrics, rows_per_call_family, vllm_engine_families
from loopserve.engine.stats import EngineStats


@dataclass(frozen=True, slots=True)
class ReplicaGauges:
    index: int
    state: str  # starting | serving | restarting | dead
    snapshot: EngineStats
    outstanding_tokens: int
    num_routed: int
    num_prefix_hits: int
    num_restarts: int
    num_failed_requests: int
    role: str | None = None  # prefill | decode in a prefill/decode pool
    num_handoffs: int = 0  # requests exported (prefill role) or imported (decode role)
    kv_bytes_sent: int = 0  # by the replica's KV transport (torch), since it started
    kv_bytes_received: int = 0
    kv_chunks_sent: int = 0  # streamed hand-offs' chunks (`--kv-handoff stream`)
    kv_chunks_received: int = 0
    kv_landed: tuple[int, int] = (0, 0)  # K/V landed before import: on the device, the host


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    num_replicas: int
    replicas: tuple[ReplicaGauges, ...] = ()


# (name, help, kind, value of one replica)
_PER_REPLICA = (
    ("loopserve_num_requests_running", "Requests running.", "gauge",
     lambda r: r.snapshot.num_running),
    ("loopserve_num_requests_waiting", "Requests waiting.", "gauge",
     lambda r: r.snapshot.num_waiting),
    ("loopserve_kv_blocks_free", "Free KV blocks.", "gauge", lambda r: r.snapshot.kv_blocks_free),
    ("loopserve_kv_blocks_total", "KV blocks in the pool.", "gauge",
     lambda r: r.snapshot.kv_blocks_total),
    ("loopserve_kv_cache_usage_ratio", "Share of KV blocks in use.", "gauge",
     lambda r: r.snapshot.kv_usage),
    ("loopserve_mean_loops_per_token", "Mean loops of the shared core per output token.",
     "gauge", lambda r: r.snapshot.mean_loops_per_token),
    ("loopserve_mean_rows_per_core_call", "Mean rows (tokens) per core call.", "gauge",
     lambda r: r.snapshot.mean_rows_per_core_call),
    ("loopserve_generation_tokens", "Output tokens generated (since the replica started).",
     "counter", lambda r: r.snapshot.num_output_tokens),
    ("loopserve_core_calls", "Core calls (since the replica started).", "counter",
     lambda r: r.snapshot.num_core_calls),
    ("loopserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     "counter", lambda r: r.snapshot.num_prefix_cache_queried_tokens),
    ("loopserve_prefix_cache_hits", "Prompt tokens served by the prefix cache.", "counter",
     lambda r: r.snapshot.num_prefix_cache_hit_tokens),
    ("loopserve_kv_swapped_bytes",
     "KV bytes copied between device and host by swap preemption (both ways).", "counter",
     lambda r: r.snapshot.num_swapped_bytes),
    ("loopserve_replica_outstanding_tokens",
     "Router's outstanding work: prompt tokens not yet prefilled plus tokens still to generate.",
     "gauge", lambda r: r.outstanding_tokens),
    ("loopserve_replica_serving", "1 while the replica takes requests.", "gauge",
     lambda r: int(r.state == "serving")),
    ("loopserve_router_requests", "Requests routed to the replica.", "counter",
     lambda r: r.num_routed),
    ("loopserve_router_prefix_hits",
     "Submissions routed to the replica because it served their prompt prefix.", "counter",
     lambda r: r.num_prefix_hits),
    ("loopserve_replica_restarts", "Times the replica was restarted.", "counter",
     lambda r: r.num_restarts),
    ("loopserve_replica_failed_requests",
     "Requests failed with a 503 because the replica died while serving them.", "counter",
     lambda r: r.num_failed_requests),
)  # fmt: skip


_HANDOFFS = (
    ("loopserve_pd_handoffs",
     "Requests handed off: exported by a prefill replica, or imported by a decode replica.",
     "counter", lambda r: r.num_handoffs),
)  # fmt: skip


class _PoolCollector:
    """Turns the pool snapshot current at scrape time into metric families."""

    def __init__(self) -> None:
        self.snapshot: PoolSnapshot | None = None
        self.num_in_flight = 0
        self.is_ready = False
        self.kv_transport_fallback = 0
        self.model_name = "loopserve"

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        pool = self.snapshot
        if pool is None:
            return
        num_serving = sum(r.state == "serving" for r in pool.replicas)
        snapshots = [r.snapshot for r in pool.replicas]
        total = sum(s.kv_blocks_total for s in snapshots)
        used = sum(s.kv_blocks_total - s.kv_blocks_free for s in snapshots)
        yield from vllm_engine_families(
            self.model_name,
            running=sum(s.num_running for s in snapshots),
            waiting=sum(s.num_waiting for s in snapshots),
            kv_usage=used / total if total else 0.0,
            generation_tokens=sum(s.num_output_tokens for s in snapshots),
        )
        yield rows_per_call_family(snapshots)
        for name, help_text, value in (
            ("loopserve_ready", "1 when at least one replica serves.", int(self.is_ready)),
            (
                "loopserve_num_requests_in_flight",
                "Requests accepted, not done.",
                self.num_in_flight,
            ),
            ("loopserve_replicas", "Configured data-parallel replicas.", pool.num_replicas),
            ("loopserve_replicas_serving", "Replicas taking requests.", num_serving),
        ):
            yield GaugeMetricFamily(name, help_text, value=value)
        with_role = any(r.role is not None for r in pool.replicas)
        labels = ["replica", "role"] if with_role else ["replica"]

        def label_values(replica: ReplicaGauges) -> list[str]:
            values = [str(replica.index)]
            return values + [replica.role or ""] if with_role else values

        preemptions = CounterMetricFamily(
            "loopserve_preemptions",
            "Requests preempted for KV or priority, by mode.",
            labels=[*labels, "mode"],
        )
        for replica in pool.replicas:
            preemptions.add_metric([*label_values(replica), "recompute"],
                                   replica.snapshot.num_preemptions_recompute)  # fmt: skip
            preemptions.add_metric([*label_values(replica), "swap"],
                                   replica.snapshot.num_preemptions_swap)  # fmt: skip
        yield preemptions
        per_replica = _PER_REPLICA + (_HANDOFFS if with_role else ())
        for name, help_text, kind, value_of in per_replica:
            family_cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_cls(name, help_text, labels=labels)
            for replica in pool.replicas:
                family.add_metric(label_values(replica), value_of(replica))
            yield family
        if with_role:
            yield from self._kv_transport(pool, label_values)

    def _kv_transport(
        self, pool: PoolSnapshot, label_values: Callable[[ReplicaGauges], list[str]]
    ) -> Iterator[Metric]:
        by_direction = (
            ("loopserve_kv_transport_bytes",
             "K/V bytes of hand-offs moved by the replica's torch KV transport, by direction.",
             lambda r: (r.kv_bytes_sent, r.kv_bytes_received)),
            ("loopserve_kv_stream_chunks",
             "Chunks of streamed hand-offs (--kv-handoff stream) the replica sent (prefill) or "
             "wrote into reserved blocks (decode), by direction.",
             lambda r: (r.kv_chunks_sent, r.kv_chunks_received)),
        )  # fmt: skip
        for name, help_text, values_of in by_direction:
            family = CounterMetricFamily(name, help_text, labels=["replica", "role", "direction"])
            for replica in pool.replicas:
                sent, received = values_of(replica)
                family.add_metric([*label_values(replica), "sent"], sent)
                family.add_metric([*label_values(replica), "received"], received)
            yield family
        landings = CounterMetricFamily(
            "loopserve_kv_landings",
            "Hand-offs' and chunks' K/V a decode replica landed before importing it, by where: "
            "on the GPU (copied there on a side stream, or sent there by the transport) or on "
            "the host (pinned when too large for free GPU memory; always on CPU).",
            labels=["replica", "role", "where"],
        )
        for replica in pool.replicas:
            on_device, on_host = replica.kv_landed
            landings.add_metric([*label_values(replica), "device"], on_device)
            landings.add_metric([*label_values(replica), "host"], on_host)
        yield landings
        yield GaugeMetricFamily(
            "loopserve_kv_transport_fallback",
            "1 once hand-offs fell back from the torch KV transport to Ray's object store.",
            value=self.kv_transport_fallback,
        )


class PoolMetrics(ServingMetrics):
    """`ServingMetrics` whose engine gauges are per replica; `render` takes a `PoolSnapshot`."""

    def __init__(self) -> None:
        super().__init__()
        self._pool = _PoolCollector()
        self._scrape_registry.register(self._pool)

    def set_kv_transport_fallback(self) -> None:
        self._pool.kv_transport_fallback = 1

    def render(self, gauges: PoolSnapshot, *, num_in_flight: int, is_ready: bool) -> str:  # type: ignore[override]
        self._pool.snapshot = gauges
        self._pool.model_name = self.model_name
        self._pool.num_in_flight = num_in_flight
        self._pool.is_ready = is_ready
        return prometheus_client.generate_latest(self._scrape_registry).decode()
