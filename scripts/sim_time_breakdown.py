"""Where simulated GPU time goes at one request rate: prompt vs decode, weights vs KV reads.

Run: PYTHONPATH=. python scripts/sim_time_breakdown.py RATE [--no-enable-prefix-caching]
     [--no-cascade-attention] [--shared-prefix-len 1024] [--num-requests 300]

Builds the same workload as `loopserve simulate --policies refill` (ShareGPT lengths, exit
distribution ouro_1p4b_t0.5, seed 0, simulated H100, Ouro-1.4B) and runs it once at RATE,
re-pricing every core call beside the executor: a memory-bound call's time is split by the
bytes it moves (core weights + embeddings, KV read, KV written), a compute-bound call's by
its FLOPs (linear layers, attention). Also reports seats, waiting requests and KV usage per
step, and the cascade groups the executor priced. Prints shares of simulated GPU time.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from loopserve.runner.attention.prefix_groups import plan_prefix_groups
from loopserve.sim.cost_model import OURO_1P4B
from loopserve.sim.executor import _CallTally
from loopserve.sim.hardware import get_device_profile
from loopserve.sim.metrics import summarize
from loopserve.sim.simulator import Simulator
from loopserve.sim.sweep import get_arm
from loopserve.sim.workload import WorkloadSpec, build_workload, sample_lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("rate", type=float)
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--shared-prefix-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    parser.add_argument("--cascade-attention", action=argparse.BooleanOptionalAction)
    args = parser.parse_args()
    spec = WorkloadSpec(
        num_requests=args.num_requests,
        dataset="sharegpt",
        exit_dist="ouro_1p4b_t0.5",
        seed=0,
        shared_prefix_len=args.shared_prefix_len,
    )
    lengths = sample_lengths(spec)
    point = WorkloadSpec(
        num_requests=len(lengths),
        dataset="sharegpt",
        request_rate=args.rate,
        exit_dist="ouro_1p4b_t0.5",
        seed=0,
        shared_prefix_len=args.shared_prefix_len,
    )
    workload = build_workload(point, OURO_1P4B.total_ut_steps, lengths=lengths)
    engine_args = {
        **get_arm("refill").engine_args,
        "max_num_seqs": args.max_num_seqs,
        "enable_prefix_caching": args.enable_prefix_caching,
        "cascade_attention": args.cascade_attention,
    }
    sim = Simulator(OURO_1P4B, get_device_profile("h100"), engine_args)
    totals = _instrument(sim)
    seats = []

    def on_step(scheduler) -> None:
        seats.append((len(scheduler.running), len(scheduler.waiting), sim.kv.usage))

    run = sim.run(workload, on_step=on_step)
    result = summarize(run)
    busy = run.executor.model_time_s
    print(
        f"rate {args.rate}: clock {run.clock_s:.2f} s, simulated GPU busy {busy:.2f} s, "
        f"P99 normalized latency {result.normalized_latency.p99_s * 1e3:.1f} ms/token, "
        f"TTFT p50 {result.ttft.p50_s * 1e3:.1f} ms"
    )
    print(f"  coda + sampling {(run.executor.coda_time_s + run.executor.sampling_time_s):.2f} s")
    for kind in ("prompt", "mixed", "decode"):
        calls = totals[kind, "calls"]
        if not calls:
            continue
        time_s = totals[kind, "time"]
        print(
            f"  {kind}: {time_s:.2f} s ({time_s / busy:.1%}), {calls:.0f} calls "
            f"({totals[kind, 'compute_bound']:.0f} compute-bound), "
            f"{totals[kind, 'rows'] / calls:.1f} rows and "
            f"{totals[kind, 'kv_positions'] / calls:.0f} KV positions read per call"
        )
        for part in ("weights", "kv_read", "kv_write", "linear_flops", "attention_flops"):
            if totals[kind, part]:
                print(
                    f"    {part:16s} {totals[kind, part]:7.2f} s {totals[kind, part] / busy:6.1%}"
                )
    running = [r for r, _, _ in seats]
    stats = run.executor
    print(
        f"  running mean {statistics.mean(running):.1f}, steps at max_num_seqs "
        f"{sum(r >= args.max_num_seqs for r in running) / len(running):.1%}, waiting mean "
        f"{statistics.mean(w for _, w, _ in seats):.1f}, KV usage mean "
        f"{statistics.mean(u for _, _, u in seats):.1%} max {max(u for _, _, u in seats):.1%}"
    )
    print(
        f"  cascade groups {stats.cascade_groups}, grouped rows {stats.cascade_rows}, "
        f"KV positions not read {stats.cascade_saved_positions}"
    )


def _instrument(sim: Simulator) -> dict:
    """Wrap the executor's per-step pricing to add up each call's parts."""
    executor, cost = sim.executor, sim.cost_model
    shape, device = cost.shape, cost.device
    bw, flops = device.effective_bandwidth, device.effective_flops
    kv = shape.kv_bytes_per_token_per_depth
    totals: dict = defaultdict(float)
    price = executor._price_calls

    def priced(tallies, block_tables):
        call = _CallTally()
        for k in range(len(tallies) - 1, 0, -1):
            call.add(tallies[k])
            saved = 0
            if executor.cascade and len(call.singles) > 1:
                tables = [
                    block_tables[i.request_id][0 if executor.shared else i.depth + k - 1]
                    for i in call.singles
                ]
                positions = [i.token_start for i in call.singles]
                for group in plan_prefix_groups(tables, positions, executor.block_size):
                    saved += (len(group.rows) - 1) * group.num_blocks * executor.block_size
            prelude = call.prelude_rows if k == 1 else 0
            parts_bytes = {
                "weights": shape.core_weight_bytes
                + prelude * shape.hidden_size * shape.dtype_bytes,
                "kv_read": (call.kv_read - saved) * kv,
                "kv_write": (call.rows + 2 * call.finalize) * kv,
            }
            parts_flops = {
                "linear_flops": 2 * shape.core_params * call.rows,
                "attention_flops": shape.attention_flops_per_pair * call.pairs,
            }
            memory_s = sum(parts_bytes.values()) / bw
            compute_s = sum(parts_flops.values()) / flops
            kind = (
                "mixed"
                if call.has_prompt and call.has_decode
                else ("prompt" if call.has_prompt else "decode")
            )
            totals[kind, "time"] += max(memory_s, compute_s) + device.call_overhead_s
            totals[kind, "calls"] += 1
            totals[kind, "rows"] += call.rows
            totals[kind, "kv_positions"] += call.kv_read - saved
            if compute_s > memory_s:
                totals[kind, "compute_bound"] += 1
                for name, value in parts_flops.items():
                    totals[kind, name] += value / flops
            else:
                for name, value in parts_bytes.items():
                    totals[kind, name] += value / bw
        return price(tallies, block_tables)

    executor._price_calls = priced
    return totals


if __name__ == "__main__":
    main()
