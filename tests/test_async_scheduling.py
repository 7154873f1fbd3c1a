"""Async scheduling (`async_scheduling=True`): step n+1's rows are chosen while step n executes,
and every output equals synchronous scheduling and the dense reference."""

from __future__ import annotations

import zlib

import pytest

from loopserve.config import EngineConfig
from loopserve.engine.async_core import AsyncEngineCore
from loopserve.engine.core import EngineCore
from loopserve.errors import ConfigError
from tests.engine_utils import make_engine, random_workload, reference_for, run_steps


def test_async_with_plain_ouro_is_rejected_with_the_fix():
    with pytest.raises(ConfigError, match="ouro_delayed"):
        EngineConfig.from_engine_args(async_scheduling=True, exit_mode="ouro")
    config = EngineConfig.from_engine_args(async_scheduling=True, exit_mode="ouro_delayed")
    assert config.async_scheduling


def _outputs(finished):
    return {
        rid: (out.token_ids, out.exit_depths, out.finish_reason) for rid, out in finished.items()
    }


@pytest.mark.parametrize(
    ("layout", "mode", "exit_mode", "prefill_mode", "mixed"),
    [
        ("last_exited", "refill", "ouro_delayed", "atomic", False),
        ("last_exited", "no_refill", "ouro_delayed", "per_depth", False),
        ("shared", "refill", "trace", "atomic", False),
        ("shared", "no_refill", "random_lookahead", "atomic", False),
        ("last_exited", "refill", "random_lookahead", "wavefront", False),
        ("last_exited", "no_refill", "trace", "per_depth", True),
    ],
)
def test_async_matches_sync_and_reference(tiny_dir, layout, mode, exit_mode, prefill_mode, mixed):
    args = dict(
        layout=layout,
        mode=mode,
        exit_mode=exit_mode,
        prefill_mode=prefill_mode,
        mixed_prefill_decode=mixed,
        max_num_batched_tokens=48,
    )
    seed = zlib.crc32(f"{layout}-{mode}-{exit_mode}-{prefill_mode}".encode()) % 1000
    sync = make_engine(tiny_dir, **args)
    work = random_workload(seed, 9, sync.model.config.vocab_size, sampled=True)
    aborted = {"r3": 9}
    sync_out = _outputs(run_steps(sync, work, abort_at=aborted))
    engine = make_engine(tiny_dir, async_scheduling=True, **args)
    assert isinstance(engine.core, AsyncEngineCore) and type(sync.core) is EngineCore
    async_out = _outputs(run_steps(engine, work, abort_at=aborted))
    assert set(async_out) == {w[0] for w in work}
    for request_id, prompt, params, _ in work:
        if request_id in aborted:
            continue  # aborted at the same step number, which may hold other progress
        assert async_out[request_id] == sync_out[request_id], request_id
        ref = reference_for(engine, prompt, params)
        assert async_out[request_id][:2] == (ref.token_ids, ref.exit_depths), request_id
    stats = engine.stats
    # Overlap really happened: some steps ran rows chosen before the previous step's results
    # were applied; the synchronous engine never does.
    assert stats.num_steps_scheduled_ahead > 0
    assert sync.stats.num_steps_scheduled_ahead == 0
    assert stats.num_early_exits > 0
    assert stats.kv_blocks_used == 0 and engine.runner.num_live_handles == 0
    engine.core.shutdown()


def test_async_with_graph_emulation_matches_sync(tiny_dir):
    work = random_workload(5, 6, 256, sampled=False)
    args = dict(exit_mode="ouro_delayed", max_model_len=96)
    sync_out = _outputs(run_steps(make_engine(tiny_dir, **args), work))
    engine = make_engine(tiny_dir, async_scheduling=True, graph_mode="emulate", **args)
    assert _outputs(run_steps(engine, work)) == sync_out
    stats = engine.stats
    assert stats.num_steps_scheduled_ahead > 0 and stats.num_graph_calls > 0


