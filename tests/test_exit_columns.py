"""The column form of the exit rules (`exit/columns.py`) equals `TokenExit`, token for token.

The independent source is `TokenExit` (the per-token state machine the dense reference uses):
both run the same random hazard sequences for many tokens at once, and every loop's plan,
every exit decision and every CDF must be identical, bit for bit."""

from __future__ import annotations

import random

import numpy as np
import pytest

from loopserve.exit import ExitMode, ExitRule, TokenExit, criterion_exits, loop_exits
from loopserve.exit.columns import (
    CONTINUE,
    EXIT,
    GATE,
    ExitColumns,
    decide_criterion_exits,
    decide_exits,
)

NUM_LOOPS = 4
CODE = {True: EXIT, False: CONTINUE, None: GATE}


def _run(mode: ExitMode, seed: int, num_tokens: int) -> dict[str, int]:
    rng = random.Random(seed)
    rules = []
    for _ in range(num_tokens):
        low = rng.randint(1, NUM_LOOPS)
        high = rng.randint(low, NUM_LOOPS)
        rules.append(ExitRule(low, high, rng.choice([1.0, 0.2, 0.5, 0.8, 0.999])))
    traces = [rng.randint(1, NUM_LOOPS + 1) for _ in range(num_tokens)]
    trace = mode is ExitMode.TRACE
    tokens = [TokenExit(mode, rule, traces[i] if trace else None) for i, rule in enumerate(rules)]
    columns = ExitColumns(mode, num_tokens)
    rows = np.arange(num_tokens)
    for row, rule in enumerate(rules):
        columns.set_rule(row, rule)
        columns.start(row, columns.trace_exit_after(row, traces[row] if trace else None))
    seen = {"exits": 0, "gated": 0, "gate_decided": 0}
    live = rows
    while len(live):
        plan = columns.plan(live)
        hazards = np.array([rng.choice([0.0, 0.1, 0.35, 0.6, 0.95, 1.0]) for _ in live])
        fires = plan.needs_gate & (hazards >= 1.0)  # under the criterion modes
        if mode.reads_criterion:  # a signal of 1.0 stands for "the criterion fired"
            exited = decide_criterion_exits(plan.exit_code, fires)
        else:
            exited = decide_exits(
                plan.exit_code, plan.cdf_before, plan.survival_before,
                np.where(plan.needs_gate, hazards, np.nan), plan.threshold,
            )  # fmt: skip
        for i, row in enumerate(live):
            token = tokens[row]
            expected = token.plan()
            assert (bool(plan.needs_gate[i]), int(plan.exit_code[i])) == (
                expected.needs_gate, CODE[expected.exit_now],
            ), (mode, rules[row], token.depth)  # fmt: skip
            assert plan.cdf_before[i] == expected.state_before.cdf
            assert plan.survival_before[i] == expected.state_before.survival
            hazard = float(hazards[i]) if expected.needs_gate else None
            if mode.reads_criterion:
                fired = None if hazard is None else hazard >= 1.0
                decided = criterion_exits(expected.exit_now, fired)
                # a criterion reads no signal below min_loops and folds nothing
                assert not expected.needs_gate or token.depth + 1 >= rules[row].min_loops
                assert expected.state_before.cdf == 0.0
            else:
                decided = loop_exits(
                    expected.exit_now, expected.state_before, hazard, expected.threshold
                )
            assert bool(exited[i]) == decided
            token.record(hazard, decided)
            seen["gated"] += expected.needs_gate
            seen["gate_decided"] += expected.exit_now is None
        columns.record(live, plan.needs_gate, hazards, fires)
        for row in live:
            assert columns.cdf[row] == tokens[row].state.cdf
            assert columns.depth[row] == tokens[row].depth
        seen["exits"] += int(exited.sum())
        live = live[~exited]
    assert seen["exits"] == num_tokens  # every token exits within max_loops
    return seen


@pytest.mark.parametrize("mode", list(ExitMode))
def test_column_rules_equal_token_exit_in_every_mode(mode):
    seen = _run(mode, seed=7, num_tokens=300)
    if mode is ExitMode.TRACE:
        assert seen["gated"] == 0
    else:
        assert seen["gated"] > 50  # the gate really ran
    if mode in (ExitMode.OURO, ExitMode.CRITERION):
        assert seen["gate_decided"] > 20  # and really decided exits


def test_criterion_delayed_exits_one_loop_after_its_criterion_fires():
    """The delayed criterion commits at the loop it fires and exits after the next loop,
    reading no signal there; it fires only from min_loops on, and never past max_loops."""

    def loops_used(rule, fired_at):
        token = TokenExit(ExitMode.CRITERION_DELAYED, rule)
        while True:
            plan = token.plan()
            assert plan.exit_now is not None  # every exit is known before its loop runs
            signal = float(token.depth + 1 == fired_at) if plan.needs_gate else None
            if token.observe(signal):
                return token.loops_used

    assert loops_used(ExitRule(1, 8, 0.5), fired_at=3) == 4
    assert loops_used(ExitRule(1, 8, 0.5), fired_at=8) == 8  # max_loops reads no signal
    assert loops_used(ExitRule(1, 4, 0.5), fired_at=4) == 4
    assert loops_used(ExitRule(3, 8, 0.5), fired_at=2) == 8  # below min_loops: not read
    assert loops_used(ExitRule(3, 8, 0.5), fired_at=3) == 4
    authors = TokenExit(ExitMode.CRITERION, ExitRule(1, 8, 0.5))
    while not authors.observe(float(authors.depth + 1 == 3) if authors.plan().needs_gate else None):
        pass
    assert authors.loops_used == 3


@pytest.mark.parametrize("seed", range(25))
def test_column_rules_equal_token_exit_for_random_rules_and_hazards(seed):
    _run(list(ExitMode)[seed % len(ExitMode)], 1000 + seed, num_tokens=40)
