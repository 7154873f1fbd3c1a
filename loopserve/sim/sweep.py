"""Policy arms, rate sweeps and capacity search on top of the simulator.

An arm is a named set of engine-arg overrides plus an optional exit-distribution override:
`refill` (continuous depth batching), `no_refill` (cohort baseline), `full_depth` (refill
with every token at full depth). Prompt-scheduling arms (`per_depth` = A1, `mixed` = A2,
`wavefront`) only pass engine args through, so they run as soon as `EngineConfig` accepts
them; until then their points are reported as pending with the config error.

Capacity = the highest request rate whose P99 normalized latency stays under an SLO, found
by bisection on the rate (the same requests and exit traces at every rate).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from loopserve.errors import ConfigError
from loopserve.models.family import LoopedConfig
from loopserve.sim.hardware import DeviceProfile
from loopserve.sim.host_model import HostModel
from loopserve.sim.metrics import SimResult, summarize
from loopserve.sim.simulator import Simulator
from loopserve.sim.workload import WorkloadSpec, build_workload
from loopserve.workloads.arms import ARMS as ALL_ARMS
from loopserve.workloads.arms import SIM_POLICIES, Arm

ARMS: dict[str, Arm] = {name: ALL_ARMS[name] for name in SIM_POLICIES}


def get_arm(name: str) -> Arm:
    try:
        return ARMS[name]
    except KeyError:
        raise ConfigError(f"unknown policy {name!r}; choose from {', '.join(ARMS)}") from None


@dataclass(frozen=True)
class PointResult:
    """One (arm, rate) simulation, or why it could not run."""

    arm: str
    request_rate: float
    result: SimResult | None
    error: str | None = None

    @property
    def p99_normalized_latency_s(self) -> float:
        return math.inf if self.result is None else self.result.normalized_latency.p99_s

    def to_dict(self) -> dict:
        return {
            "policy": self.arm,
            "request_rate": None if math.isinf(self.request_rate) else self.request_rate,
            "error": self.error,
            "result": None if self.result is None else self.result.to_dict(),
        }


@dataclass
class SweepSetup:
    """Everything fixed across the points of a sweep."""

    model_config: LoopedConfig
    device: DeviceProfile
    spec: WorkloadSpec
    engine_args: dict[str, object]
    lengths: list[tuple[int, int]]
    max_concurrency: int | None = None
    host_time_s: float = 0.0
    roofline: str = "call"
    on_finish: Callable[[int], None] | None = None
    client_max_tokens: int | None = None  # see `Simulator`
    host_model: HostModel | None = None  # host time per core call (`sim.host_model`)
    coda_every_loop: bool = False  # see `Simulator`
    draft_stable_dist: tuple[float, ...] | None = None  # see `Simulator`


def run_point(setup: SweepSetup, arm: Arm, request_rate: float) -> PointResult:
    spec = setup.spec
    exit_dist = arm.exit_dist or spec.exit_dist
    point_spec = WorkloadSpec(
        num_requests=len(setup.lengths),
        dataset=spec.dataset,
        request_rate=request_rate,
        exit_dist=exit_dist,
        seed=spec.seed,
        shared_prefix_len=spec.shared_prefix_len,
    )
    workload = build_workload(point_spec, setup.model_config.num_loops, lengths=setup.lengths)
    try:
        sim = Simulator(
            setup.model_config,
            setup.device,
            {**setup.engine_args, **arm.engine_args},
            host_time_s=setup.host_time_s,
            roofline=setup.roofline,
            client_max_tokens=setup.client_max_tokens,
            host_model=setup.host_model,
            # A full-depth arm never turns a criterion on: no coda before the last loop.
            coda_every_loop=setup.coda_every_loop and exit_dist != "full",
            draft_stable_dist=setup.draft_stable_dist,
        )
    except ConfigError as err:
        return PointResult(arm.name, request_rate, None, f"pending: {err}")
    run = sim.run(workload, max_concurrency=setup.max_concurrency, on_finish=setup.on_finish)
    return PointResult(arm.name, request_rate, summarize(run))


def find_capacity(
    setup: SweepSetup,
    arm: Arm,
    slo_s: float,
    *,
    low: float,
    high: float,
    rel_tol: float = 0.03,
    max_iters: int = 12,
    on_point: Callable[[PointResult], None] | None = None,
) -> tuple[float, list[PointResult]]:
    """Bisect the rate in [low, high] for the highest one with P99 normalized latency <= slo_s.

    Returns 0.0 when even `low` misses the SLO and `high` when `high` still meets it.
    """
    points: list[PointResult] = []

    def meets(rate: float) -> bool:
        point = run_point(setup, arm, rate)
        points.append(point)
        if on_point is not None:
            on_point(point)
        return point.p99_normalized_latency_s <= slo_s

    rate = highest_rate(meets, low=low, high=high, rel_tol=rel_tol, max_iters=max_iters)
    return rate, points


def highest_rate(
    meets: Callable[[float], bool],
    *,
    low: float,
    high: float,
    rel_tol: float = 0.03,
    max_iters: int = 12,
) -> float:
    """The highest rate in [low, high] for which `meets(rate)`, by geometric bisection (rates
    span orders of magnitude): 0.0 when even `low` misses, `high` when `high` still meets."""
    if not meets(low):
        return 0.0
    if meets(high):
        return high
    for _ in range(max_iters):
        if high - low <= rel_tol * low:
            break
        mid = math.sqrt(low * high)
        if meets(mid):
            low = mid
        else:
            high = mid
    return low
