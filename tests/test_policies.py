"""Row-selection policies on hand-built requests (no torch, no engine).

Decode: refill takes every ready token up to the row budget; no_refill keeps a cohort until
all of its tokens exit. Prompt: the chunk/depth order of atomic, per-depth and wavefront
prefill, driven by a small stand-in for the scheduler's `update()` (a chunk that ran advances
its depth; a chunk done at every depth leaves the request and extends its prefilled prefix).
"""

from __future__ import annotations

import itertools

import pytest

from loopserve.exit import ExitMode
from loopserve.sampling_params import SamplingParams
from loopserve.scheduler.decode_table import DecodeTable
from loopserve.scheduler.policies import (
    PROMPT_POLICIES,
    NoRefillPolicy,
    PromptPolicy,
    RefillPolicy,
)
from loopserve.scheduler.request import Request

NUM_LOOPS = 4


def make_request(request_id: str, num_prompt_tokens: int = 3, order: int = 0) -> Request:
    params = SamplingParams(max_tokens=4, temperature=0).resolve_loops(NUM_LOOPS)
    return Request(
        request_id,
        list(range(1, num_prompt_tokens + 1)),
        params,
        arrival_order=order,
        eos_token_ids=frozenset(),
        arrival_s=0.0,
    )


def decoding(requests: list[Request]) -> DecodeTable:
    """A decode table holding these requests (admission order) with a token in flight each."""
    table = DecodeTable(8, exit_mode=ExitMode.OURO)
    for request in requests:
        request.output_token_ids = [5]
        table.add(request)
        table.start_token(request)
    return table


def ids(table: DecodeTable, rows) -> list[str]:
    return [table.ids[row] for row in rows]


def rows_of(table: DecodeTable, *request_ids: str):
    return table.lookup(request_ids)


# ---- decode policies ------------------------------------------------------------------------


def test_refill_picks_every_ready_token_in_order_up_to_the_row_budget():
    requests = [make_request(f"r{i}", order=i) for i in range(5)]
    table = decoding(requests)
    policy = RefillPolicy()
    assert ids(table, policy.select(table, 3)) == ["r0", "r1", "r2"]
    assert ids(table, policy.select(table, 8)) == ["r0", "r1", "r2", "r3", "r4"]
    # an exit frees the row at once: r0's next token is ready again
    policy.on_token_exits(table, rows_of(table, "r0"))
    table.start_token(requests[0])
    assert ids(table, policy.select(table, 5)) == ["r0", "r1", "r2", "r3", "r4"]
    table.remove("r1")  # a request that left takes no row
    assert ids(table, policy.select(table, 5)) == ["r0", "r2", "r3", "r4"]


def test_no_refill_keeps_its_cohort_until_every_token_exits_then_refills():
    a, b, c, d = (make_request(name, order=i) for i, name in enumerate("abcd"))
    table = decoding([a, b, c])
    policy = NoRefillPolicy()
    assert ids(table, policy.select(table, 2)) == ["a", "b"]  # cohort {a, b}; c waits
    policy.on_token_exits(table, rows_of(table, "a"))
    table.start_token(a)
    d.output_token_ids = [5]
    table.add(d)
    table.start_token(d)
    # a's next token is ready and a row is free, but the cohort has not drained.
    assert ids(table, policy.select(table, 2)) == ["b"]
    assert ids(table, policy.select(table, 2)) == ["b"]
    policy.on_token_exits(table, rows_of(table, "b"))
    table.start_token(b)
    assert ids(table, policy.select(table, 2)) == ["a", "b"]  # drained: a new cohort forms
    policy.on_token_exits(table, rows_of(table, "a"))
    table.start_token(a)
    table.remove("b")  # a finished or aborted member also leaves the cohort
    assert ids(table, policy.select(table, 2)) == ["a", "c"]


# ---- prompt policies ------------------------------------------------------------------------


def make_policy(name: str, chunk_size: int) -> PromptPolicy:
    handles = itertools.count(1)
    return PROMPT_POLICIES[name](chunk_size, NUM_LOOPS, lambda: next(handles))


def run_prompts(
    policy: PromptPolicy, requests: list[Request], max_rows: int, *, counts: bool = False
) -> list[list]:
    """Select until every prompt is done; each step as [(request, chunk start, depth, depths)]
    (with `counts`: (request, chunk start, depth, chunk rows))."""
    steps = []
    while any(r.in_prompt_phase for r in requests):
        work = policy.select([r for r in requests if r.in_prompt_phase], max_rows)
        assert work, "no prompt work was ready"
        assert sum(w.chunk.count for w in work) <= max_rows
        steps.append(
            [
                (w.request.request_id, w.chunk.start, w.depth,
                 w.chunk.count if counts else w.num_depths)
                for w in work
            ]
        )  # fmt: skip
        for w in work:  # what the scheduler's update does with a prompt item
            w.chunk.next_depth += w.num_depths
            if w.chunk.next_depth == NUM_LOOPS:
                assert w.request.prompt_chunks[0] is w.chunk, "chunks must complete in order"
                w.request.prompt_chunks.pop(0)
                w.request.num_prefilled_tokens = w.chunk.end
        assert len(steps) < 100
    return steps


def test_atomic_runs_one_chunk_per_request_through_all_depths_per_step():
    requests = [make_request("a", 20, 0), make_request("b", 5, 1)]
    steps = run_prompts(make_policy("atomic", 8), requests, max_rows=24)
    # Chunks of 8 fixed at creation: a = 0..8, 8..16, 16..20; b = 0..5.
    assert steps == [
        [("a", 0, 0, 4), ("b", 0, 0, 4)],
        [("a", 8, 0, 4)],
        [("a", 16, 0, 4)],
    ]


