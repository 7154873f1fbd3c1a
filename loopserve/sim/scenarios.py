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

import statistics
from dataclasses import asdict, dataclass

import numpy as np

from loopserve.contracts import ItemKind
from loopserve.errors import ConfigError
from loopserve.models.config import OuroConfig
from loopserve.sim.hardware import DeviceProfile
from loopserve.sim.metrics import window_gaps
from loopserve.sim.simulator import Simulator
from loopserve.sim.workload import SimRequest, exit_distribution

# Prompt-scheduling arms: engine args on top of the scenario's budget and chunk size.
PROMPT_ARMS: dict[str, dict[str, object]] = {
    "atomic": {"prefill_mode": "atomic"},  # A0
    "per_depth": {"prefill_mode": "per_depth"},  # A1
    "wavefront": {"prefill_mode": "wavefront"},
    "mixed": {"prefill_mode": "per_depth", "mixed_prefill_decode": True},  # A2
    "wavefront_mixed": {"prefill_mode": "wavefront", "mixed_prefill_decode": True},
}


def _arm_args(arm: str) -> dict[str, object]:
    try:
        return PROMPT_ARMS[arm]
    except KeyError:
        raise ConfigError(f"unknown arm {arm!r}; choose from {', '.join(PROMPT_ARMS)}") from None


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
                **_arm_args(arm),
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
class InterferenceSpec:
    num_decode: int = 64
    decode_prompt_len: int = 128
    decode_max_tokens: int = 1536  # must outlast the prompts; the KV of all must fit
    prompt_lens: tuple[int, ...] = (8064, 8064, 8064, 8064)
    inject_at: tuple[int, ...] = (8, 8, 8, 8)
    prefill_chunk_size: int = 512
    max_num_batched_tokens: int = 2048
    exit_dist: str = "ouro_1p4b_t0.5"
    seed: int = 0

    def validate(self) -> None:
        if len(self.inject_at) != len(self.prompt_lens):
            raise ConfigError("inject_at needs one value per prompt length")
        if self.num_decode < 1 or max(self.inject_at) >= self.decode_max_tokens:
            raise ConfigError("need num_decode >= 1 and every inject_at < decode_max_tokens")


@dataclass(frozen=True)
class InterferenceResult:
    arm: str
    window_s: float
    itl_p50_ms: float
    itl_p99_ms: float
    itl_max_ms: float
    tpot_ms: float
    ttft_mean_s: float
    ttft_max_s: float
    prompt_token_loops_per_s: float
    output_tokens_per_s: float
    num_core_calls: int
    num_mixed_core_calls: int
    prompt_rows_per_core_call: float
    decode_rows_per_core_call: float

    def to_dict(self) -> dict:
        return asdict(self)


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
        **_arm_args(arm),
        "prefill_chunk_size": spec.prefill_chunk_size,
        "max_num_batched_tokens": spec.max_num_batched_tokens,
        "max_num_seqs": spec.num_decode + len(spec.prompt_lens),
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
        clock += output.model_time_s
        if arrivals:  # inside the window
            calls += len(output.rows_per_core_call)
            mixed += executor.stats.mixed_calls - mixed_before
            for item in scheduled.items:
                rows = item.token_count * item.num_depths
                if item.kind is ItemKind.PROMPT:
                    prompt_rows += rows
                else:
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
    itl_ms = 1e3 * np.asarray(window.gaps_s)
    ttft = [first_token[r] - arrivals[r] for r in arrivals]
    return InterferenceResult(
        arm=arm,
        window_s=window_s,
        itl_p50_ms=float(np.percentile(itl_ms, 50)),
        itl_p99_ms=float(np.percentile(itl_ms, 99)),
        itl_max_ms=float(itl_ms.max()),
        tpot_ms=1e3 * statistics.fmean(window.per_request_mean_s),
        ttft_mean_s=statistics.fmean(ttft),
        ttft_max_s=max(ttft),
        prompt_token_loops_per_s=sum(spec.prompt_lens) * num_loops / window_s,
        output_tokens_per_s=(window.num_tokens + len(first_token)) / window_s,
        num_core_calls=calls,
        num_mixed_core_calls=mixed,
        prompt_rows_per_core_call=prompt_rows / calls,
        decode_rows_per_core_call=decode_rows / calls,
    )


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
