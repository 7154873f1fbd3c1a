"""`loopserve simulate --scenario pd`: N colocated replicas against P prefill + Q decode
replicas (whole or streamed hand-offs) on the same requests, and what a cluster run reports.

`run_pd` builds the workload (ShareGPT or synthetic lengths, a seeded share of prompts made
long by `long_prompt_mix`), runs each setup on a `Cluster` (sim/cluster.py) at each rate and
summarizes each run with `cluster_stats`: throughput over the makespan, TTFT, TPOT, ITL (and
`decode_itl` without the hand-off gap), the mean transfer, the share of link time sent
before the first token (hidden behind prefill) and the mean gap from the first token to the
hand-off landing. `format_pd` prints them with the target (ITL p99 <= 0.6x colocated at >=
0.95x throughput).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from loopserve.distributed.args import with_default_prefill_mode
from loopserve.models.config import OuroConfig
from loopserve.sim.cluster import LINKS, Cluster, ClusterRun
from loopserve.sim.hardware import DeviceProfile
from loopserve.sim.metrics import LatencyStats
from loopserve.sim.workload import SimRequest


@dataclass(frozen=True)
class ClusterStats:
    name: str
    num_requests: int
    duration_s: float
    output_throughput: float  # output tokens / makespan
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats  # every gap between consecutive tokens of a request
    decode_itl: LatencyStats  # without PD hand-off gaps (same as itl when colocated)
    mean_transfer_ms: float = 0.0
    # PD: the share of link time that ran before the first token (hidden behind prefill),
    # and the mean time from the first token to the hand-off landing (the rest of the
    # bytes, and any wait for a link that carried other hand-offs).
    hidden_transfer_share: float = 0.0
    mean_exposed_transfer_ms: float = 0.0
    prompt_arm: str = "atomic"  # the replicas' prefill_mode

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def cluster_stats(name: str, run: ClusterRun, prompt_arm: str = "atomic") -> ClusterStats:
    records = [r for r in run.records if r.finished_s is not None]
    itls: list[float] = []
    decode_itls: list[float] = []
    for r in records:
        gaps = np.diff(r.token_times_s).tolist()
        itls += gaps
        skip = run.handoff_index.get(r.request_id)
        decode_itls += [g for i, g in enumerate(gaps) if i != skip]
    num_output = sum(len(r.token_times_s) for r in records)
    tpots = [t for r in records if (t := r.tpot_s) is not None]
    transfer_ms = [(t.end_s - t.start_s) * 1e3 for t in run.transfers]
    hidden_s = sum(t.hidden_s for t in run.transfers)
    busy_s = sum(t.busy_s for t in run.transfers)
    return ClusterStats(
        name,
        len(records),
        run.clock_s,
        num_output / run.clock_s if run.clock_s else 0.0,
        LatencyStats.of([r.ttft_s for r in records]),
        LatencyStats.of(tpots),
        LatencyStats.of(itls),
        LatencyStats.of(decode_itls),
        float(np.mean(transfer_ms)) if transfer_ms else 0.0,
        hidden_s / busy_s if busy_s else 0.0,
        float(np.mean([t.exposed_s * 1e3 for t in run.transfers])) if run.transfers else 0.0,
        prompt_arm,
    )


def long_prompt_mix(
    workload: list[SimRequest],
    *,
    share: float,
    min_len: int,
    max_len: int,
    seed: int,
) -> list[SimRequest]:
    """Replace the prompt of a seeded `share` of the requests with a uniform length in
    [min_len, max_len] (arrivals, outputs and exit traces unchanged)."""
    rng = np.random.default_rng(seed)
    picked = rng.random(len(workload)) < share
    lengths = rng.integers(min_len, max_len + 1, size=len(workload))
    return [
        dataclasses.replace(s, prompt_len=int(n)) if p else s
        for s, p, n in zip(workload, picked, lengths)
    ]


def format_cluster(rows: list[ClusterStats]) -> str:
    head = (
        f"{'setup':<22} {'out tok/s':>9} {'ITL p50':>8} {'ITL p99':>8} {'dITL p99':>8} "
        f"{'TPOT p50':>8} {'TPOT p99':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'xfer ms':>7}"
    )
    lines = [head + "   (ms)"]
    for s in rows:
        lines.append(
            f"{s.name:<22} {s.output_throughput:>9.0f} {s.itl.p50_s * 1e3:>8.2f} "
            f"{s.itl.p99_s * 1e3:>8.2f} {s.decode_itl.p99_s * 1e3:>8.2f} "
            f"{s.tpot.p50_s * 1e3:>8.2f} {s.tpot.p99_s * 1e3:>8.2f} {s.ttft.p50_s * 1e3:>9.1f} "
            f"{s.ttft.p99_s * 1e3:>9.1f} {s.mean_transfer_ms:>7.2f}"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class PdSpec:
    """`loopserve simulate --scenario pd`: N colocated vs P prefill + Q decode replicas on
    the same requests (ShareGPT or synthetic lengths with a long-prompt mix) at each rate."""

    num_requests: int = 400
    request_rates: tuple[float, ...] = (20.0,)
    num_colocated: int = 4
    num_prefill: int = 2
    num_decode: int = 2
    link: str = "nvlink"
    long_share: float = 0.15
    long_min: int = 4096
    long_max: int = 8192
    dataset: str = "sharegpt"
    exit_dist: str = "ouro_1p4b_t0.5"
    seed: int = 0
    streaming: bool = True  # also run the PD replicas with per-chunk streaming
    handoff_landing: str = "device"  # `Cluster`'s


def run_pd(
    model_config: OuroConfig,
    device: DeviceProfile,
    engine_args: dict[str, object],
    spec: PdSpec,
) -> list[tuple[float, ClusterStats, ClusterStats, ClusterStats | None]]:
    """(rate, colocated stats, PD stats with whole hand-offs, PD stats with per-chunk
    streaming or None) per rate. Without a `prefill_mode` in `engine_args` each setup runs
    the prompt arm `loopserve serve` would pick for it: per_depth when streaming, else atomic."""
    from loopserve.sim.workload import WorkloadSpec, build_workload, sample_lengths

    base = WorkloadSpec(
        spec.num_requests, dataset=spec.dataset, exit_dist=spec.exit_dist, seed=spec.seed
    )
    lengths = sample_lengths(base)
    out = []
    for rate in spec.request_rates:
        work = build_workload(
            dataclasses.replace(base, request_rate=rate), model_config.num_loops, lengths=lengths
        )
        work = long_prompt_mix(
            work,
            share=spec.long_share,
            min_len=spec.long_min,
            max_len=spec.long_max,
            seed=spec.seed + 1,
        )
        colocated_args = with_default_prefill_mode("whole", engine_args)
        colocated = Cluster(
            model_config, device, colocated_args, num_colocated=spec.num_colocated, seed=spec.seed
        )

        def pd(streaming: bool, work=work) -> ClusterStats:
            # the prompt arm `loopserve serve --pd` picks where none is given
            args = with_default_prefill_mode("stream" if streaming else "whole", engine_args)
            cluster = Cluster(
                model_config, device, args, num_prefill=spec.num_prefill,
                num_decode=spec.num_decode, link_bytes_per_s=LINKS[spec.link], seed=spec.seed,
                streaming=streaming, handoff_landing=spec.handoff_landing,
            )  # fmt: skip
            name = f"{spec.num_prefill}P{spec.num_decode}D {spec.link}"
            return cluster_stats(
                name + (" stream" if streaming else ""),
                cluster.run(work),
                str(args["prefill_mode"]),
            )

        out.append(
            (
                rate,
                cluster_stats(
                    f"{spec.num_colocated} colocated",
                    colocated.run(work),
                    str(colocated_args["prefill_mode"]),
                ),
                pd(False),
                pd(True) if spec.streaming else None,
            )
        )
    return out


def format_pd(rows: list[tuple[float, ClusterStats, ClusterStats, ClusterStats | None]]) -> str:
    lines = []
    for rate, colocated, pd, streamed in rows:
        lines.append(f"request rate {rate:g}/s")
        lines.append(format_cluster([colocated, pd] + ([streamed] if streamed else [])))
        if streamed is not None:
            lines.append(
                f"streaming ({streamed.prompt_arm} prompts): "
                f"{streamed.hidden_transfer_share:.1%} of link time hidden behind "
                f"prefill (whole hand-off: {pd.hidden_transfer_share:.1%}); first token to "
                f"hand-off landed {streamed.mean_exposed_transfer_ms:.2f} ms against "
                f"{pd.mean_exposed_transfer_ms:.2f} ms"
            )
        itl = pd.itl.p99_s / colocated.itl.p99_s if colocated.itl.p99_s else math.nan
        tput = pd.output_throughput / colocated.output_throughput
        lines.append(
            f"PD/colocated: ITL p99 {itl:.2f}x (target <= 0.60), throughput {tput:.3f}x "
            f"(target >= 0.95): {'met' if itl <= 0.6 and tput >= 0.95 else 'missed'}"
        )
    return "\n".join(lines)
