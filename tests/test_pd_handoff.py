"""Prefill/decode hand-off between two in-process engines: export after the first token (or a
few), import, decode; outputs must equal the dense reference, and aborts leave nothing behind."""

from __future__ import annotations

import random

import pytest

from loopserve.sampling_params import SamplingParams
from tests.engine_utils import make_engine, reference_for

EXIT_MODES = ["ouro", "ouro_delayed", "random_lookahead", "trace"]


def handoff_workload(seed: int, num_requests: int, vocab: int):
    """Odd requests sample (seeded), even ones are greedy; each is handed off after 1 or 3
    output tokens."""
    rng = random.Random(seed)
    work = []
    for i in range(num_requests):
        prompt = [rng.randrange(vocab) for _ in range(rng.choice([1, 3, 5, 13, 30]))]
        params = SamplingParams(
            max_tokens=rng.randrange(4, 12),
            temperature=0.0 if i % 2 == 0 else rng.choice([0.7, 1.0]),
            top_k=rng.choice([-1, 30]),
            seed=3000 + i,
            exit_threshold=rng.choice([0.3, 0.6, 0.9]),
            min_loops=rng.choice([1, 1, 2]),
            exit_trace=tuple(rng.randrange(1, 5) for _ in range(rng.randrange(1, 6))),
            ignore_eos=True,
            logprobs=rng.choice([None, 2]),
        )
        work.append((f"r{i}", prompt, params, rng.choice([1, 1, 3])))
    return work


def assert_clean(engine) -> None:
    engine.scheduler.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    assert engine.runner.samplers == {}
    assert engine.runner.moves.staged_imports == {}
    assert engine.runner.num_live_handles == 0
    assert engine._tracked == {}


def run_disaggregated(prefill, decode, work):
    """All requests go to `prefill`; each is exported once it has `export_after` tokens and
    decoded on `decode`, both engines stepping in turn. Returns final outputs and the
    exported request ids."""
    after = {request_id: n for request_id, _, _, n in work}
    for request_id, prompt, params, _ in work:
        prefill.add_request(request_id, prompt, params)
    finished, exported, streamed = {}, [], {}
    while prefill.has_unfinished_requests() or decode.has_unfinished_requests():
        for engine in (prefill, decode):
            if not engine.has_unfinished_requests():
                continue
            for output in engine.step():
                streamed.setdefault(output.request_id, []).extend(output.new_token_ids)
                if output.finished:
                    finished[output.request_id] = output
            engine.scheduler.check_invariants()
        for request_id in list(prefill.scheduler.requests):
            request = prefill.scheduler.requests[request_id]
            if len(request.output_token_ids) >= after[request_id] and prefill.can_export(
                request_id
            ):
                decode.import_request(prefill.export_request(request_id))
                exported.append(request_id)
    return finished, exported, streamed


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("exit_mode", EXIT_MODES)
def test_handoff_equals_reference(tiny_dir, layout, exit_mode):
    overrides = dict(layout=layout, exit_mode=exit_mode, lookahead_seed=7)
    prefill = make_engine(tiny_dir, **overrides)
    # Different block size of the pool and prior traffic: imported blocks land elsewhere.
    decode = make_engine(tiny_dir, num_blocks=300, **overrides)
    work = handoff_workload(11, 6, prefill.model.config.vocab_size)
    finished, exported, streamed = run_disaggregated(prefill, decode, work)
    assert sorted(exported) == sorted(r for r, *_ in work)  # every request was handed off
    assert decode.stats.num_output_tokens > 0
    for request_id, prompt, params, export_after in work:
        expected = reference_for(prefill, prompt, params)
        output = finished[request_id]
        assert output.token_ids == expected.token_ids, request_id
        assert output.exit_depths == expected.exit_depths, request_id
        assert output.finish_reason == "length"
        # The client sees every token exactly once across the two engines.
        assert streamed[request_id] == expected.token_ids, request_id
        assert len(output.token_ids) > export_after  # decode really ran on the importer
        if params.logprobs is not None:  # the exporter's logprobs travel with the request
            assert [lp.token_id for lp in output.logprobs] == expected.token_ids
            assert all(len(lp.top_logprobs) == 2 for lp in output.logprobs)
    assert_clean(prefill)
    assert_clean(decode)


