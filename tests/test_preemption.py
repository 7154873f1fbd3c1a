"""Preemption must not change any output: recompute and swap against the dense reference."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from loopserve.sampling_params import SamplingParams
from tests.engine_utils import kv_planes, make_engine, pairwise, reference_for, run_steps

PROMPT_ARMS = {
    "atomic": {"prefill_mode": "atomic"},
    "per_depth": {"prefill_mode": "per_depth"},
    "wavefront": {"prefill_mode": "wavefront"},
    "mixed": {"prefill_mode": "per_depth", "mixed_prefill_decode": True},
}

EXIT_MODES = ("ouro", "ouro_delayed", "random_lookahead", "trace")
# Preemption mode x layout x decode mode x prompt arm x exit mode: an all-pairs covering of
# the product (18 of its 96 cases: every two factors' values meet in some case; see
# `test_the_cases_cover_every_pair_of_the_product`). Every run mixes greedy and seeded
# requests (odd requests sample, even ones are greedy), so the sampling axis is covered
# inside each run.
PRODUCT = [
    (preemption, layout, mode, arm, exit_mode)
    for preemption in ("recompute", "swap")
    for layout in ("last_exited", "shared")
    for mode in ("refill", "no_refill")
    for arm in PROMPT_ARMS
    for exit_mode in EXIT_MODES
    # SHARED rejects wavefront and mixed prompt work at start-up (test_prompt_scheduling).
    if layout == "last_exited" or arm in ("atomic", "per_depth")
]
CASES = pairwise(PRODUCT)
# The dense reference depends only on the layout, the exit mode and the request, so each is
# computed once per (checkpoint, layout, exit mode, workload seed, request).
_REFERENCES: dict[tuple, object] = {}


def cached_reference(engine, key: tuple, prompt, params):
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_for(engine, prompt, params)
    return _REFERENCES[key]


def priority_workload(seed: int, num_requests: int, vocab: int, *, sampled: bool):
    rng = random.Random(seed)
    work = []
    for i in range(num_requests):
        prompt = [rng.randrange(vocab) for _ in range(rng.choice([2, 5, 9, 14, 23]))]
        params = SamplingParams(
            max_tokens=rng.randrange(6, 16),
            temperature=rng.choice([0.7, 1.0]) if sampled and i % 2 else 0.0,
            top_k=rng.choice([-1, 30]),
            seed=2000 + i,
            exit_threshold=rng.choice([0.3, 0.6, 0.9]),
            min_loops=rng.choice([1, 1, 2]),
            exit_trace=tuple(rng.randrange(1, 5) for _ in range(rng.randrange(1, 6))),
            priority=rng.choice([0, 0, 1, -1]),
            ignore_eos=True,
        )
        work.append((f"r{i}", prompt, params, rng.randrange(0, 10)))
    return work


def assert_all_released(engine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    assert engine.kv.host_pool.num_free_blocks == engine.kv.host_pool.num_blocks
    assert engine.runner.num_live_handles == 0
    assert engine.runner.samplers == {}
    assert engine.runner.moves.swapped_inflight == {}


@pytest.mark.parametrize(
    "preemption,layout,mode,prompt_arm,exit_mode",
    CASES,
    ids=["-".join(case) for case in CASES],
)
def test_preempted_requests_match_reference(
    tiny_dir, preemption, layout, mode, prompt_arm, exit_mode
):
    # The largest request writes 23 + 15 - 1 = 37 positions: 10 blocks per plane. The pool
    # holds barely more than one such request, so four running requests preempt constantly.
    num_planes = 1 if layout == "shared" else 4
    case_index = CASES.index((preemption, layout, mode, prompt_arm, exit_mode))
    engine = make_engine(
        tiny_dir,
        layout=layout,
        mode=mode,
        exit_mode=exit_mode,
        preemption_mode=preemption,
        # Half the runs also preempt for priority (the workload mixes priorities).
        scheduling_policy="priority" if case_index % 2 else "fcfs",
        num_blocks=11 * num_planes,
        swap_space=2048 * 40,  # 40 host blocks of 2 KiB
        **PROMPT_ARMS[prompt_arm],
    )
    # One workload per (layout, prompt arm, exit mode): its references are shared by the 4
    # runs of the preemption and decode modes.
    seed = (
        17
        + 16 * ("last_exited", "shared").index(layout)
        + 4 * list(PROMPT_ARMS).index(prompt_arm)
        + EXIT_MODES.index(exit_mode)
    )
    work = priority_workload(seed, 9, engine.model.config.vocab_size, sampled=True)
    assert {p.temperature > 0 for _, _, p, _ in work} == {False, True}  # greedy and seeded
    aborted = {"r3": 9, "r6": 25}
    finished = run_steps(engine, work, abort_at=aborted)
    stats = engine.scheduler.memory_stats
    assert stats.num_preemptions > 0
    if preemption == "swap":
        assert stats.num_preemptions_swap > 0
        assert engine.kv.num_swapped_in_blocks > 0
    else:
        assert stats.num_preemptions_swap == 0
        assert stats.num_replayed_rows > 0
    assert set(finished) == {w[0] for w in work}
    for request_id, prompt, params, _ in work:
        key = (str(tiny_dir), layout, exit_mode, seed, request_id)
        ref = cached_reference(engine, key, prompt, params)
        out = finished[request_id]
        if out.finish_reason == "abort":
            assert request_id in aborted
            assert out.token_ids == ref.token_ids[: len(out.token_ids)]
            assert out.exit_depths == ref.exit_depths[: len(out.exit_depths)]
            continue
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), request_id
    assert_all_released(engine)


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_recompute_rebuilds_kvkv_planes(tiny_dir, layout, batch_invariant):
    """The replay rebuilds every plane of every written position.

    In batch-invariant mode every row's bits depend only on its own inputs, so every plane
    matches bit for bit in both layouts. In the default mode SHARED replays one row per core
    call, like the original decode of a lone request, and matches bit for bit too; LAST_EXITED
    replays generated positions as a wavefront (position t at depth d next to t+1 at depth
    d-1), so its core calls carry 2-4 rows where the original carried 1: CPU float32 GEMM
    picks its kernel by the call's row count (one row: a GEMV path; more: blocked
    micro-kernels with separate tail kernels), so a row's bits depend on how many rows share
    the call. Prompt positions (same chunk, same rows) match bit for bit; replayed positions
    match to float32 rounding (measured max |diff| about 2e-6), while any semantic slip
    (wrong depth, missing finalize copy) is O(1).
    """
    # Prefix caching off: the prompt then re-runs as the same chunk (same rows per call).
    engine = make_engine(
        tiny_dir,
        layout=layout,
        exit_mode="trace",
        enable_prefix_caching=False,
        batch_invariant=batch_invariant,
    )
    params = SamplingParams(
        max_tokens=14, temperature=0, ignore_eos=True, exit_trace=(1, 3, 2, 4, 1, 2, 3)
    )
    prompt = [7, 3, 9, 11, 2, 5, 8, 1, 4, 6]
    engine.add_request("a", prompt, params)
    request = engine.scheduler.requests["a"]
    while len(request.output_token_ids) < 9:
        engine.step()
    assert engine.scheduler.token_depth("a") == 0  # the next token has not run a loop yet
    position = request.next_position  # the token in flight; positions before it are final
    before = kv_planes(engine, "a", position)
    early = [d for d in request.exit_depths[1:] if d < 4]
    assert early, "some replayed positions exited early (finalize copies in the replay)"
    engine.scheduler.preempt("a")
    assert "a" not in engine.kv.tables
    saw_replay = False
    while request.in_prompt_phase or request.replay is not None or "a" not in engine.kv.tables:
        engine.step()
        engine.scheduler.check_invariants()
        saw_replay |= request.replay is not None
    assert saw_replay
    after = kv_planes(engine, "a", position)
    num_prompt = len(prompt)
    assert torch.equal(before[:, :, :, :num_prompt], after[:, :, :, :num_prompt])
    if layout == "shared" or batch_invariant:
        assert torch.equal(before, after)
    else:
        torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
    finished = run_steps(engine, [])
    ref = reference_for(engine, prompt, params)
    assert (finished["a"].token_ids, finished["a"].exit_depths) == (
        ref.token_ids,
        ref.exit_depths,
    )
    assert engine.scheduler.memory_stats.num_preemptions_recompute == 1


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_mid_token_keeps_gate_state_and_sampler(tiny_dir, preemption):
    # A seeded, gated request preempted while its token is between loops 2 and 3.
    engine = make_engine(tiny_dir, preemption_mode=preemption, swap_space=2048 * 64)
    params = SamplingParams(
        max_tokens=10, temperature=0.8, seed=5, exit_threshold=0.7, min_loops=2, ignore_eos=True
    )
    engine.add_request("a", [4, 8, 15, 16, 23, 42], params)
    request = engine.scheduler.requests["a"]
    while not (len(request.output_token_ids) >= 4 and engine.scheduler.token_depth("a") == 2):
        engine.step()
    engine.scheduler.preempt("a")
    assert request.swapped == (preemption == "swap")
    finished = run_steps(engine, [])
    ref = reference_for(engine, [4, 8, 15, 16, 23, 42], params)
    assert (finished["a"].token_ids, finished["a"].exit_depths) == (
        ref.token_ids,
        ref.exit_depths,
    )
    assert_all_released(engine)


def test_incremental_allocation_grows_block_by_block(tiny_dir):
    engine = make_engine(tiny_dir, exit_mode="trace", block_size=4)
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, exit_trace=(2,))
    engine.add_request("a", [1, 2, 3, 4, 5], params)  # 5 prompt positions: 2 blocks per plane
    request = engine.scheduler.requests["a"]
    engine.step()
    sizes = [len(plane) for plane in engine.kv.tables["a"]]
    assert sizes == [2, 2, 2, 2]  # prompt only, every plane, not the worst case (4 blocks)
    seen = {}
    while engine.has_unfinished_requests():
        engine.step()
        if "a" in engine.kv.tables and not request.is_finished:
            seen[request.next_position] = len(engine.kv.tables["a"][0])
    # Decode tokens are fed at positions 5..12; a block is added when one starts a block.
    assert seen == {5: 2, 6: 2, 7: 2, 8: 3, 9: 3, 10: 3, 11: 3, 12: 4}


def test_full_reservation_reserves_worst_case_up_front(tiny_dir):
    engine = make_engine(tiny_dir, kv_reservation="full", block_size=4)
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=9, temperature=0))
    engine.step()
    # 5 + 9 - 1 = 13 positions -> 4 blocks per plane.
    assert [len(plane) for plane in engine.kv.tables["a"]] == [4, 4, 4, 4]


def test_watermark_holds_back_admission_while_others_run(tiny_dir):
    # 40 blocks, watermark 0.25 -> 10 blocks kept free while a request runs.
    engine = make_engine(tiny_dir, num_blocks=40, block_size=4, kv_watermark=0.25)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(1, 21)), params)  # 5 blocks x 4 planes = 20
    engine.add_request("b", list(range(1, 17)), params)  # 4 x 4 = 16: 20 + 16 > 40 - 10
    engine.step()
    assert engine.scheduler.num_running == 1 and engine.scheduler.num_waiting == 1
    engine2 = make_engine(tiny_dir, num_blocks=40, block_size=4, kv_watermark=0.25)
    engine2.add_request("b", list(range(1, 37)), params)  # 9 x 4 = 36 > 30 but alone: admitted
    engine2.step()
    assert engine2.scheduler.num_running == 1


def _finish_order(engine) -> list[str]:
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
        engine.scheduler.check_invariants()
    return order


@pytest.mark.parametrize("full_on", ["seats", "kv"])
def test_high_priority_arrival_preempts_lowest_priority_and_finishes_first(tiny_dir, full_on):
    # Seats full: two seats, both taken. KV full: seats to spare, but the 2 running requests
    # hold 2 x 3 blocks x 4 planes of 28 and the newcomer's prompt needs 3 x 4 more.
    limits = {"max_num_seqs": 2} if full_on == "seats" else {"num_blocks": 28}
    engine = make_engine(tiny_dir, scheduling_policy="priority", block_size=4, **limits)
    low = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, priority=1)
    high = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, priority=0)
    engine.add_request("old", [1, 2, 3, 4, 5, 6, 7, 8, 9], low)
    engine.add_request("young", [9, 8, 7, 6, 5, 4, 3, 2, 1], low)
    for _ in range(3):
        engine.step()
    assert engine.scheduler.num_running == 2
    engine.add_request("vip", [5, 5, 6, 6, 7, 7, 8, 8, 9], high)
    engine.step()
    young = engine.scheduler.requests["young"]
    assert young.num_preemptions == 1 and engine.scheduler.requests["old"].num_preemptions == 0
    outputs = {}
    order = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
                outputs[out.request_id] = out
    assert order[0] == "vip"
    for request_id, prompt, params in [
        ("old", [1, 2, 3, 4, 5, 6, 7, 8, 9], low),
        ("young", [9, 8, 7, 6, 5, 4, 3, 2, 1], low),
        ("vip", [5, 5, 6, 6, 7, 7, 8, 8, 9], high),
    ]:
        assert outputs[request_id].token_ids == reference_for(engine, prompt, params).token_ids
    assert_all_released(engine)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_no_preemption_for_equal_priority_or_under_fcfs(tiny_dir, policy):
    engine = make_engine(tiny_dir, scheduling_policy=policy, max_num_seqs=2)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    engine.add_request("b", [4, 5, 6], params)
    engine.step()
    # Equal priority under "priority"; a better one under "fcfs": neither preempts.
    newcomer = params if policy == "priority" else SamplingParams(max_tokens=2, priority=-5)
    engine.add_request("c", [7, 8, 9], newcomer)
    assert _finish_order(engine)[-1] == "c"
    assert engine.scheduler.memory_stats.num_preemptions == 0


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full(tiny_dir):
    # 2 host blocks of 2 KiB; the request holds at least 2 blocks x 4 planes.
    engine = make_engine(tiny_dir, preemption_mode="swap", swap_space=2 * 2048)
    assert engine.kv.host_pool.num_blocks == 2
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("a", [3, 1, 4, 1, 5, 9, 2], params)
    request = engine.scheduler.requests["a"]
    while len(request.output_token_ids) < 3:
        engine.step()
    engine.scheduler.preempt("a")
    assert not request.swapped
    stats = engine.scheduler.memory_stats
    assert (stats.num_preemptions_swap, stats.num_preemptions_recompute) == (0, 1)
    finished = run_steps(engine, [])
    assert finished["a"].token_ids == reference_for(engine, [3, 1, 4, 1, 5, 9, 2], params).token_ids
    assert finished["a"].metrics.num_preemptions == 1
    assert_all_released(engine)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])
def test_preempted_logprobs_and_text_match_an_uninterrupted_run(
    tiny_tok_dir, layout, preemption, batch_invariant
):
    """Logprobs (top-2 included) and text, not just tokens, equal an uninterrupted run's.

    Tokens, top-k ids, finish reasons and text must be equal; logprob values to float32
    rounding (relative 1e-5): the two runs share their core calls with different rows (the
    tight pool runs fewer requests at once, and replays), and CPU float32 GEMM gives a row
    different bits depending on how many rows share the call (measured |diff| ~1e-5 on a
    logprob of -5). In batch-invariant mode they are bit-identical."""
    num_planes = 1 if layout == "shared" else 4

    def run(num_blocks: int):
        engine = make_engine(
            tiny_tok_dir,
            layout=layout,
            preemption_mode=preemption,
            num_blocks=num_blocks * num_planes,
            swap_space=2048 * 40,
            batch_invariant=batch_invariant,
        )
        work = priority_workload(101, 6, engine.model.config.vocab_size, sampled=True)
        work = [
            (rid, prompt, dataclasses.replace(params, logprobs=2), arrival)
            for rid, prompt, params, arrival in work
        ]
        return engine, run_steps(engine, work)

    tight, preempted = run(11)
    _, uninterrupted = run(512)
    assert tight.scheduler.memory_stats.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in preempted.values()) > 0
    assert all(o.text for o in uninterrupted.values())  # the tiny checkpoint detokenizes
    for request_id, out in uninterrupted.items():
        got = preempted[request_id]
        assert out.metrics.num_preemptions == 0
        assert (got.token_ids, got.exit_depths, got.text, got.finish_reason) == (
            out.token_ids,
            out.exit_depths,
            out.text,
            out.finish_reason,
        )
        assert len(got.logprobs) == len(out.logprobs) == len(out.token_ids)
        for a, b in zip(got.logprobs, out.logprobs):
            assert a.token_id == b.token_id
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
            if batch_invariant:
                assert (a.logprob, a.top_logprobs) == (b.logprob, b.top_logprobs)
            else:
                assert a.logprob == pytest.approx(b.logprob, rel=1e-5, abs=1e-6)
    assert_all_released(tight)


def test_the_cases_cover_every_pair_of_the_product():
    """The covering is complete: any two factors' values that meet in the product meet in a
    chosen case (and a case set missing one is caught)."""

    def pairs(cases):
        return {(i, c[i], j, c[j]) for c in cases for i in range(5) for j in range(i + 1, 5)}

    assert pairs(CASES) == pairs(PRODUCT) and len(CASES) < len(PRODUCT) // 4
    assert pairs(CASES[1:]) != pairs(PRODUCT)  # every chosen case adds a pair
