"""The tools' shared workloads: one arms table, one exit distribution, one window ITL."""

from __future__ import annotations

import numpy as np
import pytest

from loopserve.errors import ConfigError
from loopserve.workloads.arms import ARMS, PROMPT_ARMS, SIM_POLICIES, get_arm, prompt_arm_args
from loopserve.workloads.exits import exit_distribution, exit_probabilities
from loopserve.workloads.metrics import window_gaps


def test_mixed_means_per_depth_prompt_items_in_the_decode_call_everywhere():
    from loopserve.bench.throughput import ARMS as THROUGHPUT_ARMS
    from loopserve.sim.sweep import ARMS as SIM_ARMS

    expected = {"prefill_mode": "per_depth", "mixed_prefill_decode": True}
    assert ARMS["mixed"].engine_args == expected
    assert prompt_arm_args("mixed") == expected
    assert SIM_ARMS["mixed"].engine_args == expected
    assert prompt_arm_args("wavefront_mixed") == {
        "prefill_mode": "wavefront",
        "mixed_prefill_decode": True,
    }
    assert [a.name for a in THROUGHPUT_ARMS] == ["full_depth", "no_refill", "refill"]
    assert [(a.mode, a.full_depth) for a in THROUGHPUT_ARMS] == [
        ("refill", True),
        ("no_refill", False),
        ("refill", False),
    ]
    assert SIM_ARMS["full_depth"].exit_dist == "full" and SIM_ARMS["refill"].exit_dist is None
    assert set(PROMPT_ARMS) | set(SIM_POLICIES) == set(ARMS)
    with pytest.raises(ConfigError):
        get_arm("refill", PROMPT_ARMS)


def test_ouro_distribution_is_the_measured_gate_and_one_parser_serves_both_tools():
    assert exit_probabilities("ouro_1p4b_t0.5", 4) == (0.0, 0.043, 0.877, 0.080)
    assert exit_distribution("ouro_1p4b_t0.5", 4).mean_loops == pytest.approx(
        2 * 0.043 + 3 * 0.877 + 4 * 0.080
    )
    assert exit_probabilities("uniform", 4) == (0.25, 0.25, 0.25, 0.25)
    with pytest.raises(ConfigError):
        exit_probabilities("probs:1,1,1,1", 4)  # the throughput bench takes names only
    assert exit_distribution("probs:1,1,2", 3).probs == (0.25, 0.25, 0.5)


def test_window_gaps_counts_only_gaps_ending_inside_the_window():
    token_times = [[0.0, 1.0, 3.0, 6.0], [2.5, 2.7], [10.0]]
    window = window_gaps(token_times, 1.0, 6.0)
    # request 0: gaps ending at 3.0 (2.0) and 6.0 (3.0); request 1: 0.2; request 2: none
    assert window.gaps_s == pytest.approx([2.0, 3.0, 0.2])
    assert window.per_request_mean_s == pytest.approx([2.5, 0.2])
    assert window.num_tokens == 4
    assert np.isclose(sum(window.gaps_s), 5.2)
