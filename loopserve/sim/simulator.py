"""Run a workload through the real `EngineCore` on a virtual clock.

The scheduler and KV manager are built from an `EngineConfig` exactly as `LLMEngine` builds
them, and stepped by the same `EngineCore` (loopserve/engine/core.py); only the executor is
`SimExecutor` instead of `ModelRunner`. This module has no step loop of its own: it owns the
virtual clock and the arrivals and calls `EngineCore.step()`. The KV pool is sized from the simulated
GPU: `num_blocks = ((HBM - weights) · gpu_memory_utilization - in-flight hidden states) /
bytes per block` unless the engine args fix `num_blocks` or `kv_cache_bytes`.

Clock: requests are submitted when the virtual clock passes their arrival (at most
`max_concurrency` outstanding, like a benchmark client's semaphore; a held request's latency
starts when it is released). Each step advances the clock by the simulated step time plus
`host_time_s` (default 0); tokens produced in a step are stamped at its end. The real CPU time
of the core's steps outside `execute` (schedule, update, core bookkeeping) is measured on the
process CPU clock and reported separately, never added to the clock.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable

from loopserve.config import (
    EngineConfig,
    cascade_enabled,
    effective_graph_mode,
    max_inflight_rows,
    prefix_caching_enabled,
    resolve_coda_batching,
    resolve_num_blocks,
)
from loopserve.contracts import RunnerOutput, SchedulerOutput
from loopserve.engine.build import build_engine_core
from loopserve.errors import ConfigError
from loopserve.models.family import LoopedConfig, once_weight
from loopserve.models.registry import family_of_config
from loopserve.sampling_params import SamplingParams
from loopserve.scheduler.request import FinishReason, Request
from loopserve.scheduler.scheduler import Scheduler
from loopserve.sim.cost_model import CostModel, ModelShape, kv_element_bytes
from loopserve.sim.executor import SimExecutor
from loopserve.sim.hardware import DeviceProfile
from loopserve.sim.host_model import HostModel, step_time_s
from loopserve.sim.metrics import RequestRecord, SimResult, SimRun, summarize
from loopserve.sim.workload import ExitDistribution, SimRequest

StepHook = Callable[[Scheduler], None]


def build_engine_config(engine_args: dict[str, object]) -> EngineConfig:
    """Engine args as `LLM(...)` takes them; the simulator forces `exit_mode='trace'` unless
    another mode is asked for explicitly."""
    args = {"exit_mode": "trace", **engine_args}
    return EngineConfig.from_engine_args(**args)


def kv_bytes_per_block(shape: ModelShape, block_size: int) -> int:
    """Bytes of one block of one plane (`ModelRunner.kv_bytes_per_block` at the sim dtype)."""
    return shape.kv_bytes_per_token_per_depth * block_size


def resolve_sim_config(
    config: EngineConfig, shape: ModelShape, device: DeviceProfile
) -> EngineConfig:
    """Fix `num_blocks` from the simulated HBM left after the weights, minus the in-flight
    hidden states the runner may hold, and the score store with prefix caching (the same
    memory plan as `LLMEngine`)."""
    free_bytes = max(0, device.hbm_bytes - shape.total_weight_bytes)
    # A row in flight keeps its state (and, for Huginn, the injected prelude output).
    inflight_rows = max_inflight_rows(config, shape.num_loops) * shape.vectors_per_row
    block_size = config.cache.block_size
    # With prefix caching the runner's score store keeps a hidden vector per KV slot.
    store = block_size * shape.hidden_size * shape.dtype_bytes
    cache = resolve_num_blocks(
        config.cache,
        bytes_per_block=kv_bytes_per_block(shape, block_size)
        + (store if prefix_caching_enabled(config.cache) else 0),
        free_bytes=free_bytes,
        reserved_bytes=inflight_rows * shape.hidden_size * shape.dtype_bytes,
    )
    return dataclasses.replace(config, cache=cache)


def captures_decode(config: EngineConfig, shape: ModelShape) -> bool:
    """Whether the engine on a GPU runs decode-only calls through its captured step: as
    `effective_graph_mode` on CUDA and the engine's `auto` (`resolve_model_options`: a family
    with prelude and coda layers, Huginn, runs eagerly unless graphs are asked for)."""
    if effective_graph_mode(dataclasses.replace(config, device="cuda")) == "off":
        return False
    return config.graph_mode != "auto" or not (shape.prelude_layers or shape.coda_layers)


class Simulator:
    """One engine configuration on one simulated device; `run(workload)` once per instance."""

    def __init__(
        self,
        model_config: LoopedConfig,
        device: DeviceProfile,
        engine_args: dict[str, object] | None = None,
        *,
        host_time_s: float = 0.0,
        exit_dist: ExitDistribution | None = None,
        exit_threshold: float = 0.5,
        seed: int = 0,
        roofline: str = "call",
        client_max_tokens: int | None = None,
        host_model: HostModel | None = None,
        coda_every_loop: bool = False,
        draft_stable_dist: tuple[float, ...] | None = None,
        brownout_floor: int | None = None,
        imports_on_device: bool = False,
    ) -> None:
        """`draft_stable_dist`: with `speculative_tokens` > 0, the distribution of the loop
        from which a position's draft is right (`SimExecutor`). `exit_dist` and `exit_threshold` matter only for gated exit modes (the executor
        draws hazards from the distribution; requests get the threshold); trace mode replays
        each request's `exit_trace`. `roofline`: see `CostModel`. `coda_every_loop`: price
        an exit criterion that runs the coda after every loop (Huginn's KL, entropy and
        argmax criteria). `brownout_floor`: every request's (`SamplingParams.brownout_floor`;
        the engine's brownout arguments say whether and when it engages). `imports_on_device`:
        hand-offs land in device memory (`SimExecutor`)."""
        self.exit_threshold = exit_threshold
        self.brownout_floor = brownout_floor
        config = build_engine_config(engine_args or {})
        self.shape = ModelShape.from_config(
            model_config, kv_dtype_bytes=kv_element_bytes(config.cache.kv_cache_dtype)
        )
        family = family_of_config(model_config)  # its K/V and prompt rules, as the engine's
        self.device = device
        self.cost_model = CostModel(self.shape, device, roofline)
        self.config = resolve_sim_config(config, self.shape, device)
        self.num_loops = self.shape.num_loops
        self.max_model_len = self.config.max_model_len or model_config.max_position_embeddings
        cache = self.config.cache
        assert cache.num_blocks is not None
        block_bytes = kv_bytes_per_block(self.shape, cache.block_size)
        # CPU seconds: the scheduler's share is robust to other load on the host. A
        # synchronous core: async overlap is priced by `_step_s`.
        weight = once_weight(model_config)
        self.defers_leave = resolve_coda_batching(
            self.config, once_weight=weight, reads_logits=coda_every_loop
        )
        self.core = build_engine_core(
            self.config,
            num_loops=self.num_loops,
            bytes_per_block=block_bytes,
            defers_leave=self.defers_leave,
            once_weight=weight,
            make_executor=lambda _kv: SimExecutor(
                self.cost_model,
                layout=cache.layout,
                exit_mode=self.config.exit.mode,
                exit_dist=exit_dist,
                seed=seed,
                kv_block_bytes=block_bytes,
                cascade=cascade_enabled(self.config),
                block_size=cache.block_size,
                coda_every_loop=coda_every_loop,
                draft_stable_dist=draft_stable_dist,
                defers_leave=self.defers_leave,
                imports_on_device=imports_on_device,
                graphed=captures_decode(self.config, self.shape),
            ),
            async_scheduling=False,
            clock=time.process_time,
            extra_planes=self.shape.extra_kv_planes,
            prefix_key_by_max_loops=family.prefix_keyed_by_max_loops,
            prompt_loops_by_request=family.prompt_loops_by_request,
        )
        self.scheduler = self.core.scheduler
        self.kv = self.scheduler.kv
        self.executor: SimExecutor = self.core.executor  # type: ignore[assignment]
        self.host_time_s = host_time_s
        # Host time per core call (`sim.host_model`); None: steps cost device time only.
        self.host_model = host_model
        self.host_s = 0.0
        self.host_bound_steps = 0
        # Clients that do not know the output length send this max_tokens (capped by the
        # context); each request still stops at its sampled output length (a stop, as if
        # the model emitted EOS), so the engine never learns the length in advance.
        self.client_max_tokens = client_max_tokens
        self._output_len: dict[str, int] = {}

    def _step_s(self, output: RunnerOutput) -> float:
        """A step's wall time: device time, plus the host model's time for its core calls
        (overlapped, ideally, under async scheduling)."""
        device_s = output.stats.model_time_s
        if self.host_model is None:
            return device_s
        host_s = self.host_model.step_s(output.stats.rows_per_core_call)
        self.host_s += host_s
        self.host_bound_steps += host_s > device_s
        return step_time_s(device_s, host_s, overlap=self.config.async_scheduling)

    def make_request(self, sim: SimRequest, order: int, arrival_s: float) -> Request:
        trace_mode = self.config.exit.mode == "trace"
        max_tokens = sim.output_len
        if self.client_max_tokens is not None:
            room = self.max_model_len - sim.prompt_len
            max_tokens = max(sim.output_len, min(self.client_max_tokens, room))
            self._output_len[sim.request_id] = sim.output_len
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            exit_trace=sim.exit_trace if trace_mode else None,
            exit_threshold=1.0 if trace_mode else self.exit_threshold,
            brownout_floor=self.brownout_floor,
        ).resolve_loops(self.num_loops)
        total = sim.prompt_len + sim.output_len
        if total > self.max_model_len:
            raise ConfigError(
                f"request {sim.request_id}: {sim.prompt_len} prompt + {sim.output_len} output "
                f"tokens exceed the simulated model's {self.max_model_len}; shorten the "
                "workload's prompts or outputs (--input-len, --output-len, a scenario's --prompt-lens "
                "or --long-lens)"
            )
        return Request(
            sim.request_id,
            # Token ids only matter to prefix caching: a shared prefix of 1s, then ids unique
            # to the request (no accidental sharing between requests).
            [1] * sim.shared_prefix_len + [order + 2] * (sim.prompt_len - sim.shared_prefix_len),
            params,
            arrival_order=order,
            eos_token_ids=frozenset(),
            arrival_s=arrival_s,
        )

    def run(
        self,
        workload: list[SimRequest],
        *,
        max_concurrency: int | None = None,
        on_step: StepHook | None = None,
        on_finish: Callable[[int], None] | None = None,
        record_items: bool = False,
    ) -> SimRun:
        """Simulate until every request finishes. `on_step(scheduler)` runs after each step
        (tests call `check_invariants` there); `on_finish(n)` reports finished requests."""
        wall_start = time.perf_counter()
        cpu_start = time.process_time()
        core, scheduler = self.core, self.scheduler
        clients = _Clients(workload, max_concurrency)
        step_items: list[tuple] = []
        remove_observer = None
        if record_items:

            def record(scheduled: SchedulerOutput, _output: RunnerOutput) -> None:
                step_items.append(tuple(scheduled.row_groups()))

            remove_observer = core.add_observer(record)
        before = core.stats()
        leaver = scheduler.leaver
        leaver0 = (leaver.num_batches, leaver.num_rows, leaver.num_waited_steps)
        while clients.pending or core.has_unfinished_requests():
            for sim, release_s in clients.release():
                core.add_request(self.make_request(sim, len(clients.records), release_s))
                clients.records[sim.request_id] = RequestRecord(
                    sim.request_id, sim.prompt_len, sim.output_len, release_s
                )
            if not core.has_unfinished_requests():
                clients.idle_until_next_arrival()
                continue
            result = core.step()
            if result.output is None:  # the simulated executor raised: a bug, never load
                assert result.error is not None
                raise result.error
            for request in result.touched:
                if not request.is_finished and len(
                    request.output_token_ids
                ) >= self._output_len.get(request.request_id, 1 << 60):
                    scheduler.finish(request, FinishReason.STOP)
            if result.scheduled.is_empty:
                raise RuntimeError("the scheduler planned an empty step with work pending")
            clients.clock += self._step_s(result.output) + self.host_time_s
            finished = clients.record_tokens(result.touched)
            if finished and on_finish is not None:
                on_finish(finished)
            if on_step is not None:
                on_step(scheduler)
        if remove_observer is not None:
            remove_observer()
        after = core.stats()
        sched_s = (after.step_time_s - before.step_time_s) - (
            after.execute_time_s - before.execute_time_s
        )
        num_steps = after.num_steps - before.num_steps
        return SimRun(
            records=list(clients.records.values()),
            executor=self.executor.stats,
            clock_s=clients.clock,
            num_steps=num_steps,
            scheduler_cpu_s=sched_s,
            config=self.config,
            core_weight_bytes=self.shape.core_weight_bytes,
            wall_s=time.perf_counter() - wall_start,
            cpu_s=time.process_time() - cpu_start,
            step_items=step_items,
            memory=scheduler.memory_stats,
            prefix_hit_tokens=self.kv.prefix_cache.stats.num_hit_tokens
            if self.kv.prefix_cache
            else 0,
            host_s=self.host_s,
            host_bound_steps=self.host_bound_steps,
            leave_batches=scheduler.leaver.num_batches - leaver0[0],
            leave_rows=scheduler.leaver.num_rows - leaver0[1],
            held_steps=scheduler.leaver.num_waited_steps - leaver0[2],
        )


class _Clients:
    """The request side of the virtual clock: arrivals, the concurrency limit, records."""

    def __init__(self, workload: list[SimRequest], max_concurrency: int | None) -> None:
        self.pending = deque(sorted(workload, key=lambda r: r.arrival_s))
        self.limit = max_concurrency if max_concurrency is not None else math.inf
        self.outstanding = 0
        self.slot_freed_s = 0.0  # when the concurrency limit last let a held request go
        self.clock = 0.0
        self.records: dict[str, RequestRecord] = {}

    def release(self) -> list[tuple[SimRequest, float]]:
        """Requests sent by now, with the time each was sent (its latency starts there)."""
        released = []
        pending = self.pending
        while pending and pending[0].arrival_s <= self.clock and self.outstanding < self.limit:
            sim = pending.popleft()
            released.append((sim, max(sim.arrival_s, self.slot_freed_s)))
            self.outstanding += 1
        return released

    def idle_until_next_arrival(self) -> None:
        self.clock = max(self.clock, self.pending[0].arrival_s)

    def record_tokens(self, touched: list[Request]) -> int:
        """Stamp this step's tokens at the clock; returns how many requests finished."""
        finished = 0
        for request in touched:
            record = self.records[request.request_id]
            # Every token this step appended (a speculating request may append several).
            new = len(request.output_token_ids) - len(record.token_times_s)
            record.token_times_s.extend([self.clock] * max(new, 1))
            if request.is_finished:
                record.finished_s = self.clock
                record.exit_depths = request.exit_depths
                if self.outstanding == self.limit:
                    self.slot_freed_s = self.clock
                self.outstanding -= 1
                finished += 1
        return finished


def simulate(
    model_config: LoopedConfig,
    device: DeviceProfile,
    workload: list[SimRequest],
    engine_args: dict[str, object] | None = None,
    *,
    max_concurrency: int | None = None,
    host_time_s: float = 0.0,
    on_finish: Callable[[int], None] | None = None,
    host_model: HostModel | None = None,
) -> SimResult:
    """Build a `Simulator`, run the workload and summarize it."""
    sim = Simulator(
        model_config, device, engine_args, host_time_s=host_time_s, host_model=host_model
    )
    run = sim.run(workload, max_concurrency=max_concurrency, on_finish=on_finish)
    return summarize(run)
