"""Overload brownout (`scheduler/brownout.py`): the level follows the waiting queue with
hysteresis, eligible requests' new decode tokens run lowered budgets (never below their
floor, never above their own max_loops), other requests are untouched, and every request
equals the dense reference given the budgets its tokens recorded; below the threshold it
never engages."""

from __future__ import annotations

import random

import pytest

from loopserve.errors import ConfigError
from loopserve.reference import generate
from loopserve.sampling_params import SamplingParams
from loopserve.scheduler.brownout import Brownout, token_max_loops
from tests.engine_utils import make_engine, run_steps


def test_the_level_follows_the_queue_with_hysteresis_and_dwell():
    governor = Brownout(waiting_high=4, waiting_low=1, step_loops=1, max_level=2, dwell_steps=3)
    seen = []
    for waiting in [9] * 9 + [3] * 5 + [1] * 7:
        governor.observe(waiting)
        seen.append(governor.level)
    # up one level at most every 3 steps, to the cap; between low and high it holds; at low
    # it comes back a level (3 steps after the last change have passed) every 3 steps
    assert seen == [0, 0, 1, 1, 1, 2, 2, 2, 2] + [2] * 5 + [1, 1, 1, 0, 0, 0, 0]
    assert governor.num_changes == 4
    assert not Brownout(waiting_high=0).observe(100)  # off
    assert token_max_loops(4, 1, 2, cut=3) == 2  # the floor holds
    assert token_max_loops(4, 3, 1, cut=3) == 3  # so does min_loops
    assert token_max_loops(2, 1, 3, cut=1) == 2  # never above the request's own max
    assert token_max_loops(4, 1, None, cut=3) == 4  # not eligible


def _workload(seed, count, *, floor_every=2):
    rng = random.Random(seed)
    work = []
    for i in range(count):
        prompt = [rng.randrange(5, 200) for _ in range(rng.choice([3, 9, 17]))]
        params = SamplingParams(
            max_tokens=rng.randrange(4, 10), temperature=rng.choice([0.0, 0.8]), seed=100 + i,
            exit_threshold=rng.choice([0.6, 1.0]), ignore_eos=True,
            brownout_floor=1 if i % floor_every == 0 else None,
        )  # fmt: skip
        work.append((f"b{i}", prompt, params, i // 4))
    return work


def _budgets_seen(engine, seen):
    for request_id, request in engine.scheduler.requests.items():
        seen[request_id] = list(request.loop_budgets)


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_overload_lowers_eligible_budgets_and_every_request_equals_its_reference(tiny_dir, layout):
    engine = make_engine(tiny_dir, layout=layout, max_num_seqs=2, brownout_waiting_high=3,
                         brownout_waiting_low=1, brownout_dwell_steps=2,
                         brownout_step_loops=1, brownout_max_level=3)  # fmt: skip
    work = _workload(7, 16)
    budgets: dict[str, list[int]] = {}
    levels = []

    def on_step(engine):
        _budgets_seen(engine, budgets)
        levels.append(engine.scheduler.brownout.level)

    finished = run_steps(engine, work, on_step=on_step)
    assert max(levels) >= 2 and levels[-1] < max(levels)  # engaged, then eased as it drained
    lowered = 0
    for request_id, prompt, params, _ in work:
        out = finished[request_id]
        own = budgets.get(request_id, [])
        if params.brownout_floor is None:
            assert own == []  # never budgeted
        else:
            assert len(own) == len(out.token_ids) - 1  # one budget per decode token
            assert all(1 <= b <= 4 for b in own)
            assert all(d <= b for d, b in zip(out.exit_depths[1:], own))
            lowered += sum(b < 4 for b in own)
        ref = generate(engine.model, prompt, params, layout=layout,
                       loop_budgets=own or None)  # fmt: skip
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), request_id
    assert lowered > 0
    stats = engine.stats
    assert stats.num_brownout_changes >= 2


def test_below_the_threshold_brownout_never_engages(tiny_dir):
    engine = make_engine(tiny_dir, max_num_seqs=4, brownout_waiting_high=6,
                         brownout_waiting_low=1, brownout_dwell_steps=1)  # fmt: skip
    work = _workload(3, 6, floor_every=1)
    budgets: dict[str, list[int]] = {}
    finished = run_steps(engine, work, on_step=lambda e: _budgets_seen(e, budgets))
    assert engine.stats.num_brownout_changes == 0 and engine.stats.brownout_level == 0
    for request_id, *_ in work:
        assert all(b == 4 for b in budgets[request_id])  # the request's own max_loops
        assert finished[request_id].finish_reason == "length"


def test_bad_brownout_settings_are_start_up_errors(tiny_dir):
    with pytest.raises(ConfigError, match="brownout_waiting_low"):
        make_engine(tiny_dir, brownout_waiting_high=2, brownout_waiting_low=2)
    with pytest.raises(ConfigError, match="brownout_dwell_steps"):
        make_engine(tiny_dir, brownout_waiting_high=2, brownout_dwell_steps=0)


def test_the_simulated_study_gains_goodput_in_overload_and_never_engages_below_it():
    """`loopserve simulate --scenario brownout`'s points, small: Ouro-1.4B on a simulated
    H200, 120 synthetic requests (256 prompt and output tokens, +-50%). Well below capacity brownout never moves (counted); far
    above it, goodput with brownout exceeds goodput without, with loops given up."""
    from loopserve.sim.brownout import StudySetup, goodput_point
    from loopserve.sim.cost_model import OURO_1P4B
    from loopserve.sim.hardware import get_device_profile

    setup = StudySetup(OURO_1P4B, get_device_profile("h200"),
                       {"mode": "refill", "exit_mode": "trace", "max_num_seqs": 64},
                       num_requests=120, dataset="synthetic")  # fmt: skip
    calm = goodput_point(setup, 10.0, brownout=True)
    assert calm.level_changes == 0 and calm.max_level == 0
    assert calm.slo_met == calm.num_requests
    off = goodput_point(setup, 120.0, brownout=False)
    on = goodput_point(setup, 120.0, brownout=True)
    assert on.level_changes > 0 and on.max_level > 0
    assert on.slo_met > off.slo_met and on.goodput > off.goodput
    assert on.mean_loops_per_token < off.mean_loops_per_token
