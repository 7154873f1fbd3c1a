"""Request states: one field (`Request.state`), one table of allowed transitions, and the
engine's real paths (admission, both preemption modes with a replay, hand-off, finish) moving
requests only along that table while their outputs stay those of the dense reference."""

from __future__ import annotations

import pytest

from loopserve.sampling_params import SamplingParams
from loopserve.scheduler.request import (
    ALLOWED_TRANSITIONS,
    IllegalTransitionError,
    Request,
    RequestState,
    RequestStatus,
)
from tests.engine_utils import make_engine, reference_for

S = RequestState
PARAMS = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
PROMPT = [4, 8, 15, 16, 23, 42, 7, 9, 11]


def _request() -> Request:
    return Request(
        "r", [1, 2, 3], PARAMS.resolve_loops(4), arrival_order=0, eos_token_ids=frozenset()
    )


def test_table_every_state_reachable_and_finished_terminal():
    reached, frontier = {S.WAITING}, [S.WAITING]
    while frontier:
        for nxt in ALLOWED_TRANSITIONS[frontier.pop()]:
            if nxt not in reached:
                reached.add(nxt)
                frontier.append(nxt)
    assert reached == set(S)
    assert ALLOWED_TRANSITIONS[S.FINISHED] == frozenset()
    assert all(S.FINISHED in ALLOWED_TRANSITIONS[s] for s in S if s is not S.FINISHED)


def test_illegal_transitions_raise_and_flags_follow_the_state():
    request = _request()
    with pytest.raises(IllegalTransitionError):
        request.transition(S.REPLAYING)  # a waiting request has nothing to replay
    request.transition(S.RUNNING)
    assert request.status is RequestStatus.RUNNING and not request.swapped
    request.transition(S.WAITING_SWAPPED)
    assert request.swapped and request.status is RequestStatus.WAITING
    with pytest.raises(IllegalTransitionError):
        request.transition(S.IMPORTING)
    request.transition(S.FINISHED)
    with pytest.raises(IllegalTransitionError):
        request.transition(S.WAITING)
    assert request.is_finished and request.status is RequestStatus.FINISHED


@pytest.fixture
def transitions(monkeypatch):
    """Every (request, from, to) the engine makes, through `Request.transition`."""
    seen: list[tuple[str, RequestState, RequestState]] = []
    original = Request.transition

    def recording(self, new_state):
        seen.append((self.request_id, self.state, new_state))
        original(self, new_state)

    monkeypatch.setattr(Request, "transition", recording)
    return seen


def _run_until(engine, done) -> None:
    while not done():
        engine.step()


def _finish(engine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_engine_paths_follow_the_table(tiny_dir, transitions, preemption):
    engine = make_engine(tiny_dir, preemption_mode=preemption, swap_space=2048 * 64)
    engine.add_request("a", PROMPT, PARAMS)
    request = engine.scheduler.requests["a"]
    _run_until(engine, lambda: len(request.output_token_ids) >= 4)
    engine.scheduler.preempt("a")
    assert request.state is (S.WAITING_SWAPPED if preemption == "swap" else S.WAITING)
    finals = _finish(engine)
    ref = reference_for(engine, PROMPT, PARAMS)
    assert (finals["a"].token_ids, finals["a"].exit_depths) == (ref.token_ids, ref.exit_depths)

    path = [(old, new) for rid, old, new in transitions if rid == "a"]
    assert all(new in ALLOWED_TRANSITIONS[old] for old, new in path), path
    visited = [new for _, new in path]
    if preemption == "swap":
        assert visited == [S.RUNNING, S.WAITING_SWAPPED, S.RUNNING, S.FINISHED]
    else:  # the recomputed prompt, then the replay of the lost decode positions
        assert visited == [S.RUNNING, S.WAITING, S.RUNNING, S.REPLAYING, S.RUNNING, S.FINISHED]


def test_hand_off_imports_through_importing(tiny_dir, transitions):
    prefill, decode = make_engine(tiny_dir), make_engine(tiny_dir)
    prefill.add_request("x", PROMPT, PARAMS)
    _run_until(prefill, lambda: prefill.can_export("x"))
    decode.import_request(prefill.export_request("x"))
    assert decode.scheduler.requests["x"].state is S.IMPORTING
    finals = _finish(decode)
    ref = reference_for(prefill, PROMPT, PARAMS)
    assert (finals["x"].token_ids, finals["x"].exit_depths) == (ref.token_ids, ref.exit_depths)
    steps = [(old, new) for _, old, new in transitions]
    assert all(new in ALLOWED_TRANSITIONS[old] for old, new in steps), steps
    # Exporter: running, then finished without an output; importer: importing -> running.
    assert steps == [
        (S.WAITING, S.RUNNING),
        (S.RUNNING, S.FINISHED),
        (S.WAITING, S.IMPORTING),
        (S.IMPORTING, S.RUNNING),
        (S.RUNNING, S.FINISHED),
    ]
