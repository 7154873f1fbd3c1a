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
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from loopserve.cli.engine_args import int_list
from loopserve.engine.llm_engine import LLMEngine
from loopserve.engine.stats import EngineStats
from loopserve.errors import ConfigError
from loopserve.models.config import OuroConfig
from loopserve.models.loader import resolve_model_path
from loopserve.models.tiny import make_tiny_checkpoint
from loopserve.sampling_params import SamplingParams

EXIT_DISTRIBUTIONS = ("uniform", "full", "ouro_1p4b_t0.5")
# Ouro-1.4B's trained gate at threshold 0.5 on GSM8K decode tokens (shared/DATA.md).
OURO_1P4B_T05 = (0.0, 0.043, 0.877, 0.080)
NUM_WARMUP_REQUESTS = 4


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    mode: str  # scheduler mode
    full_depth: bool  # every token runs all D loops


ARMS = (
    Arm("full_depth", "refill", True),
    Arm("no_refill", "no_refill", False),
    Arm("refill", "refill", False),
)
REFILL = ARMS[-1]


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    exit_trace: tuple[int, ...] | None  # loops per output token; None: the gate decides


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


@dataclass(frozen=True, slots=True)
class HostOverhead:
    """Host overhead on the steps that ran exactly one core call of `rows` rows."""

    rows: int
    num_steps: int
    step_ms: float
    host_ms: float
    host_overhead_share: float
    runner_host_ms: float  # the runner's part of host_ms


def exit_probabilities(name: str, num_loops: int) -> tuple[float, ...]:
    """P(exit after 1..D loops) of a named distribution."""
    if name == "uniform":
        return (1.0 / num_loops,) * num_loops
    if name == "full":
        return (0.0,) * (num_loops - 1) + (1.0,)
    if name == "ouro_1p4b_t0.5":
        if num_loops != len(OURO_1P4B_T05):
            raise ConfigError(f"{name} is measured for 4 loops; this model has {num_loops}")
        return OURO_1P4B_T05
    raise ConfigError(f"--exit-dist must be one of {', '.join(EXIT_DISTRIBUTIONS)}; got {name!r}")


def _uniform_lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    low = max(1, math.floor(mean * (1.0 - ratio)))
    return rng.integers(low, max(low, math.ceil(mean * (1.0 + ratio))) + 1, size=n)


