"""Coda batching in time: when the tokens that exited run their once-per-token work.

A looped family's once-per-token work (the leave: Huginn's coda layers and the lm_head;
sampling; then the next token's prelude at its loop 0) reads its own weights once per call
that has any such row. Under refill, exits spread over every step, so nearly every step pays
that read for a few rows; for a family whose once-per-token layers weigh about a loop
(Huginn-0125: 2 prelude + 2 coda layers against a 4-layer core) that costs more than early
exits save. With batching on (`StepRules.defers_leave`), a token whose loops exit is held
(`DecodeTable.hold`: it keeps its K/V and carried state, runs no loop) and `LeaveBatcher`
decides each step whether the held tokens run their leave now, together:

- when the calls they waited, summed over the held tokens (each counting the coming one),
  reach `once_weight x running rows` (`once_weight`: the once-per-token layers' weight in
  loops, from the family's shape; a held token's call is worth `1 / rows` of a call, the
  leave's weight read `once_weight` calls: the batch runs when waiting has cost as much as
  one more weight read would), or, with `min_rows` set, once that many tokens are held;
- when a token would otherwise wait more than `max_wait` calls (the latency bound);
- when no token has a loop to run (nothing else would move).

The leave runs in the step after the exit at the earliest, and the next token's loop 0 in
the step after its leave, so a token pays at least one extra step; the family's cost decides
whether batching is on (`config.resolve_coda_batching`). Exits, tokens and K/V are the same
as without batching: the leave reads the state the exit loop left. Torch-free.
"""

from __future__ import annotations

import math

import numpy as np

from loopserve.contracts import LeaveRows
from loopserve.scheduler.decode_table import DecodeTable


class LeaveBatcher:
    def __init__(
        self, *, enabled: bool, once_weight: float, max_wait: int, min_rows: int | None
    ) -> None:
        self.enabled = enabled
        self.once_weight = once_weight
        self.max_wait = max_wait
        self.min_rows = min_rows
        self.num_batches = 0  # leave batches run
        self.num_rows = 0  # tokens they carried
        self.num_waited_steps = 0  # steps those tokens were held, each counting its leave's

    def start(self, table: DecodeTable) -> LeaveRows | None:
        """The held tokens whose leave runs this step (`select`). Each request's next token
        starts in the same step, fed back the token its leave samples (KV growth, which runs
        next, gives its position a block), unless the held token is its last (`max_tokens`)."""
        leave = self.select(table)
        if leave is None:
            return None
        rows, requests = [], []
        for row in table.lookup(leave.request_ids).tolist():
            request = table.requests[row]
            assert request is not None
            if len(request.output_token_ids) + 1 < request.params.max_tokens:
                rows.append(row)
                requests.append(request)
        table.start_tokens(rows, requests, ahead=True)
        return leave

    @staticmethod
    def still_held(table: DecodeTable, leave: LeaveRows) -> LeaveRows | None:
        """The leave rows whose requests KV growth left running (a preempted one left the
        table: its held token is parked as held under swap, or recomputed)."""
        kept = table.lookup(leave.request_ids) >= 0
        if kept.all():
            return leave
        return leave.take(kept.nonzero()[0]) if kept.any() else None

    def select(self, table: DecodeTable) -> LeaveRows | None:
        """The held tokens whose leave runs this step (all of them, or none); the others'
        wait grows by one step."""
        if not self.enabled:
            return None
        held = table.held.nonzero()[0]
        if not len(held):
            return None
        if not self._fires(table, held):
            table.waited[held] += 1
            return None
        self.num_batches += 1
        self.num_rows += len(held)
        self.num_waited_steps += int(table.waited[held].sum()) + len(held)
        return table.leave_rows(table.oldest_first(held))

    def _fires(self, table: DecodeTable, held: np.ndarray) -> bool:
        waited = table.waited[held] + 1  # counting this step
        if int(waited.max()) >= self.max_wait or table.num_ready == 0:
            return True
        if self.min_rows is not None:
            return len(held) >= self.min_rows
        running = table.num_ready + len(held)
        return int(waited.sum()) >= math.ceil(self.once_weight * running)
