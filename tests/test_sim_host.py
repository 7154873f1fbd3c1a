"""The simulator's host-time model: fitted from `bench host` points, priced per core call,
serial without async scheduling and (ideally) overlapped with it, host-bound steps reported."""

from __future__ import annotations

import gc
import json

import pytest

from loopserve.errors import ConfigError
from loopserve.runner import sampler
from loopserve.sim import host_bench
from loopserve.sim.cost_model import OURO_1P4B
from loopserve.sim.hardware import get_device_profile
from loopserve.sim.host_model import MEASURED_CPU, HostModel, load_host_model, step_time_s
from loopserve.sim.simulator import simulate
from loopserve.sim.workload import WorkloadSpec, build_workload

ARGS = dict(mode="refill", exit_mode="trace", max_num_seqs=32, max_num_batched_tokens=2048,
            prefill_chunk_size=512)  # fmt: skip


def _workload():
    spec = WorkloadSpec(48, dataset="synthetic", exit_dist="ouro_1p4b_t0.5", seed=1,
                        input_len=128, output_len=64, range_ratio=0.5)  # fmt: skip
    return build_workload(spec, OURO_1P4B.num_loops)


def test_fit_recovers_a_known_line():
    points = [(rows, 40e-6 + 3e-6 * rows) for rows in (1, 8, 32, 128)]
    model = HostModel.fit(points)
    assert model.per_call_s == pytest.approx(40e-6) and model.per_row_s == pytest.approx(3e-6)
    assert model.step_s([10, 20]) == pytest.approx(2 * 40e-6 + 30 * 3e-6)
    assert step_time_s(1.0, 0.4, overlap=False) == 1.4
    assert step_time_s(1.0, 0.4, overlap=True) == 1.0 and step_time_s(1.0, 3.0, overlap=True) == 3.0


def test_host_time_slows_the_simulated_run_and_marks_host_bound_steps():
    device, workload = get_device_profile("h200"), _workload()
    plain = simulate(OURO_1P4B, device, workload, ARGS)
    slow = HostModel(per_call_s=5e-3, per_row_s=0.0)  # far above any device call here
    priced = simulate(OURO_1P4B, device, workload, ARGS, host_model=slow)
    assert plain.host_bound_step_share == 0.0 and plain.host_busy_share == 0.0
    assert priced.host_bound_step_share > 0.95  # all but big prompt steps
    assert priced.duration_s > plain.duration_s + 5e-3 * priced.num_core_calls * 0.99
    assert priced.num_output_tokens == plain.num_output_tokens  # same work, priced slower


def test_async_scheduling_overlaps_host_and_device_time():
    device, workload = get_device_profile("h200"), _workload()
    host = HostModel(per_call_s=1e-3, per_row_s=0.0)
    args = dict(ARGS, exit_mode="trace")
    serial = simulate(OURO_1P4B, device, workload, args, host_model=host)
    overlapped = simulate(OURO_1P4B, device, workload, dict(args, async_scheduling=True),
                          host_model=host)  # fmt: skip
    assert overlapped.duration_s < serial.duration_s


def test_load_host_model_takes_cpu_or_a_bench_host_file(tmp_path):
    assert load_host_model(None) is None
    assert load_host_model("cpu") is MEASURED_CPU and MEASURED_CPU.per_row_s > 0
    path = tmp_path / "host.json"
    path.write_text(json.dumps({"points": [{"rows": 1, "host_us": 50.0},
                                           {"rows": 101, "host_us": 250.0}]}))  # fmt: skip
    model = load_host_model(str(path))
    assert model.per_call_s == pytest.approx(48e-6) and model.per_row_s == pytest.approx(2e-6)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="bench host JSON"):
        load_host_model(str(tmp_path / "bad.json"))


@pytest.mark.parametrize(
    "family, exit", [("ouro", "trace"), ("ouro", "signal"), ("huginn", "trace")]
)
def test_bench_host_calls_have_the_rows_and_exit_regime_asked_for(monkeypatch, family, exit):
    """`bench host`'s family comparison: every measured step is one call of exactly `rows`
    decode rows; Ouro's trace arm reads no signal, while its `signal` arm and Huginn's read
    their exit signal on every row of every call (the same regime, so the families compare)."""
    seen = {"rows": 0, "gated": 0}
    null_core = host_bench.null_core

    def watching(engine):
        null_core(engine)

        def watch(scheduled, _output):
            if scheduled.decode is not None:
                seen["rows"] += len(scheduled.decode)
                seen["gated"] += int(scheduled.decode.needs_gate.sum())

        engine.core.add_observer(watch)

    monkeypatch.setattr(host_bench, "null_core", watching)
    point = host_bench.measure(4, context=24, steps=6, device_profile="h200", family=family,
                               exit=exit)  # fmt: skip
    assert point.num_calls == 6 and point.host_us > 0
    reads_signal = family == "huginn" or exit == "signal"
    assert (seen["gated"] > 0) == reads_signal
    if reads_signal:  # every row but each token's last loop (its max_loops: no signal read)
        assert seen["gated"] >= seen["rows"] // 2


def test_bench_host_refuses_contexts_the_checkpoint_cannot_hold():
    """The tiny Huginn checkpoint holds 256 positions: the default --context 256 asks for more
    per request, a usage error naming the flags (the engine's generic length error told the
    user nothing about --context)."""
    with pytest.raises(ConfigError, match="--context 256 with --steps 60 needs 379 positions"):
        host_bench.measure(8, context=256, steps=60, device_profile="h200", family="huginn")


