"""Offline throughput benchmark: full-depth vs no_refill vs refill (continuous depth batching).

One `LLMEngine` per arm replays the same seeded workload (random token-id prompts,
`ignore_eos`, `max_tokens = output_len`: every arm emits the same tokens), arms interleaved
round after round; reports per-arm medians and refill's speed-ups. Arms: `full_depth` (refill
scheduler, every token runs all D loops), `no_refill` (cohorts) and `refill` (continuous depth
batching), the last two with the workload's exits: a per-token trace sampled from a named
distribution (exit_mode "trace") or the model's gate at a threshold (exit_mode "ouro").
A last refill run at `--host-rows` sequences measures host overhead on steps of exactly that
many rows. Counters come from `EngineStats`: "host" is everything outside the model's forward
calls (scheduler, engine bookkeeping, and the runner's tensor building, attention metadata,
finalize copies and sampling); "runner host" is the runner's part of it.
It does not serve HTTP and does not judge targets; `docs/benchmarks.md` records results.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from loopserve.bench.args import add_throughput_args as add_cli_args  # noqa: F401
from loopserve.bench.common import machine_info, median_of, write_json
from loopserve.bench.group_rollout import ARMS as GROUP_ARMS
from loopserve.bench.group_rollout import format_group_rollout, run_group_rollout
from loopserve.bench.throughput_report import (
    HostOverhead,
    RunResult,
    cost_curve_summary,
    format_report,
)
from loopserve.bench.throughput_workload import (  # noqa: F401  (make_workload: re-export)
    BenchRequest,
    blocks_for,
    make_workload,
    sampling_params,
)
from loopserve.engine.llm_engine import LLMEngine
from loopserve.engine.stats import EngineStats
from loopserve.errors import ConfigError
from loopserve.models.loader import resolve_model_path
from loopserve.models.registry import read_config
from loopserve.models.tiny import make_tiny_checkpoint
from loopserve.sampling_params import SamplingParams
from loopserve.workloads.arms import ARMS as ALL_ARMS
from loopserve.workloads.arms import DECODE_ARMS, Arm
from loopserve.workloads.exits import exit_probabilities  # noqa: F401  (re-export)
from loopserve.workloads.progress import progress_bar

NUM_WARMUP_REQUESTS = 4


ARMS = tuple(ALL_ARMS[name] for name in DECODE_ARMS)  # full_depth, no_refill, refill
REFILL = ARMS[-1]
# With --speculative-tokens K > 0: refill with self-speculative decoding, the same workload.
SPEC_ARM = Arm("refill_spec", {"mode": "refill"})


def _drive(
    engine: LLMEngine,
    requests: list[BenchRequest],
    params: list[SamplingParams],
    tag: str,
    arrivals: dict[str, list[float]] | None = None,
) -> Iterator[EngineStats]:
    """Submit the workload with the stats counters reset; step until done, yielding the
    `EngineStats` snapshot after each step. `arrivals`: filled with each request's token
    times (seconds since submission; tokens of one step share its time)."""
    engine.reset_stats()
    start_s = time.perf_counter()
    for i, (request, p) in enumerate(zip(requests, params)):
        engine.add_request(f"{tag}-{i}", request.prompt_token_ids, p)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if arrivals is not None:
            now = time.perf_counter() - start_s
            for out in outputs:
                times = arrivals.setdefault(out.request_id, [])
                times += [now] * (out.num_output_tokens - len(times))
        yield engine.stats


def latency_ms(arrivals: dict[str, list[float]]) -> dict[str, float]:
    """TTFT (submission to first token), TPOT (a request's mean gap after its first token)
    and ITL (every gap between successive tokens) p50/p99, in ms, over an offline run's
    requests (all submitted at once: TTFT includes queueing)."""
    ttft = [times[0] for times in arrivals.values() if times]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in arrivals.values() if len(t) > 1]
    itl = [b - a for t in arrivals.values() for a, b in zip(t, t[1:])]
    record = {}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in (50, 99):
            value = float(np.percentile(values, q)) if values else 0.0
            record[f"{name}_ms_p{q}"] = 1e3 * value
    return record


def run_workload(
    engine: LLMEngine, requests: list[BenchRequest], params: list[SamplingParams], tag: str
) -> RunResult:
    start_s, start_cpu_s = time.perf_counter(), time.process_time()
    arrivals: dict[str, list[float]] = {}
    for _ in _drive(engine, requests, params, tag, arrivals):
        pass
    wall_s, stats = time.perf_counter() - start_s, engine.stats
    return RunResult(
        output_tokens=stats.num_output_tokens,
        wall_s=wall_s,
        cpu_s=time.process_time() - start_cpu_s,
        output_tokens_per_s=stats.num_output_tokens / wall_s,
        num_steps=stats.num_steps,
        num_core_calls=stats.num_core_calls,
        mean_rows_per_core_call=stats.mean_rows_per_core_call,
        mean_loops_per_token=stats.mean_loops_per_token,
        host_overhead_share=stats.host_overhead_share,
        host_ms_per_step=1e3 * (stats.step_time_s - stats.forward_time_s) / max(stats.num_steps, 1),
        runner_host_share=stats.runner_host_share,
        leave_batch_rows=stats.num_leave_rows / max(stats.num_leave_batches, 1),
        held_steps=stats.num_held_steps / max(stats.num_leave_rows, 1),
        **latency_ms(arrivals),
    )


def measure_host_overhead(
    engine: LLMEngine, requests: list[BenchRequest], params: list[SamplingParams], rows: int
) -> HostOverhead:
    """Run the workload; keep only the steps of exactly one core call over `rows` rows."""
    num_steps, step_s, forward_s, model_s = 0, 0.0, 0.0, 0.0
    before = (0, 0, 0.0, 0.0, 0.0)
    for stats in _drive(engine, requests, params, "host"):
        after = (
            stats.num_core_calls,
            stats.num_rows,
            stats.step_time_s,
            stats.forward_time_s,
            stats.model_time_s,
        )
        if (after[0] - before[0], after[1] - before[1]) == (1, rows):
            num_steps += 1
            step_s += after[2] - before[2]
            forward_s += after[3] - before[3]
            model_s += after[4] - before[4]
        before = after
    if not num_steps:
        raise ConfigError(f"no decode step ran {rows} rows; raise --num-requests")
    return HostOverhead(
        rows=rows,
        num_steps=num_steps,
        step_ms=1e3 * step_s / num_steps,
        host_ms=1e3 * (step_s - forward_s) / num_steps,
        host_overhead_share=1.0 - forward_s / step_s,
        runner_host_ms=1e3 * (model_s - forward_s) / num_steps,
    )


def build_engine(
    args: argparse.Namespace,
    model_dir: Path,
    arm: Arm,
    max_num_seqs: int,
    num_blocks: int,
    *,
    gate: bool | None = None,
    share_prompts: bool = True,
) -> LLMEngine:
    """An arm's engine; `gate`: exits by the model's gate (else by the requests' traces;
    None: by the gate exactly when `--exit-threshold` is given)."""
    gate = args.exit_threshold is not None if gate is None else gate
    return LLMEngine.from_engine_args(
        model=str(model_dir),
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_size=min(args.prefill_chunk_size, args.max_num_batched_tokens),
        mode=arm.mode,
        exit_mode="ouro" if gate else "trace",
        share_prompts=share_prompts,
        exit_criterion=args.exit_criterion,
        speculative_tokens=args.speculative_tokens if arm is SPEC_ARM else 0,
        draft_loops=args.draft_loops,
        speculative_max_seqs=args.speculative_max_seqs,
        coda_batching=args.coda_batching,
        coda_batch_max_wait=args.coda_batch_max_wait,
        coda_batch_min_rows=args.coda_batch_min_rows,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def run_benchmark(args: argparse.Namespace, model_dir: Path) -> dict[str, object]:
    """Warm up, run the arms interleaved for `--repeats` rounds, then the host-overhead run."""
    model_config = read_config(model_dir)[1]
    num_loops, gate = model_config.num_loops, args.exit_threshold is not None
    # LAST_EXITED: one KV plane per depth, and a family's once planes (Huginn's prelude/coda)
    num_planes = num_loops + model_config.extra_kv_planes
    requests = make_workload(
        args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        vocab_size=model_config.vocab_size,
        exit_probs=None if gate else exit_probabilities(args.exit_dist, num_loops),
        seed=args.seed,
    )
    threshold = args.exit_threshold if gate else 1.0
    arms = ARMS + ((SPEC_ARM,) if args.speculative_tokens else ())
    params = {a.name: [sampling_params(r, a, num_loops, threshold) for r in requests] for a in arms}
    runs: dict[str, list[RunResult]] = {arm.name: [] for arm in arms}
    num_blocks = args.num_blocks or blocks_for(
        requests, args.max_num_seqs, args.block_size, num_planes
    )
    total = len(arms) * (args.repeats + 1) + 1 + len(args.cost_rows)
    if args.group_size > 1:
        total += len(GROUP_ARMS) * (args.repeats + 1)
    speculation = None
    with progress_bar(args, total=total, desc="bench throughput", unit="run") as bar:
        engines = {
            a.name: build_engine(args, model_dir, a, args.max_num_seqs, num_blocks) for a in arms
        }
        for round_idx in range(-1, args.repeats):  # round -1 is the warm-up
            for arm in arms:  # interleaved: drift on the machine hits every arm alike
                label = "warm-up" if round_idx < 0 else f"round {round_idx + 1}"
                bar.set_postfix_str(f"{label} {arm.name}")
                n = NUM_WARMUP_REQUESTS if round_idx < 0 else len(requests)
                tag = f"r{round_idx}"
                result = run_workload(engines[arm.name], requests[:n], params[arm.name][:n], tag)
                if round_idx >= 0:
                    runs[arm.name].append(result)
                bar.update(1)
        if args.speculative_tokens:  # every round's drafts, the warm-up's included
            spec = engines[SPEC_ARM.name].core.stats()
            verified = spec.num_spec_accepted + spec.num_spec_rejected
            speculation = {
                "drafted": spec.num_spec_drafted,
                "accepted": spec.num_spec_accepted,
                "rejected": spec.num_spec_rejected,
                "redrafted": spec.num_spec_redrafted,
                "acceptance": spec.num_spec_accepted / verified if verified else None,
            }
        del engines  # free their KV before the host-overhead engine allocates its own
        group = None
        if args.group_size > 1:

            def build_group_engine(share: bool, work: list[BenchRequest]) -> LLMEngine:
                blocks = blocks_for(work, args.max_num_seqs, args.block_size, num_planes)
                return build_engine(
                    args, model_dir, REFILL, args.max_num_seqs, blocks, gate=True,
                    share_prompts=share,
                )  # fmt: skip

            def on_group_run(label: str) -> None:
                bar.set_postfix_str(label)
                bar.update(1)

            group = run_group_rollout(
                requests,
                group_size=args.group_size,
                exit_threshold=1.0 if args.exit_threshold is None else args.exit_threshold,
                repeats=args.repeats,
                build=build_group_engine,
                run=run_workload,
                on_run=on_group_run,
            )
        bar.set_postfix_str(f"host overhead @ {args.host_rows} rows")
        # The first `host_rows` requests together: steps of that many rows until one finishes.
        rows = min(args.host_rows, len(requests))
        # (the warm-up runs its first requests on this engine too: room for the largest)
        host_blocks = blocks_for(
            requests[: max(rows, NUM_WARMUP_REQUESTS)], rows, args.block_size, num_planes
        )
        engine = build_engine(args, model_dir, REFILL, rows, host_blocks)
        refill_params, n = params[REFILL.name], NUM_WARMUP_REQUESTS
        run_workload(engine, requests[:n], refill_params[:n], "warmup")
        host = measure_host_overhead(engine, requests[:rows], refill_params[:rows], rows)
        bar.update(1)
        del engine
        if args.cost_rows:
            bar.set_postfix_str(f"decode step cost @ rows {args.cost_rows}")
        curve = measure_cost_curve(args, model_dir, requests, params["full_depth"], num_planes)
        bar.update(len(curve))
    m = {name: median_of(arm_runs) for name, arm_runs in runs.items()}
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config.update(num_loops=num_loops, num_blocks=num_blocks, model_dir=str(model_dir))
    return {
        "config": config,
        "machine": machine_info(python=platform.python_version()),
        "arms": {
            name: {"median": asdict(m[name]), "runs": [asdict(r) for r in runs[name]]}
            for name in runs
        },
        # Every arm emits the same tokens: a time ratio is a throughput ratio.
        "ratios": {
            f"refill_over_{b}": {
                "wall": m[b].wall_s / m[REFILL.name].wall_s,
                "cpu": m[b].cpu_s / m[REFILL.name].cpu_s,
                # Paired within each round (the arms ran back to back): robust to drift.
                "cpu_per_round": [x.cpu_s / y.cpu_s for x, y in zip(runs[b], runs[REFILL.name])],
            }
            for b in ("full_depth", "no_refill")
        }
        | (
            {
                "refill_spec_over_refill": {
                    "wall": m[REFILL.name].wall_s / m[SPEC_ARM.name].wall_s,
                    "cpu": m[REFILL.name].cpu_s / m[SPEC_ARM.name].cpu_s,
                    "cpu_per_round": [
                        x.cpu_s / y.cpu_s for x, y in zip(runs[REFILL.name], runs[SPEC_ARM.name])
                    ],
                }
            }
            if args.speculative_tokens
            else {}
        ),
        # Continuous depth batching against its ceiling D / mean loops (D: full depth's loops
        # per token; every arm emits the same tokens, so the wall-time ratio is the speed-up).
        "cdb": {
            name: {
                "speedup": m["full_depth"].wall_s / m[name].wall_s,
                "ceiling": m["full_depth"].mean_loops_per_token / m[name].mean_loops_per_token,
            }
            for name in ("no_refill", "refill")
        },
        "speculation": speculation,
        "group_rollout": group,
        "host_overhead_at_rows": asdict(host),
        "cost_curve": cost_curve_summary(curve, m) if curve else None,
    }


def measure_cost_curve(
    args: argparse.Namespace,
    model_dir: Path,
    requests: list[BenchRequest],
    full_params: list[SamplingParams],
    num_planes: int,
) -> list[HostOverhead]:
    """Step time of decode steps of exactly n rows (one core call), for n in `--cost-rows`:
    n requests at `max_num_seqs` n, every token at all D loops (the coda runs every D-th step)."""
    curve = []
    for rows in args.cost_rows:
        if rows > len(requests):
            raise ConfigError(f"--cost-rows {rows} exceeds --num-requests {len(requests)}")
        blocks = blocks_for(requests[:rows], rows, args.block_size, num_planes)
        engine = build_engine(args, model_dir, ARMS[0], rows, blocks)
        curve.append(measure_host_overhead(engine, requests[:rows], full_params[:rows], rows))
    return curve


def main_from_args(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.num_requests < 1:
        raise ConfigError("--repeats and --num-requests must be >= 1")
    if not 0.0 <= args.range_ratio < 1.0:
        raise ConfigError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads_before)
    try:  # a synthetic checkpoint lives in a temporary directory for the whole run
        with tempfile.TemporaryDirectory(prefix="loopserve-bench-") as tmp:
            if args.model:
                model_dir = resolve_model_path(
                    args.model, revision=args.revision, download_dir=args.download_dir
                )
            else:
                shape = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size")
                model_dir = make_tiny_checkpoint(
                    tmp, **{k: getattr(args, k) for k in shape}, total_ut_steps=args.loops
                )
            result = run_benchmark(args, model_dir)
    finally:
        torch.set_num_threads(threads_before)
    print(format_report(result))
    if result["group_rollout"]:
        print("\n".join(format_group_rollout(result["group_rollout"])))
    print(f"wrote {write_json(result, args.output_json)}")
    return 0