def test_per_depth_advances_one_chunk_one_depth_per_step():
    requests = [make_request("a", 12, 0), make_request("b", 3, 1)]
    steps = run_prompts(make_policy("per_depth", 8), requests, max_rows=24)
    assert steps == [
        [("a", 0, 0, 1), ("b", 0, 0, 1)],
        [("a", 0, 1, 1), ("b", 0, 1, 1)],
        [("a", 0, 2, 1), ("b", 0, 2, 1)],
        [("a", 0, 3, 1), ("b", 0, 3, 1)],
        [("a", 8, 0, 1)],  # a's second chunk opens only after the first finished every depth
        [("a", 8, 1, 1)],
        [("a", 8, 2, 1)],
        [("a", 8, 3, 1)],
    ]


def test_wavefront_overlaps_chunks_at_staggered_depths():
    steps = run_prompts(make_policy("wavefront", 8), [make_request("a", 20)], max_rows=100)
    # Chunk c at depth d runs after c-1 finished d and c finished d-1; chunk c opens once
    # c-1 finished depth 0. Chunks: 0..8, 8..16, 16..20.
    assert steps == [
        [("a", 0, 0, 1)],
        [("a", 0, 1, 1), ("a", 8, 0, 1)],
        [("a", 0, 2, 1), ("a", 8, 1, 1), ("a", 16, 0, 1)],
        [("a", 0, 3, 1), ("a", 8, 2, 1), ("a", 16, 1, 1)],
        [("a", 8, 3, 1), ("a", 16, 2, 1)],
        [("a", 16, 3, 1)],
    ]


def test_wavefront_row_budget_never_splits_a_chunk():
    steps = run_prompts(make_policy("wavefront", 8), [make_request("a", 20)], max_rows=16)
    # Step 3: c0@2 and c1@1 fill the 16 rows, so c2 (4 rows) does not open until c0 is done
    # and c1@3 leaves room.
    assert steps == [
        [("a", 0, 0, 1)],
        [("a", 0, 1, 1), ("a", 8, 0, 1)],
        [("a", 0, 2, 1), ("a", 8, 1, 1)],
        [("a", 0, 3, 1), ("a", 8, 2, 1)],
        [("a", 8, 3, 1), ("a", 16, 0, 1)],
        [("a", 16, 1, 1)],
        [("a", 16, 2, 1)],
        [("a", 16, 3, 1)],
    ]


@pytest.mark.parametrize("name", ["atomic", "per_depth", "wavefront"])
def test_a_new_chunk_is_cut_to_the_rows_left_in_admission_order(name):
    first, second = make_request("a", 8, 0), make_request("b", 2, 1)
    policy = make_policy(name, 8)
    # 6 rows: a's new chunk is cut to 6 (min(remaining 8, rows left 6, chunk 8)); nothing
    # is left for b, which may not jump ahead of a.
    work = policy.select([first, second], 6)
    assert [(w.request.request_id, w.chunk.count) for w in work] == [("a", 6)]


@pytest.mark.parametrize("name", ["per_depth", "wavefront"])
def test_an_in_flight_chunk_that_does_not_fit_stops_selection(name):
    first, second = make_request("a", 8, 0), make_request("b", 2, 1)
    policy = make_policy(name, 8)
    (work,) = policy.select([first, second], 8)
    work.chunk.next_depth += 1  # its depth 0 ran; its length is fixed at 8
    # 5 rows: a's chunk is never split, and b may not jump ahead of it.
    assert policy.select([first, second], 5) == []
    again = policy.select([first, second], 10)
    assert [(w.request.request_id, w.chunk.count, w.depth) for w in again][0] == ("a", 8, 1)


def test_wavefront_dependencies_hold_for_several_requests_under_a_tight_budget():
    lengths = [29, 17, 9]
    requests = [make_request(f"p{i}", n, i) for i, n in enumerate(lengths)]
    steps = run_prompts(make_policy("wavefront", 8), requests, max_rows=20, counts=True)
    done: set[tuple[str, int, int]] = set()
    chunks: dict[str, dict[int, int]] = {}  # request -> start -> count
    for step in steps:
        for request_id, start, depth, count in step:
            known = chunks.setdefault(request_id, {})
            assert known.setdefault(start, count) == count, "a chunk's length is fixed"
            if start > 0:  # the previous chunk finished this depth in an earlier step
                previous = max(s for s in known if s < start)
                assert previous + known[previous] == start
                assert (request_id, previous, depth) in done
            if depth > 0:
                assert (request_id, start, depth - 1) in done
        order = [int(request_id[1:]) for request_id, *_ in step]
        assert order == sorted(order), "prompt items keep admission order"
        done |= {(request_id, start, depth) for request_id, start, depth, _ in step}
    for i, n in enumerate(lengths):  # chunks tile the prompt, each at most 8 rows
        starts = sorted(chunks[f"p{i}"])
        assert sum(chunks[f"p{i}"].values()) == n and starts[0] == 0
        assert all(count <= 8 for count in chunks[f"p{i}"].values())
    expected = {
        (request_id, start, depth)
        for request_id, known in chunks.items()
        for start in known
        for depth in range(NUM_LOOPS)
    }
    assert done == expected  # every chunk ran every depth exactly once
    assert sum(len(step) for step in steps) == len(expected)
    assert any(len({d for _, _, d, _ in step}) > 1 for step in steps), "depths never overlapped"
