"""`EngineCore` over the simulated executor: observers see every executed step, releases
travel in `SchedulerOutput.finished_request_ids`, a failing step fails only its requests,
and the stats snapshot counts what the steps did."""

from __future__ import annotations

from loopserve.contracts import SchedulerOutput
from loopserve.scheduler.request import FinishReason
from loopserve.sim.cost_model import OURO_1P4B
from loopserve.sim.hardware import get_device_profile
from loopserve.sim.simulator import Simulator
from loopserve.sim.workload import SimRequest

H100 = get_device_profile("h100")


def make_sim(**engine_args) -> Simulator:
    return Simulator(OURO_1P4B, H100, {"num_blocks": 256, **engine_args})


def submit(sim: Simulator, request_id: str, prompt_len: int, output_len: int, trace) -> None:
    order = len(sim.scheduler.requests)
    sim.core.add_request(
        sim.make_request(SimRequest(request_id, 0.0, prompt_len, output_len, trace), order, 0.0)
    )


def test_observer_sees_every_step_and_releases_ride_on_the_next_output():
    sim = make_sim()
    core = sim.core
    seen: list[tuple[SchedulerOutput, int]] = []
    remove = core.add_observer(lambda s, o: seen.append((s, sum(o.stats.rows_per_core_call))))
    submit(sim, "short", 5, 1, (4,))
    submit(sim, "long", 6, 3, (1, 2, 3))
    while core.has_unfinished_requests():
        core.step()
    stats = core.stats()
    # Atomic prompt step (both prompts, 4 calls), then decode steps: long's tokens 2 and 3
    # with traces 2 and 3 loops -> 2 + 3 decode steps.
    assert len(seen) == stats.num_steps == 1 + 2 + 3
    assert sum(rows for _, rows in seen) == stats.num_rows == 4 * 11 + 2 + 3
    assert [s.step_id for s, _ in seen] == sorted(s.step_id for s, _ in seen)
    # "short" finished with its first token in step 1; its release rides on step 2.
    assert seen[1][0].finished_request_ids == ("short",)
    assert stats.num_output_tokens == 4 and stats.num_loops == 4 + 1 + 2 + 3
    assert stats.num_early_exits == 3  # 1, 2 and 3 loops < 4
    assert stats.num_finalize_copies == 2  # the two decode tokens exited early
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
    # "long" finished in the last step; the idle core flushed its release at once.
    assert sim.executor.num_live_handles == 0
    remove()
    submit(sim, "after", 3, 1, (4,))
    core.step()
    assert len(seen) == 6  # removed observers are not called


def test_abort_between_steps_is_delivered_with_the_next_output():
    sim = make_sim()
    core = sim.core
    seen: list[SchedulerOutput] = []
    core.add_observer(lambda s, o: seen.append(s))
    submit(sim, "a", 4, 5, (4,))
    submit(sim, "b", 4, 5, (4,))
    core.step()
    core.step()  # decode loop 0 of both: their decode state is in flight
    assert sim.executor.num_live_handles == 2
    assert core.abort_request("a") is not None
    assert core.stats().num_running == 1
    core.step()
    assert seen[-1].finished_request_ids == ("a",)
    assert seen[-1].decode.request_ids == ("b",)
    assert sim.executor.num_live_handles == 1
    core.finish_request(sim.scheduler.requests["b"], FinishReason.STOP)
    assert sim.executor.num_live_handles == 0  # idle: flushed without a step


def test_failing_execute_fails_only_the_requests_of_that_step():
    sim = make_sim(max_num_seqs=1)
    core = sim.core
    submit(sim, "first", 4, 2, (4,))
    submit(sim, "second", 4, 2, (4,))  # waits: one sequence at a time
    real_execute = sim.executor.execute

    def failing(scheduled):
        raise RuntimeError("injected")

    sim.executor.execute = failing  # type: ignore[method-assign]
    result = core.step()
    assert [r.request_id for r in result.failed] == ["first"] and result.output is None
    assert str(result.error) == "injected"
    sim.executor.execute = real_execute  # type: ignore[method-assign]
    finished = []
    while core.has_unfinished_requests():
        finished += [r.request_id for r in core.step().touched if r.is_finished]
    assert finished == ["second"]
    stats = core.stats()
    assert stats.num_failed_steps == 1 and stats.num_output_tokens == 2


def test_failing_execute_also_fails_requests_it_only_announced():
    """Atomic prompts alternate with decode: "b" is admitted (announced in `new_requests`) in
    a decode step that carries only "a"'s row. The executor may have raised before setting "b"
    up, so "b" fails with the step instead of running later without its state."""
    sim = make_sim()
    core = sim.core
    submit(sim, "a", 4, 3, (4,))
    core.step()  # a's prompt and first token
    submit(sim, "b", 4, 2, (4,))

    def failing(scheduled):
        raise RuntimeError("injected")

    real_execute = sim.executor.execute
    sim.executor.execute = failing  # type: ignore[method-assign]
    result = core.step()
    assert sim.scheduler.has_pending_releases()  # the failing executor could not take them
    sim.executor.execute = real_execute  # type: ignore[method-assign]
    assert result.scheduled.decode.request_ids == ("a",)
    assert [new.request_id for new in result.scheduled.new_requests] == ["b"]
    assert [r.request_id for r in result.failed] == ["a", "b"]
    assert result.errors == {"a": "RuntimeError: injected", "b": "RuntimeError: injected"}
    assert all(r.finish_reason is FinishReason.ABORT for r in result.failed)
    assert core.stats().kv_blocks_used == 0
    sim.scheduler.check_invariants()
    assert core.step().scheduled.finished_request_ids == ("a", "b")
    assert not sim.scheduler.has_pending_releases() and sim.executor.num_live_handles == 0
