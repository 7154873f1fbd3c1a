"""Per-request setup isolation: a request whose setup raises in the runner fails alone.

The fault comes through a real seam: `SetupFaultRunner` (tests/fault_runner.py) overrides the
runner's per-request setup hook and raises for requests seeded `FAIL_SEED`; the engine builds
it where it builds its `ModelRunner`. Everything else is the real engine, checked against the
dense reference.
"""

from __future__ import annotations

import pytest

from loopserve.engine import llm_engine
from loopserve.sampling_params import SamplingParams
from tests.engine_utils import make_engine, reference_for, run_steps, step_rows
from tests.fault_runner import FAIL_SEED, FAULT_TEXT, SetupFaultRunner, fail_sampling

ARMS = {
    "atomic": dict(prefill_mode="atomic"),
    "wavefront": dict(prefill_mode="wavefront"),
    "mixed": dict(prefill_mode="per_depth", mixed_prefill_decode=True),
    "wavefront_mixed": dict(prefill_mode="wavefront", mixed_prefill_decode=True),
}
BUDGET = dict(prefill_chunk_size=8, max_num_batched_tokens=24, max_num_seqs=4, block_size=4)


def prompt(start: int, length: int) -> list[int]:
    return [(start + 7 * i) % 97 + 1 for i in range(length)]


# (request id, prompt, params, arrival step); "bad" and "c" arrive together while "a" and "b"
# run, so "c" is set up in the same bookkeeping as "bad".
WORK = [
    ("a", prompt(1, 13), SamplingParams(max_tokens=12, temperature=0.8, seed=7), 0),
    ("b", prompt(2, 5), SamplingParams(max_tokens=10, temperature=0, exit_threshold=0.6), 0),
    ("bad", prompt(3, 9), SamplingParams(max_tokens=6, temperature=0.7, seed=FAIL_SEED), 4),
    ("c", prompt(4, 30), SamplingParams(max_tokens=8, temperature=1.0, top_k=30, seed=11), 4),
    ("d", prompt(5, 6), SamplingParams(max_tokens=5, temperature=0), 10),
]


@pytest.fixture
def fault_engine(tiny_dir, monkeypatch):
    monkeypatch.setattr(llm_engine, "ModelRunner", SetupFaultRunner)

    def build(**overrides):
        engine = make_engine(tiny_dir, **overrides)
        assert isinstance(engine.runner, SetupFaultRunner)
        return engine

    return build


@pytest.mark.parametrize("arm", list(ARMS))
def test_failed_setup_fails_only_that_request_and_the_rest_match_the_reference(fault_engine, arm):
    engine = fault_engine(**ARMS[arm], **BUDGET)
    steps = []
    engine.core.add_observer(lambda scheduled, output: steps.append((scheduled, output)))
    checked = []

    def after_step(engine) -> None:  # run_steps has just checked the scheduler's invariants
        if steps and steps[-1][1].failed_requests and not checked:
            runner = engine.runner
            assert "bad" not in runner.samplers and not runner.inflight.handles_of("bad")
            assert "c" in runner.samplers  # set up in the same bookkeeping, kept
            assert engine.stats.num_running == 3  # a, b, c; bad's KV is freed
            checked.append(len(steps))

    finished = run_steps(engine, WORK, on_step=after_step)
    assert checked, "no step reported a failed setup"
    failing = [(s, o) for s, o in steps if o.failed_requests]
    assert len(failing) == 1
    scheduled, output = failing[0]
    [failure] = output.failed_requests
    assert failure.request_id == "bad" and FAULT_TEXT in failure.error
    assert {"bad", "c"} <= {new.request_id for new in scheduled.new_requests}
    # The step carried other requests' rows, ran none of bad's, and gave bad empty results.
    others = [row for row in step_rows(scheduled) if row.request_id != "bad"]
    assert others
    if ARMS[arm].get("mixed_prefill_decode"):  # running decode rows shared the core call
        assert {"a", "b"} & {item.request_id for item in others if item.kind == "decode"}
    assert output.stats.rows_per_core_call[0] == sum(item.token_count for item in others)
    for item, result in zip(scheduled.items, output.results):
        assert result.handle == item.handle
        if item.request_id == "bad":
            assert (result.sampled, result.hazards, result.exited) == (None, (), False)
    assert not any(item.request_id == "bad" for s, _ in steps[checked[0] :] for item in s.items)

    assert_only_bad_failed(engine, finished)


def assert_only_bad_failed(engine, finished) -> None:
    bad = finished["bad"]
    assert bad.finish_reason == "abort" and FAULT_TEXT in bad.error and bad.token_ids == []
    for request_id, tokens, params, _ in WORK:
        if request_id == "bad":
            continue
        out = finished[request_id]
        ref = reference_for(engine, tokens, params)
        assert out.error is None and out.finish_reason == "length", request_id
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), request_id
    assert engine.stats.kv_blocks_used == 0
    assert engine.runner.num_live_handles == 0 and engine.runner.samplers == {}
    assert engine.stats.num_failed_steps == 0  # the step itself succeeded


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_failed_setup_under_preemption_fails_only_that_request(fault_engine, preemption):
    """14 blocks of 4 positions per plane, while "c" alone grows to 30 + 8 - 1 = 37 positions
    (10 blocks): the running requests preempt each other around the failed setup."""
    engine = fault_engine(
        **ARMS["mixed"],
        **BUDGET | dict(num_blocks=14 * 4),
        preemption_mode=preemption,
        swap_space=2048 * 40,  # 40 host blocks of 2 KiB
    )
    finished = run_steps(engine, WORK)
    assert engine.scheduler.memory_stats.num_preemptions > 0
    assert_only_bad_failed(engine, finished)
    assert engine.runner.moves.swapped_inflight == {}
    assert engine.kv.host_pool.num_free_blocks == engine.kv.host_pool.num_blocks


