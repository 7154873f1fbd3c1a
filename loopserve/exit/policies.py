"""Exit policies as pure functions and a tiny per-token state machine.

Depth `d` is 0-based; a token that exits after loop `d` used `loops = d + 1`. The gate output
of loop `d` is read as the hazard `λ_d`; `p_exit_d = λ_d · Π_{j<d}(1-λ_j)` and
`cdf_d = Σ_{j<=d} p_exit_j`.

- `ouro`: exit after loop d when loops >= max_loops, or threshold < 1 and loops >= min_loops
  and cdf_d >= threshold.
- `ouro_delayed`: when the CDF crosses at loop d (loops >= min_loops) the token exits after
  loop d+1, so loop d+1 can be submitted before the signal is read.
- `random_lookahead`: identical rule to `ouro_delayed`, but the hazards come from a seeded,
  untrained lookahead head instead of the trained gate (the runner picks the head).
- `trace`: loops replayed from a per-request list; no gate is computed.
- `criterion`: a convergence criterion's score (Huginn's, `criteria.py`) checked after every
  loop from `min_loops` on against the request's threshold (`criterion_exits`); each loop's
  check stands alone (nothing is folded across loops) and a token that never fires runs
  `max_loops`. No signal is read below `min_loops`, and none for prompts: a first token whose
  loop outputs exist uses `max_loops` (the family runs its prompts to the request's bound).
- `criterion_delayed`: the criterion's one-loop-delayed variant (as `ouro_delayed` is for
  `ouro`): when the criterion fires after loop d (loops >= min_loops) the token runs one more
  loop and exits after loop d+1 (or at `max_loops`), so every loop's exit is known before the
  loop runs and async scheduling can plan the next step while this one executes. Tokens use
  one loop more than under `criterion` wherever it fired before `max_loops`; `criterion`
  (the authors' rule) stays the default.

This module is the single source of exit decisions. An exit is decided once, by whoever
holds the hazard: the executor (`ModelRunner`, `SimExecutor`) calls `loop_exits` for a decode
loop and `choose_exit_from_hazards` for a first token, and reports the result; the scheduler
only records it (`TokenExit.record`: fold the hazard into the CDF, commit a delayed exit)
without re-deriving it. The dense reference runs the same functions (`TokenExit.observe`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple


class ExitMode(str, enum.Enum):
    OURO = "ouro"
    OURO_DELAYED = "ouro_delayed"
    RANDOM_LOOKAHEAD = "random_lookahead"
    TRACE = "trace"
    CRITERION = "criterion"
    CRITERION_DELAYED = "criterion_delayed"

    @property
    def delayed(self) -> bool:
        """A signal at loop d commits the exit after loop d+1 (each exit known a loop ahead)."""
        return self in (
            ExitMode.OURO_DELAYED,
            ExitMode.RANDOM_LOOKAHEAD,
            ExitMode.CRITERION_DELAYED,
        )

    @property
    def reads_criterion(self) -> bool:
        """The signal is a convergence criterion that fires or not (no CDF, nothing read
        below `min_loops`)."""
        return self in (ExitMode.CRITERION, ExitMode.CRITERION_DELAYED)

    @property
    def uses_gate(self) -> bool:
        """Some loop reads an exit signal (a hazard, or a criterion's score)."""
        return self is not ExitMode.TRACE

    @property
    def folds_hazards(self) -> bool:
        """The signal is a hazard folded into the exit CDF (`next_gate_state`)."""
        return self in (ExitMode.OURO, ExitMode.OURO_DELAYED, ExitMode.RANDOM_LOOKAHEAD)


# The convergence criteria (`exit/criteria.py`) whose check runs the coda (reads the
# next-token distribution); the others read only the recurrent states. Torch-free here for
# the scheduler; tests/test_speculation.py checks it against the criteria themselves.
CRITERIA_READING_LOGITS = frozenset({"entropy-diff", "kl", "minp-kl", "argmax-stability"})


@dataclass(frozen=True, slots=True)
class ExitRule:
    """Per-request bounds, already resolved against the model depth."""

    min_loops: int
    max_loops: int
    threshold: float = 1.0

    @property
    def can_exit_early(self) -> bool:
        return self.threshold < 1.0 and self.min_loops < self.max_loops


class GateState(NamedTuple):
    """Running CDF of one token after some loops. (NamedTuples here and in `LoopPlan`: built
    once per token loop on the scheduler's hot path, and cheaper than frozen dataclasses.)"""

    cdf: float = 0.0
    survival: float = 1.0


def next_gate_state(state: GateState, hazard: float) -> GateState:
    """Fold the hazard of one more loop into the running CDF."""
    p_exit = hazard * state.survival
    return GateState(cdf=state.cdf + p_exit, survival=state.survival * (1.0 - hazard))


def crosses(rule: ExitRule, loops: int, cdf: float) -> bool:
    """True when the CDF signal allows an exit after `loops` loops.

    Threshold exactly 1.0 never exits early, even if a sigmoid rounds to 1.
    """
    return rule.threshold < 1.0 and loops >= rule.min_loops and cdf >= rule.threshold


def loop_exits(
    exit_now: bool | None, before: GateState, hazard: float | None, threshold: float
) -> bool:
    """The exit decision of one decode loop, given its plan (`LoopPlan` fields).

    `exit_now` True/False is already decided (committed exit, or no exit possible at this
    loop); None means the gate of this loop decides: exit iff the CDF folded with `hazard`
    reaches `threshold` (the plan guarantees threshold < 1 and loops >= min_loops then).
    """
    if exit_now is not None:
        return exit_now
    assert hazard is not None, "a gate-decided loop needs its hazard"
    return next_gate_state(before, hazard).cdf >= threshold


def criterion_exits(exit_now: bool | None, fired: bool | None) -> bool:
    """The exit decision of one decode loop under `criterion`: `exit_now` when the plan
    decided it, else whether this loop's criterion fired (its score crossed the request's
    threshold: the criterion's own comparison, `criteria.py`)."""
    if exit_now is not None:
        return exit_now
    assert fired is not None, "a criterion-decided loop needs its check"
    return fired


class LoopPlan(NamedTuple):
    """What the runner must do for one token's loop at one depth.

    `exit_now` is True (run the coda after this loop), False (continue), or None: decided by
    the gate of this loop — exit iff `next_gate_state(state_before, λ).cdf >= threshold`.
    """

    needs_gate: bool
    exit_now: bool | None
    state_before: GateState
    threshold: float


class TokenExit:
    """Exit state machine of one decode token; `plan()` before a loop, `observe()` after it."""

    __slots__ = (
        "mode", "rule", "trace_loops", "state", "depth", "exit_after_depth", "exited", "_plan"
    )  # fmt: skip

    def __init__(self, mode: ExitMode, rule: ExitRule, trace_loops: int | None = None) -> None:
        self.mode = mode
        self.rule = rule
        self.reset(trace_loops)

    def reset(self, trace_loops: int | None = None) -> None:
        """Start the next token of the same request (same mode and rule) before its loop 0."""
        self.state = GateState()
        self.depth = 0  # the next loop to run
        self.exited = False
        # A depth the token is already committed to exit after (trace, delayed crossing).
        self.exit_after_depth: int | None = None
        if self.mode is ExitMode.TRACE:
            if trace_loops is None:
                raise ValueError("trace exit mode needs trace_loops")
            loops = min(max(trace_loops, self.rule.min_loops), self.rule.max_loops)
            self.exit_after_depth = loops - 1
        self.trace_loops = trace_loops
        self._plan: LoopPlan | None = None  # plan of the current depth, computed once

    def plan(self) -> LoopPlan:
        if self._plan is None:
            self._plan = self._make_plan()
        return self._plan

    def _make_plan(self) -> LoopPlan:
        loops = self.depth + 1
        committed = loops >= self.rule.max_loops or self.exit_after_depth == self.depth
        if committed:
            return LoopPlan(False, True, self.state, self.rule.threshold)
        if self.mode is ExitMode.TRACE or not self.rule.can_exit_early:
            return LoopPlan(False, False, self.state, self.rule.threshold)
        if self.mode.delayed:
            # The gate of this loop can only commit an exit after the next loop; a
            # criterion reads nothing below min_loops.
            reads = self.exit_after_depth is None and (
                self.mode.folds_hazards or loops >= self.rule.min_loops
            )
            return LoopPlan(reads, False, self.state, self.rule.threshold)
        if loops < self.rule.min_loops:
            # Below min_loops the CDF still accumulates, so the gate is still needed; a
            # criterion reads nothing there.
            return LoopPlan(self.mode.folds_hazards, False, self.state, self.rule.threshold)
        return LoopPlan(True, None, self.state, self.rule.threshold)

    def record(self, hazard: float | None, exited: bool) -> None:
        """Record the loop just run: its hazard (when the plan asked for one; under the
        criterion modes 1.0 where the criterion fired) and the exit the executor decided.
        Advances the CDF and commits a delayed exit; never re-decides."""
        assert not self.exited, "token already exited"
        plan = self.plan()
        if plan.needs_gate and self.mode is ExitMode.CRITERION_DELAYED:
            assert hazard is not None, "plan needed a criterion check"
            if hazard >= 1.0:  # fired (the plan reads it only from min_loops on)
                self.exit_after_depth = self.depth + 1
        if plan.needs_gate and self.mode.folds_hazards:
            assert hazard is not None, "plan needed a gate value"
            self.state = next_gate_state(self.state, hazard)
            # Delayed modes: a crossing at this loop commits the exit after the next one.
            if self.mode.delayed and crosses(self.rule, self.depth + 1, self.state.cdf):
                self.exit_after_depth = self.depth + 1
        self.depth += 1
        self.exited = exited
        self._plan = None

    def observe(self, hazard: float | None) -> bool:
        """Decide this loop's exit with `loop_exits` and record it (for callers that hold the
        hazard themselves: the dense reference and `choose_exit_from_hazards`)."""
        plan = self.plan()
        if self.mode.reads_criterion:  # `hazard`: 1.0 where the criterion fired
            exited = criterion_exits(plan.exit_now, None if hazard is None else hazard >= 1.0)
        else:
            exited = loop_exits(plan.exit_now, plan.state_before, hazard, plan.threshold)
        self.record(hazard, exited)
        return exited

    @property
    def loops_used(self) -> int:
        assert self.exited
        return self.depth


def choose_exit_from_hazards(
    mode: ExitMode, rule: ExitRule, hazards: list[float] | None, trace_loops: int | None = None
) -> int:
    """Loops used by a token whose every loop output already exists (the first output token).

    Runs the same state machine over precomputed hazards, so prefill and decode agree. Under
    `criterion` prompts read no signal (`hazards` None): the token uses `max_loops`.
    """
    if mode.reads_criterion and hazards is None:
        return rule.max_loops
    token = TokenExit(mode, rule, trace_loops)
    while True:
        plan = token.plan()
        hazard = hazards[token.depth] if plan.needs_gate else None
        if token.observe(hazard):
            return token.loops_used
