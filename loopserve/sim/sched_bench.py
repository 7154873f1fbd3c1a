"""Microbenchmark: real CPU microseconds of scheduler bookkeeping per decode step.

For each count of running requests it builds the simulator's `EngineCore` (the real
`Scheduler` + `KVCacheManager`, `SimExecutor` standing in for the GPU), admits that many
requests with short prompts and long outputs (none finishes during the run), steps until
every request is decoding, then reads the process CPU time of many `EngineCore.step()`s from
the core's stats: `schedule`, the executor (reported separately), and the rest of the step
(`update`, observers, counters) as "update". Exits follow a trace drawn from
an exit distribution, so tokens exit at mixed depths as in serving. Optionally profiles the
timed steps with cProfile and returns the top functions by internal time.
"""

from __future__ import annotations

import cProfile
import io
import pstats
from dataclasses import dataclass

from loopserve.engine.core import EngineCore
from loopserve.models.config import OuroConfig
from loopserve.sim.cost_model import OURO_1P4B
from loopserve.sim.hardware import get_device_profile
from loopserve.sim.simulator import Simulator
from loopserve.sim.workload import SimRequest, WorkloadSpec, build_workload

DEFAULT_RUNNING = (8, 16, 32, 64, 128)


@dataclass(frozen=True)
class SchedBenchResult:
    num_running: int
    mode: str
    num_steps: int
    schedule_us: float  # per step
    update_us: float  # per step
    executor_us: float  # per step (the simulated executor, not part of the scheduler)
    profile: str = ""

    @property
    def scheduler_us(self) -> float:
        return self.schedule_us + self.update_us


def _requests(num_running: int, output_len: int, exit_dist: str, seed: int) -> list[SimRequest]:
    spec = WorkloadSpec(num_running, dataset="synthetic", exit_dist=exit_dist, seed=seed)
    lengths = [(16, output_len)] * num_running
    return build_workload(spec, OURO_1P4B.num_loops, lengths=lengths)


def bench_scheduler(
    num_running: int,
    *,
    num_steps: int = 2000,
    mode: str = "refill",
    exit_dist: str = "ouro_1p4b_t0.5",
    model_config: OuroConfig = OURO_1P4B,
    seed: int = 0,
    profile: bool = False,
) -> SchedBenchResult:
    """Time `num_steps` decode steps with `num_running` requests in flight."""
    output_len = (
        2 if profile else 1
    ) * num_steps + 64  # each step yields at most one token per request
    engine_args = {
        "max_num_seqs": num_running,
        "max_num_batched_tokens": max(2048, num_running),
        "mode": mode,
        "num_blocks": num_running * model_config.num_loops * (-(-(16 + output_len) // 16)),
    }
    sim = Simulator(model_config, get_device_profile("h100"), engine_args)
    core = sim.core  # its clock is the process CPU time: robust to other load on the host
    for i, request in enumerate(_requests(num_running, output_len, exit_dist, seed)):
        core.add_request(sim.make_request(request, i, 0.0))
    while core.stats().num_waiting or any(r.in_prompt_phase for r in sim.scheduler.running):
        core.step()
    core.reset_counters()
    for _ in range(num_steps):
        core.step()
    stats = core.stats()
    text = _profile(core, num_steps) if profile else ""
    assert stats.num_running == num_running, "a request finished during the benchmark"
    scale = 1e6 / num_steps
    return SchedBenchResult(
        num_running,
        mode,
        num_steps,
        stats.schedule_time_s * scale,
        stats.update_time_s * scale,
        stats.execute_time_s * scale,
        text,
    )


def _profile(core: EngineCore, num_steps: int) -> str:
    """cProfile of further steps."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(num_steps):
        core.step()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue()


def run_sched_bench(
    running: tuple[int, ...] = DEFAULT_RUNNING, *, num_steps: int = 2000, mode: str = "refill"
) -> list[SchedBenchResult]:
    return [bench_scheduler(n, num_steps=num_steps, mode=mode) for n in running]


def format_sched_bench(results: list[SchedBenchResult]) -> str:
    lines = [
        f"{'running':>8} {'mode':>10} {'schedule us':>12} {'update us':>10} "
        f"{'sched total us':>15} {'us/request':>11} {'sim executor us':>16}"
    ]
    for r in results:
        lines.append(
            f"{r.num_running:>8} {r.mode:>10} {r.schedule_us:>12.1f} {r.update_us:>10.1f} "
            f"{r.scheduler_us:>15.1f} {r.scheduler_us / r.num_running:>11.2f} "
            f"{r.executor_us:>16.1f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_sched_bench(run_sched_bench()))
