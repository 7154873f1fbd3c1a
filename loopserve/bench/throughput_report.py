"""`bench throughput`'s summary: the cost-curve fit and the printed report."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class RunResult:
    """One run of one arm over the whole workload."""

    output_tokens: int
    wall_s: float
    cpu_s: float  # this process's CPU time: barely moved by other tenants of a shared machine
    output_tokens_per_s: float
    num_steps: int
    num_core_calls: int
    mean_rows_per_core_call: float
    mean_loops_per_token: float
    host_overhead_share: float  # 1 - forward time / step time
    host_ms_per_step: float
    runner_host_share: float  # (runner execute - forward) / step time
    # Latency over the run's requests, ms (`throughput.latency_ms`; offline: all submitted
    # at once, so TTFT includes queueing).
    ttft_ms_p50: float = 0.0
    ttft_ms_p99: float = 0.0
    tpot_ms_p50: float = 0.0
    tpot_ms_p99: float = 0.0
    itl_ms_p50: float = 0.0
    itl_ms_p99: float = 0.0
    # Coda batching in time (0 without it): tokens per leave batch, steps a token was held
    # (counting its leave's step).
    leave_batch_rows: float = 0.0
    held_steps: float = 0.0


@dataclass(frozen=True, slots=True)
class HostOverhead:
    """Host overhead on the steps that ran exactly one core call of `rows` rows."""

    rows: int
    num_steps: int
    step_ms: float
    host_ms: float
    host_overhead_share: float
    runner_host_ms: float  # the runner's part of host_ms


def cost_curve_summary(curve: list[HostOverhead], medians: dict[str, RunResult]) -> dict:
    """Least-squares `step_ms = fixed + per_row * rows`, and the refill / no_refill time ratio
    that model implies for the arms' core calls and rows (prompt calls priced alike)."""
    rows = np.array([c.rows for c in curve], dtype=float)
    step_ms = np.array([c.step_ms for c in curve])
    per_row, fixed = np.polyfit(rows, step_ms, 1) if len(curve) > 1 else (step_ms[0] / rows[0], 0.0)

    def model_ms(m: RunResult) -> float:
        return m.num_core_calls * fixed + m.num_core_calls * m.mean_rows_per_core_call * per_row

    return {
        "rows": rows.tolist(),
        "step_ms": step_ms.tolist(),
        "fixed_ms": float(fixed),
        "per_row_ms": float(per_row),
        "implied_refill_over_no_refill": model_ms(medians["no_refill"])
        / model_ms(medians["refill"]),
    }


def format_report(result: dict) -> str:
    header = (
        f"{'arm':<11} {'tok/s':>7} {'wall s':>7} {'cpu s':>7} {'core calls':>10} {'rows/call':>9} "
        f"{'loops/tok':>9} {'host %':>7} {'runner %':>8} {'host ms/step':>12}"
    )
    lines = [header, "-" * len(header)]
    for name, arm in result["arms"].items():
        m = RunResult(**arm["median"])
        lines.append(
            f"{name:<11} {m.output_tokens_per_s:>7.1f} {m.wall_s:>7.2f} {m.cpu_s:>7.2f} "
            f"{m.num_core_calls:>10.0f} "
            f"{m.mean_rows_per_core_call:>9.1f} {m.mean_loops_per_token:>9.2f} "
            f"{100 * m.host_overhead_share:>6.1f}% {100 * m.runner_host_share:>7.1f}% "
            f"{m.host_ms_per_step:>12.2f}"
        )
    lines.append("latency, ms (p50 / p99): TTFT, TPOT, ITL")
    for name, arm in result["arms"].items():
        m = RunResult(**arm["median"])
        lines.append(
            f"  {name:<11} TTFT {m.ttft_ms_p50:.1f} / {m.ttft_ms_p99:.1f}  TPOT "
            f"{m.tpot_ms_p50:.2f} / {m.tpot_ms_p99:.2f}  ITL {m.itl_ms_p50:.2f} / "
            f"{m.itl_ms_p99:.2f}"
        )
    batched = {name: RunResult(**arm["median"]) for name, arm in result["arms"].items()}
    batched = {name: m for name, m in batched.items() if m.leave_batch_rows}
    if batched:
        lines.append("coda batching in time: tokens per leave batch, steps held per token")
        for name, m in batched.items():
            lines.append(
                f"  {name:<11} {m.leave_batch_rows:.1f} per batch, {m.held_steps:.2f} held"
            )
    for name, r in result["ratios"].items():
        rounds = ", ".join(f"{x:.2f}" for x in r["cpu_per_round"])
        lines.append(
            f"{name}: {r['wall']:.2f}x wall time, {r['cpu']:.2f}x CPU time "
            f"(medians); per round, CPU time: {rounds} (median "
            f"{statistics.median(r['cpu_per_round']):.2f}x)"
        )
    for name, cdb in result.get("cdb", {}).items():
        lines.append(
            f"{name} over full_depth: {cdb['speedup']:.2f}x against a ceiling of "
            f"{cdb['ceiling']:.2f}x (D / mean loops): {cdb['speedup'] / cdb['ceiling']:.0%} of it"
        )
    spec = result.get("speculation")
    if spec:
        acceptance = "-" if spec["acceptance"] is None else f"{spec['acceptance']:.3f}"
        lines.append(
            f"refill_spec drafts: {spec['drafted']} drafted, {spec['accepted']} accepted, "
            f"{spec['rejected']} rejected (acceptance {acceptance}), {spec['redrafted']} "
            "replaced by a deeper loop's"
        )
    host = HostOverhead(**result["host_overhead_at_rows"])
    curve = result.get("cost_curve")
    if curve:
        points = ", ".join(f"{r:.0f}: {t:.2f}" for r, t in zip(curve["rows"], curve["step_ms"]))
        lines.append(
            f"decode step ms by rows ({points}) ~ {curve['fixed_ms']:.2f} + "
            f"{curve['per_row_ms']:.3f} x rows; implied refill/no_refill "
            f"{curve['implied_refill_over_no_refill']:.2f}x"
        )
    lines.append(
        f"host overhead @ {host.rows} rows: {100 * host.host_overhead_share:.1f}% of step "
        f"({host.host_ms:.2f} of {host.step_ms:.2f} ms, of which runner {host.runner_host_ms:.2f}; "
        f"{host.num_steps} steps)"
    )
    return "\n".join(lines)
