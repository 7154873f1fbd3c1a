"""A third looped family proves the seam (#31): MomentumLoop (`models/momentum.py`) carries
[h, m] (a running mean of the loop outputs, which its coda reads) and exits on its own
confidence (the coda's largest probability as the hazard). It was added as a model file and
one registry entry; the engine runs it through the one executor, and every feature that
reads only the math serves it: each run below equals the dense reference
(`loopserve.reference`, which calls the same math one request at a time, densely)."""

from __future__ import annotations

import collections
import random

import pytest

from loopserve.models import load_model
from loopserve.models.momentum import MomentumLoopLM
from loopserve.models.momentum_tiny import make_tiny_momentum_checkpoint
from loopserve.models.registry import MOMENTUM, read_config
from loopserve.sampling_params import SamplingParams
from tests.engine_utils import assert_match_reference, make_engine, random_workload, run_steps
from tests.test_pd_handoff import handoff_workload, run_disaggregated


@pytest.fixture(scope="module")
def momentum_dir(tmp_path_factory):
    return make_tiny_momentum_checkpoint(tmp_path_factory.mktemp("momentum"))


def long_decodes(seed: int, count: int = 6):
    """Requests that outgrow a small pool together: 6-12 prompt tokens, 12 output tokens."""
    rng = random.Random(seed)
    return [
        (f"r{i}", [rng.randrange(128) for _ in range(rng.choice([6, 9, 12]))],
         SamplingParams(max_tokens=12, temperature=0.8 if i % 2 else 0.0, seed=40 + i,
                        exit_threshold=rng.choice([0.3, 0.6, 1.0]), ignore_eos=True), i % 3)
        for i in range(count)
    ]  # fmt: skip


def run_and_check(engine, seed: int, *, sampled: bool = True, count: int = 8, work=None):
    if work is None:
        work = random_workload(seed, count, engine.model.config.vocab_size, sampled=sampled)
    finished = run_steps(engine, work, abort_at={"r5": 4})
    work = [w for w in work if w[0] != "r5"]
    depths = assert_match_reference(engine, work, finished)
    seen = collections.Counter(depths)
    assert min(seen) < engine.num_loops and len(seen) >= 2, seen  # early exits, several depths
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    assert engine.runner.num_live_handles == 0 and engine.runner.samplers == {}
    return seen


def test_the_registry_loads_it_as_its_own_family(momentum_dir):
    family, config = read_config(momentum_dir)
    assert family is MOMENTUM and config.num_loops == 4
    model = load_model(momentum_dir)
    assert isinstance(model, MomentumLoopLM)
    assert model.state_width == 2 * config.hidden_size  # not Ouro's H, not Huginn's once planes


CASES = [  # layout, decode mode, prompt arm, exit mode
    ("last_exited", "refill", {"prefill_mode": "atomic"}, "ouro"),
    ("last_exited", "no_refill", {"prefill_mode": "wavefront"}, "trace"),
    ("last_exited", "refill", {"prefill_mode": "per_depth", "mixed_prefill_decode": True}, "ouro"),
    ("shared", "refill", {"prefill_mode": "per_depth"}, "ouro"),
]


@pytest.mark.parametrize("layout, mode, arm, exit_mode", CASES)
def test_the_engine_equals_the_dense_reference(momentum_dir, layout, mode, arm, exit_mode):
    engine = make_engine(momentum_dir, layout=layout, mode=mode, exit_mode=exit_mode, **arm)
    run_and_check(engine, CASES.index((layout, mode, arm, exit_mode)))


@pytest.mark.parametrize(
    "features",
    [
        {"graph_mode": "emulate"},
        {"async_scheduling": True, "exit_mode": "ouro_delayed"},
        {"batch_invariant": True},
        {"speculative_tokens": 2, "draft_loops": 1},
    ],
    ids=["graphs", "async", "batch_invariant", "speculation"],
)
def test_executor_features_serve_it_unchanged(momentum_dir, features):
    engine = make_engine(momentum_dir, **features)
    run_and_check(engine, 21, sampled="speculative_tokens" not in features)
    if "graph_mode" in features:
        assert engine.stats.num_graph_calls > 0


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preempted_requests_resume_to_the_reference(momentum_dir, preemption):
    engine = make_engine(momentum_dir, preemption_mode=preemption, num_blocks=48,
                         swap_space=2048 * 64)  # fmt: skip
    run_and_check(engine, 31, work=long_decodes(31))
    assert engine.scheduler.memory_stats.num_preemptions > 0


def test_handed_off_requests_decode_to_the_reference(momentum_dir):
    prefill, decode = make_engine(momentum_dir), make_engine(momentum_dir, num_blocks=300)
    work = handoff_workload(11, 5, prefill.model.config.vocab_size)
    finished, exported, _ = run_disaggregated(prefill, decode, work)
    assert sorted(exported) == sorted(r for r, *_ in work)
    assert_match_reference(prefill, [(r, p, q, 0) for r, p, q, _ in work], finished)
