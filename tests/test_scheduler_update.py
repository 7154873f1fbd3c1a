"""Scheduler `update()` driven by hand-built `RunnerOutput`s: the executor decides each exit,
the scheduler records it (depth, CDF, delayed commitment) without re-deriving it. No model,
no executor: the expected plans below are derived by hand from the rules in docs/architecture.md."""

from __future__ import annotations

from loopserve.config import EngineConfig
from loopserve.contracts import ItemKind, ItemResult, RunnerOutput, SampledToken, SchedulerOutput
from loopserve.sampling_params import SamplingParams
from loopserve.scheduler.kv_cache import KVCacheManager
from loopserve.scheduler.request import Request
from loopserve.scheduler.scheduler import Scheduler

NUM_LOOPS = 4


def make_scheduler(exit_mode: str, **engine_args) -> Scheduler:
    config = EngineConfig.from_engine_args(exit_mode=exit_mode, block_size=4, **engine_args)
    return Scheduler(config, num_loops=NUM_LOOPS, kv=KVCacheManager(64, 4, NUM_LOOPS))


def add(scheduler: Scheduler, request_id: str, prompt_len: int = 3, **params) -> Request:
    sampling = SamplingParams(temperature=0.0, ignore_eos=True, **params)
    request = Request(
        request_id,
        list(range(1, prompt_len + 1)),
        sampling.resolve_loops(NUM_LOOPS),
        arrival_order=len(scheduler.requests),
        eos_token_ids=frozenset(),
    )
    scheduler.add_request(request)
    return request


def reply(scheduled: SchedulerOutput, *results: ItemResult) -> RunnerOutput:
    return RunnerOutput(scheduled.step_id, tuple(results))


def result(item, hazards=(), exited=False, loops=None, token=None) -> ItemResult:
    sampled = None if token is None else SampledToken(token)
    return ItemResult(item.request_id, item.handle, tuple(hazards), exited, loops, sampled)


def run_prompt(scheduler: Scheduler, loops: int, token: int = 7) -> None:
    """One atomic prompt step whose first token the executor reports with `loops` loops."""
    scheduled = scheduler.schedule()
    (item,) = scheduled.items
    assert (item.kind, item.num_depths, item.first_token) == (ItemKind.PROMPT, NUM_LOOPS, True)
    hazards = [0.0] * NUM_LOOPS  # by the rule these would never exit early
    scheduler.update(scheduled, reply(scheduled, result(item, hazards, True, loops, token)))


def test_first_token_prompt_item_appends_token_with_the_reported_loops():
    scheduler = make_scheduler("ouro")
    request = add(scheduler, "a", max_tokens=4, exit_threshold=0.5)
    run_prompt(scheduler, loops=3, token=11)
    assert request.output_token_ids == [11] and request.exit_depths == [3]
    assert request.num_prefilled_tokens == 3 and not request.in_prompt_phase


def test_exit_reported_at_depth_one_frees_the_row_and_next_token_starts_at_depth_zero():
    scheduler = make_scheduler("ouro")
    request = add(scheduler, "a", max_tokens=4, exit_threshold=0.5)
    run_prompt(scheduler, loops=4)
    scheduled = scheduler.schedule()
    (item,) = scheduled.items
    # Loop 0 of the decode token at position 3 (the first output token, fed back).
    assert (item.depth, item.token_start, item.token_ids, item.needs_prelude) == (0, 3, (7,), True)
    assert item.needs_gate and item.exit_now is None  # the gate of this loop decides
    handle = item.handle
    scheduler.update(scheduled, reply(scheduled, result(item, [0.1])))
    scheduled = scheduler.schedule()
    (item,) = scheduled.items
    assert (item.depth, item.handle, item.needs_prelude) == (1, handle, False)
    assert abs(item.cdf_before - 0.1) < 1e-12 and abs(item.survival_before - 0.9) < 1e-12
    # The executor reports an exit at depth 1 although 0.1 + 0.2 * 0.9 < 0.5: the scheduler
    # records the reported decision instead of re-deriving it.
    touched = scheduler.update(scheduled, reply(scheduled, result(item, [0.2], True, 2, 8)))
    assert touched == [request]
    assert request.output_token_ids == [7, 8] and request.exit_depths == [4, 2]
    scheduled = scheduler.schedule()
    (item,) = scheduled.items
    assert (item.depth, item.token_start, item.token_ids, item.needs_prelude) == (0, 4, (8,), True)
    assert (item.cdf_before, item.survival_before) == (0.0, 1.0)
    scheduler.check_invariants()


