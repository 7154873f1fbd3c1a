"""`loopserve simulate`: run policies through the simulated GPU over request rates.

One configuration or a sweep (request rate × policy); optionally a capacity search per
policy (bisection on the rate against a P99 normalized-latency SLO). Prints a table, writes
`simulate.json` and `simulate.png` (rate vs P99 normalized latency per policy) to --out-dir.
`--sched-bench` instead runs the scheduler CPU microbenchmark.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict
from pathlib import Path

from tqdm.auto import tqdm

from loopserve.engine_args import add_engine_args, engine_args_from
from loopserve.models.config import OuroConfig
from loopserve.sim.cost_model import OURO_1P4B, CostModel, ModelShape
from loopserve.sim.hardware import DEVICE_PROFILES, get_device_profile
from loopserve.sim.scenarios import (
    InterferenceSpec,
    format_interference,
    format_wcpb,
    run_interference,
    run_wcpb,
)
from loopserve.sim.sweep import ARMS, PointResult, SweepSetup, find_capacity, get_arm, run_point
from loopserve.sim.workload import WorkloadSpec, sample_lengths
from loopserve.workloads.args import int_list
from loopserve.workloads.arms import PROMPT_ARMS

# The engine flags `simulate` takes (same names, defaults and help as every other command).
SIM_ENGINE_ARGS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "prefill_chunk_size",
    "prefill_mode",
    "mixed_prefill_decode",
    "block_size",
    "num_blocks",
    "gpu_memory_utilization",
    "layout",
)


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 (or inf), got {text}")
    return value


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device-profile", default="h100", choices=sorted(DEVICE_PROFILES))
    parser.add_argument(
        "--model-config", default=None, help="an Ouro config.json (default: Ouro-1.4B)"
    )
    parser.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "synthetic"])
    parser.add_argument("--input-len", type=int, default=256, help="synthetic prompt length")
    parser.add_argument("--output-len", type=int, default=256, help="synthetic output length")
    parser.add_argument("--range-ratio", type=float, default=0.5, help="synthetic length spread")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument(
        "--request-rate", type=_rate, nargs="+", default=[math.inf], help="req/s; inf = offline"
    )
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--policies", nargs="+", default=["refill"], choices=sorted(ARMS))
    parser.add_argument(
        "--exit-dist",
        default="ouro_1p4b_t0.5",
        help="ouro_1p4b_t0.5 | uniform | full | probs:p1,..,pD | trace:l1,l2,..",
    )
    add_engine_args(parser, names=SIM_ENGINE_ARGS, title="engine (simulated)")
    parser.add_argument(
        "--host-overhead-ms", type=float, default=0.0, help="host time added per step"
    )
    parser.add_argument(
        "--roofline",
        default="call",
        choices=["call", "phase"],
        help="one roofline per core call, or linear and attention phases priced separately",
    )
    parser.add_argument(
        "--slo-ms", type=float, default=50.0, help="P99 normalized latency SLO (ms/token)"
    )
    parser.add_argument(
        "--find-capacity",
        action="store_true",
        help="bisect the rate per policy between min and max of --request-rate",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="sim_out")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--sched-bench", action="store_true", help="scheduler CPU microbenchmark and exit"
    )
    scenario = parser.add_argument_group(
        "prompt-scheduling scenarios (--scenario; see loopserve.sim.scenarios)"
    )
    scenario.add_argument(
        "--scenario",
        choices=["wcpb", "interference"],
        default=None,
        help="instead of a rate sweep: wcpb (long prompts only) or interference (decode "
        "population + injected long prompts); uses --device-profile, --max-num-batched-tokens, "
        "--prefill-chunk-size (interference) and --exit-dist (interference)",
    )
    scenario.add_argument("--arms", nargs="+", default=None, choices=sorted(PROMPT_ARMS))
    scenario.add_argument("--prompt-lens", type=int_list, default=[8064] * 4)
    scenario.add_argument("--chunk-sizes", type=int_list, default=[128, 64, 32, 16])
    scenario.add_argument("--num-decode", type=int, default=InterferenceSpec.num_decode)
    scenario.add_argument(
        "--decode-prompt-len", type=int, default=InterferenceSpec.decode_prompt_len
    )
    scenario.add_argument(
        "--decode-max-tokens", type=int, default=InterferenceSpec.decode_max_tokens
    )
    scenario.add_argument(
        "--inject-at",
        type=int_list,
        default=None,
        help="prompt j arrives once every decode request has this many tokens (default 8 each)",
    )


def _engine_args(args: argparse.Namespace) -> dict[str, object]:
    engine_args = engine_args_from(args, SIM_ENGINE_ARGS)
    if engine_args["num_blocks"] is None:
        del engine_args["num_blocks"]
    return engine_args


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


def _sched_bench(args: argparse.Namespace) -> int:
    from loopserve.sim.sched_bench import format_sched_bench, run_sched_bench

    for mode in ("refill", "no_refill"):
        print(format_sched_bench(run_sched_bench(mode=mode)))
    return 0


def _scenario(args: argparse.Namespace, model_config: OuroConfig, device) -> int:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.scenario == "wcpb":
        arms = args.arms or ["atomic", "wavefront"]
        points = run_wcpb(
            model_config,
            device,
            prompt_lens=tuple(args.prompt_lens),
            chunk_sizes=tuple(args.chunk_sizes),
            arms=tuple(arms),
            max_num_batched_tokens=args.max_num_batched_tokens,
            roofline=args.roofline,
        )
        print(format_wcpb(points))
        rows = [asdict(p) for p in points]
    else:
        arms = args.arms or ["atomic", "per_depth", "mixed"]
        spec = InterferenceSpec(
            num_decode=args.num_decode,
            decode_prompt_len=args.decode_prompt_len,
            decode_max_tokens=args.decode_max_tokens,
            prompt_lens=tuple(args.prompt_lens),
            inject_at=tuple(args.inject_at or [8] * len(args.prompt_lens)),
            prefill_chunk_size=args.prefill_chunk_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            exit_dist=args.exit_dist,
            seed=args.seed,
        )
        results = [
            run_interference(model_config, device, spec, arm, roofline=args.roofline)
            for arm in arms
        ]
        print(format_interference(results))
        rows = [r.to_dict() for r in results]
    path = out_dir / f"scenario_{args.scenario}.json"
    record = {
        "scenario": args.scenario,
        "device": device.name,
        "roofline": args.roofline,
        "results": rows,
    }
    record["args"] = {k: v for k, v in vars(args).items() if k not in ("func", "request_rate")}
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"device {device.name}; wrote {path}")
    return 0


def main_from_args(args: argparse.Namespace) -> int:
    if args.sched_bench:
        return _sched_bench(args)
    model_config = (
        OURO_1P4B if args.model_config is None else OuroConfig.from_file(args.model_config)
    )
    device = get_device_profile(args.device_profile)
    if args.scenario is not None:
        return _scenario(args, model_config, device)
    arms = [get_arm(name) for name in args.policies]
    spec = WorkloadSpec(
        num_requests=args.num_requests,
        dataset=args.dataset,
        exit_dist=args.exit_dist,
        seed=args.seed,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
    )
    lengths = sample_lengths(spec)
    rates = sorted(args.request_rate)
    runs = len(arms) * (12 if args.find_capacity else len(rates))
    bar = tqdm(total=runs * len(lengths), unit="req", disable=args.no_progress, desc="simulate")
    setup = SweepSetup(
        model_config,
        device,
        spec,
        _engine_args(args),
        lengths,
        max_concurrency=args.max_concurrency,
        host_time_s=args.host_overhead_ms / 1e3,
        roofline=args.roofline,
        on_finish=bar.update,
    )
    slo_s = args.slo_ms / 1e3
    start = time.perf_counter()
    points: list[PointResult] = []
    capacity: dict[str, float] = {}
    for arm in arms:
        if args.find_capacity:
            cap, arm_points = find_capacity(setup, arm, slo_s, low=rates[0], high=rates[-1])
            capacity[arm.name] = cap
            points += arm_points
        else:
            points += [run_point(setup, arm, rate) for rate in rates]
    bar.close()
    points.sort(key=lambda p: (p.arm, p.request_rate))
    if not args.find_capacity:
        for arm in arms:
            ok = [
                p.request_rate
                for p in points
                if p.arm == arm.name and p.result is not None and not math.isinf(p.request_rate)
            ]
            if ok:  # offline (rate inf) points say nothing about capacity
                ok = [r for r in ok if _meets(points, arm.name, r, slo_s)]
                capacity[arm.name] = max(ok, default=0.0)
    print(format_table(points))
    shape = ModelShape.from_config(model_config)
    cost = CostModel(shape, device, args.roofline)
    print(
        f"\ndevice {device.name}: batch-1 loop {cost.decode_loop_time(1, 1) * 1e3:.3f} ms, "
        f"weight GEMMs compute-bound from {cost.linear_ridge_rows():.0f} rows; "
        f"SLO: P99 normalized latency <= {args.slo_ms:g} ms/token"
    )
    for name, cap in capacity.items():
        print(f"capacity {name:>11}: {cap:.3f} req/s")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "args": {
            k: (None if isinstance(v, float) and math.isinf(v) else v)
            for k, v in vars(args).items()
            if k != "func"
        },
        "request_rate": [None if math.isinf(r) else r for r in rates],
        "device": device.name,
        "slo_ms": args.slo_ms,
        "capacity_req_s": capacity,
        "wall_s": time.perf_counter() - start,
        "points": [p.to_dict() for p in points],
    }
    (out_dir / "simulate.json").write_text(json.dumps(record, indent=2) + "\n")
    if not args.no_plot and any(not math.isinf(p.request_rate) for p in points):
        title = f"{device.name}, {args.dataset}, exit {args.exit_dist}"
        plot(points, slo_s, out_dir / "simulate.png", title)
    print(f"wrote {out_dir / 'simulate.json'}")
    return 0


def _meets(points: list[PointResult], arm: str, rate: float, slo_s: float) -> bool:
    """A rate counts only if it and every lower simulated rate meet the SLO."""
    return all(
        p.p99_normalized_latency_s <= slo_s
        for p in points
        if p.arm == arm and p.request_rate <= rate
    )
