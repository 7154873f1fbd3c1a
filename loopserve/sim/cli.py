"""`loopserve simulate`: run policies through the simulated GPU over request rates.

One configuration or a sweep (request rate × policy); optionally a capacity search per
policy (bisection on the rate against a P99 normalized-latency SLO). Prints a table, writes
`simulate.json` and `simulate.png` (rate vs P99 normalized latency per policy) to --output-dir.
`--sched-bench` instead runs the scheduler CPU microbenchmark.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from dataclasses import asdict
from pathlib import Path

from loopserve.engine_args import engine_args_from
from loopserve.errors import ConfigError
from loopserve.models.config import OuroConfig
from loopserve.models.huginn_config import HuginnConfig
from loopserve.sim.args import SIM_ENGINE_ARGS
from loopserve.sim.args import add_cli_args as add_cli_args  # noqa: F401  (re-export)
from loopserve.sim.calibration import load_calibrated_profile
from loopserve.sim.cost_model import CostModel, ModelShape, sim_model_config
from loopserve.sim.hardware import get_device_profile
from loopserve.sim.host_model import load_host_model
from loopserve.sim.report import (
    cdb_points,
    format_capacity,
    format_cdb_table,
    format_host_table,
    format_leave_table,
    format_memory_table,
    format_table,
    plot,
)
from loopserve.sim.scenarios import (
    InterferenceSpec,
    format_interference,
    format_wcpb,
    run_interference,
    run_wcpb,
)
from loopserve.sim.sweep import PointResult, SweepSetup, find_capacity, get_arm, run_point
from loopserve.sim.workload import WorkloadSpec, sample_lengths
from loopserve.workloads.exits import exit_distribution
from loopserve.workloads.progress import progress_bar


def _engine_args(args: argparse.Namespace) -> dict[str, object]:
    engine_args = engine_args_from(args, SIM_ENGINE_ARGS)
    for name in ("num_blocks", "prefill_mode"):  # None: the engine's (or the scenario's)
        if engine_args[name] is None:
            del engine_args[name]
    return engine_args


def _sched_bench(args: argparse.Namespace) -> int:
    from loopserve.sim.sched_bench import format_sched_bench, run_sched_bench

    for mode in ("refill", "no_refill"):
        print(format_sched_bench(run_sched_bench(mode=mode)))
    return 0


def _scenario(args: argparse.Namespace, model_config: OuroConfig, device) -> int:
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.scenario == "brownout":
        from loopserve.sim.brownout import StudySetup, brownout_study, format_study, plot_study

        setup = StudySetup(model_config, device, _engine_args(args),
                           num_requests=args.num_requests, dataset=args.dataset,
                           exit_dist=args.exit_dist, seed=args.seed)  # fmt: skip
        study = brownout_study(setup)
        print(format_study(study))
        if not args.no_plot:
            plot_study(study, out_dir / "brownout_goodput.png")
        rows = [study]
    elif args.scenario == "pd":
        from loopserve.sim.pd_scenario import PdSpec, format_pd, run_pd

        pd_spec = PdSpec(
            num_requests=args.num_requests,
            request_rates=tuple(args.request_rate),
            num_colocated=args.colocated,
            num_prefill=args.pd[0],
            num_decode=args.pd[1],
            link=args.link,
            handoff_landing=args.handoff_landing,
            long_share=args.long_share,
            long_min=args.long_lens[0],
            long_max=args.long_lens[1],
            dataset=args.dataset,
            exit_dist=args.exit_dist,
            seed=args.seed,
        )
        pd_rows = run_pd(model_config, device, _engine_args(args), pd_spec)
        print(format_pd(pd_rows))
        rows = [
            {"request_rate": rate, "colocated": c.to_dict(), "pd": p.to_dict(),
             "pd_streaming": None if s is None else s.to_dict()}
            for rate, c, p, s in pd_rows
        ]  # fmt: skip
    elif args.scenario == "wcpb":
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
            fill_prompt_chunks=args.fill_prompt_chunks,
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


def default_exit_dist(model_config) -> str:
    """The simulated model's own measured exits: Ouro-1.4B's gate at threshold 0.5 (4 loops),
    Huginn-0125's latent-diff 0.03 (32 steps); uniform over any other depth."""
    if isinstance(model_config, HuginnConfig):
        return "huginn_0125_latent_diff" if model_config.num_loops == 32 else "uniform"
    return "ouro_1p4b_t0.5" if model_config.num_loops == 4 else "uniform"