def test_no_exit_reported_keeps_the_token_looping_even_past_the_threshold():
    scheduler = make_scheduler("ouro")
    request = add(scheduler, "a", max_tokens=4, exit_threshold=0.5)
    run_prompt(scheduler, loops=4)
    scheduled = scheduler.schedule()
    (item,) = scheduled.items
    scheduler.update(scheduled, reply(scheduled, result(item, [0.9])))  # executor: continue
    (item,) = scheduler.schedule().items
    assert item.depth == 1 and abs(item.cdf_before - 0.9) < 1e-12
    assert request.exit_depths == [4]


def test_delayed_crossing_commits_the_exit_one_loop_later():
    scheduler = make_scheduler("ouro_delayed")
    request = add(scheduler, "a", max_tokens=4, exit_threshold=0.5)
    run_prompt(scheduler, loops=4)
    scheduled = scheduler.schedule()
    (item,) = scheduled.items
    # Delayed: the gate of loop 0 can only commit an exit after loop 1.
    assert item.depth == 0 and item.needs_gate and item.exit_now is False
    scheduler.update(scheduled, reply(scheduled, result(item, [0.6])))  # crosses 0.5
    scheduled = scheduler.schedule()
    (item,) = scheduled.items
    assert item.depth == 1 and item.exit_now is True and not item.needs_gate
    scheduler.update(scheduled, reply(scheduled, result(item, (), True, 2, 9)))
    assert request.exit_depths == [4, 2] and request.output_token_ids == [7, 9]
    (item,) = scheduler.schedule().items
    assert item.depth == 0 and item.needs_gate and item.exit_now is False


def test_delayed_hazard_below_the_threshold_commits_nothing():
    scheduler = make_scheduler("ouro_delayed")
    add(scheduler, "a", max_tokens=4, exit_threshold=0.5)
    run_prompt(scheduler, loops=4)
    scheduled = scheduler.schedule()
    (item,) = scheduled.items
    scheduler.update(scheduled, reply(scheduled, result(item, [0.3])))
    (item,) = scheduler.schedule().items
    assert item.depth == 1 and item.exit_now is False and item.needs_gate


def test_finished_and_aborted_requests_are_released_in_the_next_output():
    scheduler = make_scheduler("trace")
    add(scheduler, "a", max_tokens=1, exit_trace=(2,))
    add(scheduler, "b", max_tokens=3, exit_trace=(2,))
    scheduled = scheduler.schedule()
    assert [i.request_id for i in scheduled.items] == ["a", "b"]
    results = [result(i, (), True, 2, 5) for i in scheduled.items]
    scheduler.update(scheduled, reply(scheduled, *results))  # "a" finishes by length
    scheduler.abort_request("b")
    assert scheduler.has_pending_releases()
    out = scheduler.schedule_releases()
    assert out.items == () and set(out.finished_request_ids) == {"a", "b"}
    assert not scheduler.has_pending_releases() and scheduler.kv.num_used_blocks == 0


def test_an_item_result_with_several_tokens_appends_them_in_order_up_to_max_tokens():
    """The multi-token seam: a result's `more_sampled` tokens follow `sampled`, each with its
    own loop count; the request finishes at max_tokens and later ones are dropped."""
    scheduler = make_scheduler("trace")
    request = add(scheduler, "a", max_tokens=4, exit_trace=(4,))
    run_prompt(scheduler, loops=4)
    for _ in range(3):  # loops 0..2 of the second token
        scheduled = scheduler.schedule()
        (item,) = scheduled.items
        scheduler.update(scheduled, reply(scheduled, result(item)))
    scheduled = scheduler.schedule()
    (item,) = scheduled.items
    extra = ((SampledToken(9), 2), (SampledToken(10), 3), (SampledToken(11), 4))
    done = result(item, (), True, 4, 8)._replace(more_sampled=extra)
    assert scheduler.update(scheduled, reply(scheduled, done)) == [request]
    assert request.output_token_ids == [7, 8, 9, 10] and request.exit_depths == [4, 4, 2, 3]
    assert request.is_finished and request.finish_reason.value == "length"
    scheduler.check_invariants()
