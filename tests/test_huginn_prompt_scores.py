"""Prompt logprobs at the exit loop for Huginn (`prompt_logprobs_loop='exit'`): each prompt
position scored at the step its criterion fires, as a decode token there would exit, over
the prompt run at r steps (its coda attends to the earlier positions' r-step coda K/V and
its own of that step, which it does not write). Equal to the dense reference
(`huginn_dense.prompt_logprobs_at_exit`) in every prompt arm, for criteria that read logits
and criteria that read states; the r-step K/V that decode reads is left as it was."""

from __future__ import annotations

import pytest
import torch

from loopserve.models.huginn_dense import prompt_logprobs_at_exit
from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopserve.sampling_params import SamplingParams
from tests.engine_utils import make_engine, run_steps
from tests.test_huginn_engine import PROMPT_ARMS, reference

PROMPT = [7, 3, 99, 42, 5, 17, 64, 11, 4, 5, 6, 9, 30]


@pytest.fixture(scope="module")
def huginn_dir(tmp_path_factory):
    return make_tiny_huginn_checkpoint(tmp_path_factory.mktemp("huginn"))


def expected(model, prompt, params, criterion):
    threshold = params.exit_threshold
    if criterion == "argmax-stability":
        threshold = params.exit_stable_steps or 2
    early = params.exit_threshold < 1.0
    return prompt_logprobs_at_exit(
        model, prompt, criterion=criterion if early else "none", threshold=threshold,
        min_steps=params.min_loops - 1, num_steps=params.max_loops,
    )  # fmt: skip


CASES = [  # (criterion, prompt arm, threshold, min_loops, max_loops)
    ("kl", "atomic", 0.03, 1, None),
    ("latent-diff", "per_depth", 0.2, 2, None),
    ("argmax-stability", "wavefront", 0.5, 1, 6),
    ("entropy-diff", "mixed", 0.1, 3, None),
]


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c[:2])) for c in CASES])
def test_exit_loop_scores_equal_the_dense_reference(huginn_dir, case):
    criterion, arm, threshold, min_loops, max_loops = case
    engine = make_engine(
        huginn_dir, exit_criterion=criterion, prefill_chunk_size=5, **PROMPT_ARMS[arm]
    )
    base = dict(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1,
                exit_threshold=threshold, min_loops=min_loops, max_loops=max_loops)  # fmt: skip
    at_exit = SamplingParams(**base, prompt_logprobs_loop="exit")
    at_last = SamplingParams(**base)
    work = [("exit", PROMPT, at_exit, 0), ("last", PROMPT, at_last, 0)]
    finished = run_steps(engine, work)
    out = finished["exit"]
    assert out.error is None and out.prompt_logprobs[0] is None
    want, steps = expected(engine.model, PROMPT, at_exit, criterion)
    got = out.prompt_logprobs[1:]
    assert [entry.loops for entry in got] == steps
    for entry, value in zip(got, want.tolist()):
        assert entry.logprob == pytest.approx(value, abs=1e-4)
    r = max_loops or engine.num_loops
    assert min(steps) < r and max(steps) <= r  # positions scored before their last step
    moved = [a.logprob - b.logprob for a, b in zip(got, finished["last"].prompt_logprobs[1:])]
    assert max(abs(x) for x in moved) > 1e-3  # the exit loop's scores differ from the last's
    # Decode read the prompt's r-step coda K/V, untouched by the scoring leaves.
    ref = reference(engine.model, PROMPT, at_exit, criterion)
    assert (out.token_ids, out.exit_depths) == (ref.tokens, ref.steps)
    assert (finished["last"].token_ids, finished["last"].exit_depths) == (ref.tokens, ref.steps)


def test_the_scoring_leave_writes_no_k_v(huginn_dir):
    """The once planes after a prompt scored at its exit loops equal those of the same prompt
    scored at its last loop, bit for bit (latent-diff: the leave runs once, over the rows'
    states of their exit loops)."""
    planes = []
    for loop in ("exit", "last"):
        engine = make_engine(huginn_dir, exit_criterion="latent-diff")
        params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0,
                                prompt_logprobs_loop=loop, exit_threshold=0.2)  # fmt: skip
        engine.add_request("a", PROMPT, params)
        outputs = []
        while not outputs:  # the prompt's chunks: its K/V and first token
            outputs = engine.step()
        first = outputs[0]
        tables = engine.runner.block_tables.tables["a"]
        once = tables[engine.runner.calls.once_planes[0]]
        slots = torch.tensor([b * 4 + i for b in once for i in range(4)])[: len(PROMPT)]
        planes.append(engine.runner.kv_cache[:, :, slots].clone())
        if loop == "exit":
            steps = [entry.loops for entry in first.prompt_logprobs[1:]]
    assert min(steps) < engine.num_loops  # rows scored before the last step
    assert torch.equal(planes[0], planes[1])
