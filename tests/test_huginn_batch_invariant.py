"""Batch-invariant mode for Huginn: a request run alone and the same request sharing every
core call with other requests (staggered arrivals, other criteria thresholds, other steps,
a recompute preemption of the target in between) get bit-identical logprobs, tokens, steps
and K/V planes, in every prompt arm, both decode modes and both layouts. A control shows the default
path does change bits in the same situation (where this host's kernels show it)."""

from __future__ import annotations

import random

import pytest
import torch

from loopserve.errors import ConfigError
from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopserve.runner.batch_invariant import RowInvariantLinear, RowInvariantTorchBackend
from loopserve.sampling_params import SamplingParams
from tests.engine_utils import kv_planes, make_engine, run_steps
from tests.test_batch_invariant import host_control

TARGET_PROMPT = [17, 50, 3, 99, 41, 7, 100, 12, 88, 5, 61]
TARGET = SamplingParams(
    max_tokens=10, temperature=0.8, seed=11, exit_threshold=0.3, logprobs=3, ignore_eos=True
)
ARMS = {
    "atomic-refill": dict(prefill_mode="atomic"),
    "per_depth-no_refill": dict(prefill_mode="per_depth", mode="no_refill"),
    "wavefront-refill": dict(prefill_mode="wavefront"),
    "mixed-refill": dict(prefill_mode="per_depth", mixed_prefill_decode=True),
    "shared-atomic": dict(layout="shared", prefill_mode="atomic"),
}


@pytest.fixture(scope="module")
def huginn_dir(tmp_path_factory):
    return make_tiny_huginn_checkpoint(tmp_path_factory.mktemp("huginn-bi"))


def others(shared: bool = False):
    """Five requests beside the target (under SHARED at the model's r: it runs no other)."""
    rng = random.Random(4)
    work = []
    for i in range(5):
        params = SamplingParams(
            max_tokens=rng.randrange(4, 10),
            temperature=rng.choice([0.0, 1.0]),
            seed=200 + i,
            exit_threshold=rng.choice([0.1, 0.3, 1.0]),
            min_loops=rng.choice([1, 3]),
            max_loops=None if shared else rng.choice([None, 6]),
            ignore_eos=True,
        )
        prompt = [rng.randrange(128) for _ in range(rng.choice([2, 6, 13]))]
        work.append((f"o{i}", prompt, params, i))
    return work


def run(huginn_dir, args, *, busy: bool, preempt_after: int | None = None):
    """The target alone or among `others()`; its planes after every token (by position)."""
    engine = make_engine(huginn_dir, exit_criterion="kl", prefill_chunk_size=5,
                         enable_prefix_caching=False, **args)  # fmt: skip
    shared = args.get("layout") == "shared"
    work = [("t", TARGET_PROMPT, TARGET, 2 if busy else 0)] + (others(shared) if busy else [])
    snapshots: dict[int, torch.Tensor] = {}
    shared = []
    preempted = []

    def observe(scheduled, _output) -> None:
        ids = {row.request_id for row in scheduled.row_groups()}
        if "t" in ids and len(ids) > 1:
            shared.append(scheduled.step_id)

    engine.core.add_observer(observe)

    def on_step(engine) -> None:
        request = engine.scheduler.requests.get("t")
        if request is None or request.in_prompt_phase or request.replay is not None:
            return
        if engine.scheduler.token_depth("t") == 0 and "t" in engine.kv.tables:
            snapshots.setdefault(
                request.next_position, kv_planes(engine, "t", request.next_position)
            )
            done = len(request.output_token_ids)
            if preempt_after is not None and not preempted and done >= preempt_after:
                preempted.append(done)
                engine.scheduler.preempt("t")

    finished = run_steps(engine, work, on_step=on_step)
    return engine, finished["t"], snapshots, len(shared)


@pytest.mark.parametrize("arm", list(ARMS))
def test_request_alone_and_among_others_get_identical_bits(huginn_dir, arm):
    args = dict(ARMS[arm], batch_invariant=True)
    engine, alone, alone_planes, _ = run(huginn_dir, args, busy=False)
    assert isinstance(engine.runner.attention, RowInvariantTorchBackend)
    assert isinstance(engine.model.lm_head, RowInvariantLinear)
    engine, busy, busy_planes, shared = run(huginn_dir, args, busy=True, preempt_after=4)
    assert shared > 5  # the target shared core calls with other requests' rows
    assert engine.scheduler.memory_stats.num_preemptions_recompute == 1
    assert min(alone.exit_depths) < 8  # early exits (LAST_EXITED finalize copies)
    assert (busy.token_ids, busy.exit_depths) == (alone.token_ids, alone.exit_depths)
    assert busy.logprobs == alone.logprobs and len(alone.logprobs) == 10
    assert busy_planes.keys() == alone_planes.keys() and len(alone_planes) >= 9
    for position, planes in alone_planes.items():
        assert torch.equal(busy_planes[position], planes), position


def test_default_mode_among_others_changes_bits(huginn_dir):
    """Control: without batch-invariant mode the busy run gives other bits somewhere."""
    _, alone, alone_planes, _ = run(huginn_dir, ARMS["mixed-refill"], busy=False)
    _, busy, busy_planes, _ = run(huginn_dir, ARMS["mixed-refill"], busy=True, preempt_after=4)
    differs = busy.logprobs != alone.logprobs or any(
        not torch.equal(busy_planes[p], planes)
        for p, planes in alone_planes.items()
        if p in busy_planes
    )
    host_control(differs, "a busy default-mode Huginn engine")


def test_batch_invariant_refuses_the_full_lookup(huginn_dir):
    with pytest.raises(ConfigError, match="batch_invariant=True with kv_lookup='full'"):
        make_engine(huginn_dir, batch_invariant=True, kv_lookup="full")