def make_workload(
    num_requests: int,
    *,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    exit_probs: tuple[float, ...] | None,
    seed: int,
) -> list[BenchRequest]:
    """Seeded requests; lengths uniform in len·[1 - ratio, 1 + ratio] (the `bench serve` rule)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ConfigError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    input_lens = _uniform_lengths(rng, input_len, range_ratio, num_requests)
    output_lens = _uniform_lengths(rng, output_len, range_ratio, num_requests)
    requests = []
    for prompt_len, out_len in zip(input_lens, output_lens):
        prompt = rng.integers(0, vocab_size, size=int(prompt_len)).tolist()
        trace = None
        if exit_probs is not None:
            loops = rng.choice(len(exit_probs), size=int(out_len), p=exit_probs) + 1
            trace = tuple(int(x) for x in loops)
        requests.append(BenchRequest(prompt, int(out_len), trace))
    return requests


def sampling_params(
    request: BenchRequest, arm: Arm, num_loops: int, exit_threshold: float
) -> SamplingParams:
    """Greedy, `ignore_eos`, exactly `output_len` tokens; full depth: trace all-D or no gate."""
    full, trace = arm.full_depth, request.exit_trace
    return SamplingParams(
        max_tokens=request.output_len,
        temperature=0.0,
        ignore_eos=True,
        exit_threshold=1.0 if full else exit_threshold,
        exit_trace=(num_loops,) if full and trace is not None else trace,
    )


def blocks_for(
    requests: list[BenchRequest], max_num_seqs: int, block_size: int, num_planes: int
) -> int:
    """KV blocks for the `max_num_seqs` largest requests at once: admission never waits on KV."""
    positions = [len(r.prompt_token_ids) + r.output_len - 1 for r in requests]
    per_request = sorted(-(-p // block_size) * num_planes for p in positions)
    return sum(per_request[-max_num_seqs:])


def _drive(
    engine: LLMEngine, requests: list[BenchRequest], params: list[SamplingParams], tag: str
) -> Iterator[EngineStats]:
    """Submit the workload with the stats counters reset; step until done, yielding the
    `EngineStats` snapshot after each step."""
    engine.reset_stats()
    for i, (request, p) in enumerate(zip(requests, params)):
        engine.add_request(f"{tag}-{i}", request.prompt_token_ids, p)
    while engine.has_unfinished_requests():
        engine.step()
        yield engine.stats


def run_workload(
    engine: LLMEngine, requests: list[BenchRequest], params: list[SamplingParams], tag: str
) -> RunResult:
    start_s, start_cpu_s = time.perf_counter(), time.process_time()
    for _ in _drive(engine, requests, params, tag):
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


def median_result(runs: list[RunResult]) -> RunResult:
    names = [f.name for f in fields(RunResult)]
    return RunResult(**{name: statistics.median(getattr(r, name) for r in runs) for name in names})


def machine_info() -> dict[str, object]:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": names[0] if names else platform.processor(),
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def build_engine(
    args: argparse.Namespace, model_dir: Path, arm: Arm, max_num_seqs: int, num_blocks: int
) -> LLMEngine:
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
        exit_mode="ouro" if args.exit_threshold is not None else "trace",
    )


def run_benchmark(args: argparse.Namespace, model_dir: Path) -> dict[str, object]:
    """Warm up, run the arms interleaved for `--repeats` rounds, then the host-overhead run."""
    model_config = OuroConfig.from_file(model_dir / "config.json")
    num_loops, gate = model_config.num_loops, args.exit_threshold is not None
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
    params = {a.name: [sampling_params(r, a, num_loops, threshold) for r in requests] for a in ARMS}
    runs: dict[str, list[RunResult]] = {arm.name: [] for arm in ARMS}
    num_blocks = args.num_blocks or blocks_for(  # LAST_EXITED: one KV plane per depth
        requests, args.max_num_seqs, args.block_size, num_loops
    )
    total = len(ARMS) * (args.repeats + 1) + 1 + len(args.cost_rows)
    with tqdm(total=total, desc="bench throughput", unit="run", disable=args.no_progress) as bar:
        engines = {
            a.name: build_engine(args, model_dir, a, args.max_num_seqs, num_blocks) for a in ARMS
        }
        for round_idx in range(-1, args.repeats):  # round -1 is the warm-up
            for arm in ARMS:  # interleaved: drift on the machine hits every arm alike
                label = "warm-up" if round_idx < 0 else f"round {round_idx + 1}"
                bar.set_postfix_str(f"{label} {arm.name}")
                n = NUM_WARMUP_REQUESTS if round_idx < 0 else len(requests)
                tag = f"r{round_idx}"
                result = run_workload(engines[arm.name], requests[:n], params[arm.name][:n], tag)
                if round_idx >= 0:
                    runs[arm.name].append(result)
                bar.update(1)
        del engines  # free their KV before the host-overhead engine allocates its own
        bar.set_postfix_str(f"host overhead @ {args.host_rows} rows")
        # The first `host_rows` requests together: steps of that many rows until one finishes.
        rows = min(args.host_rows, len(requests))
        host_blocks = blocks_for(requests[:rows], rows, args.block_size, num_loops)
        engine = build_engine(args, model_dir, REFILL, rows, host_blocks)
        refill_params, n = params[REFILL.name], NUM_WARMUP_REQUESTS
        run_workload(engine, requests[:n], refill_params[:n], "warmup")
        host = measure_host_overhead(engine, requests[:rows], refill_params[:rows], rows)
        bar.update(1)
        del engine
        if args.cost_rows:
            bar.set_postfix_str(f"decode step cost @ rows {args.cost_rows}")
        curve = measure_cost_curve(args, model_dir, requests, params["full_depth"], num_loops)
        bar.update(len(curve))
    m = {name: median_result(arm_runs) for name, arm_runs in runs.items()}
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config.update(num_loops=num_loops, num_blocks=num_blocks, model_dir=str(model_dir))
    return {
        "config": config,
        "machine": machine_info(),
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
        },
        "host_overhead_at_rows": asdict(host),
        "cost_curve": cost_curve_summary(curve, m) if curve else None,
    }


def measure_cost_curve(
    args: argparse.Namespace,
    model_dir: Path,
    requests: list[BenchRequest],
    full_params: list[SamplingParams],
    num_loops: int,
) -> list[HostOverhead]:
    """Step time of decode steps of exactly n rows (one core call), for n in `--cost-rows`:
    n requests at `max_num_seqs` n, every token at all D loops (the coda runs every D-th step)."""
    curve = []
    for rows in args.cost_rows:
        if rows > len(requests):
            raise ConfigError(f"--cost-rows {rows} exceeds --num-requests {len(requests)}")
        blocks = blocks_for(requests[:rows], rows, args.block_size, num_loops)
        engine = build_engine(args, model_dir, ARMS[0], rows, blocks)
        curve.append(measure_host_overhead(engine, requests[:rows], full_params[:rows], rows))
    return curve


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
        / model_ms(medians[REFILL.name]),
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
    for name, r in result["ratios"].items():
        rounds = ", ".join(f"{x:.2f}" for x in r["cpu_per_round"])
        lines.append(
            f"{name}: {r['wall']:.2f}x wall time, {r['cpu']:.2f}x CPU time "
            f"(medians); per round, CPU time: {rounds} (median "
            f"{statistics.median(r['cpu_per_round']):.2f}x)"
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


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    work = parser.add_argument_group("workload")
    work.add_argument("--num-requests", type=int, default=64)
    work.add_argument("--input-len", type=int, default=32, help="mean prompt tokens")
    work.add_argument("--output-len", type=int, default=64, help="mean output tokens")
    work.add_argument("--range-ratio", type=float, default=0.25, help="lengths uniform ±ratio")
    work.add_argument("--exit-dist", default="uniform", choices=EXIT_DISTRIBUTIONS)
    work.add_argument("--exit-threshold", type=float, help="gate exits at this CDF, no trace")
    work.add_argument("--seed", type=int, default=0)
    model = parser.add_argument_group("model (synthetic unless --model)")
    model.add_argument("--model", default=None, help="checkpoint dir or Hub id")
    model.add_argument("--hidden-size", type=int, default=512)
    model.add_argument("--num-layers", type=int, default=4)
    model.add_argument("--num-heads", type=int, default=8)
    model.add_argument("--num-kv-heads", type=int, default=8)
    model.add_argument("--loops", type=int, default=4)
    model.add_argument("--vocab-size", type=int, default=4096)
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    engine.add_argument("--device", default="cpu")
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--num-blocks", type=int, default=None, help="default: fits the workload")
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--prefill-chunk-size", type=int, default=512)
    engine.add_argument("--threads", type=int, default=1, help="torch threads; 0: torch default")
    run = parser.add_argument_group("run")
    run.add_argument("--repeats", type=int, default=5, help="interleaved rounds (median)")
    run.add_argument("--host-rows", type=int, default=32, help="rows of the host-overhead run")
    run.add_argument(
        "--cost-rows",
        type=int_list,
        default=[],
        help="also time single-call decode steps at these row counts (e.g. 8,16,32,64) and "
        "fit step time = fixed + per_row x rows",
    )
    run.add_argument("--out", default="bench_results/throughput.json")
    run.add_argument("--no-progress", action="store_true")


def main_from_args(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.num_requests < 1:
        raise ConfigError("--repeats and --num-requests must be >= 1")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads_before)
    try:  # a synthetic checkpoint lives in a temporary directory for the whole run
        with tempfile.TemporaryDirectory(prefix="loopserve-bench-") as tmp:
            if args.model:
                model_dir = resolve_model_path(args.model)
            else:
                shape = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size")
                model_dir = make_tiny_checkpoint(
                    tmp, **{k: getattr(args, k) for k in shape}, total_ut_steps=args.loops
                )
            result = run_benchmark(args, model_dir)
    finally:
        torch.set_num_threads(threads_before)
    print(format_report(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
