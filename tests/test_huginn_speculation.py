"""Self-speculative decoding for Huginn, a family whose leave attends (its coda layers keep
once-plane K/V) and whose exit signal is a convergence criterion: greedy tokens and steps
equal the dense Huginn reference across criteria, both criterion exit modes, decode modes,
prompt arms, preemption and prefix hits; a position's leave for its exit rule never runs
while an older position is still looping (so it reads only final leave K/V); seeded
sampling repeats; what speculation cannot run with is refused at start-up."""

from __future__ import annotations

import dataclasses
import random

import pytest

from loopserve.errors import ConfigError
from loopserve.exit.criteria import CRITERIA, make_criterion
from loopserve.exit.policies import CRITERIA_READING_LOGITS
from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopserve.sampling_params import SamplingParams
from tests.engine_utils import assert_preempted_and_hit, make_engine, run_steps
from tests.test_huginn_engine import PROMPT_ARMS, reference


@pytest.fixture(scope="module")
def huginn_dir(tmp_path_factory):
    return make_tiny_huginn_checkpoint(tmp_path_factory.mktemp("huginn"))


THRESHOLDS = {
    "kl": (0.01, 0.1, 0.03),
    "entropy-diff": (0.03, 0.1),
    "latent-diff": (0.1, 0.2),
    "argmax-stability": (0.5,),
}
# (criterion, exit mode, decode mode, prompt arm, (K, d), min_loops choices). The first
# case's workload is one where a check that reads an older position's non-final leave K/V
# changes a token's steps (found by turning the wait off).
CASES = [
    ("entropy-diff", "criterion", "refill", "atomic", (3, 1), (1,)),
    ("kl", "criterion", "no_refill", "per_depth", (2, 2), (1, 3)),
    ("argmax-stability", "criterion", "refill", "mixed", (3, 1), (1, 3)),
    ("latent-diff", "criterion_delayed", "refill", "wavefront", (2, 1), (1, 3)),
    ("kl", "criterion_delayed", "no_refill", "atomic", (3, 2), (3,)),
]


def spec_work(seed: int, criterion: str, min_loops, count: int = 6):
    rng = random.Random(seed)
    return [
        (
            f"r{i}",
            [rng.randrange(128) for _ in range(rng.choice([3, 9]))],
            SamplingParams(
                max_tokens=12,
                temperature=0.0,
                exit_threshold=rng.choice(THRESHOLDS[criterion]),
                min_loops=rng.choice(min_loops),
                ignore_eos=True,
                speculative=i != 2,  # r2 decodes plainly in the same engine
            ),
            i,
        )
        for i in range(count)
    ]


def watch_leaves(engine, waits: str) -> list[int]:
    """Wrap the runner: per step, a speculating request's items other than its oldest running
    position never run a loop whose leave serves the exit rule (an exit loop, and under
    "check" a checked loop). Returns the per-step counts of a request's positions that ran
    in one step (> 1: overlap)."""
    execute = engine.runner.execute
    running: list[int] = []

    def checked(scheduled):
        by_request: dict[str, list] = {}
        for item in scheduled.items:
            if item.kind.name == "SPEC":
                by_request.setdefault(item.request_id, []).append(item)
        for rows in by_request.values():
            rows.sort(key=lambda item: item.token_start)
            running.append(len(rows))
            for item in rows[1:]:
                assert item.exit_now is False, item
                assert not (waits == "check" and item.needs_gate), item
        return execute(scheduled)

    engine.runner.execute = checked
    return running


def assert_equals_reference(engine, work, finished, criterion, exit_mode):
    for request_id, prompt, params, _ in work:
        ref = reference(
            engine.model, prompt, params, criterion, delayed=exit_mode == "criterion_delayed"
        )
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.tokens, ref.steps), request_id


def assert_released(engine):
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    assert engine.runner.num_live_handles == 0 and engine.runner.coda.spec.drafts == {}
    assert engine.runner.eager.spec_criteria.fields == {}


def test_the_criteria_that_read_logits_are_named_for_the_scheduler():
    """The scheduler's torch-free list equals the criteria's own `needs_logits`."""
    reading = {name for name in CRITERIA if make_criterion(name, vocab_size=8).needs_logits}
    assert reading == CRITERIA_READING_LOGITS


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c[:4])) for c in CASES])
def test_greedy_speculation_equals_the_dense_reference(huginn_dir, case):
    criterion, exit_mode, mode, arm, (num_tokens, draft_loops), min_loops = case
    engine = make_engine(
        huginn_dir, mode=mode, exit_criterion=criterion, exit_mode=exit_mode,
        speculative_tokens=num_tokens, draft_loops=draft_loops, **PROMPT_ARMS[arm],
    )  # fmt: skip
    waits = engine.scheduler.speculator.leave_waits
    assert waits == ("check" if criterion in CRITERIA_READING_LOGITS else "exit")
    running = watch_leaves(engine, waits)
    work = spec_work(5 + CASES.index(case), criterion, min_loops)
    finished = run_steps(engine, work)
    assert_equals_reference(engine, work, finished, criterion, exit_mode)
    stats = engine.scheduler.speculator.stats
    assert stats.drafted > 0 and stats.accepted > 0
    if min_loops != (1,) or waits == "exit":
        assert max(running) > 1  # younger positions ran loops beside an older one
    assert finished["r2"].metrics.spec_drafted == 0
    assert_released(engine)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_speculation_under_preemption_and_prefix_hits(huginn_dir, preemption):
    """9 planes x 8 blocks of 4 positions, about one request's: speculating Huginn requests are preempted (their
    drafts and criteria dropped) and their prompts hit the prefix cache."""
    engine = make_engine(
        huginn_dir, exit_criterion="kl", speculative_tokens=2, draft_loops=1,
        preemption_mode=preemption, num_blocks=9 * 8, swap_space=9 * 10 * 2048,
        enable_prefix_caching=True,
    )  # fmt: skip
    shared = [7, 3, 99, 42, 5, 17, 64, 11]  # two full blocks every prompt shares
    work = [
        (rid, shared + prompt, params, at)
        for rid, prompt, params, at in spec_work(21, "kl", (1, 3), count=4)
    ]
    finished = run_steps(engine, work)
    assert_preempted_and_hit(engine, preemption)
    assert_equals_reference(engine, work, finished, "kl", "criterion")
    assert engine.scheduler.speculator.stats.accepted > 0
    assert_released(engine)


def test_seeded_sampled_speculation_repeats(huginn_dir):
    def run() -> dict[str, tuple[int, ...]]:
        engine = make_engine(huginn_dir, exit_criterion="kl", speculative_tokens=2, draft_loops=1)
        work = [
            (rid, prompt, dataclasses.replace(params, temperature=1.0, seed=i), at)
            for i, (rid, prompt, params, at) in enumerate(spec_work(3, "kl", (1, 3), count=4))
        ]
        finished = run_steps(engine, work)
        assert engine.scheduler.speculator.stats.drafted > 0
        assert_released(engine)
        return {rid: tuple(out.token_ids) for rid, out in finished.items()}

    assert run() == run()


@pytest.mark.parametrize(
    "args, named",
    [
        ({"init_scale": 1.0, "seed": 3}, "init_scale"),
        ({"kv_lookup": "full"}, "kv_lookup='full'"),
    ],
)
def test_speculation_refuses_what_it_cannot_run_for_huginn(huginn_dir, args, named):
    with pytest.raises(ConfigError, match=named):
        make_engine(huginn_dir, speculative_tokens=2, **args)
