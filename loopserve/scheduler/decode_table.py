"""The persistent decode batch: each running request's decode token in flight, as columns.

A looped model runs one core call per loop, so the scheduler plans every decode token once
per loop. Instead of one object per token per loop, `DecodeTable` keeps one row per running
request for its whole stay in RUNNING (rows are reused once it leaves): the token's position,
the token id fed back at loop 0, and its exit state (`exit.columns.ExitColumns`: depth, CDF,
survival, committed exit). A step selects rows and builds `DecodeRows` columns from them
with a few array operations; `update` folds the executor's hazards and exits back the same
way, and only tokens that exit touch their `Request` (to append the token).

A row is `ready` while its request has a decode token in flight: from the first token (or an
import, or the end of a recompute replay) until the request leaves RUNNING. A request
swapped out mid-token parks its token's exit state here (`park`) and resumes it when swapped
back in (`unpark`). `cohort` marks the current cohort of the no_refill policy.

Coda batching in time (`StepRules.defers_leave`): a token whose loops exited is `held`
(`hold`): not ready, its exit state kept, `waited` counting the steps since its exit, until
a `LeaveBatcher` (scheduler/leave_batch.py) puts it in a step's `LeaveRows`; its sampled
token then starts the next token as an exit does without batching. Torch-free.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from loopserve.contracts import DecodeRows, LeaveRows
from loopserve.exit import ExitMode
from loopserve.exit.columns import ExitColumns
from loopserve.scheduler.brownout import token_max_loops
from loopserve.scheduler.request import Request


class ParkedToken(NamedTuple):
    """The exit state of a token swapped out between two of its loops."""

    depth: int
    cdf: float
    survival: float
    exit_after: int
    held: bool = False  # its loops exited; it waits for its leave


class DecodeTable:
    def __init__(self, capacity: int, *, exit_mode: ExitMode) -> None:
        self.capacity = capacity
        self.exit = ExitColumns(exit_mode, capacity)
        self.requests: list[Request | None] = [None] * capacity
        self.ids: list[str | None] = [None] * capacity
        self.row_of: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self.ready = np.zeros(capacity, bool)
        self.cohort = np.zeros(capacity, bool)
        self.held = np.zeros(capacity, bool)  # exited, waiting for its leave (coda batching)
        self.waited = np.zeros(capacity, np.int64)  # steps a held token has waited
        self.awaiting = np.zeros(capacity, bool)  # started ahead of its fed-back token
        self.held_loops = np.zeros(capacity, np.int64)  # loops the held token ran
        self.position = np.zeros(capacity, np.int64)
        self.token_id = np.zeros(capacity, np.int64)
        self.order = np.zeros(capacity, np.int64)  # admission order: oldest first
        self._num_added = 0
        self._parked: dict[str, ParkedToken] = {}
        # Overload brownout (`scheduler/brownout.py`): loops taken from eligible requests'
        # max_loops for the tokens that start now (0: none); set by the scheduler per step.
        self.brownout_cut = 0
        self.brownout = False  # the engine runs brownout: eligible tokens get a budget

    # ---- membership -------------------------------------------------------------------------

    def add(self, request: Request) -> int:
        """Give a request entering RUNNING its row (no token in flight yet)."""
        if not self._free:
            raise RuntimeError(f"decode table full ({self.capacity} running requests)")
        row = self._free.pop()
        self.requests[row] = request
        self.ids[row] = request.request_id
        self.row_of[request.request_id] = row
        self.exit.set_rule(row, request.exit_rule)
        self.order[row] = self._num_added
        self._num_added += 1
        return row

    def remove(self, request_id: str) -> None:
        """The request left RUNNING (finished, aborted, preempted): its row is free."""
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        request = self.requests[row]
        if self.awaiting[row] and self.brownout and request is not None:
            # Its token started ahead never ran to its exit: its budget goes with it.
            if request.params.brownout_floor is not None and request.loop_budgets:
                request.loop_budgets.pop()
        self.requests[row] = self.ids[row] = None
        self.ready[row] = self.cohort[row] = self.held[row] = self.awaiting[row] = False
        self._free.append(row)

    @property
    def num_ready(self) -> int:
        return int(np.count_nonzero(self.ready))

    def lookup(self, request_ids: tuple[str, ...]) -> np.ndarray:
        """Each request's row, -1 for a request no longer here."""
        row_of = self.row_of
        return np.fromiter((row_of.get(rid, -1) for rid in request_ids), np.int64, len(request_ids))

    # ---- tokens -----------------------------------------------------------------------------

    def start_token(self, request: Request, *, resume: bool = False) -> None:
        """The request's next decode token (its last output token, fed back) starts at loop 0
        (`resume`: a parked token coming back, which keeps the loop budget it started with)."""
        row = self.row_of[request.request_id]
        self.position[row] = request.next_position
        self.token_id[row] = request.output_token_ids[-1]
        trace = request.trace_loops(len(request.output_token_ids))
        self.exit.start(row, self.exit.trace_exit_after(row, trace))
        self.ready[row] = True
        self.held[row] = False
        if self.brownout:
            self._budget([row], [request], resume=resume)

    def start_tokens(
        self, rows: list[int], requests: list[Request], *, ahead: bool = False
    ) -> None:
        """`start_token` for many rows at once (the tokens that just exited, continuing).
        `ahead`: the rows are held and their leave runs in this step; their next tokens
        start in the same step, at the position after the held token, fed back the token
        the leave samples (`token_id` -1 and `awaiting` until the results come)."""
        if not rows:
            return
        index = np.array(rows, np.int64)
        after = int(ahead)
        self.position[index] = [r.next_position + after for r in requests]
        if ahead:
            self.token_id[index] = -1
            self.awaiting[index] = True
        else:
            self.token_id[index] = [r.output_token_ids[-1] for r in requests]
        if self.exit.mode is ExitMode.TRACE:
            traces = [r.trace_loops(len(r.output_token_ids) + after) for r in requests]
            self.exit.start(index, self.exit.trace_exits_after(index, np.array(traces, np.int64)))
        else:
            self.exit.start(index, -1)
        self.ready[index] = True
        self.held[index] = False
        if self.brownout:
            self._budget(rows, requests)

    def _budget(self, rows: list[int], requests: list[Request], *, resume: bool = False) -> None:
        """The loop budget of eligible requests' tokens that start (`brownout_floor` set):
        their max_loops at the current level, recorded on the request (`resume`: a parked
        token coming back keeps the budget it started with)."""
        exit = self.exit
        for row, request in zip(rows, requests):
            floor = request.params.brownout_floor
            if floor is None:
                continue
            rule = request.exit_rule
            if resume and request.loop_budgets:
                budget = request.loop_budgets[-1]
            else:
                budget = token_max_loops(rule.max_loops, rule.min_loops, floor, self.brownout_cut)
                request.loop_budgets.append(budget)
            exit.max_loops[row] = budget
            exit.can_exit_early[row] = rule.threshold < 1.0 and rule.min_loops < budget

    def hold(self, rows: np.ndarray) -> None:
        """These rows' tokens exited (their loops are recorded): they wait for their leave."""
        self.ready[rows] = False
        self.held[rows] = True
        self.waited[rows] = 0
        self.held_loops[rows] = self.exit.depth[rows]

    def leave_rows(self, rows: np.ndarray) -> LeaveRows:
        """The `LeaveRows` of these held rows (they stay held until their tokens come)."""
        ids = self.ids
        return LeaveRows(
            tuple([ids[row] for row in rows.tolist()]),  # type: ignore[misc]
            self.position[rows],
            self.held_loops[rows] - 1,
        )

    def stop_token(self, request_id: str) -> None:
        """The request has no token that may run (a recompute replay comes first)."""
        self.ready[self.row_of[request_id]] = False

    def park(self, request: Request) -> None:
        """Keep the exit state of the request's token in flight while it is swapped out."""
        row = self.row_of[request.request_id]
        if self.awaiting[row]:  # its held token's leave never ran: it parks as held
            self._parked[request.request_id] = ParkedToken(
                int(self.held_loops[row]), 0.0, 0.0, -1, held=True
            )
        elif self.ready[row] or self.held[row]:
            exit = self.exit
            self._parked[request.request_id] = ParkedToken(
                int(exit.depth[row]),
                float(exit.cdf[row]),
                float(exit.survival[row]),
                int(exit.exit_after[row]),
                bool(self.held[row]),
            )

    def unpark(self, request: Request) -> bool:
        """Resume a parked token in the request's (new) row; False if none was parked."""
        parked = self._parked.pop(request.request_id, None)
        if parked is None:
            return False
        row = self.row_of[request.request_id]
        self.start_token(request, resume=True)
        exit = self.exit
        exit.depth[row], exit.cdf[row], exit.survival[row], exit.exit_after[row] = parked[:4]
        if parked.held:  # it exited before the swap: it waits for its leave again
            self.hold(np.array([row], np.int64))
        return True

    def forget(self, request_id: str) -> None:
        """A parked request finished while waiting."""
        self._parked.pop(request_id, None)

    def depth_of(self, request_id: str) -> int | None:
        """The loop the request's token in flight runs next (None: no token in flight)."""
        row = self.row_of.get(request_id)
        return None if row is None or not self.ready[row] else int(self.exit.depth[row])

    def is_held(self, request_id: str) -> bool:
        """The request's token exited and waits for its leave (coda batching)."""
        row = self.row_of.get(request_id)
        return row is not None and bool(self.held[row])

    # ---- steps ------------------------------------------------------------------------------

    def oldest_first(self, rows: np.ndarray) -> np.ndarray:
        return rows[np.argsort(self.order[rows], kind="stable")]

    def decode_rows(self, rows: np.ndarray) -> DecodeRows:
        """The `DecodeRows` of one loop of these rows' tokens (copies: the table moves on)."""
        plan = self.exit.plan(rows)
        ids = self.ids
        return DecodeRows(
            tuple([ids[row] for row in rows.tolist()]),  # type: ignore[misc]
            self.position[rows],
            self.exit.depth[rows],
            self.token_id[rows],
            plan.exit_code,
            plan.needs_gate,
            plan.cdf_before,
            plan.survival_before,
            plan.threshold,
        )

    def rows_entering_a_block(self, block_size: int) -> np.ndarray:
        """Rows whose token is about to write the first position of a block, oldest first:
        the only ones that may need KV growth before the step."""
        candidates = (
            self.ready & (self.exit.depth == 0) & (self.position % block_size == 0)
        ).nonzero()[0]
        return self.oldest_first(candidates)

    def check_invariants(self) -> None:
        assert len(self.row_of) + len(self._free) == self.capacity, "decode rows leaked"
        for request_id, row in self.row_of.items():
            assert self.ids[row] == request_id, f"row {row} is not {request_id}'s"
        free = np.array(self._free, np.int64)
        assert not self.ready[free].any() and not self.cohort[free].any(), "a free row is live"
        assert not self.held[free].any(), "a free row waits for its leave"
        assert not (self.ready & self.held).any(), "a held token is also ready"