@pytest.mark.parametrize("temperature, top_p, draws", [(0.0, 1.0, False), (0.8, 0.9, True)])
def test_bench_host_samples_when_told_from_the_command_line(
    monkeypatch, tmp_path, temperature, top_p, draws
):
    """`bench host --temperature T --top-p P`: every request samples (one seeded draw per
    exiting token, top-p filtering before it); without the flags every token is greedy."""

    from loopserve.cli.main import main

    seen = {"draws": 0, "top_p": set()}
    draw_rows, filtered = sampler.draw_rows, sampler.filtered_probs

    def draw(probs, rows, *args):
        seen["draws"] += len(rows)
        return draw_rows(probs, rows, *args)

    def filtering(logits, spec):
        seen["top_p"].add(spec.top_p)
        return filtered(logits, spec)

    monkeypatch.setattr(sampler, "draw_rows", draw)
    monkeypatch.setattr(sampler, "filtered_probs", filtering)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the command sets it; restored after the test
    out = tmp_path / "host.json"
    argv = ["bench", "host", "--rows", "4", "--steps", "6", "--context", "24",
            "--temperature", str(temperature), "--top-p", str(top_p), "--output-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert [p["rows"] for p in json.loads(out.read_text())["points"]] == [4]
    assert (seen["draws"] > 0) == draws
    assert seen["top_p"] == ({top_p} if draws else set())


def test_bench_host_reports_the_run_with_the_median_host_time(monkeypatch):
    """`--segments 3`: the measured calls run in three runs of steps / 3 calls each, and
    the point is the run with the median host time (a burst of other work spoils a run,
    not the median), each run's time kept beside it; more runs than steps is refused."""
    runs = iter([5.0, 1.0, 3.0])
    seen_calls = []

    def fake(engine, rows, calls, device_us):
        seen_calls.append(calls)
        return host_bench.HostPoint(rows, calls, next(runs), 0.0, 0.0, 0.0, 0.0, device_us)

    monkeypatch.setattr(host_bench, "_measure_calls", fake)
    point = host_bench.measure(4, context=24, steps=6, device_profile="h200", segments=3)
    assert seen_calls == [2, 2, 2]
    assert point.host_us == 3.0 and point.segment_host_us == (5.0, 1.0, 3.0)
    with pytest.raises(ConfigError, match="--segments must be between 1 and --steps"):
        host_bench.measure(4, context=24, steps=6, device_profile="h200", segments=7)


@pytest.mark.parametrize("freeze", [True, False])
def test_bench_host_measures_calls_with_the_heap_frozen_as_a_server_does(monkeypatch, freeze):
    """The calls run with the start-up heap frozen (as `loopserve serve` runs once its
    engine loads; `--no-freeze-heap`: not), the heap is given back afterwards, and the
    point carries one full collection's pause both ways (the benchmark prints them; no
    time is asserted here)."""
    frozen_during = []

    def fake(engine, rows, calls, device_us):
        frozen_during.append(gc.get_freeze_count())
        return host_bench.HostPoint(rows, calls, 1.0, 0.0, 0.0, 0.0, 0.0, device_us)

    monkeypatch.setattr(host_bench, "_measure_calls", fake)
    point = host_bench.measure(4, context=24, steps=6, device_profile="h200", freeze_heap=freeze)
    assert (frozen_during[0] > 0) is freeze and gc.get_freeze_count() == 0
    # Frozen objects are still freed when their last reference goes (another thread of the
    # test process may drop some between the freeze and the calls): the count can only fall.
    assert (0 < frozen_during[0] <= point.num_frozen) if freeze else point.num_frozen == 0
    assert (point.gc_frozen_ms is not None) is freeze


def test_bench_host_can_replay_the_steps_device_work_and_keeps_the_host_path(monkeypatch):
    """`--replay-device-work`: the emulated step's tensor work runs once per bucket and form
    and its outputs are reused, while every measured call still stages its rows, launches
    and reads them back (one copy each way) with the rows asked for; calls whose exits the
    device decides are refused by name."""
    seen = {}
    replay = host_bench.replay_device_work_of

    def watched(engine):
        seen["engine"], seen["runs"] = engine, replay(engine)
        return seen["runs"]

    monkeypatch.setattr(host_bench, "replay_device_work_of", watched)
    emulate = {"graph_mode": "emulate"}
    point = host_bench.measure(4, context=24, steps=6, device_profile="h200",
                               engine_args=emulate, replay_device_work=True)  # fmt: skip
    stats = seen["engine"].stats
    assert point.num_calls == stats.num_graph_calls == 6  # counted over the measured calls
    assert seen["runs"] and set(seen["runs"].values()) == {1}  # once per bucket and form
    assert stats.num_h2d_transfers >= 6 and stats.num_d2h_transfers > 0  # staged and read
    with pytest.raises(ConfigError, match="--replay-device-work needs calls whose exits"):
        host_bench.measure(4, context=24, steps=6, device_profile="h200", exit="signal",
                           engine_args=emulate, replay_device_work=True)  # fmt: skip
    with pytest.raises(ConfigError, match="it needs --graph-mode emulate"):
        host_bench.measure(4, context=24, steps=6, device_profile="h200",
                           engine_args={"graph_mode": "off"}, replay_device_work=True)  # fmt: skip
