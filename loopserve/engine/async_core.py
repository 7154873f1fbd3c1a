"""`AsyncEngineCore`: the engine core with async scheduling (`async_scheduling=True`).

The executor runs step n on a worker thread while the engine thread chooses the rows of step
n+1 (`Scheduler.select_ahead`) from what is known before step n's results: with
`ouro_delayed`, `random_lookahead` and `trace` every decode loop's exit is fixed when the loop
is planned (a gate crossing at loop d commits the exit after loop d+1), so the tokens that
continue, and therefore the next step's rows, do not depend on step n's outputs. After step n
returns, `update(n)` records its results, and the chosen rows become step n+1's items
(`Scheduler.complete_ahead`: depths, exit plans and block tables read from the now-current
state). A token that exits in step n keeps its request's row under refill (its next token,
built after update once the sampled id is known) and leaves the cohort under no_refill;
prompt work and admissions are never planned ahead (those steps are scheduled after update,
as in `EngineCore`).

What overlaps: the row selection of step n+1 with the execution of step n; and, because a
step planned ahead is submitted before `step()` returns, the caller's processing of step n's
outputs with the execution of step n+1. What does not: `update(n)`, building step n+1's
items and the runner's input preparation. Outputs (tokens, exit depths) equal synchronous
scheduling because every request's results are independent of which step and batch its rows
ran in (batch invariance); tests check this against `EngineCore` and the dense reference.

A request finished or aborted while a step is in flight: its blocks return to the pool (no
block is handed out before the step is collected: admission runs only in `schedule()`, only
with nothing in flight), `update` ignores its rows, and its release goes with the next output.
When the core goes idle with a step in flight it collects that step before sending releases.

`stats().num_steps_scheduled_ahead` counts the steps whose rows were chosen while the
previous step executed. The step API, observers, failure handling and releases are those of
`EngineCore`.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from loopserve.contracts import RunnerOutput, SchedulerOutput
from loopserve.engine.core import EngineCore, StepResult


class AsyncEngineCore(EngineCore):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loopserve-exec")
        # The step executing on the worker (submitted, results not applied yet).
        self._inflight: tuple[SchedulerOutput, Future[RunnerOutput]] | None = None

    def _submit(self, scheduled: SchedulerOutput) -> None:
        self._inflight = (scheduled, self._worker.submit(self.executor.execute, scheduled))

    def step(self) -> StepResult:
        clock, counters, scheduler = self._clock, self._counters, self.scheduler
        start = clock()
        if self._inflight is None:  # nothing planned ahead: schedule now, after the last update
            self._submit(scheduler.schedule())
            counters.schedule_time_s += clock() - start
        assert self._inflight is not None
        scheduled, future = self._inflight
        execute_start = clock()
        # Overlaps the execution of `scheduled`: choose the next step's rows.
        next_rows = scheduler.select_ahead(scheduled) if not scheduled.is_empty else None
        try:
            output = future.result()
        except Exception as err:  # a failed step fails its own requests, not the engine
            self._inflight = None
            return self._fail_step(scheduled, err)
        self._inflight = None
        execute_end = clock()
        applied = self._apply(scheduled, output)
        if next_rows:
            plan_start = clock()
            ahead = scheduler.complete_ahead(next_rows)
            if ahead is not None:
                counters.num_steps_scheduled_ahead += 1
                self._submit(ahead)  # runs while the caller processes this step's outputs
            counters.schedule_time_s += clock() - plan_start
        end = clock()
        counters.execute_time_s += execute_end - execute_start
        counters.step_time_s += end - start
        return StepResult(scheduled, output, applied.touched, applied.failed, errors=applied.errors)

    def _drain(self) -> None:
        """Wait for the step in flight and apply it (its requests may all be gone by now)."""
        if self._inflight is None:
            return
        scheduled, future = self._inflight
        self._inflight = None
        try:
            output = future.result()
        except Exception as err:
            self._fail_step(scheduled, err)
            return
        self._apply(scheduled, output)

    def _flush_if_idle(self) -> None:
        # The executor runs one thing at a time: a release-only output waits for the step in
        # flight (whose requests were all finished or aborted meanwhile).
        if self._inflight is not None and not self.scheduler.has_unfinished_requests():
            self._drain()
        super()._flush_if_idle()

    def shutdown(self) -> None:
        self._drain()
        self._worker.shutdown(wait=True)
        super().shutdown()