def test_request_announced_in_a_step_without_its_items_fails_alone(fault_engine):
    """Atomic prompts alternate with decode: "bad" is admitted (announced) in a decode step
    that carries only "a"'s row, so its setup fails before it has any item."""
    engine = fault_engine()
    a_params = SamplingParams(max_tokens=6, temperature=0.9, seed=21)
    engine.add_request("a", prompt(6, 5), a_params)
    assert engine.step()[0].request_id == "a"  # the prompt step: a's first token
    engine.add_request("bad", prompt(7, 4), SamplingParams(max_tokens=3, seed=FAIL_SEED))
    steps = []
    engine.core.add_observer(lambda scheduled, output: steps.append((scheduled, output)))
    outputs = {out.request_id: out for out in engine.step()}
    scheduled, output = steps[0]
    assert [new.request_id for new in scheduled.new_requests] == ["bad"]
    assert scheduled.items == () and scheduled.decode.request_ids == ("a",)
    assert [failure.request_id for failure in output.failed_requests] == ["bad"]
    assert outputs["bad"].finish_reason == "abort" and FAULT_TEXT in outputs["bad"].error
    assert "bad" not in engine.runner.samplers
    engine.scheduler.check_invariants()
    finished = run_steps(engine, [])
    ref = reference_for(engine, prompt(6, 5), a_params)
    assert (finished["a"].token_ids, finished["a"].exit_depths) == (
        ref.token_ids,
        ref.exit_depths,
    )
    assert engine.stats.kv_blocks_used == 0 and engine.runner.samplers == {}


# ---- sampling values that break float32 math, and a failure inside sampling ------------------

EXTREME = [
    ("tiny_temperature", SamplingParams(max_tokens=6, temperature=5e-324, seed=3)),
    ("tiny_temperature_2", SamplingParams(max_tokens=6, temperature=2e-38, seed=4)),
    ("tiny_top_p", SamplingParams(max_tokens=6, temperature=0.9, top_p=1e-300, seed=5)),
]


def test_extreme_sampling_values_neither_fail_nor_harm_the_call(tiny_dir):
    """A temperature that overflows float32 logits samples greedily (the vLLM floor, 1e-5);
    a top_p that rounds to 0 keeps the most likely token. Both beside running requests."""
    engine = make_engine(tiny_dir, **BUDGET)
    work = [(rid, prompt(20 + i, 7), params, 2) for i, (rid, params) in enumerate(EXTREME)]
    work += [w for w in WORK if w[0] != "bad"]
    finished = run_steps(engine, work)
    for request_id, tokens, params, _ in work:
        out = finished[request_id]
        assert out.error is None and out.finish_reason == "length", request_id
        ref = reference_for(engine, tokens, params)
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), request_id
    for request_id, tokens, _params, _ in work[:3]:  # all three sample the top token
        greedy = reference_for(engine, tokens, SamplingParams(max_tokens=6, temperature=0.0))
        assert finished[request_id].token_ids == greedy.token_ids, request_id


def test_a_failure_inside_sampling_fails_only_its_request(tiny_dir, monkeypatch):
    """Fault injected at the sampler's per-row step for requests with top_k=13; the other rows
    of the same coda calls are sampled, and every other request equals the reference."""
    fail_sampling(monkeypatch)
    engine = make_engine(tiny_dir, **BUDGET)
    steps = []
    engine.core.add_observer(lambda scheduled, output: steps.append(output))
    bad = SamplingParams(max_tokens=6, temperature=0.8, top_k=13, seed=9)
    # "e" arrives with "bad": their first tokens are sampled in the same coda call.
    partner = ("e", prompt(6, 9), SamplingParams(max_tokens=4, temperature=0.7, seed=21), 4)
    work = [("bad", prompt(3, 9), bad, 4), partner] + [w for w in WORK if w[0] != "bad"]
    finished = run_steps(engine, work)
    out = finished["bad"]
    assert out.finish_reason == "abort" and "sampling failed" in out.error
    assert "inf, nan" in out.error
    failing = [o for o in steps if o.failed_requests]
    assert len(failing) == 1 and failing[0].failed_requests[0].request_id == "bad"
    assert sum(1 for r in failing[0].results if r.sampled is not None) >= 1  # others sampled
    for request_id, tokens, params, _ in work[1:]:
        ref = reference_for(engine, tokens, params)
        got = finished[request_id]
        assert got.error is None and (got.token_ids, got.exit_depths) == (
            ref.token_ids, ref.exit_depths,
        ), request_id  # fmt: skip
    assert engine.stats.kv_blocks_used == 0 and engine.stats.num_failed_steps == 0
