"""`EngineCore`: the one step loop, schedule -> execute -> update, over an `Executor`.

Token ids only: it takes `Request`s, runs steps, and hands back the requests each step
touched; text (tokenization, detokenization, stop strings) lives above it in `LLMEngine`.
`LLMEngine` drives it with a `ModelRunner`, the simulator with a `SimExecutor` on a virtual
clock; neither has a step loop of its own.

- Observers: `add_observer(fn)` registers `fn(scheduled, output)`, called after every
  executed step (after `update`), in registration order. Observers must not mutate either
  argument; bookkeeping-only flushes and failed steps are not reported.
- Failures: a new request whose setup raised in the executor (`RunnerOutput.failed_requests`)
  is aborted alone, with its own error; the rest of the step is applied as usual. If `execute`
  raises, only the requests of that step fail (those with items and those it announced in
  `new_requests`). Either way the failed requests are aborted (KV freed, release sent with the
  next output) and returned in `StepResult.failed`, each with its message in
  `StepResult.errors`; the core keeps serving the rest.
- Releases: requests that leave RUNNING (finished, aborted, failed) reach the executor only
  through `SchedulerOutput.finished_request_ids`, with the next step. When the core goes idle
  (no unfinished request) with releases pending, it flushes them at once with a
  bookkeeping-only `SchedulerOutput` (no items), so an idle executor holds no request state.
  If that flush raises too (a failing executor), the releases stay pending for the next
  output.
- Stats: `stats()` returns a frozen `EngineStats` snapshot (gauges now, counters since
  construction or `reset_counters()`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from loopserve.contracts import ItemKind, RunnerOutput, SchedulerOutput
from loopserve.engine.stats import EngineStats, StepCounters
from loopserve.execution import Executor
from loopserve.scheduler.request import FinishReason, Request
from loopserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)
StepObserver = Callable[[SchedulerOutput, RunnerOutput], None]


class AppliedStep(NamedTuple):
    """What applying one executed step produced: requests with a new token or finished, and
    the requests whose per-request setup failed (with their messages)."""

    touched: list[Request]
    failed: list[Request]
    errors: dict[str, str]


@dataclass(frozen=True, slots=True)
class StepResult:
    """One step: its plan, the executor's output (None when `execute` raised), the requests
    that produced a token (some of them finished), and the requests that failed (aborted):
    those whose setup raised, or every request of the step when `execute` raised (`error`)."""

    scheduled: SchedulerOutput
    output: RunnerOutput | None = None
    touched: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)
    error: Exception | None = None
    errors: dict[str, str] = field(default_factory=dict)  # failed request id -> message


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`clock` times steps for `stats()` (the simulator passes `time.process_time`)."""
        self.scheduler = scheduler
        self.executor = executor
        self._clock = clock
        self._observers: list[StepObserver] = []
        self._counters = StepCounters()

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def add_imported(self, request: Request) -> None:
        """Queue a request handed off by another engine (its K/V staged in the executor)."""
        self.scheduler.add_imported(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request with `abort`; None if it is unknown or already finished."""
        request = self.scheduler.abort_request(request_id)
        self._flush_if_idle()
        return request

    def finish_request(self, request: Request, reason: FinishReason) -> None:
        """Finish an unfinished request from above the core (e.g. a stop string matched)."""
        self.scheduler.finish(request, reason)
        self._flush_if_idle()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_waiting + self.scheduler.num_running

    # ---- observers ----------------------------------------------------------------------------

    def add_observer(self, observer: StepObserver) -> Callable[[], None]:
        """Call `observer(scheduled, output)` after every executed step; returns a remover."""
        self._observers.append(observer)
        return lambda: self._observers.remove(observer)

    # ---- stepping -----------------------------------------------------------------------------

    def step(self) -> StepResult:
        clock, counters = self._clock, self._counters
        start = clock()
        scheduled = self.scheduler.schedule()
        execute_start = clock()
        try:
            output = self.executor.execute(scheduled)
        except Exception as err:  # a failed step fails its own requests, not the engine
            return self._fail_step(scheduled, err)
        execute_end = clock()
        applied = self._apply(scheduled, output)
        end = clock()
        counters.schedule_time_s += execute_start - start
        counters.execute_time_s += execute_end - execute_start
        counters.step_time_s += end - start
        return StepResult(scheduled, output, applied.touched, applied.failed, errors=applied.errors)

    def _fail_step(self, scheduled: SchedulerOutput, err: Exception) -> StepResult:
        # Announced requests too: the executor may not have set them up.
        decode_ids = scheduled.decode.request_ids if scheduled.decode is not None else ()
        ids = dict.fromkeys(
            [*decode_ids, *(item.request_id for item in scheduled.items)]
            + [new.request_id for new in scheduled.new_requests]
        )
        failed = self.scheduler.fail_requests(ids)
        self._counters.num_failed_steps += 1
        self._flush_if_idle()
        message = f"{type(err).__name__}: {err}"
        errors = {request.request_id: message for request in failed}
        return StepResult(scheduled, failed=failed, error=err, errors=errors)

    def _apply(self, scheduled: SchedulerOutput, output: RunnerOutput) -> AppliedStep:
        """Per-request failures, `update`, observers, counters and idle flush of one executed
        step."""
        counters = self._counters
        failed, errors = [], {}
        if output.failed_requests:  # their items ran nothing; `update` skips finished requests
            errors = {failure.request_id: failure.error for failure in output.failed_requests}
            failed = self.scheduler.fail_requests(errors)
        touched = self.scheduler.update(scheduled, output)
        for observer in self._observers:
            observer(scheduled, output)
        counters.num_steps += 1
        stats = output.stats
        rows = stats.rows_per_core_call
        counters.num_core_calls += len(rows)
        counters.num_rows += sum(rows)
        histograms = counters.rows
        for count in rows:
            histograms["core"].observe(count)
        prelude = sum(item.token_count for item in scheduled.items if item.needs_prelude)
        if scheduled.decode is not None:
            prelude += int(np.count_nonzero(scheduled.decode.depths == 0))
        if prelude:
            histograms["prelude"].observe(prelude)
        if self.scheduler.step_tokens:
            histograms["coda"].observe(self.scheduler.step_tokens)
        counters.num_output_tokens += self.scheduler.step_tokens
        counters.num_loops += self.scheduler.step_loops
        counters.num_early_exits += stats.num_early_exits
        counters.num_finalize_copies += stats.num_finalize_copies
        for item in scheduled.items:
            if item.kind is ItemKind.PROMPT:
                counters.num_prompt_row_loops += item.token_count * item.num_depths
        for result in output.results:
            if result.prompt_logprobs:
                counters.num_scored_prompt_positions += len(result.prompt_logprobs)
                counters.num_scored_prompt_loops += sum(
                    s.loops or 0 for s in result.prompt_logprobs
                )
        counters.num_graph_calls += stats.num_graph_calls
        counters.num_padded_rows += stats.num_padded_rows
        counters.num_h2d_transfers += stats.num_h2d_transfers
        counters.num_d2h_transfers += stats.num_d2h_transfers
        counters.h2d_bytes += stats.h2d_bytes
        counters.d2h_bytes += stats.d2h_bytes
        counters.model_time_s += stats.model_time_s
        counters.forward_time_s += stats.forward_time_s
        self._flush_if_idle()
        return AppliedStep(touched, failed, errors)

    def deliver_bookkeeping(self) -> None:
        """Execute a bookkeeping-only output now (announcements, releases, table updates and
        K/V copies the next step would carry first): a reader of K/V outside a step (an
        export) needs the copies done."""
        self.executor.execute(self.scheduler.schedule_releases())

    def _flush_if_idle(self) -> None:
        """Deliver pending releases now when no step would come to carry them."""
        if self.scheduler.has_pending_releases() and not self.scheduler.has_unfinished_requests():
            releases = self.scheduler.schedule_releases()
            try:
                self.executor.execute(releases)
            except Exception:  # the executor is failing; the next output carries them again
                logger.exception("releasing %s failed", list(releases.finished_request_ids))
                self.scheduler.return_releases(releases.finished_request_ids)

    # ---- stats --------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        scheduler, kv, counters = self.scheduler, self.scheduler.kv, self._counters
        memory, prefix = scheduler.memory_stats, kv.prefix_cache
        return EngineStats(
            num_prefix_cache_queried_tokens=prefix.stats.num_queried_tokens if prefix else 0,
            num_prefix_cache_hit_tokens=prefix.stats.num_hit_tokens if prefix else 0,
            num_preemptions_recompute=memory.num_preemptions_recompute,
            num_preemptions_swap=memory.num_preemptions_swap,
            num_swapped_bytes=(kv.num_swapped_out_blocks + kv.num_swapped_in_blocks)
            * kv.bytes_per_block,
            num_spec_drafted=scheduler.speculator.stats.drafted,
            num_spec_accepted=scheduler.speculator.stats.accepted,
            num_spec_rejected=scheduler.speculator.stats.rejected,
            num_spec_redrafted=scheduler.speculator.stats.redrafted,
            brownout_level=scheduler.brownout.level,
            num_brownout_changes=scheduler.brownout.num_changes,
            num_leave_batches=scheduler.leaver.num_batches,
            num_leave_rows=scheduler.leaver.num_rows,
            num_held_steps=scheduler.leaver.num_waited_steps,
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_total=kv.num_blocks,
            block_size=kv.block_size,
            num_planes=kv.num_planes,
            num_steps=counters.num_steps,
            num_core_calls=counters.num_core_calls,
            num_rows=counters.num_rows,
            num_output_tokens=counters.num_output_tokens,
            num_loops=counters.num_loops,
            num_early_exits=counters.num_early_exits,
            num_finalize_copies=counters.num_finalize_copies,
            num_scored_prompt_positions=counters.num_scored_prompt_positions,
            num_scored_prompt_loops=counters.num_scored_prompt_loops,
            num_prompt_row_loops=counters.num_prompt_row_loops,
            num_forked_requests=scheduler.groups.stats.num_forked,
            num_failed_steps=counters.num_failed_steps,
            num_graph_calls=counters.num_graph_calls,
            num_padded_rows=counters.num_padded_rows,
            num_h2d_transfers=counters.num_h2d_transfers,
            num_d2h_transfers=counters.num_d2h_transfers,
            h2d_bytes=counters.h2d_bytes,
            d2h_bytes=counters.d2h_bytes,
            num_steps_scheduled_ahead=counters.num_steps_scheduled_ahead,
            model_time_s=counters.model_time_s,
            forward_time_s=counters.forward_time_s,
            step_time_s=counters.step_time_s,
            schedule_time_s=counters.schedule_time_s,
            execute_time_s=counters.execute_time_s,
            rows_per_call=tuple(
                (stage, tuple(h.counts), h.total) for stage, h in counters.rows.items()
            ),
        )

    def reset_counters(self) -> None:
        """Start the counters of `stats()` from zero (benchmarks time one run at a time)."""
        self._counters = StepCounters()

    def shutdown(self) -> None:
        self.executor.shutdown()
