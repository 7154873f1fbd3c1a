"""What `loopserve simulate` prints and draws: the sweep table, capacities and the figure."""

from __future__ import annotations

import math
from pathlib import Path

from loopserve.sim.sweep import PointResult


def format_table(points: list[PointResult]) -> str:
    header = (
        f"{'policy':>11} {'rate':>7} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'TPOT p50':>9} {'norm mean':>9} {'norm p99':>9} {'busy':>5} "
        f"{'dec rows':>8} {'W share':>7} {'loops':>5} {'wall s':>6} {'cpu s':>6} {'sched us':>8}"
    )
    lines = [header + "\n" + " " * 31 + "(latencies in ms; norm = E2E / output tokens)"]
    for p in points:
        rate = "inf" if math.isinf(p.request_rate) else f"{p.request_rate:.2f}"
        r = p.result
        if r is None:
            lines.append(f"{p.arm:>11} {rate:>7} {p.error}")
            continue
        lines.append(
            f"{p.arm:>11} {rate:>7} {r.request_throughput:>7.2f} {r.output_throughput:>9.0f} "
            f"{r.ttft.p50_s * 1e3:>9.1f} {r.ttft.p99_s * 1e3:>9.1f} {r.tpot.p50_s * 1e3:>9.2f} "
            f"{r.normalized_latency.mean_s * 1e3:>9.2f} "
            f"{r.normalized_latency.p99_s * 1e3:>9.2f} {r.gpu_busy_share:>5.2f} "
            f"{r.mean_decode_rows_per_call:>8.1f} {r.decode_weight_byte_share:>7.2f} "
            f"{r.mean_loops_per_token:>5.2f} {r.wall_s:>6.1f} "
            f"{r.cpu_s:>6.1f} {r.scheduler_us_per_step:>8.0f}"
        )
    return "\n".join(lines)


def cdb_efficiency(full, arm) -> dict[str, float]:
    """Continuous depth batching against its ceiling, from two runs of one workload (`full`:
    the full-depth arm; `arm`: an early-exit one; `SimResult`s): the speed-up in output
    tokens per second; the ceiling D / mean loops (D: the full-depth run's loops per token);
    the ceiling with once-per-token work counted (its share f of the full-depth run's GPU
    time does not shrink with fewer loops: 1 / ((1 - f) * loops / D + f)); and the
    efficiency against each."""
    speedup = arm.output_throughput / full.output_throughput
    depth, loops, once = full.mean_loops_per_token, arm.mean_loops_per_token, full.once_time_share
    ceiling = depth / loops
    ceiling_once = 1.0 / ((1.0 - once) * loops / depth + once)
    return {
        "speedup": speedup,
        "ceiling": ceiling,
        "efficiency": speedup / ceiling,
        "ceiling_once": ceiling_once,
        "efficiency_once": speedup / ceiling_once,
        "once_share": once,
    }


def cdb_points(points: list[PointResult]) -> list[tuple[PointResult, dict[str, float]]]:
    """Every point with a result and a `full_depth` result at its rate (full depth's own
    included), with its `cdb_efficiency` against that."""
    full = {p.request_rate: p.result for p in points if p.arm == "full_depth" and p.result}
    return [
        (p, cdb_efficiency(full[p.request_rate], p.result))
        for p in points
        if p.result is not None and p.request_rate in full
    ]


def format_cdb_table(points: list[PointResult]) -> str:
    """Per rate, each early-exit policy against `full_depth` (`cdb_efficiency`), with the
    latencies batching costs: TTFT, TPOT and ITL p50 / p99 (ms). Empty without full depth."""
    rows = cdb_points(points)
    if not rows:
        return ""
    lines = [
        "\ncontinuous depth batching against its ceiling (speed-up in output tok/s over "
        "full_depth; ceiling = D / mean loops; 'once': with the once-per-token share f of "
        "full depth's GPU time counted)",
        f"{'policy':>11} {'rate':>7} {'speed-up':>8} {'ceiling':>7} {'eff':>5} "
        f"{'f once':>6} {'ceil once':>9} {'eff once':>8} {'TTFT p50/p99':>13} "
        f"{'TPOT p50/p99':>13} {'ITL p50/p99':>13}",
    ]
    for p, e in rows:
        r = p.result
        assert r is not None
        rate = "inf" if math.isinf(p.request_rate) else f"{p.request_rate:.2f}"
        lines.append(
            f"{p.arm:>11} {rate:>7} {e['speedup']:>7.2f}x {e['ceiling']:>6.2f}x "
            f"{e['efficiency']:>5.0%} {e['once_share']:>6.2f} {e['ceiling_once']:>8.2f}x "
            f"{e['efficiency_once']:>8.0%} "
            f"{r.ttft.p50_s * 1e3:>6.0f}/{r.ttft.p99_s * 1e3:<6.0f} "
            f"{r.tpot.p50_s * 1e3:>6.1f}/{r.tpot.p99_s * 1e3:<6.1f} "
            f"{r.itl.p50_s * 1e3:>6.1f}/{r.itl.p99_s * 1e3:<6.1f}"
        )
    return "\n".join(lines)


