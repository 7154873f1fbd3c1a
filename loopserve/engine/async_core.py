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

What overlaps: the row selection of step n+1 with the execution of step n. What does not:
`update(n)`, building step n+1's items, and the caller's output processing of step n run
between executions. Outputs (tokens, exit depths) equal synchronous scheduling because every
request's results are independent of which step and batch its rows ran in (batch
invariance); tests check this against `EngineCore` and the dense reference.

`stats().num_steps_scheduled_ahead` counts the steps whose rows were chosen while the
previous step executed. The step API, observers, failure handling and releases are those of
`EngineCore`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from loopserve.engine.core import EngineCore, StepResult


class AsyncEngineCore(EngineCore):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loopserve-exec")
        self._ahead: list[str] | None = None  # request ids of the next step's rows

    def step(self) -> StepResult:
        clock, counters, scheduler = self._clock, self._counters, self.scheduler
        start = clock()
        ahead, self._ahead = self._ahead, None
        scheduled = scheduler.complete_ahead(ahead) if ahead else None
        if scheduled is not None:
            counters.num_steps_scheduled_ahead += 1
        else:  # nothing planned ahead (or every chosen request left): schedule after update
            scheduled = scheduler.schedule()
        execute_start = clock()
        future = self._worker.submit(self.executor.execute, scheduled)
        next_rows = scheduler.select_ahead(scheduled) if scheduled.items else None
        try:
            output = future.result()
        except Exception as err:  # a failed step fails its own requests, not the engine
            return self._fail_step(scheduled, err)
        execute_end = clock()
        touched = self._apply(scheduled, output)
        self._ahead = next_rows
        end = clock()
        counters.schedule_time_s += execute_start - start
        counters.execute_time_s += execute_end - execute_start
        counters.step_time_s += end - start
        return StepResult(scheduled, output, touched)

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True)
        super().shutdown()
