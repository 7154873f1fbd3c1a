"""Per-request records of a simulated run and the summary statistics built from them.

Latencies are virtual-clock seconds: TTFT (first token - arrival), TPOT ((E2E - TTFT) /
(output tokens - 1)), ITL (every gap between consecutive tokens of a request), E2E (finish -
arrival) and normalized latency (E2E / output tokens, the per-token latency of the vLLM and
continuous-depth-batching papers). Throughput is over the makespan (first arrival at t=0 to the
last finish). Nothing here runs the simulation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from loopserve.scheduler.admission import MemoryStats

if TYPE_CHECKING:
    from loopserve.config import EngineConfig
    from loopserve.sim.call_pricing import ExecutorStats


@dataclass
class RequestRecord:
    request_id: str
    prompt_len: int
    output_len: int
    arrival_s: float
    token_times_s: list[float] = field(default_factory=list)
    finished_s: float | None = None
    exit_depths: list[int] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.arrival_s

    @property
    def e2e_s(self) -> float:
        assert self.finished_s is not None
        return self.finished_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        n = len(self.token_times_s)
        return (self.token_times_s[-1] - self.token_times_s[0]) / (n - 1) if n > 1 else None

    @property
    def normalized_latency_s(self) -> float:
        return self.e2e_s / len(self.token_times_s)


@dataclass(frozen=True)
class LatencyStats:
    mean_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    max_s: float

    @classmethod
    def of(cls, values: list[float] | np.ndarray) -> LatencyStats:
        arr = np.asarray(values, dtype=float)
        if arr.size == 0:
            return cls(0.0, 0.0, 0.0, 0.0, 0.0)
        p50, p90, p99 = np.percentile(arr, [50, 90, 99])
        return cls(float(arr.mean()), float(p50), float(p90), float(p99), float(arr.max()))


@dataclass(frozen=True)
class SimResult:
    num_requests: int
    num_finished: int
    num_output_tokens: int
    duration_s: float
    request_throughput: float  # requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output) tokens / s
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    normalized_latency: LatencyStats
    gpu_busy_share: float  # simulated GPU seconds / makespan
    decode_time_share: float  # of simulated GPU seconds: decode-only core calls
    prompt_time_share: float  # prompt-only core calls (the rest: mixed calls, coda, sampling)
    mean_loops_per_token: float
    num_steps: int
    num_core_calls: int
    decode_calls: int
    mean_decode_rows_per_call: float
    decode_weight_byte_share: float  # share of decode-call HBM bytes that are core weights
    prompt_calls: int
    mean_prompt_rows_per_call: float
    mixed_calls: int
    mean_mixed_rows_per_call: float
    num_blocks: int
    scheduler_cpu_s: float
    scheduler_us_per_step: float
    wall_s: float
    cpu_s: float  # process CPU seconds of the simulation (robust to other load on the host)
    num_preemptions: int = 0
    num_preemptions_swap: int = 0
    # Row-loops re-run by recompute preemption (prompt replays + generated-token replays)
    # over all row-loops of all core calls: the recompute share of the work.
    recompute_row_share: float = 0.0
    swap_time_share: float = 0.0  # of simulated GPU seconds: host-link copies
    prefix_hit_tokens: int = 0
    num_prompt_tokens: int = 0
    # With a host model (`sim.host_model`): priced host seconds over the makespan, and the
    # share of steps whose host time exceeded their device time (host-bound steps).
    host_busy_share: float = 0.0
    host_bound_step_share: float = 0.0
    # Of simulated GPU seconds: once-per-token work (the prelude's part of core calls, the
    # coda, sampling): what continuous depth batching cannot save by exiting early.
    once_time_share: float = 0.0
    # Coda batching in time: leave batches run, mean tokens per batch, mean steps a token
    # was held (counting its leave's step; 0 without batching).
    leave_batches: int = 0
    mean_leave_batch_rows: float = 0.0
    mean_held_steps: float = 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


@dataclass
class SimRun:
    """Raw outcome of one simulation (turned into a `SimResult` by `summarize`)."""

    records: list[RequestRecord]
    executor: ExecutorStats
    clock_s: float
    num_steps: int
    scheduler_cpu_s: float
    config: EngineConfig
    core_weight_bytes: int  # read once per core call
    wall_s: float = 0.0
    cpu_s: float = 0.0  # process CPU seconds of the whole run
    step_items: list[tuple] = field(default_factory=list)
    memory: MemoryStats = field(default_factory=MemoryStats)
    prefix_hit_tokens: int = 0
    host_s: float = 0.0  # priced host time of every step (`HostModel`; 0 without one)
    host_bound_steps: int = 0  # steps whose host time exceeded their device time
    # Coda batching in time (`scheduler/leave_batch.py`): batches, tokens, steps held.
    leave_batches: int = 0
    leave_rows: int = 0
    held_steps: int = 0


def summarize(run: SimRun) -> SimResult:
    records = [r for r in run.records if r.finished_s is not None]
    tpots = [t for r in records if (t := r.tpot_s) is not None]
    itls = np.concatenate([np.diff(r.token_times_s) for r in records]) if records else []
    num_output = sum(len(r.token_times_s) for r in records)
    num_prompt = sum(r.prompt_len for r in records)
    loops = sum(sum(r.exit_depths) for r in records)
    ex = run.executor
    duration = run.clock_s
    assert run.config.cache.num_blocks is not None
    return SimResult(
        num_requests=len(run.records),
        num_finished=len(records),
        num_output_tokens=num_output,
        duration_s=duration,
        request_throughput=_ratio(len(records), duration),
        output_throughput=_ratio(num_output, duration),
        total_token_throughput=_ratio(num_output + num_prompt, duration),
        ttft=LatencyStats.of([r.ttft_s for r in records]),
        tpot=LatencyStats.of(tpots),
        itl=LatencyStats.of(itls),
        e2e=LatencyStats.of([r.e2e_s for r in records]),
        normalized_latency=LatencyStats.of([r.normalized_latency_s for r in records]),
        gpu_busy_share=_ratio(ex.model_time_s, duration),
        decode_time_share=_ratio(ex.decode_time_s, ex.model_time_s),
        prompt_time_share=_ratio(ex.prompt_time_s, ex.model_time_s),
        mean_loops_per_token=_ratio(loops, num_output),
        num_steps=run.num_steps,
        num_core_calls=ex.num_core_calls,
        decode_calls=ex.decode_calls,
        mean_decode_rows_per_call=_ratio(ex.decode_rows, ex.decode_calls),
        decode_weight_byte_share=_ratio(ex.decode_calls * run.core_weight_bytes, ex.decode_bytes),
        prompt_calls=ex.prompt_calls,
        mean_prompt_rows_per_call=_ratio(ex.prompt_rows, ex.prompt_calls),
        mixed_calls=ex.mixed_calls,
        mean_mixed_rows_per_call=_ratio(ex.mixed_rows, ex.mixed_calls),
        num_blocks=run.config.cache.num_blocks,
        scheduler_cpu_s=run.scheduler_cpu_s,
        scheduler_us_per_step=_ratio(run.scheduler_cpu_s * 1e6, run.num_steps),
        wall_s=run.wall_s,
        cpu_s=run.cpu_s,
        num_preemptions=run.memory.num_preemptions,
        num_preemptions_swap=run.memory.num_preemptions_swap,
        recompute_row_share=_ratio(
            run.memory.num_recompute_prompt_rows + run.memory.num_replayed_rows,
            ex.decode_rows + ex.prompt_rows + ex.mixed_rows,
        ),
        swap_time_share=_ratio(ex.swap_time_s, ex.model_time_s),
        prefix_hit_tokens=run.prefix_hit_tokens,
        num_prompt_tokens=num_prompt,
        host_busy_share=_ratio(run.host_s, duration),
        host_bound_step_share=_ratio(run.host_bound_steps, run.num_steps),
        once_time_share=_ratio(
            ex.prelude_time_s + ex.coda_time_s + ex.sampling_time_s, ex.model_time_s
        ),
        leave_batches=run.leave_batches,
        mean_leave_batch_rows=_ratio(run.leave_rows, run.leave_batches),
        mean_held_steps=_ratio(run.held_steps, run.leave_rows),
    )