def format_host_table(points: list[PointResult], host_model) -> str:
    """With a host model: the share of the makespan the host was busy and the share of steps
    that were host-bound (host time above device time)."""
    lines = [
        f"host model: {host_model.per_call_s * 1e6:.0f} us per core call + "
        f"{host_model.per_row_s * 1e6:.1f} us per row ({host_model.source})",
        f"{'policy':>11} {'rate':>7} {'host busy':>9} {'gpu busy':>8} {'host-bound steps':>16}",
    ]
    for p in points:
        if p.result is None:
            continue
        rate = "inf" if math.isinf(p.request_rate) else f"{p.request_rate:.2f}"
        r = p.result
        lines.append(
            f"{p.arm:>11} {rate:>7} {r.host_busy_share:>9.2f} {r.gpu_busy_share:>8.2f} "
            f"{r.host_bound_step_share:>16.0%}"
        )
    return "\n".join(lines)


def format_memory_table(points: list[PointResult]) -> str:
    """Memory management per point: preemptions per 1000 requests, the recompute share of
    row-loops, the swap share of GPU time, prefix-cache hits over prompt tokens."""
    lines = [
        f"{'policy':>11} {'rate':>7} {'preempt/1k':>10} {'swap':>5} {'recomp rows':>11} "
        f"{'swap time':>9} {'prefix hit':>10} {'TTFT p50':>9}"
    ]
    for p in points:
        r = p.result
        if r is None:
            continue
        rate = "inf" if math.isinf(p.request_rate) else f"{p.request_rate:.2f}"
        per_1k = 1000 * r.num_preemptions / max(r.num_requests, 1)
        hit = r.prefix_hit_tokens / max(r.num_prompt_tokens, 1)
        lines.append(
            f"{p.arm:>11} {rate:>7} {per_1k:>10.1f} {r.num_preemptions_swap:>5} "
            f"{r.recompute_row_share:>11.3f} {r.swap_time_share:>9.3f} {hit:>10.3f} "
            f"{r.ttft.p50_s * 1e3:>9.1f}"
        )
    return "\n".join(lines)


def format_leave_table(points: list[PointResult]) -> str:
    """Coda batching in time, per point that ran it: leave batches, tokens per batch, steps
    a token was held (counting its leave's step); empty when no point batched."""
    rows = [p for p in points if p.result is not None and p.result.leave_batches]
    if not rows:
        return ""
    lines = [
        "coda batching in time (held tokens' leaves run together)",
        f"{'policy':>11} {'rate':>7} {'batches':>8} {'rows/batch':>10} {'held steps':>10}",
    ]
    for p in rows:
        r = p.result
        rate = "inf" if math.isinf(p.request_rate) else f"{p.request_rate:.2f}"
        lines.append(
            f"{p.arm:>11} {rate:>7} {r.leave_batches:>8} {r.mean_leave_batch_rows:>10.1f} "
            f"{r.mean_held_steps:>10.2f}"
        )
    return "\n".join(lines)


def plot(points: list[PointResult], slo_s: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in dict.fromkeys(p.arm for p in points):
        pts = sorted(
            (p.request_rate, p.p99_normalized_latency_s * 1e3)
            for p in points
            if p.arm == arm and p.result is not None and not math.isinf(p.request_rate)
        )
        if pts:
            ax.plot(*zip(*pts), marker="o", label=arm)
    ax.axhline(slo_s * 1e3, color="grey", linestyle="--", label=f"SLO {slo_s * 1e3:g} ms")
    ax.set_yscale("log")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("P99 normalized latency (ms/token)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_capacity(name: str, capacity: float, top_rate: float) -> str:
    """One capacity line; "≥ X" when the top rate of the sweep still met the SLO (the true
    capacity lies above what was simulated)."""
    at_least = capacity > 0 and capacity >= top_rate
    value = f"≥ {capacity:.3f}" if at_least else f"{capacity:.3f}"
    return f"capacity {name:>11}: {value} req/s"