def main_from_args(args: argparse.Namespace) -> int:
    if args.sched_bench:
        return _sched_bench(args)
    model_config = sim_model_config(args.model_config)
    if args.exit_dist is None:
        args.exit_dist = default_exit_dist(model_config)
    # Checked here, not only where an arm samples it: a run of full_depth alone accepted any.
    exit_distribution(args.exit_dist, model_config.num_loops)
    if args.kernel_us <= 0 and (args.fused_linears or args.kernels_per_layer is not None):
        raise ConfigError(
            "--fused-linears and --kernels-per-layer change how kernels are priced; price them "
            "with --kernel-us (e.g. --kernel-us 1.5)"
        )
    device = (
        get_device_profile(args.device_profile)
        if args.calibration is None
        else load_calibrated_profile(args.calibration)
    )
    device = dataclasses.replace(
        device, kernel_s=args.kernel_us * 1e-6, kernels_per_layer=args.kernels_per_layer,
        fused_linears=args.fused_linears,
    )  # fmt: skip
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
        shared_prefix_len=args.shared_prefix_len,
    )
    lengths = sample_lengths(spec)
    rates = sorted(args.request_rate)
    runs = len(arms) * (12 if args.find_capacity else len(rates))
    bar = progress_bar(args, total=runs * len(lengths), desc="simulate", unit="req")
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
        client_max_tokens=args.client_max_tokens,
        host_model=load_host_model(args.host_model),
        coda_every_loop=args.coda_every_loop,
        # Only speculation reads it (its default is the embedded 4-loop model's).
        draft_stable_dist=args.draft_stable_dist if args.speculative_tokens else None,
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
    cdb = format_cdb_table(points)
    if cdb:
        print(cdb)
    print(format_memory_table(points))
    leave = format_leave_table(points)
    if leave:
        print(leave)
    if setup.host_model is not None:
        print(format_host_table(points, setup.host_model))
    shape = ModelShape.from_config(model_config)
    cost = CostModel(shape, device, args.roofline)
    print(
        f"\ndevice {device.name}: batch-1 loop {cost.decode_loop_time(1, 1) * 1e3:.3f} ms, "
        f"weight GEMMs compute-bound from {cost.linear_ridge_rows():.0f} rows; "
        f"SLO: P99 normalized latency <= {args.slo_ms:g} ms/token"
    )
    finite = [r for r in rates if not math.isinf(r)]
    top = max(finite) if finite else math.inf
    for name, cap in capacity.items():
        print(format_capacity(name, cap, top))
    out_dir = Path(args.output_dir)
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
        "cdb_efficiency": _cdb_records(points),
    }
    (out_dir / "simulate.json").write_text(json.dumps(record, indent=2) + "\n")
    if not args.no_plot and any(not math.isinf(p.request_rate) for p in points):
        title = f"{device.name}, {args.dataset}, exit {args.exit_dist}"
        plot(points, slo_s, out_dir / "simulate.png", title)
    print(f"wrote {out_dir / 'simulate.json'}")
    return 0


def _cdb_records(points: list[PointResult]) -> list[dict]:
    """`cdb_efficiency` of every early-exit point against full depth at its rate."""
    return [
        {
            "policy": p.arm,
            "request_rate": None if math.isinf(p.request_rate) else p.request_rate,
            **efficiency,
        }
        for p, efficiency in cdb_points(points)
        if p.arm != "full_depth"
    ]


def _meets(points: list[PointResult], arm: str, rate: float, slo_s: float) -> bool:
    """A rate counts only if it and every lower simulated rate meet the SLO."""
    return all(
        p.p99_normalized_latency_s <= slo_s
        for p in points
        if p.arm == arm and p.request_rate <= rate
    )