@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_select_ahead_predicts_the_next_rows_before_update(tiny_dir, mode):
    """Trace exits (the first entry is the first token's, from the prompt): the second token
    of "a" exits after 2 loops (depth 1); "b" and "c" go on. The rows of step 3 are chosen
    before step 2's update: refill keeps "a"'s row for its next token (depth 0, built after
    update, once its sampled id is known); no_refill drops "a" from the cohort."""
    from loopserve.sampling_params import SamplingParams

    engine = make_engine(tiny_dir, exit_mode="trace", async_scheduling=True, mode=mode)
    scheduler, runner = engine.scheduler, engine.runner
    traces = {"a": (4, 2), "b": (4, 4), "c": (4, 3)}
    for request_id, trace in traces.items():
        params = SamplingParams(max_tokens=3, exit_trace=trace, ignore_eos=True)
        engine.add_request(request_id, [5, 6, 7], params)
    # Prompt steps are never planned ahead.
    scheduled = scheduler.schedule()
    assert scheduled.items[0].kind.value == "prompt"
    assert scheduler.select_ahead(scheduled) is None
    scheduler.update(scheduled, runner.execute(scheduled))
    ahead_out = None
    for _ in range(2):  # decode loops at depth 0 and 1
        scheduled = ahead_out or scheduler.schedule()
        depths = {row.request_id: row.depth for row in scheduled.decode.rows()}
        ahead = scheduler.select_ahead(scheduled)
        output = runner.execute(scheduled)
        scheduler.update(scheduled, output)
        ahead_out = scheduler.complete_ahead(ahead)
    assert depths == {"a": 1, "b": 1, "c": 1}
    next_depths = {row.request_id: row.depth for row in ahead_out.decode.rows()}
    if mode == "refill":
        assert ahead == ["a", "b", "c"]
        assert next_depths == {"a": 0, "b": 2, "c": 2}
        first = ahead_out.decode.row(0)  # "a"'s next token: its sampled id, fed back
        assert first.depth == 0 and first.token_id == output.decode.token_ids[0]
    else:
        assert ahead == ["b", "c"]
        assert next_depths == {"b": 2, "c": 2}
    assert engine.scheduler.requests["a"].exit_depths == [4, 2]  # first and second token


def test_complete_ahead_drops_requests_finished_between_steps(tiny_dir):
    from loopserve.sampling_params import SamplingParams

    engine = make_engine(tiny_dir, exit_mode="ouro_delayed", async_scheduling=True)
    scheduler, runner = engine.scheduler, engine.runner
    for request_id in ("a", "b"):
        engine.add_request(request_id, [3, 4], SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(2):  # the prompt step, then one decode step at depth 0
        scheduled = scheduler.schedule()
        ahead = scheduler.select_ahead(scheduled)
        scheduler.update(scheduled, runner.execute(scheduled))
    assert ahead == ["a", "b"]
    engine.abort_request("b")  # between steps, while "b" sits in the planned rows
    out = scheduler.complete_ahead(ahead)
    assert out.items == () and out.decode.request_ids == ("a",)
    assert out.finished_request_ids == ("b",)  # the release still reaches the runner
    engine.abort_request("a")
    assert scheduler.complete_ahead(["a"]) is None  # nothing left: schedule after update


def test_aborting_everything_while_a_step_is_in_flight_drains_it(tiny_dir):
    from loopserve.sampling_params import SamplingParams

    engine = make_engine(tiny_dir, exit_mode="ouro_delayed", async_scheduling=True)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for request_id in ("a", "b"):
        engine.add_request(request_id, [3, 4, 5], params)
    steps = 0
    while engine.core._inflight is None:  # until a step returns with the next one submitted
        engine.step()
        steps += 1
        assert steps < 20
    in_flight = engine.core._inflight[0]
    assert set(in_flight.decode.request_ids) == {"a", "b"}
    engine.abort_request("a")
    assert engine.core._inflight is not None  # "b" still runs: the step stays in flight
    engine.abort_request("b")
    # Idle now: the step in flight was collected before the release-only output ran.
    assert engine.core._inflight is None
    assert not engine.has_unfinished_requests()
    assert engine.runner.num_live_handles == 0 and engine.runner.samplers == {}
    assert engine.stats.kv_blocks_used == 0
    engine.core.shutdown()


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_async_under_preemption_matches_the_reference(tiny_dir, preemption):
    """A KV pool barely larger than one request: decode tokens entering a new block grow (and
    preempt) in steps planned ahead too, and outputs still equal the dense reference."""
    engine = make_engine(
        tiny_dir,
        async_scheduling=True,
        exit_mode="ouro_delayed",
        preemption_mode=preemption,
        num_blocks=14 * 4,  # the largest request needs 13 blocks per plane
        swap_space=2048 * 56,
    )
    work = random_workload(23, 8, engine.model.config.vocab_size, sampled=True)
    finished = run_steps(engine, work)
    for request_id, prompt, params, _ in work:
        ref = reference_for(engine, prompt, params)
        assert (finished[request_id].token_ids, finished[request_id].exit_depths) == (
            ref.token_ids,
            ref.exit_depths,
        ), request_id
    stats = engine.stats
    assert stats.num_preemptions > 0 and stats.num_steps_scheduled_ahead > 0
    assert stats.kv_blocks_used == 0 and engine.runner.num_live_handles == 0
    engine.core.shutdown()
