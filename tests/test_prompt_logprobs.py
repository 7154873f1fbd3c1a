"""Prompt log-probabilities: computed by the engine in the prompt's own core calls, only for
requests that ask, equal to the dense reference's (the last loop at full depth) in every
prompt arm and layout, with prefix caching, preemption and beside other requests."""

from __future__ import annotations

import math

import pytest

from loopserve.exit import ExitRule
from loopserve.reference import prompt_exit_loops as reference_exit_loops
from loopserve.reference import prompt_logprobs as reference_prompt_logprobs
from loopserve.sampling_params import SamplingParams
from tests.engine_utils import make_engine, run_steps

ARMS = {
    "atomic": dict(prefill_mode="atomic"),
    "per_depth": dict(prefill_mode="per_depth"),
    "wavefront": dict(prefill_mode="wavefront"),
    "mixed": dict(prefill_mode="per_depth", mixed_prefill_decode=True),
}
CHUNKS = dict(prefill_chunk_size=8, max_num_batched_tokens=24, max_num_seqs=4, block_size=4)
PROMPTS = {
    "a": [17, 250, 3, 99, 41, 7, 300, 12, 88, 5, 61, 140, 9, 33, 2, 71, 8, 19, 27],
    "b": [5, 6, 7],
    "c": [44, 1, 250, 250, 8, 91, 100, 3, 14, 15, 92, 65],
}


def check_against_reference(engine, output, prompt, k: int) -> None:
    expected = reference_prompt_logprobs(engine.model, prompt, layout=engine.config.cache.layout)
    got = output.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for position, (entry, want) in enumerate(zip(got[1:], expected[1:]), 1):
        assert entry.token_id == prompt[position]
        assert math.isclose(entry.logprob, want, abs_tol=1e-4), (position, entry.logprob, want)
        assert len(entry.top_logprobs) == k
        values = [lp for _, lp in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert values[0] >= entry.logprob - 1e-6  # the best alternative is at least as likely


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("arm", list(ARMS))
def test_prompt_logprobs_equal_the_dense_reference(tiny_dir, arm, layout):
    if layout == "shared" and arm in ("wavefront", "mixed"):
        pytest.skip("SHARED rejects wavefront and mixed prompt work at start-up")
    engine = make_engine(tiny_dir, layout=layout, **ARMS[arm], **CHUNKS)
    scored = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    plain = SamplingParams(max_tokens=5, temperature=0.8, seed=3, ignore_eos=True)
    work = [("a", PROMPTS["a"], scored, 0), ("b", PROMPTS["b"], plain, 0)]
    work += [("c", PROMPTS["c"], scored, 2)]
    finished = run_steps(engine, work)
    for request_id in ("a", "c"):
        check_against_reference(engine, finished[request_id], PROMPTS[request_id], 2)
    assert finished["b"].prompt_logprobs is None  # only requests that ask pay for it


def test_prefix_cache_and_recompute_keep_prompt_logprobs_whole(tiny_dir):
    engine = make_engine(tiny_dir, enable_prefix_caching=True, **CHUNKS)
    prompt = PROMPTS["a"]
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    run_steps(engine, [("warm", prompt, warm, 0)])  # its pages are cached now
    scored = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    engine.add_request("x", prompt, scored)
    request = engine.scheduler.requests["x"]
    while len(request.output_token_ids) < 3:
        engine.step()
    engine.scheduler.preempt("x")  # recompute: the prompt runs again
    finished = run_steps(engine, [])
    out = finished["x"]
    check_against_reference(engine, out, prompt, 1)
    # The warm request's pages serve 16 positions (the last prompt position always runs);
    # their scores come from the stored last-loop outputs.
    assert out.metrics.num_cached_prompt_tokens == 16
    assert engine.scheduler.memory_stats.num_preemptions_recompute == 1


def test_multiple_choice_context_is_prefilled_once_for_all_its_choices(tiny_dir):
    """lm-eval's multiple-choice shape: one context, several continuations, each a scored
    prompt. The first computes the context; the others reuse its pages (hit counts) and
    score the cached positions from the stored outputs: values equal the dense reference."""
    engine = make_engine(tiny_dir, enable_prefix_caching=True, **CHUNKS)
    context = PROMPTS["a"][:14]  # 3 full pages of 4 positions, and 2 more positions
    choices = [[61, 140, 9], [5], [33, 2, 71, 8, 19], [300, 12]]
    scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    first = run_steps(engine, [("q0", context + choices[0], scored, 0)])["q0"]
    check_against_reference(engine, first, context + choices[0], 1)
    assert first.metrics.num_cached_prompt_tokens == 0
    work = [(f"q{i}", context + c, scored, 0) for i, c in enumerate(choices[1:], 1)]
    finished = run_steps(engine, work)
    for i, choice in enumerate(choices[1:], 1):
        out = finished[f"q{i}"]
        check_against_reference(engine, out, context + choice, 1)
        assert out.metrics.num_cached_prompt_tokens == 12  # the context's 3 full pages
    at_exit = SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=1, prompt_logprobs_loop="exit"
    )
    exit_out = run_steps(engine, [("e", context + choices[0], at_exit, 0)])["e"]
    assert exit_out.metrics.num_cached_prompt_tokens == 0  # the store holds last loops only


