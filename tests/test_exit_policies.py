"""Exit policies as pure functions: worked examples and edge cases."""

from __future__ import annotations

import pytest

from loopserve.exit import ExitMode, ExitRule, GateState, TokenExit, choose_exit_from_hazards


def run_token(mode: ExitMode, rule: ExitRule, hazards: list[float], trace=None) -> int:
    return choose_exit_from_hazards(mode, rule, hazards, trace)


def test_constant_hazard_point_four_at_threshold_point_six_exits_after_two_loops():
    rule = ExitRule(min_loops=2, max_loops=4, threshold=0.6)
    assert run_token(ExitMode.OURO, rule, [0.4] * 4) == 2


def test_delayed_mode_exits_one_loop_after_the_crossing():
    rule = ExitRule(min_loops=2, max_loops=4, threshold=0.5)
    hazards = [0.3, 0.3, 0.3, 0.3]
    assert run_token(ExitMode.OURO, rule, hazards) == 2
    assert run_token(ExitMode.OURO_DELAYED, rule, hazards) == 3
    assert run_token(ExitMode.RANDOM_LOOKAHEAD, rule, hazards) == 3


def test_threshold_one_never_exits_early_even_with_hazard_one():
    rule = ExitRule(min_loops=1, max_loops=4, threshold=1.0)
    for mode in (ExitMode.OURO, ExitMode.OURO_DELAYED):
        assert run_token(mode, rule, [1.0] * 4) == 4


def test_min_loops_holds_back_an_early_crossing():
    rule = ExitRule(min_loops=3, max_loops=4, threshold=0.1)
    assert run_token(ExitMode.OURO, rule, [0.9, 0.9, 0.9, 0.9]) == 3


def test_max_loops_takes_the_remaining_mass():
    rule = ExitRule(min_loops=1, max_loops=2, threshold=0.99)
    assert run_token(ExitMode.OURO, rule, [0.01, 0.01, 0.01, 0.01]) == 2


def test_delayed_crossing_at_last_allowed_loop_exits_there():
    rule = ExitRule(min_loops=1, max_loops=2, threshold=0.5)
    # Crosses at loop 2 == max_loops: cannot run a third loop.
    assert run_token(ExitMode.OURO_DELAYED, rule, [0.1, 0.9, 0.5, 0.5]) == 2


def test_cdf_accumulates_below_min_loops():
    # cdf after loop 1 = 0.5, after loop 2 = 0.5 + 0.5*0.2 = 0.6 >= 0.55 -> exit at 2.
    rule = ExitRule(min_loops=2, max_loops=4, threshold=0.55)
    assert run_token(ExitMode.OURO, rule, [0.5, 0.2, 0.0, 0.0]) == 2


@pytest.mark.parametrize("trace,expected", [(1, 1), (3, 3), (9, 4), (0, 2)])
def test_trace_replays_loops_clamped_to_bounds(trace, expected):
    rule = ExitRule(min_loops=1 if trace else 2, max_loops=4)
    assert run_token(ExitMode.TRACE, rule, None, trace) == expected


def test_trace_mode_never_asks_for_the_gate():
    token = TokenExit(ExitMode.TRACE, ExitRule(1, 4), trace_loops=3)
    plans = []
    while True:
        plans.append(token.plan())
        if token.observe(None):
            break
    assert [p.needs_gate for p in plans] == [False, False, False]
    assert [p.exit_now for p in plans] == [False, False, True]


def test_ouro_plan_is_conditional_only_from_min_loops():
    token = TokenExit(ExitMode.OURO, ExitRule(2, 4, 0.9))
    first = token.plan()
    assert first.needs_gate and first.exit_now is False
    token.observe(0.1)
    second = token.plan()
    assert second.needs_gate and second.exit_now is None
    assert second.state_before.cdf == pytest.approx(0.1)


def test_criterion_mode_reads_from_min_loops_folds_nothing_and_exits_where_it_fires():
    """`criterion`: no signal below min_loops; from there each loop's check decides alone
    (1.0 stands for "fired"); the CDF never moves."""
    token = TokenExit(ExitMode.CRITERION, ExitRule(2, 6, 0.5))
    plans = []
    for fired in (None, 0.0, 0.0, 1.0):
        plan = token.plan()
        plans.append((plan.needs_gate, plan.exit_now))
        exited = token.observe(fired)
        assert token.state == GateState()
    assert plans == [(False, False), (True, None), (True, None), (True, None)]
    assert exited and token.loops_used == 4


def test_criterion_mode_without_a_fire_runs_max_loops_and_a_first_token_takes_max_loops():
    token = TokenExit(ExitMode.CRITERION, ExitRule(1, 3, 0.5))
    while not token.observe(0.0 if token.plan().needs_gate else None):
        pass
    assert token.loops_used == 3
    assert choose_exit_from_hazards(ExitMode.CRITERION, ExitRule(1, 5, 0.1), None) == 5
