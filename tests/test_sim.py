"""The simulated executor: cost model figures, workloads, contract parity with the real engine.

The parity tests run the same offline workload (trace exits, ignore_eos) through `LLMEngine`
on a tiny CPU model and through the simulator, and require the identical sequence of
scheduled items: the simulator drives the real scheduler, so any contract mismatch in
`SimExecutor` (exits, first tokens, handles) shows up as a different schedule.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from loopserve.contracts import DecodeRow, PromptChunk, SchedulerOutput
from loopserve.engine.llm_engine import LLMEngine
from loopserve.errors import ConfigError
from loopserve.exit import ExitRule
from loopserve.exit.columns import CONTINUE, EXIT, GATE
from loopserve.models.config import OuroConfig
from loopserve.sampling_params import SamplingParams
from loopserve.sim.cost_model import HUGINN_0125, OURO_1P4B, CostModel, ModelShape
from loopserve.sim.executor import SimExecutor
from loopserve.sim.hardware import DEVICE_PROFILES, get_device_profile
from loopserve.sim.metrics import summarize
from loopserve.sim.scenarios import InterferenceSpec, run_interference, run_wcpb
from loopserve.sim.simulator import Simulator
from loopserve.sim.workload import (
    SimRequest,
    WorkloadSpec,
    build_workload,
    exit_distribution,
    poisson_arrivals,
)
from tests.engine_utils import decode_rows

H200 = get_device_profile("h200")


# ---- cost model ----------------------------------------------------------------------------


def test_ouro_1p4b_shape_reproduces_data_md_figures():
    shape = ModelShape.from_config(OURO_1P4B)
    assert round(shape.core_params / 1e9, 3) == 1.233
    assert round(shape.core_weight_bytes / 1e9, 3) == 2.467
    assert shape.kv_bytes_per_token_per_depth == 196_608


def test_batch_one_loop_on_h200_is_weight_bandwidth_bound_near_0p57_ms():
    cost = CostModel(ModelShape.from_config(OURO_1P4B), H200)
    loop_ms = cost.decode_loop_time(1, 1) * 1e3
    assert 0.55 <= loop_ms <= 0.62
    assert not cost.core_call(rows=1, kv_read_positions=1, attention_pairs=1).compute_bound
    assert (
        150 <= cost.linear_ridge_rows() <= 210
    )  # an H200 is compute-bound from ~184 rows (docs/simulator.md)
    assert cost.core_call(rows=512).compute_bound


def test_call_time_grows_with_rows_context_and_finalize():
    cost = CostModel(ModelShape.from_config(OURO_1P4B), H200)
    by_rows = [cost.decode_loop_time(b, 512) for b in (1, 8, 64, 256, 1024)]
    by_context = [cost.decode_loop_time(32, c) for c in (1, 128, 1024, 8192)]
    assert by_rows == sorted(by_rows) and by_rows[0] < by_rows[-1]
    assert by_context == sorted(by_context) and by_context[0] < by_context[-1]
    plain = cost.core_call(rows=64, kv_read_positions=64 * 100, attention_pairs=64 * 100)
    with_copies = cost.core_call(
        rows=64, kv_read_positions=64 * 100, attention_pairs=64 * 100, finalize_copies=64
    )
    assert with_copies.time_s > plain.time_s
    assert cost.coda(0).time_s == 0.0 < cost.coda(1).time_s < cost.coda(64).time_s


def test_faster_devices_are_faster():
    shape = ModelShape.from_config(OURO_1P4B)
    times = {
        name: CostModel(shape, d).decode_loop_time(64, 512) for name, d in DEVICE_PROFILES.items()
    }
    assert times["a100"] > times["h100"] > times["h200"] > times["b200"]


# ---- workloads -----------------------------------------------------------------------------


def test_workload_is_seeded_and_exit_traces_follow_the_distribution():
    spec = WorkloadSpec(200, dataset="synthetic", request_rate=5.0, seed=3)
    first, again = build_workload(spec, 4), build_workload(spec, 4)
    assert first == again
    other = build_workload(WorkloadSpec(200, dataset="synthetic", request_rate=5.0, seed=4), 4)
    assert first != other
    loops = np.concatenate([r.exit_trace for r in first])
    assert all(len(r.exit_trace) == r.output_len for r in first)
    shares = [(loops == k).mean() for k in (1, 2, 3, 4)]
    assert shares[0] == 0.0 and abs(shares[2] - 0.877) < 0.02 and abs(loops.mean() - 3.04) < 0.03


def test_poisson_arrivals_have_the_requested_rate_and_inf_means_offline():
    arrivals = poisson_arrivals(20_000, 10.0, np.random.default_rng(0))
    assert arrivals == sorted(arrivals)
    assert abs(len(arrivals) / arrivals[-1] - 10.0) < 0.3
    assert poisson_arrivals(3, math.inf, np.random.default_rng(0)) == [0.0, 0.0, 0.0]


def test_named_exit_distributions():
    assert exit_distribution("full", 4).sample(np.random.default_rng(0), 5) == (4,) * 5
    assert exit_distribution("uniform", 4).mean_loops == pytest.approx(2.5)
    assert exit_distribution("trace:2,3", 4).sample(np.random.default_rng(0), 5) == (2, 3, 2, 3, 2)
    assert exit_distribution("probs:0,1,1,0", 4).mean_loops == pytest.approx(2.5)
    with pytest.raises(ValueError):
        exit_distribution("trace:5", 4)


# ---- executor contract ---------------------------------------------------------------------


def _decode_step(step_id: int, depth: int, **kw) -> SchedulerOutput:
    """One decode row of request "r" at position 10 (token 1 fed at loop 0)."""
    row = dict(request_id="r", position=10, depth=depth, token_id=1, exit_code=CONTINUE,
               needs_gate=False, cdf_before=0.0, survival_before=1.0, threshold=1.0)  # fmt: skip
    return SchedulerOutput(step_id, (), decode=decode_rows(DecodeRow(**{**row, **kw})))


def test_gated_decode_exits_at_the_drawn_target():
    cost = CostModel(ModelShape.from_config(OURO_1P4B), H200)
    executor = SimExecutor(cost, exit_mode="ouro", exit_dist=exit_distribution("trace:3", 4))
    from loopserve.contracts import NewRequestData, SampleSpec

    new = (NewRequestData("r", SampleSpec(), None),)
    exits = []
    for depth in range(3):
        scheduled = _decode_step(depth + 1, depth, exit_code=GATE, needs_gate=True, threshold=0.5)
        if depth == 0:
            scheduled = dataclasses.replace(scheduled, new_requests=new)
        result = executor.execute(scheduled).decode
        exits.append((float(result.hazards[0]), bool(result.exited[0]), int(result.token_ids[0])))
    assert exits == [(0.0, False, -1), (0.0, False, -1), (1.0, True, 1)]
    assert executor.num_live_handles == 1  # the request's decode state, until it is released
    executor.execute(SchedulerOutput(4, (), finished_request_ids=("r",)))
    assert executor.num_live_handles == 0


@pytest.mark.parametrize("graphed", [False, True])
def test_a_graphed_decode_step_prices_its_leave_over_every_row(graphed):
    """The captured decode step runs the lm_head (and its argmax) over every row of a call
    with a coda candidate, and no leave in a call without one; an eager call runs it over
    the exiting rows. So the simulator prices 4 coda rows for 1 exit of 4 rows graphed, 1
    eager, and none for a call with no candidate either way."""
    from loopserve.contracts import NewRequestData, SampleSpec

    cost = CostModel(ModelShape.from_config(OURO_1P4B), H200)
    executor = SimExecutor(cost, graphed=graphed)
    row = dict(position=10, token_id=1, needs_gate=False, cdf_before=0.0,
               survival_before=1.0, threshold=1.0)  # fmt: skip
    ids = ("a", "b", "c", "d")
    new = tuple(NewRequestData(r, SampleSpec(), None) for r in ids)
    first = decode_rows(*(DecodeRow(r, depth=0, exit_code=CONTINUE, **row) for r in ids))
    out = executor.execute(SchedulerOutput(1, (), new_requests=new, decode=first))
    assert executor.stats.coda_rows == 0 and executor.stats.coda_time_s == 0.0
    codes = (EXIT, CONTINUE, CONTINUE, CONTINUE)
    second = decode_rows(*(DecodeRow(r, depth=1, exit_code=c, **row) for r, c in zip(ids, codes)))
    out = executor.execute(SchedulerOutput(2, (), decode=second))
    assert out.decode.exited.tolist() == [True, False, False, False]
    assert executor.stats.coda_rows == (4 if graphed else 1)
    eager = cost.coda(1).time_s
    assert (executor.stats.coda_time_s > eager) == graphed
    assert executor.stats.coda_time_s == pytest.approx(cost.coda(4 if graphed else 1).time_s)


def test_resuming_from_an_unknown_handle_fails_loudly():
    cost = CostModel(ModelShape.from_config(OURO_1P4B), H200)
    executor = SimExecutor(cost)
    with pytest.raises(AssertionError, match="never kept"):
        executor.execute(_decode_step(1, depth=1))
    item = PromptChunk("r", 0, 8, 1, 1, 7, False)  # a chunk at depth 1
    with pytest.raises(AssertionError, match="never kept"):
        executor.execute(SchedulerOutput(2, (item,)))


def test_first_token_uses_its_trace_and_atomic_prompt_runs_d_calls():
    cost = CostModel(ModelShape.from_config(OURO_1P4B), H200)
    executor = SimExecutor(cost)
    from loopserve.contracts import NewRequestData, SampleSpec

    item = PromptChunk(
        "r", 0, 32, 0, 4, 7, True, (1,) * 32,
        first_token=True, exit_rule=ExitRule(1, 4, 1.0), trace_loops=2,
    )  # fmt: skip
    out = executor.execute(
        SchedulerOutput(1, (item,), (), (NewRequestData("r", SampleSpec(), None),))
    )
    assert out.stats.rows_per_core_call == (32, 32, 32, 32)
    assert out.results[0].loops_used == 2 and out.results[0].sampled is not None
    assert out.stats.model_time_s > 4 * cost.core_call(rows=32).time_s * 0.99


# ---- simulator vs the real engine ------------------------------------------------------------

PARITY_CASES = [
    ({"mode": "refill"}, 256),
    ({"mode": "no_refill"}, 256),
    ({"mode": "refill"}, 40),  # KV-limited admission
    ({"mode": "refill", "prefill_mode": "wavefront"}, 256),
    ({"mode": "refill", "mixed_prefill_decode": True}, 256),
]


def _parity_workload() -> list[SimRequest]:
    rng = np.random.default_rng(7)
    dist = exit_distribution("uniform", 4)
    lengths = [(5, 6), (37, 4), (20, 9), (3, 1), (50, 5), (17, 7), (9, 12), (28, 3)]
    return [
        SimRequest(f"req-{i}", 0.0, p, o, dist.sample(rng, o)) for i, (p, o) in enumerate(lengths)
    ]


def _engine_schedule(tiny_dir, engine_args, workload) -> list[tuple]:
    engine = LLMEngine.from_engine_args(model=str(tiny_dir), dtype="float32", **engine_args)
    steps: list[tuple] = []

    def record(scheduled, _output) -> None:
        steps.append(tuple(scheduled.row_groups()))

    engine.core.add_observer(record)
    rng = np.random.default_rng(1)
    for req in workload:
        prompt = rng.integers(3, 500, size=req.prompt_len).tolist()
        params = SamplingParams(
            max_tokens=req.output_len, temperature=0.0, ignore_eos=True, exit_trace=req.exit_trace
        )
        engine.add_request(req.request_id, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return steps


@pytest.mark.parametrize(("extra_args", "num_blocks"), PARITY_CASES)
def test_simulator_schedules_exactly_like_the_real_engine(tiny_dir, extra_args, num_blocks):
    engine_args = dict(
        num_blocks=num_blocks, exit_mode="trace", max_num_seqs=4, max_num_batched_tokens=48,
        prefill_chunk_size=16, **extra_args,
    )  # fmt: skip
    workload = _parity_workload()
    # Every case is a supported configuration: a setup error (ConfigError) is a failure.
    expected = _engine_schedule(tiny_dir, engine_args, workload)
    model_config = OuroConfig.from_file(tiny_dir / "config.json")
    sim = Simulator(model_config, H200, engine_args)
    run = sim.run(workload, on_step=lambda s: s.check_invariants(), record_items=True)
    assert run.step_items == expected
    assert all(len(r.token_times_s) == r.output_len for r in run.records)
    assert [r.exit_depths for r in run.records] == [list(r.exit_trace) for r in workload]


# ---- simulator invariants ------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_simulated_serving_finishes_everything_and_frees_all_kv(mode):
    spec = WorkloadSpec(
        60, dataset="synthetic", request_rate=40.0, input_len=64, output_len=32, seed=2
    )
    workload = build_workload(spec, 4)
    sim = Simulator(
        OURO_1P4B,
        H200,
        {"mode": mode, "max_num_seqs": 16, "prefill_chunk_size": 128, "num_blocks": 1024},
    )
    run = sim.run(workload, on_step=lambda s: s.check_invariants(), max_concurrency=24)
    result = summarize(run)
    assert result.num_finished == 60 and result.num_output_tokens == sum(
        r.output_len for r in workload
    )
    assert not sim.scheduler.has_unfinished_requests()
    assert sim.core.stats().kv_blocks_used == 0
    assert sim.executor.num_live_handles == 0
    assert 0.0 < result.gpu_busy_share <= 1.0 + 1e-9
    assert result.ttft.p50_s > 0 and result.tpot.p50_s > 0
    assert result.mean_loops_per_token == pytest.approx(
        np.concatenate([r.exit_trace for r in workload]).mean()
    )
    arrivals = {r.request_id: r.arrival_s for r in workload}
    assert all(rec.arrival_s >= arrivals[rec.request_id] for rec in run.records)


def test_kv_blocks_come_from_simulated_hbm_left_after_weights():
    sim = Simulator(OURO_1P4B, get_device_profile("h100"), {"max_num_seqs": 128})
    shape = sim.shape
    inflight_bytes = 128 * (1 + 4) * shape.hidden_size * 2  # atomic: one row + D last rows
    budget = int((80e9 - shape.total_weight_bytes) * 0.9) - inflight_bytes
    # Prefix caching is on (LAST_EXITED): each slot also keeps a hidden vector (score store).
    per_block = (shape.kv_bytes_per_token_per_depth + shape.hidden_size * 2) * 16
    assert sim.config.cache.num_blocks == budget // per_block
    plain = Simulator(
        OURO_1P4B,
        get_device_profile("h100"),
        {"max_num_seqs": 128, "enable_prefix_caching": False},
    )
    assert plain.config.cache.num_blocks == budget // (shape.kv_bytes_per_token_per_depth * 16)


@pytest.mark.parametrize("exit_mode", ["ouro", "ouro_delayed"])
def test_gated_exit_modes_follow_the_exit_distribution(exit_mode):
    dist = exit_distribution("probs:0,0.5,0.5,0", 4)
    spec = WorkloadSpec(24, dataset="synthetic", input_len=16, output_len=40, seed=5)
    sim = Simulator(
        OURO_1P4B,
        H200,
        {"exit_mode": exit_mode, "max_num_seqs": 8, "num_blocks": 512},
        exit_dist=dist,
    )
    run = sim.run(build_workload(spec, 4), on_step=lambda s: s.check_invariants())
    loops = np.concatenate([r.exit_depths for r in run.records])
    assert set(loops.tolist()) == {2, 3}
    assert abs(loops.mean() - 2.5) < 0.1
    assert sim.executor.num_live_handles == 0


def test_phase_roofline_never_hides_kv_traffic_under_gemm_compute():
    shape = ModelShape.from_config(OURO_1P4B)
    call, phase = CostModel(shape, H200), CostModel(shape, H200, roofline="phase")
    decode = dict(rows=64, kv_read_positions=64 * 500, attention_pairs=64 * 500)
    assert phase.core_call(**decode).time_s == pytest.approx(call.core_call(**decode).time_s)
    mixed = dict(
        rows=512 + 64,
        prelude_rows=512,
        kv_read_positions=512 + 64 * 2000,
        attention_pairs=512 * 513 // 2 + 64 * 2000,
    )
    assert phase.core_call(**mixed).time_s > 1.2 * call.core_call(**mixed).time_s


def test_wcpb_scenario_fills_calls_with_chunks_at_different_depths():
    points = run_wcpb(
        OURO_1P4B,
        get_device_profile("a100"),
        prompt_lens=(1024, 1024),
        chunk_sizes=(16,),
        max_num_batched_tokens=128,
    )
    by_arm = {p.arm: p for p in points}
    atomic, wave = by_arm["atomic"], by_arm["wavefront"]
    assert atomic.rows_per_prompt_core_call == 32.0  # one 16-row chunk per prompt per call
    assert wave.rows_per_prompt_core_call > 3 * atomic.rows_per_prompt_core_call
    assert wave.prompt_tokens_per_s > atomic.prompt_tokens_per_s  # weight-bound small calls


def test_interference_scenario_mixed_calls_cut_decode_itl():
    spec = InterferenceSpec(
        num_decode=8,
        decode_prompt_len=16,
        decode_max_tokens=256,
        prompt_lens=(1024, 1024),
        inject_at=(4, 6),
        prefill_chunk_size=128,
        max_num_batched_tokens=512,
    )
    h200 = get_device_profile("h200")
    atomic, mixed = (run_interference(OURO_1P4B, h200, spec, arm) for arm in ("atomic", "mixed"))
    assert atomic.num_mixed_core_calls == 0 < mixed.num_mixed_core_calls
    assert mixed.decode_rows_per_core_call > atomic.decode_rows_per_core_call
    assert mixed.itl_p99_ms < atomic.itl_p99_ms
    assert atomic.prompt_token_loops_per_s > 0 and mixed.ttft_mean_s > 0
    with pytest.raises(ConfigError, match="finished before the prompts"):
        run_interference(OURO_1P4B, h200, dataclasses.replace(spec, decode_max_tokens=8), "atomic")
    with pytest.raises(ConfigError, match="unknown arm"):
        run_interference(OURO_1P4B, h200, spec, "nope")


def test_simulate_cli_runs_a_scenario(tmp_path, capsys):
    from loopserve.cli.main import main

    argv = ["simulate", "--scenario", "wcpb", "--prompt-lens", "256,256", "--chunk-sizes", "32"]
    argv += ["--max-num-batched-tokens", "256", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    record = json.loads((tmp_path / "scenario_wcpb.json").read_text())
    assert [r["arm"] for r in record["results"]] == ["atomic", "wavefront"]
    assert "wavefront" in capsys.readouterr().out


def test_the_criterion_exit_mode_follows_the_exit_distribution_on_huginn():
    """`criterion` in the simulator (Huginn-0125, 32 steps): a row's synthetic check fires at
    its drawn step, decided by `decide_criterion_exits`; steps follow the distribution."""
    from loopserve.sim.cost_model import HUGINN_0125

    probs = [0.0] * 32
    probs[9] = probs[19] = 0.5  # exits after 10 or 20 steps
    dist = exit_distribution("probs:" + ",".join(str(p) for p in probs), 32)
    spec = WorkloadSpec(
        16, dataset="synthetic", input_len=16, output_len=24, seed=3, exit_dist="full"
    )  # fmt: skip (traces unused here)
    sim = Simulator(
        HUGINN_0125,
        H200,
        {"exit_mode": "criterion", "max_num_seqs": 8, "num_blocks": 512},
        exit_dist=dist,
    )
    run = sim.run(build_workload(spec, 32), on_step=lambda s: s.check_invariants())
    steps = np.concatenate([r.exit_depths[1:] for r in run.records])  # decode tokens
    assert set(steps.tolist()) == {10, 20}
    assert abs(steps.mean() - 15) < 1.5


def test_kernel_pricing_adds_each_launched_kernel_to_a_calls_time():
    """`kernel_s` charges every kernel a call launches beyond its roofline: a core call
    `per_layer x layers + per_loop` kernels, the coda and sampling their own; off (0) it
    changes nothing, and a fused count (`kernels_per_layer`) charges fewer."""
    from loopserve.sim.cost_model import CODA_KERNELS, KERNEL_COUNTS, SAMPLING_KERNELS

    h200 = get_device_profile("h200")
    shape = ModelShape.from_config(OURO_1P4B)
    per_layer, per_loop = KERNEL_COUNTS["ouro"]
    assert (shape.kernels_per_layer, shape.kernels_per_loop) == (per_layer, per_loop)
    plain = CostModel(shape, h200)
    off = CostModel(shape, dataclasses.replace(h200, kernel_s=0.0))
    priced = CostModel(shape, dataclasses.replace(h200, kernel_s=2e-6))
    fused = CostModel(shape, dataclasses.replace(h200, kernel_s=2e-6, kernels_per_layer=10))
    call = dict(rows=1, kv_read_positions=100, attention_pairs=100)
    assert off.core_call(**call) == plain.core_call(**call)
    kernels = per_layer * 24 + per_loop
    assert priced.core_call(**call).time_s == pytest.approx(
        plain.core_call(**call).time_s + kernels * 2e-6
    )
    assert fused.core_call(**call).time_s == pytest.approx(
        plain.core_call(**call).time_s + (10 * 24 + per_loop) * 2e-6
    )
    assert priced.coda(1).time_s == pytest.approx(plain.coda(1).time_s + CODA_KERNELS * 2e-6)
    assert priced.sampling(1).time_s == pytest.approx(
        plain.sampling(1).time_s + SAMPLING_KERNELS * 2e-6
    )
    assert plain.core_call(**call).bytes_moved == priced.core_call(**call).bytes_moved


def test_fused_linears_price_narrow_prelude_and_coda_layers_at_the_fused_count():
    """Huginn's prelude and coda run the core's blocks, fused the same way: with
    `fused_linears` a narrow call's prelude and coda layers cost the fused per-layer count,
    a wide one's today's."""
    from loopserve.sim.cost_model import FUSED_LINEAR_KERNEL_COUNTS, KERNEL_COUNTS

    h200 = dataclasses.replace(get_device_profile("h200"), kernel_s=2e-6)
    shape = ModelShape.from_config(HUGINN_0125)
    plain = CostModel(shape, h200)
    fused = CostModel(shape, dataclasses.replace(h200, fused_linears=True))
    fewer = (KERNEL_COUNTS["huginn"][0] - FUSED_LINEAR_KERNEL_COUNTS["huginn"][0]) * 2e-6
    for rows, layers_saved in ((4, 2), (17, 0)):  # 2 coda layers on narrow calls only
        coda = dict(rows=rows, kv_read_positions=50 * rows, attention_pairs=50 * rows)
        assert fused.coda(**coda).time_s == pytest.approx(
            plain.coda(**coda).time_s - layers_saved * fewer
        ), rows
    call = dict(rows=4, prelude_rows=4, kv_read_positions=400, attention_pairs=400)
    core_only = dict(call, prelude_rows=0)
    prelude_saved = (plain.core_call(**call).time_s - plain.core_call(**core_only).time_s) - (
        fused.core_call(**call).time_s - fused.core_call(**core_only).time_s
    )
    assert prelude_saved == pytest.approx(2 * fewer)  # 2 prelude layers


def test_fused_linears_price_narrow_core_calls_at_the_fused_count():
    """`fused_linears`: a core call of up to 16 rows launches the fused build's kernels
    (5 per layer + 1 per loop for Ouro), a wider one today's; off, every call today's."""
    from loopserve.sim.cost_model import FUSED_LINEAR_KERNEL_COUNTS, KERNEL_COUNTS

    h200 = dataclasses.replace(get_device_profile("h200"), kernel_s=2e-6)
    shape = ModelShape.from_config(OURO_1P4B)
    plain = CostModel(shape, h200)
    fused = CostModel(shape, dataclasses.replace(h200, fused_linears=True))
    (f_layer, f_loop), (layer, loop) = FUSED_LINEAR_KERNEL_COUNTS["ouro"], KERNEL_COUNTS["ouro"]
    for rows, kernels in ((1, f_layer * 24 + f_loop), (16, f_layer * 24 + f_loop),
                          (17, layer * 24 + loop)):  # fmt: skip
        call = dict(rows=rows, kv_read_positions=100 * rows, attention_pairs=100 * rows)
        saved = (layer * 24 + loop - kernels) * 2e-6
        assert fused.core_call(**call).time_s == pytest.approx(
            plain.core_call(**call).time_s - saved
        ), rows