def test_a_request_still_scoring_cached_positions_recomputes_instead_of_swapping(tiny_dir):
    engine = make_engine(
        tiny_dir, enable_prefix_caching=True, preemption_mode="swap", swap_space=1 << 20,
        prefill_mode="per_depth", **CHUNKS,
    )  # fmt: skip
    prompt = PROMPTS["a"]
    run_steps(engine, [("warm", prompt, SamplingParams(max_tokens=1), 0)])
    scored = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    engine.add_request("x", prompt, scored)
    engine.step()  # admitted with 16 cached positions; its first chunk is not at depth 4 yet
    request = engine.scheduler.requests["x"]
    assert request.scores_cached_positions
    engine.scheduler.preempt("x")
    stats = engine.scheduler.memory_stats
    assert (stats.num_preemptions_swap, stats.num_preemptions_recompute) == (0, 1)
    check_against_reference(engine, run_steps(engine, [])["x"], prompt, 1)


def test_prompt_logprobs_are_validated(tiny_dir):
    from loopserve.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def check_exit_scores(engine, output, prompt, rule) -> int:
    """The engine's prompt logprobs equal the reference scored at the rule's loops; returns
    how many positions the rule scores at another loop than the last."""
    layout = engine.config.cache.layout
    at_exit = reference_prompt_logprobs(engine.model, prompt, layout=layout, exit_rule=rule)
    at_last = reference_prompt_logprobs(engine.model, prompt, layout=layout)
    got = output.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for position, (entry, want) in enumerate(zip(got[1:], at_exit[1:]), 1):
        assert math.isclose(entry.logprob, want, abs_tol=1e-4), (position, entry.logprob, want)
    loops = reference_exit_loops(engine.model, prompt, rule, layout=layout)
    assert [entry.loops for entry in got[1:]] == loops
    return sum(not math.isclose(a, b, abs_tol=1e-4) for a, b in zip(at_exit[1:], at_last[1:]))


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("arm", list(ARMS))
def test_prompt_scored_at_the_exit_rules_loops_equals_the_dense_reference(tiny_dir, arm, layout):
    if layout == "shared" and arm in ("wavefront", "mixed"):
        pytest.skip("SHARED rejects wavefront and mixed prompt work at start-up")
    engine = make_engine(tiny_dir, layout=layout, **ARMS[arm], **CHUNKS)
    scored = SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=1, exit_threshold=0.5,
        prompt_logprobs_loop="exit",
    )  # fmt: skip
    last = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    work = [("a", PROMPTS["a"], scored, 0), ("c", PROMPTS["c"], scored, 1)]
    work += [("a_last", PROMPTS["a"], last, 1)]  # the same prompt beside it, the default way
    finished = run_steps(engine, work)
    rule = ExitRule(1, engine.model.num_loops, 0.5)
    moved = check_exit_scores(engine, finished["a"], PROMPTS["a"], rule)
    moved += check_exit_scores(engine, finished["c"], PROMPTS["c"], rule)
    assert moved > 0  # the rule exits before the last loop somewhere: the scores differ
    check_against_reference(engine, finished["a_last"], PROMPTS["a"], 1)
    last_entries = finished["a_last"].prompt_logprobs[1:]
    assert {entry.loops for entry in last_entries} == {engine.model.num_loops}
    # The engine counts every scored position and the loops that scored it.
    entries = [e for r in ("a", "c", "a_last") for e in finished[r].prompt_logprobs[1:]]
    stats = engine.stats
    assert stats.num_scored_prompt_positions == len(entries)
    assert stats.num_scored_prompt_loops == sum(entry.loops for entry in entries)
    assert stats.mean_loops_per_scored_position < engine.model.num_loops


def test_exit_loop_scores_survive_a_swap_in_the_middle_of_the_prompt(tiny_dir):
    engine = make_engine(
        tiny_dir, prefill_mode="per_depth", preemption_mode="swap", swap_space=1 << 20, **CHUNKS
    )
    rule = ExitRule(2, engine.model.num_loops, 0.5)  # min_loops 2 changes the picks too
    scored = SamplingParams(
        max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=0, min_loops=2,
        exit_threshold=0.5, prompt_logprobs_loop="exit",
    )  # fmt: skip
    engine.add_request("a", PROMPTS["a"], scored)
    engine.step()
    engine.step()  # the first chunk is between depths: its loop outputs are in flight
    assert engine.runner.inflight.handles_of("a")
    engine.scheduler.preempt("a")
    assert engine.scheduler.memory_stats.num_preemptions_swap == 1
    finished = run_steps(engine, [])
    assert check_exit_scores(engine, finished["a"], PROMPTS["a"], rule) > 0