def test_imported_kv_is_what_decode_reads(tiny_dir):
    """Zeroing the handed-off K/V changes the continuation: the import is not a no-op."""
    prefill, decode = make_engine(tiny_dir), make_engine(tiny_dir)
    prompt = list(range(5, 35))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prefill.add_request("x", prompt, params)
    while not prefill.can_export("x"):
        prefill.step()
    state = prefill.export_request("x")
    state.kv.zero_()  # type: ignore[attr-defined]
    decode.import_request(state)
    final = None
    while decode.has_unfinished_requests():
        for output in decode.step():
            final = output
    expected = reference_for(prefill, prompt, params)
    assert final is not None and final.token_ids[0] == expected.token_ids[0]
    assert (final.token_ids, final.exit_depths) != (expected.token_ids, expected.exit_depths)


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_abort_during_handoff_leaves_nothing(tiny_dir, layout):
    prefill = make_engine(tiny_dir, layout=layout)
    decode = make_engine(tiny_dir, layout=layout)
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    for request_id in ("a", "b", "c"):
        prefill.add_request(request_id, list(range(3, 20)), sampled)
    while not all(prefill.can_export(r) for r in ("a", "b", "c")):
        prefill.step()
    states = {r: prefill.export_request(r) for r in ("a", "b", "c")}
    assert prefill.abort_request("a") is None  # already gone from the exporter: no output
    assert_clean(prefill)
    # "a": aborted before it reaches the importer (its state is dropped). "b": imported, aborted
    # while its K/V is staged, before admission. "c": imported and admitted, aborted mid-decode.
    decode.import_request(states["b"])
    decode.import_request(states["c"])
    assert set(decode.runner.moves.staged_imports) == {"b", "c"}
    aborted = decode.abort_request("b")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert aborted.new_token_ids == []  # the exporter already streamed its first token
    decode.step()
    assert decode.runner.moves.staged_imports == {}
    assert "c" in decode.kv.tables and "c" in decode.runner.samplers
    assert decode.abort_request("c").finish_reason == "abort"
    assert_clean(decode)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_imported_requests_survive_preemption(tiny_dir, preemption):
    """A decode engine short of KV preempts imported requests; outputs stay exact."""
    prefill = make_engine(tiny_dir)
    decode = make_engine(tiny_dir, num_blocks=48, preemption_mode=preemption, swap_space=2048 * 64)
    work = handoff_workload(23, 6, prefill.model.config.vocab_size)
    finished, exported, _ = run_disaggregated(prefill, decode, work)
    assert len(exported) == len(work)
    assert decode.scheduler.memory_stats.num_preemptions > 0
    for request_id, prompt, params, _ in work:
        expected = reference_for(prefill, prompt, params)
        assert finished[request_id].token_ids == expected.token_ids, request_id
        assert finished[request_id].exit_depths == expected.exit_depths, request_id
    assert_clean(prefill)
    assert_clean(decode)


def test_async_scheduling_importer_is_exact(tiny_dir):
    """An importer with async scheduling (steps planned ahead) decodes handed-off requests
    exactly; exporting is refused there (a planned step may hold the request)."""
    prefill = make_engine(tiny_dir, exit_mode="trace")
    decode = make_engine(tiny_dir, exit_mode="trace", async_scheduling=True)
    work = handoff_workload(5, 6, prefill.model.config.vocab_size)
    finished, exported, _ = run_disaggregated(prefill, decode, work)
    assert len(exported) == len(work)
    assert decode.stats.num_steps_scheduled_ahead > 0
    for request_id, prompt, params, _ in work:
        expected = reference_for(prefill, prompt, params)
        assert finished[request_id].token_ids == expected.token_ids, request_id
        assert finished[request_id].exit_depths == expected.exit_depths, request_id
    assert_clean(prefill)
    assert_clean(decode)
    decode.add_request("x", [5, 6, 7], SamplingParams(max_tokens=4, exit_trace=(2,)))
    while not decode.scheduler.requests["x"].output_token_ids:
        decode.step()
    assert not decode.can_export("x")
    decode.abort_request("x")
