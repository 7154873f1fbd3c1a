"""Prompt-scheduling scenarios on the simulated GPU: the GPU-regime counterparts of
`loopserve bench wcpb` and `loopserve bench interference`.

- `run_wcpb`: long prompts arrive together with `max_tokens=1`; for each chunk size and arm
  (atomic, wavefront, ...) the prompt throughput (prompt tokens / simulated makespan) and the
  rows per prompt core call.
- `run_interference`: a decode population decodes steadily; long prompts are injected when
  every population request has produced `inject_at[j]` tokens (the same trigger in every arm).
  The window runs from the first injection to the last injected prompt's first token; over it:
  decode ITL p50/p99/max, TPOT, TTFT of the prompts, prompt token-loops/s, output tokens/s,
  rows per kind per core call and the mixed core calls. Same definitions as the CPU benchmark.

Both drive the real `Scheduler` through a `Simulator` (its `SimExecutor` prices every core call),
step by step on the virtual clock; exits are replayed from seeded traces (`exit_mode="trace"`).
`roofline` is the `CostModel` pricing ("call": one roofline per core call, so a mixed call's
decode KV traffic can hide under prompt GEMMs; "phase": linear and attention priced apart).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from loopserve.contracts import ItemKind
from loopserve.errors import ConfigError
from loopserve.models.config import OuroConfig
from loopserve.sim.hardware import DeviceProfile
from loopserve.sim.simulator import Simulator
from loopserve.sim.workload import SimRequest
from loopserve.workloads.arms import prompt_arm_args
from loopserve.workloads.exits import exit_distribution
from loopserve.workloads.interference import InterferenceRun, InterferenceSpec, interference_stats
from loopserve.workloads.metrics import window_gaps

# ---- WCPB: long prompts only -------------------------------------------------------------


@dataclass(frozen=True)
class WcpbPoint:
    arm: str
    chunk_size: int
    prompt_tokens_per_s: float
    makespan_s: float
    prompt_core_calls: int
    rows_per_prompt_core_call: float


def run_wcpb(
    model_config: OuroConfig,
    device: DeviceProfile,
    *,
    prompt_lens: tuple[int, ...] = (8064, 8064, 8064, 8064),
    chunk_sizes: tuple[int, ...] = (128, 64, 32, 16),
    arms: tuple[str, ...] = ("atomic", "wavefront"),
    max_num_batched_tokens: int = 1024,
    roofline: str = "call",
) -> list[WcpbPoint]:
    """Every prompt arrives at t=0 with one output token (all D loops)."""
    num_loops = model_config.num_loops
    points = []
    for chunk in chunk_sizes:
        for arm in arms:
            engine_args = {
                **prompt_arm_args(arm),
                "prefill_chunk_size": chunk,
                "max_num_batched_tokens": max_num_batched_tokens,
                "max_num_seqs": len(prompt_lens),
            }
            sim = Simulator(model_config, device, engine_args, roofline=roofline)
            work = [SimRequest(f"p{j}", 0.0, n, 1, (num_loops,)) for j, n in enumerate(prompt_lens)]
            run = sim.run(work)
            stats = run.executor
            calls = stats.prompt_calls + stats.mixed_calls
            rows = stats.prompt_rows + stats.mixed_rows
            points.append(
                WcpbPoint(
                    arm,
                    chunk,
                    sum(prompt_lens) / run.clock_s,
                    run.clock_s,
                    calls,
                    rows / calls,
                )
            )
    return points


def format_wcpb(points: list[WcpbPoint]) -> str:
    lines = [f"{'arm':<16} {'chunk':>5} {'prompt tok/s':>12} {'calls':>6} {'rows/call':>9}"]
    for p in points:
        lines.append(
            f"{p.arm:<16} {p.chunk_size:>5} {p.prompt_tokens_per_s:>12.0f} "
            f"{p.prompt_core_calls:>6} {p.rows_per_prompt_core_call:>9.1f}"
        )
    return "\n".join(lines)


# ---- decode interference -------------------------------------------------------------------


@dataclass(frozen=True)
class InterferenceResult(InterferenceRun):
    """An `InterferenceRun` of the simulator, with its arm."""

    arm: str = ""

    def to_dict(self) -> dict:
        record = asdict(self)
        return {"arm": record.pop("arm"), **record}


def run_interference(
    model_config: OuroConfig,
    device: DeviceProfile,
    spec: InterferenceSpec,
    arm: str,
    *,
    roofline: str = "call",
) -> InterferenceResult:
    spec.validate()
    num_loops = model_config.num_loops
    engine_args = {
        **prompt_arm_args(arm),
        "prefill_chunk_size": spec.prefill_chunk_size,
        "max_num_batched_tokens": spec.max_num_batched_tokens,
        "max_num_seqs": spec.num_decode + len(spec.prompt_lens),
        "fill_prompt_chunks": spec.fill_prompt_chunks,
    }
    sim = Simulator(model_config, device, engine_args, roofline=roofline)
    core, executor = sim.core, sim.executor
    rng = np.random.default_rng(spec.seed)
    dist = exit_distribution(spec.exit_dist, num_loops)
    for i in range(spec.num_decode):
        trace = dist.sample(rng, spec.decode_max_tokens)
        request = SimRequest(f"d{i}", 0.0, spec.decode_prompt_len, spec.decode_max_tokens, trace)
        core.add_request(sim.make_request(request, i, 0.0))
    times: dict[str, list[float]] = {f"d{i}": [] for i in range(spec.num_decode)}
    pending = sorted((at, j) for j, at in enumerate(spec.inject_at))
    arrivals: dict[str, float] = {}
    first_token: dict[str, float] = {}
    clock = 0.0
    calls = mixed = prompt_rows = decode_rows = 0
    while len(first_token) < len(spec.prompt_lens):
        progress = min(len(t) for t in times.values())
        while pending and pending[0][0] <= progress:
            _, j = pending.pop(0)
            request = SimRequest(f"p{j}", clock, spec.prompt_lens[j], 1, (num_loops,))
            core.add_request(sim.make_request(request, spec.num_decode + j, clock))
            arrivals[request.request_id] = clock
        mixed_before = executor.stats.mixed_calls
        result = core.step()
        scheduled, output, touched = result.scheduled, result.output, result.touched
        if output is None:  # the simulated executor raised: a bug, never load
            assert result.error is not None
            raise result.error
        if scheduled.is_empty:
            raise RuntimeError("the scheduler planned an empty step with work pending")
        stats = core.stats()
        if stats.num_waiting and not arrivals:
            raise ConfigError(
                f"the simulated KV cache ({stats.kv_blocks_total} blocks) cannot hold the whole "
                f"decode population; lower num_decode or decode_max_tokens"
            )
        clock += output.stats.model_time_s
        if arrivals:  # inside the window
            calls += len(output.stats.rows_per_core_call)
            mixed += executor.stats.mixed_calls - mixed_before
            decode_rows += scheduled.num_decode_rows
            for item in scheduled.items:
                rows = item.token_count * item.num_depths
                if item.kind is ItemKind.PROMPT:
                    prompt_rows += rows
                else:  # replay rows
                    decode_rows += rows
        for request in touched:
            request_id = request.request_id
            if request_id in times:
                if request.is_finished:
                    raise ConfigError(
                        f"decode request {request_id} finished before the prompts completed; "
                        f"raise decode_max_tokens (now {spec.decode_max_tokens})"
                    )
                times[request_id].append(clock)
            else:
                first_token[request_id] = clock
    start_s, end_s = min(arrivals.values()), max(first_token.values())
    window_s = end_s - start_s
    window = window_gaps(list(times.values()), start_s, end_s)
    if not window.gaps_s:
        raise ConfigError(f"arm {arm}: no decode token inside the window; lengthen the prompts")
    stats = interference_stats(
        window,
        window_s,
        [first_token[r] - arrivals[r] for r in arrivals],
        prompt_token_loops=sum(spec.prompt_lens) * num_loops,
        num_first_tokens=len(first_token),
        num_core_calls=calls,
        num_mixed_core_calls=mixed,
        prompt_rows_per_core_call=prompt_rows / calls,
        decode_rows_per_core_call=decode_rows / calls,
    )
    return InterferenceResult(arm=arm, **stats)  # type: ignore[arg-type]


def format_interference(results: list[InterferenceResult]) -> str:
    header = (
        f"{'arm':<16} {'ITL p50':>8} {'p99':>8} {'max':>8} {'TPOT':>7} {'TTFT ms':>8} "
        f"{'prompt tl/s':>11} {'out tok/s':>9} {'calls':>6} {'mixed':>6} {'P rows':>7} "
        f"{'D rows':>6}"
    )
    lines = [header + "   (ms unless noted)"]
    for r in results:
        lines.append(
            f"{r.arm:<16} {r.itl_p50_ms:>8.2f} {r.itl_p99_ms:>8.2f} {r.itl_max_ms:>8.2f} "
            f"{r.tpot_ms:>7.2f} {r.ttft_mean_s * 1e3:>8.1f} {r.prompt_token_loops_per_s:>11.0f} "
            f"{r.output_tokens_per_s:>9.0f} {r.num_core_calls:>6} {r.num_mixed_core_calls:>6} "
            f"{r.prompt_rows_per_core_call:>7.1f} {r.decode_rows_per_core_call:>6.1f}"
        )
    return "\n".join(lines)
