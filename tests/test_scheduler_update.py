"""Scheduler `update()` driven by hand-built `RunnerOutput`s: the executor decides each exit,
the scheduler records it (depth, CDF, delayed commitment) without re-deriving it. No model,
no executor: the expected plans below are derived by hand from the rules in docs/architecture.md."""

from __future__ import annotations

import numpy as np

from loopserve.config import EngineConfig
from loopserve.contracts import (
    DecodeResults,
    ItemKind,
    ItemResult,
    RunnerOutput,
    SampledToken,
    SchedulerOutput,
)
from loopserve.exit.columns import CONTINUE, EXIT, GATE
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


def decode_reply(scheduled: SchedulerOutput, *rows: tuple) -> RunnerOutput:
    """Results of the step's decode rows, one `(hazard or None, exited, token)` per row."""
    hazards = np.array([np.nan if h is None else h for h, _, _ in rows])
    exited = np.array([e for _, e, _ in rows], bool)
    tokens = np.array([-1 if t is None else t for _, _, t in rows], np.int64)
    return RunnerOutput(scheduled.step_id, (), decode=DecodeResults(exited, hazards, tokens))


def only_row(scheduled: SchedulerOutput):
    assert scheduled.items == () and scheduled.decode is not None
    (row,) = scheduled.decode.rows()
    return row


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
    row = only_row(scheduled)
    # Loop 0 of the decode token at position 3 (the first output token, fed back).
    assert (row.depth, row.position, row.token_id) == (0, 3, 7)
    assert row.needs_gate and row.exit_code == GATE  # the gate of this loop decides
    scheduler.update(scheduled, decode_reply(scheduled, (0.1, False, None)))
    scheduled = scheduler.schedule()
    row = only_row(scheduled)
    assert row.depth == 1
    assert abs(row.cdf_before - 0.1) < 1e-12 and abs(row.survival_before - 0.9) < 1e-12
    # The executor reports an exit at depth 1 although 0.1 + 0.2 * 0.9 < 0.5: the scheduler
    # records the reported decision instead of re-deriving it.
    touched = scheduler.update(scheduled, decode_reply(scheduled, (0.2, True, 8)))
    assert touched == [request]
    assert request.output_token_ids == [7, 8] and request.exit_depths == [4, 2]
    row = only_row(scheduler.schedule())
    assert (row.depth, row.position, row.token_id) == (0, 4, 8)
    assert (row.cdf_before, row.survival_before) == (0.0, 1.0)
    scheduler.check_invariants()


def test_no_exit_reported_keeps_the_token_looping_even_past_the_threshold():
    scheduler = make_scheduler("ouro")
    request = add(scheduler, "a", max_tokens=4, exit_threshold=0.5)
    run_prompt(scheduler, loops=4)
    scheduled = scheduler.schedule()
    scheduler.update(scheduled, decode_reply(scheduled, (0.9, False, None)))  # continue
    row = only_row(scheduler.schedule())
    assert row.depth == 1 and abs(row.cdf_before - 0.9) < 1e-12
    assert request.exit_depths == [4]


def test_delayed_crossing_commits_the_exit_one_loop_later():
    scheduler = make_scheduler("ouro_delayed")
    request = add(scheduler, "a", max_tokens=4, exit_threshold=0.5)
    run_prompt(scheduler, loops=4)
    scheduled = scheduler.schedule()
    row = only_row(scheduled)
    # Delayed: the gate of loop 0 can only commit an exit after loop 1.
    assert row.depth == 0 and row.needs_gate and row.exit_code == CONTINUE
    scheduler.update(scheduled, decode_reply(scheduled, (0.6, False, None)))  # crosses 0.5
    scheduled = scheduler.schedule()
    row = only_row(scheduled)
    assert row.depth == 1 and row.exit_code == EXIT and not row.needs_gate
    scheduler.update(scheduled, decode_reply(scheduled, (None, True, 9)))
    assert request.exit_depths == [4, 2] and request.output_token_ids == [7, 9]
    row = only_row(scheduler.schedule())
    assert row.depth == 0 and row.needs_gate and row.exit_code == CONTINUE


def test_delayed_hazard_below_the_threshold_commits_nothing():
    scheduler = make_scheduler("ouro_delayed")
    add(scheduler, "a", max_tokens=4, exit_threshold=0.5)
    run_prompt(scheduler, loops=4)
    scheduled = scheduler.schedule()
    scheduler.update(scheduled, decode_reply(scheduled, (0.3, False, None)))
    row = only_row(scheduler.schedule())
    assert row.depth == 1 and row.exit_code == CONTINUE and row.needs_gate


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
    assert out.items == () and out.decode is None
    assert set(out.finished_request_ids) == {"a", "b"}
    assert not scheduler.has_pending_releases() and scheduler.kv.num_used_blocks == 0


def test_a_result_of_a_row_whose_request_left_is_skipped():
    """A decode row whose request finished while its step ran: its result is dropped, the
    other rows' results are applied to their own requests."""
    scheduler = make_scheduler("trace")
    add(scheduler, "a", max_tokens=3, exit_trace=(1,))
    b = add(scheduler, "b", max_tokens=3, exit_trace=(1,))
    scheduled = scheduler.schedule()
    scheduler.update(scheduled, reply(scheduled, *(result(i, (), True, 1, 5)
                                                   for i in scheduled.items)))  # fmt: skip
    scheduled = scheduler.schedule()
    assert scheduled.decode.request_ids == ("a", "b")
    scheduler.abort_request("a")  # e.g. a client disconnect while the step runs
    touched = scheduler.update(scheduled, decode_reply(scheduled, (None, True, 6), (None, True, 8)))
    assert touched == [b] and b.output_token_ids == [5, 8]
    scheduler.check_invariants()
