"""Async scheduling: the rows of step n+1 chosen while step n still executes.

`AheadPlanner` is a collaborator the `Scheduler` owns (its `select_ahead` / `complete_ahead`
are what `AsyncEngineCore`, loopserve/engine/async_core.py, calls), with explicit inputs:
the queues, the decode policy, the admission (whether the queue's head could start; growth),
the item builder and the scheduler's output step. `select_ahead` picks the next decode rows before the
previous step's results are applied (only exit modes that know a loop's exit a loop ahead
allow it), `complete_ahead` builds their `SchedulerOutput` after the update. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from loopserve.contracts import SchedulerOutput
from loopserve.exit import ExitMode
from loopserve.exit.columns import EXIT, GATE
from loopserve.scheduler.admission import Admission
from loopserve.scheduler.decode_table import DecodeTable
from loopserve.scheduler.items import ItemBuilder, StepWork
from loopserve.scheduler.policies import DecodePolicy
from loopserve.scheduler.queues import Queues


class AheadPlanner:
    """Planning one step ahead for the `Scheduler` (see the module docstring)."""

    def __init__(
        self,
        *,
        exit_mode: ExitMode,
        queues: Queues,
        decode: DecodeTable,
        decode_policy: DecodePolicy,
        admission: Admission,
        items: ItemBuilder,
        output: Callable[[StepWork], SchedulerOutput],
    ) -> None:
        self.exit_mode = exit_mode
        self.queues = queues
        self.decode = decode
        self.decode_policy = decode_policy
        self.admission = admission
        self.items = items
        self.output = output

    def select_ahead(self, inflight: SchedulerOutput) -> list[str] | None:
        """Choose the next step's decode rows while `inflight` still executes, or None when the
        next step needs `inflight`'s results first (then `schedule()` runs after update).

        Only the exit modes that know a loop's exit before its gate is read allow this (the
        config rejects async scheduling with `ouro`): no decode row of `inflight` has the
        GATE exit code. So the requests of the next step are known now: tokens of
        `inflight` that do not exit advance one depth; tokens not in `inflight` keep their
        depth; for tokens exiting in `inflight` the decode policy decides (refill: the
        request's next token keeps the row, dropped at completion if the request finished;
        no_refill: the request leaves the cohort). Prompt work and admissions are never
        planned ahead: with a request in its prompt phase or replaying (or any item in
        `inflight`), or a waiting request that could be admitted, this returns None. Outputs
        do not depend on which step a row runs in (batch invariance), so they equal
        synchronous scheduling. The rows themselves are built by `complete_ahead` after
        update, from the exit state it records.
        """
        if not self.exit_mode.delayed and self.exit_mode is not ExitMode.TRACE:
            return None
        if self.queues.waiting and self.admission.head_may_be_admitted():
            return None
        rows_run = inflight.decode
        if inflight.items or rows_run is None:
            return None  # prompt and replay rows are planned by `schedule()` only
        if len(self.queues.running) > self.decode.num_ready:
            return None  # a request in its prompt or replaying
        assert not (rows_run.exit_code == GATE).any(), "async needs exits known a loop ahead"
        leaving = self.decode.lookup(rows_run.request_ids)[rows_run.exit_code == EXIT]
        leaving = leaving[leaving >= 0]
        chosen = self.decode_policy.select_ahead(self.decode, leaving, self.items.max_rows)
        ids = self.decode.ids
        return [ids[row] for row in chosen.tolist()] or None  # type: ignore[misc]

    def complete_ahead(self, request_ids: list[str]) -> SchedulerOutput | None:
        """The `SchedulerOutput` of rows chosen by `select_ahead`, built after the previous
        step's update from the recorded exit state. Requests finished or aborted since (or
        preempted by growth) are dropped (None if none is left); the output carries the
        releases and announcements pending now."""
        # Decode tokens entering a new block need it in every plane first (incremental KV);
        # growth may preempt, and a preempted request leaves RUNNING.
        self.admission.grow_running()
        rows = self.decode.lookup(tuple(request_ids))
        rows = rows[rows >= 0]
        rows = rows[self.decode.ready[rows]]
        if not len(rows):
            return None  # pending preemptions and releases travel with the next output
        self.items.prompt_steps_in_a_row = 0
        return self.output(StepWork([], self.items.decode_rows(np.asarray(rows))))
