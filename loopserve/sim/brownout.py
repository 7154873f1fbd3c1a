"""Goodput with and without overload brownout, in the simulator driving the real scheduler.

Goodput is the rate of requests that meet both latency objectives: time to first token
<= `ttft_s` and time per output token <= `tpot_s` (requests / s of simulated time, over the
run's makespan). `brownout_study` finds the capacity without brownout (the highest Poisson
rate at which at least `attainment` of the requests meet the objectives, by bisection), then
runs rates at multiples of it with brownout off and on (every request's `brownout_floor`
set), and reports goodput, the mean loops per token (the loops given up) and how often the
level moved. `loopserve simulate --scenario brownout` prints it and writes the figure.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from loopserve.models.family import LoopedConfig
from loopserve.sim.hardware import DeviceProfile
from loopserve.sim.simulator import Simulator
from loopserve.sim.sweep import highest_rate
from loopserve.sim.workload import WorkloadSpec, build_workload

BROWNOUT_ARGS = {  # the engine's brownout settings the study runs with
    "brownout_waiting_high": 8,
    "brownout_waiting_low": 1,
    "brownout_step_loops": 1,
    "brownout_max_level": 3,
    "brownout_dwell_steps": 32,
}


@dataclass(frozen=True)
class GoodputPoint:
    rate: float  # offered requests / s
    brownout: bool
    goodput: float  # requests / s meeting both objectives
    slo_met: int
    num_requests: int
    mean_loops_per_token: float
    level_changes: int
    max_level: int
    makespan_s: float


@dataclass(frozen=True)
class StudySetup:
    model_config: LoopedConfig
    device: DeviceProfile
    engine_args: dict
    num_requests: int = 400
    dataset: str = "sharegpt"
    exit_dist: str = "ouro_1p4b_t0.5"
    seed: int = 1
    ttft_s: float = 1.0
    tpot_s: float = 0.05
    floor: int = 1


def goodput_point(setup: StudySetup, rate: float, *, brownout: bool) -> GoodputPoint:
    spec = WorkloadSpec(setup.num_requests, dataset=setup.dataset, request_rate=rate,
                        exit_dist=setup.exit_dist, seed=setup.seed)  # fmt: skip
    workload = build_workload(spec, setup.model_config.num_loops)
    args = dict(setup.engine_args, **(BROWNOUT_ARGS if brownout else {}))
    sim = Simulator(setup.model_config, setup.device, args,
                    brownout_floor=setup.floor if brownout else None)  # fmt: skip
    levels = []
    run = sim.run(workload, on_step=lambda scheduler: levels.append(scheduler.brownout.level))
    met = sum(
        1
        for record in run.records
        if record.ttft_s <= setup.ttft_s and (record.tpot_s or 0.0) <= setup.tpot_s
    )
    tokens = sum(len(record.exit_depths) for record in run.records)
    loops = sum(sum(record.exit_depths) for record in run.records)
    return GoodputPoint(
        rate=rate, brownout=brownout, goodput=met / run.clock_s, slo_met=met,
        num_requests=len(run.records), mean_loops_per_token=loops / max(tokens, 1),
        level_changes=sim.scheduler.brownout.num_changes, max_level=max(levels, default=0),
        makespan_s=run.clock_s,
    )  # fmt: skip


def find_capacity(setup: StudySetup, *, attainment: float = 0.95, low: float = 1.0,
                  high: float = 200.0, rel_tol: float = 0.05) -> float:  # fmt: skip
    """The highest rate (without brownout) at which `attainment` of requests meet both
    objectives, by geometric bisection in [low, high] (`sweep.highest_rate`)."""

    def meets(rate: float) -> bool:
        point = goodput_point(setup, rate, brownout=False)
        return point.slo_met >= attainment * point.num_requests

    return highest_rate(meets, low=low, high=high, rel_tol=rel_tol)


def brownout_study(setup: StudySetup, multiples=(0.5, 0.75, 1.0, 1.25, 1.5, 2.0)) -> dict:
    capacity = find_capacity(setup)
    points = []
    for multiple in multiples:
        for brownout in (False, True):
            points.append(goodput_point(setup, capacity * multiple, brownout=brownout))
    return {
        "capacity": capacity,
        "multiples": list(multiples),
        "ttft_s": setup.ttft_s,
        "tpot_s": setup.tpot_s,
        "brownout_args": BROWNOUT_ARGS,
        "floor": setup.floor,
        "points": [asdict(point) for point in points],
    }


def format_study(study: dict) -> str:
    lines = [
        f"capacity without brownout: {study['capacity']:.1f} requests/s "
        f"(>= 95% meet TTFT <= {study['ttft_s']:g} s and TPOT <= {study['tpot_s'] * 1e3:g} ms)",
        "| rate (x capacity) | goodput off | goodput on | on / off | loops/token off | "
        "loops/token on | level changes on |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    points = study["points"]
    for multiple, off, on in zip(study["multiples"], points[0::2], points[1::2]):
        ratio = on["goodput"] / off["goodput"] if off["goodput"] else math.inf
        lines.append(
            f"| {off['rate']:.1f} ({multiple:g}x) | {off['goodput']:.1f} | {on['goodput']:.1f} | "
            f"{ratio:.2f} | {off['mean_loops_per_token']:.2f} | "
            f"{on['mean_loops_per_token']:.2f} | {on['level_changes']} |"
        )
    return "\n".join(lines)


def plot_study(study: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = study["points"]
    rates = [p["rate"] for p in points[0::2]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(rates, [p["goodput"] for p in points[0::2]], "o-", label="brownout off")
    left.plot(rates, [p["goodput"] for p in points[1::2]], "s-", label="brownout on")
    left.plot(rates, rates, ":", color="grey", label="offered")
    left.axvline(study["capacity"], color="grey", linewidth=0.8)
    left.set_xlabel("offered requests / s")
    left.set_ylabel("goodput (requests / s meeting TTFT and TPOT)")
    left.legend()
    right.plot(rates, [p["mean_loops_per_token"] for p in points[0::2]], "o-", label="off")
    right.plot(rates, [p["mean_loops_per_token"] for p in points[1::2]], "s-", label="on")
    right.set_xlabel("offered requests / s")
    right.set_ylabel("mean loops per output token")
    right.legend()
    fig.suptitle("Ouro-1.4B, simulated H200: goodput with and without overload brownout")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
