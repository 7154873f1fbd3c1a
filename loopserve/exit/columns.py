"""The exit rules of `policies.py` over columns of decode tokens (numpy), for the hot path.

The scheduler keeps the exit state of every in-flight decode token as columns (one entry per
token: `ExitColumns`) and plans, records and restarts many tokens with a few array
operations instead of one `TokenExit` object per token. The rules are exactly those of
`TokenExit` (tests/test_exit_columns.py drives both over random hazards and compares every
plan, CDF and exit bit for bit): the float arithmetic is the same float64 operations in the
same order. Torch-free.

Plan codes (`ExitPlan.exit_code`): `EXIT` (run the coda after this loop), `CONTINUE`, or
`GATE` (this loop's signal decides: under the CDF modes, exit iff the CDF folded with its
hazard reaches the threshold, `decide_exits`; under `criterion`, exit iff the family's
criterion fired, `decide_criterion_exits`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from loopserve.exit.policies import ExitMode, ExitRule

EXIT, CONTINUE, GATE = 1, 0, -1
NO_EXIT_AFTER = -1  # `exit_after`: no loop committed yet


class ExitPlan(NamedTuple):
    """The plan of one loop for a set of tokens (`LoopPlan` as columns)."""

    exit_code: np.ndarray  # int8: EXIT, CONTINUE or GATE
    needs_gate: np.ndarray  # bool
    cdf_before: np.ndarray  # float64
    survival_before: np.ndarray  # float64
    threshold: np.ndarray  # float64


def decide_exits(
    exit_code: np.ndarray,
    cdf_before: np.ndarray,
    survival_before: np.ndarray,
    hazards: np.ndarray,
    threshold: np.ndarray,
) -> np.ndarray:
    """`loop_exits` over columns: EXIT rows exit, GATE rows exit iff the folded CDF reaches the
    threshold (`hazards` is read only there), CONTINUE rows do not."""
    with np.errstate(invalid="ignore"):  # hazards of rows that read none are NaN
        crossed = cdf_before + hazards * survival_before >= threshold
    return (exit_code == EXIT) | ((exit_code == GATE) & crossed)


def decide_criterion_exits(exit_code: np.ndarray, fired: np.ndarray) -> np.ndarray:
    """`criterion_exits` over columns: EXIT rows exit, GATE rows exit iff their criterion
    fired this loop (`fired`, read only there), CONTINUE rows do not."""
    return (exit_code == EXIT) | ((exit_code == GATE) & fired)


@dataclass
class ExitColumns:
    """Exit state of up to `capacity` in-flight tokens (row r: one request's token in flight).

    Per request (set by `set_rule`): min/max loops and threshold. Per token (`start`): the
    loop to run next (`depth`), the running CDF and survival, and the depth it is committed to
    exit after (`exit_after`: a trace's loops, or a delayed crossing)."""

    mode: ExitMode
    capacity: int

    def __post_init__(self) -> None:
        n = self.capacity
        self.depth = np.zeros(n, np.int64)
        self.cdf = np.zeros(n, np.float64)
        self.survival = np.ones(n, np.float64)
        self.exit_after = np.full(n, NO_EXIT_AFTER, np.int64)
        self.min_loops = np.ones(n, np.int64)
        self.max_loops = np.ones(n, np.int64)
        self.threshold = np.ones(n, np.float64)
        self.can_exit_early = np.zeros(n, bool)

    def set_rule(self, row: int, rule: ExitRule) -> None:
        self.min_loops[row] = rule.min_loops
        self.max_loops[row] = rule.max_loops
        self.threshold[row] = rule.threshold
        self.can_exit_early[row] = rule.can_exit_early

    def start(self, rows: np.ndarray | int, exit_after: np.ndarray | int) -> None:
        """Start the next token of each row before its loop 0 (`TokenExit.reset`);
        `exit_after` is `trace_exit_after` of its trace loops (NO_EXIT_AFTER outside trace)."""
        self.depth[rows] = 0
        self.cdf[rows] = 0.0
        self.survival[rows] = 1.0
        self.exit_after[rows] = exit_after

    def trace_exit_after(self, row: int, trace_loops: int | None) -> int:
        """The depth a trace token exits after: its loops clamped to the rule, minus one."""
        if self.mode is not ExitMode.TRACE:
            return NO_EXIT_AFTER
        if trace_loops is None:
            raise ValueError("trace exit mode needs trace_loops")
        loops = min(max(trace_loops, int(self.min_loops[row])), int(self.max_loops[row]))
        return loops - 1

    def trace_exits_after(self, rows: np.ndarray, trace_loops: np.ndarray) -> np.ndarray:
        """`trace_exit_after` for many rows (trace mode)."""
        clamped = np.minimum(np.maximum(trace_loops, self.min_loops[rows]), self.max_loops[rows])
        return clamped - 1

    def plan(self, rows: np.ndarray) -> ExitPlan:
        """`TokenExit.plan` for each row's next loop."""
        depth = self.depth[rows]
        loops = depth + 1
        exit_after = self.exit_after[rows]
        committed = (loops >= self.max_loops[rows]) | (exit_after == depth)
        code = np.where(committed, EXIT, CONTINUE).astype(np.int8)
        if self.mode is ExitMode.TRACE:
            needs_gate = np.zeros(len(rows), bool)
        else:
            needs_gate = ~committed & self.can_exit_early[rows]
            allowed = loops >= self.min_loops[rows]
            if not self.mode.folds_hazards:  # a criterion reads nothing below min_loops
                needs_gate &= allowed
            if self.mode.delayed:
                # The gate of this loop can only commit an exit after the next one.
                needs_gate &= exit_after == NO_EXIT_AFTER
            else:
                # Below min_loops the CDF still accumulates, but the gate cannot exit yet.
                code[needs_gate & allowed] = GATE
        return ExitPlan(code, needs_gate, self.cdf[rows], self.survival[rows], self.threshold[rows])

    def record(
        self,
        rows: np.ndarray,
        needs_gate: np.ndarray,
        hazards: np.ndarray,
        fired: np.ndarray | None = None,
    ) -> None:
        """`TokenExit.record` for the loop each row just ran: fold the hazards of the rows
        that read one, commit delayed crossings (under `criterion_delayed`, rows whose
        criterion `fired`), advance the depth."""
        if self.mode is ExitMode.CRITERION_DELAYED and needs_gate.any():
            assert fired is not None, "criterion_delayed records which criteria fired"
            firing = rows[needs_gate & fired]  # checked only from min_loops on
            self.exit_after[firing] = self.depth[firing] + 1
        gated = rows[needs_gate] if self.mode.folds_hazards else rows[:0]  # criterion: no CDF
        if len(gated):
            hazard = hazards[needs_gate]
            survival = self.survival[gated]
            cdf = self.cdf[gated] + hazard * survival
            self.cdf[gated] = cdf
            self.survival[gated] = survival * (1.0 - hazard)
            if self.mode.delayed:
                # `crosses`: threshold < 1, loops >= min_loops, cdf >= threshold.
                depth = self.depth[gated]
                threshold = self.threshold[gated]
                crossing = (
                    (threshold < 1.0) & (depth + 1 >= self.min_loops[gated]) & (cdf >= threshold)
                )
                self.exit_after[gated[crossing]] = depth[crossing] + 1
        self.depth[rows] += 1
