"""Coda batching in time (scheduler/leave_batch.py): a decode token whose loops exit is held
until a batch of leaves (coda, lm_head, sampling) runs it with other held tokens, and its
next token starts in that step. Tokens and exit depths stay those of the dense references
for both families in every decode mode, layout, prompt arm and preemption mode, through the
decode graphs, prefix hits and a prefill/decode hand-off; the batcher's rule, the auto
choice per family and the simulator's pricing of it are checked directly."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from loopserve.config import EngineConfig, resolve_coda_batching
from loopserve.errors import ConfigError
from loopserve.exit import ExitMode, ExitRule
from loopserve.models.family import once_weight
from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopserve.sampling_params import SamplingParams
from loopserve.scheduler.decode_table import DecodeTable
from loopserve.scheduler.leave_batch import LeaveBatcher
from tests.engine_utils import assert_match_reference, make_engine, pairwise, run_steps
from tests.test_huginn_engine import assert_matches_reference, assert_released, reference
from tests.test_preemption import PROMPT_ARMS, assert_all_released, priority_workload


@pytest.fixture(scope="module")
def huginn_dir(tmp_path_factory):
    return make_tiny_huginn_checkpoint(tmp_path_factory.mktemp("huginn"))


class LeaveLog:
    """An engine observer: per step, the leave rows and the decode rows at loop 0."""

    def __init__(self, engine) -> None:
        self.steps: list[tuple] = []
        engine.core.add_observer(self)

    def __call__(self, scheduled, output) -> None:
        leave, decode = scheduled.leave, scheduled.decode
        starts = {}
        if decode is not None:
            for i in np.flatnonzero(decode.depths == 0).tolist():
                starts[decode.request_ids[i]] = int(decode.token_ids[i])
        in_decode = set() if decode is None else set(decode.request_ids)
        self.steps.append((() if leave is None else leave.request_ids, starts, in_decode))

    @property
    def batch_sizes(self) -> list[int]:
        return [len(ids) for ids, _, _ in self.steps if ids]

    def check_started_ahead(self) -> int:
        """Every leave row's request runs no loop of its held token in the step of its
        leave; its next token, if it runs then, is at loop 0 fed back the leave's token
        (-1 on the host). Returns how many started ahead."""
        ahead = 0
        for ids, starts, in_decode in self.steps:
            for request_id in ids:
                if request_id in in_decode:
                    assert starts.get(request_id) == -1, request_id
                    ahead += 1
        return ahead


# ---- Ouro: every arm against the dense reference ------------------------------------------

OURO_PRODUCT = [
    (preemption, layout, mode, arm, exit_mode, wait)
    for preemption in ("recompute", "swap")
    for layout in ("last_exited", "shared")
    for mode in ("refill", "no_refill")
    for arm in PROMPT_ARMS
    for exit_mode in ("ouro", "trace")
    for wait in (1, 3)
    if layout == "last_exited" or arm in ("atomic", "per_depth")
]
OURO_CASES = pairwise(OURO_PRODUCT)


@pytest.mark.parametrize("case", OURO_CASES, ids=["-".join(map(str, c)) for c in OURO_CASES])
def test_ouro_with_coda_batching_equals_the_dense_reference(tiny_dir, case):
    """Ouro's coda is cheap, so auto leaves batching off; forced on, the held tokens' leave
    runs from the state their exit loop left, with preemption (recompute and swap of held
    tokens too), priorities and aborts: tokens and exit depths equal the dense reference."""
    preemption, layout, mode, arm, exit_mode, wait = case
    num_planes = 1 if layout == "shared" else 4
    engine = make_engine(
        tiny_dir, layout=layout, mode=mode, exit_mode=exit_mode, preemption_mode=preemption,
        num_blocks=11 * num_planes, swap_space=2048 * 40, coda_batching="on",
        coda_batch_max_wait=wait, **PROMPT_ARMS[arm],
    )  # fmt: skip
    assert engine.scheduler.rules.defers_leave and engine.runner.rules.defers_leave
    log = LeaveLog(engine)
    seed = 300 + OURO_CASES.index(case)
    work = priority_workload(seed, 9, engine.model.config.vocab_size, sampled=True)
    aborted = {"r3": 9}
    finished = run_steps(engine, work, abort_at=aborted)
    assert engine.scheduler.memory_stats.num_preemptions > 0
    complete = [w for w in work if finished[w[0]].finish_reason != "abort"]
    depths = assert_match_reference(engine, complete, finished)
    assert min(depths) < 4
    assert max(log.batch_sizes) > 1  # tokens that exited in different calls left together
    assert log.check_started_ahead() > 0
    assert_all_released(engine)


@pytest.mark.parametrize("mode", ["refill", "no_refill"])
def test_ouro_batched_leaves_feed_the_graphed_decode_step(tiny_dir, mode):
    """The graphed decode step (emulated) takes its loop-0 tokens from the step's leave
    batch on the device: tokens equal the dense reference, every decode step graphed."""
    engine = make_engine(tiny_dir, mode=mode, coda_batching="on", graph_mode="emulate")
    log = LeaveLog(engine)
    work = priority_workload(400, 6, engine.model.config.vocab_size, sampled=True)
    finished = run_steps(engine, work)
    assert_match_reference(engine, work, finished)
    assert engine.stats.num_graph_calls > 0 and log.check_started_ahead() > 0
    assert_all_released(engine)


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_ouro_batched_leaves_with_prefix_hits_and_a_hand_off(tiny_dir, layout):
    """Batching on both sides of a prefill/decode hand-off (after the first token), with
    prompts that share cached pages on the prefill side: tokens and exit depths equal the
    dense reference, and both engines end clean."""
    from tests.test_pd_handoff import run_disaggregated

    args = dict(layout=layout, coda_batching="on", enable_prefix_caching=True)
    prefill = make_engine(tiny_dir, **args)
    decode = make_engine(tiny_dir, **args)
    log = LeaveLog(decode)
    shared = [5, 9, 13, 2, 7, 11, 3, 8]  # two blocks of 4
    work = [(r, shared + p, q, 1)
            for r, p, q, _ in priority_workload(410, 6, prefill.model.config.vocab_size,
                                                sampled=True)]  # fmt: skip
    finished, exported, _ = run_disaggregated(prefill, decode, work)
    assert sorted(exported) == sorted(r for r, *_ in work if finished[r].num_output_tokens > 1)
    assert prefill.stats.num_prefix_cache_hit_tokens > 0
    assert_match_reference(prefill, work, finished)
    assert log.batch_sizes and log.check_started_ahead() > 0
    for engine in (prefill, decode):
        assert not engine.has_unfinished_requests()
        assert_all_released(engine)


def test_batched_leaves_report_the_same_logprobs(tiny_dir):
    """Log-probabilities come from the leave batch's sampling as from a leave at the exit:
    outputs, logprobs and finish reasons equal the unbatched engine's. (A token that stops
    its request while its next token started in the same step: the `coda_batching` arm of
    tests/test_structured_output.py, whose requests stop at the grammar's end.)"""
    work = [
        (f"p{i}", [3 + i, 17, 42, 7 * i + 1], SamplingParams(
            max_tokens=20, temperature=0.0 if i % 2 else 0.9, seed=i, logprobs=3,
            exit_threshold=0.6), i)
        for i in range(5)
    ]  # fmt: skip
    runs = {}
    for batching in ("off", "on"):
        engine = make_engine(tiny_dir, coda_batching=batching)
        runs[batching] = run_steps(engine, work)
        assert_all_released(engine)
    for request_id, on in runs["on"].items():
        off = runs["off"][request_id]
        assert (on.token_ids, on.exit_depths, on.finish_reason) == (
            off.token_ids, off.exit_depths, off.finish_reason
        ), request_id  # fmt: skip
        for a, b in zip(on.logprobs, off.logprobs, strict=True):
            # float32 sums over differently sized batches: equal to about 1e-6
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
            assert [v for _, v in a.top_logprobs] == pytest.approx(
                [v for _, v in b.top_logprobs], abs=1e-4
            )


def test_auto_leaves_ouro_unbatched(tiny_dir):
    engine = make_engine(tiny_dir)
    assert once_weight(engine.model.config) == 0.0
    assert not engine.scheduler.rules.defers_leave and not engine.runner.rules.defers_leave


# ---- Huginn -----------------------------------------------------------------------------


def latent_workload(seed: int, count: int, *, sampled: bool = False):
    rng = random.Random(seed)
    return [
        (f"h{i}", [rng.randrange(128) for _ in range(rng.choice([2, 5, 10]))],
         SamplingParams(max_tokens=rng.randrange(4, 12),
                        temperature=rng.choice([0.0, 0.8]) if sampled else 0.0,
                        seed=60 + i, exit_threshold=rng.choice([0.1, 0.2, 1.0]),
                        min_loops=rng.choice([1, 3]), ignore_eos=True), rng.randrange(0, 5))
        for i in range(count)
    ]  # fmt: skip


HUGINN_CASES = [  # preemption, decode mode, layout, max wait, min rows
    ("recompute", "refill", "last_exited", 8, None),
    ("swap", "refill", "last_exited", 3, None),
    ("swap", "no_refill", "last_exited", 8, 2),
    ("recompute", "refill", "shared", 4, None),
]


@pytest.mark.parametrize("case", HUGINN_CASES, ids=["-".join(map(str, c)) for c in HUGINN_CASES])
def test_huginn_with_coda_batching_equals_the_dense_reference(huginn_dir, case):
    """Huginn with the latent-diff criterion (no logits read): auto turns batching on.
    A pool that holds little more than one request preempts held tokens too; tokens and
    steps equal the dense reference (which runs each request alone, coda at every exit)."""
    preemption, mode, layout, wait, min_rows = case
    planes = 2 if layout == "shared" else 9
    engine = make_engine(
        huginn_dir, exit_criterion="latent-diff", mode=mode, layout=layout,
        preemption_mode=preemption, num_blocks=planes * 8, swap_space=planes * 8 * 2048,
        enable_prefix_caching=False, coda_batch_max_wait=wait, coda_batch_min_rows=min_rows,
    )  # fmt: skip
    assert engine.scheduler.rules.defers_leave and engine.runner.rules.defers_leave
    log = LeaveLog(engine)
    work = latent_workload(80 + HUGINN_CASES.index(case), 6)
    if layout == "shared":  # the model's r for every request
        work = [(r, p, dataclasses.replace(q, max_loops=8), a) for r, p, q, a in work]
    finished = run_steps(engine, work)
    stats = engine.scheduler.memory_stats
    assert stats.num_preemptions > 0
    if preemption == "swap":
        assert stats.num_preemptions_swap > 0
    extra = {"lookup": "shared", "prompt_by_position": True} if layout == "shared" else {}
    steps = []
    for request_id, prompt, params, _ in work:
        ref = reference(engine.model, prompt, params, "latent-diff", **extra)
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.tokens, ref.steps), request_id
        steps += out.exit_depths
    assert min(steps) < 8 and max(steps) == 8
    assert max(log.batch_sizes) > 1 and log.check_started_ahead() > 0
    assert_released(engine)


def test_huginn_batched_leaves_through_the_decode_graphs_and_prefix_hits(huginn_dir):
    """The graphed decode step (emulated) with held tokens' leaves beside it and prompts
    that hit cached pages: tokens equal the dense reference; every decode call is graphed."""
    engine = make_engine(huginn_dir, exit_criterion="latent-diff", graph_mode="emulate")
    log = LeaveLog(engine)
    shared = [7, 3, 99, 42, 5, 17, 64, 11]
    work = [(r, shared + p, q, a + (6 if i else 0))
            for i, (r, p, q, a) in enumerate(latent_workload(91, 5))]  # fmt: skip
    finished = run_steps(engine, work)
    assert_matches_reference(engine, work, finished, "latent-diff")
    assert engine.stats.num_prefix_cache_hit_tokens > 0 and engine.stats.num_graph_calls > 0
    assert log.batch_sizes and log.check_started_ahead() > 0
    # The counters say what the steps carried, and /metrics exports them.
    stats = engine.stats
    assert stats.num_leave_batches == len(log.batch_sizes)
    assert stats.num_leave_rows == sum(log.batch_sizes)
    assert stats.num_held_steps >= stats.num_leave_rows
    from loopserve.engine.metrics import ServingMetrics
    from tests.server_utils import prometheus_values

    values = prometheus_values(ServingMetrics().render(stats, num_in_flight=0, is_ready=True))
    assert values["loopserve_leave_batches_total"] == stats.num_leave_batches
    assert values["loopserve_held_token_steps_total"] == stats.num_held_steps
    assert_released(engine)


def test_huginn_handed_off_requests_keep_their_tokens_under_batching(huginn_dir):
    """Prefill/decode hand-off with batching on both sides (seeded sampling included),
    after the first token as the PD modes hand off (a decode token under batching starts in
    its predecessor's leave step, so it has run a loop before an export could take it):
    each request's tokens and steps equal one engine's, and both engines end clean."""
    from tests.test_pd_handoff import run_disaggregated

    args = dict(exit_criterion="latent-diff")
    work = [(r, p, q, 1) for r, p, q, _ in latent_workload(95, 5, sampled=True)]
    single = run_steps(make_engine(huginn_dir, **args), [(r, p, q, 0) for r, p, q, _ in work])
    prefill = make_engine(huginn_dir, **args)
    decode = make_engine(huginn_dir, num_blocks=9 * 8, **args)
    log = LeaveLog(decode)
    finished, exported, _ = run_disaggregated(prefill, decode, work)
    assert sorted(exported) == sorted(r for r, *_ in work)
    for request_id, *_ in work:
        out, alone = finished[request_id], single[request_id]
        assert (out.token_ids, out.exit_depths) == (alone.token_ids, alone.exit_depths), request_id
    assert log.batch_sizes
    for engine in (prefill, decode):
        assert not engine.has_unfinished_requests()
        assert_released(engine)


def test_auto_batches_huginn_only_where_it_saves(huginn_dir):
    """Auto: on for Huginn's latent criterion, off where the criterion reads logits (kl:
    the coda runs at every checked loop anyway) and under async scheduling; on with async
    scheduling is a start-up error."""
    assert make_engine(huginn_dir, exit_criterion="latent-diff").scheduler.rules.defers_leave
    assert not make_engine(huginn_dir, exit_criterion="kl").scheduler.rules.defers_leave
    config = EngineConfig.from_engine_args(async_scheduling=True, exit_mode="criterion_delayed")
    assert not resolve_coda_batching(config, once_weight=1.0, reads_logits=False)
    assert resolve_coda_batching(EngineConfig(), once_weight=1.0, reads_logits=False)
    assert not resolve_coda_batching(EngineConfig(), once_weight=0.0, reads_logits=False)
    with pytest.raises(ConfigError, match="coda_batching='on' with async_scheduling"):
        EngineConfig.from_engine_args(
            coda_batching="on", async_scheduling=True, exit_mode="ouro_delayed"
        )
    with pytest.raises(ConfigError, match="coda_batch_max_wait"):
        EngineConfig.from_engine_args(coda_batch_max_wait=0)


# ---- the batcher's rule ------------------------------------------------------------------


class _Request:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.exit_rule = ExitRule(threshold=0.5, min_loops=1, max_loops=4)


def table_with(num_ready: int, held_waits: list[int]) -> DecodeTable:
    """A table with `num_ready` running tokens and held tokens that waited these steps."""
    table = DecodeTable(16, exit_mode=ExitMode.OURO)
    for i in range(num_ready + len(held_waits)):
        table.add(_Request(f"r{i}"))
    table.ready[:num_ready] = True
    held = np.arange(num_ready, num_ready + len(held_waits))
    table.exit.depth[held] = 2
    table.hold(held)
    table.waited[held] = held_waits
    return table


def test_the_batch_runs_once_waiting_has_cost_a_weight_read():
    """once_weight 1.0, 6 running tokens: the held tokens' waits (each counting the coming
    step) must reach 6."""
    batcher = LeaveBatcher(enabled=True, once_weight=1.0, max_wait=8, min_rows=None)
    table = table_with(4, [1, 1])  # (1 + 1) + (1 + 1) = 4 < 6: wait
    assert batcher.select(table) is None
    assert table.waited[4:6].tolist() == [2, 2]
    leave = batcher.select(table)  # 3 + 3 = 6: run
    assert leave is not None and leave.request_ids == ("r4", "r5")
    assert leave.depths.tolist() == [1, 1]  # they exited after loop 1 (depth 2 recorded)
    assert batcher.num_batches == 1 and batcher.num_rows == 2


def test_the_latency_bound_and_an_idle_batch_run_the_leave_at_once():
    batcher = LeaveBatcher(enabled=True, once_weight=10.0, max_wait=3, min_rows=None)
    assert batcher.select(table_with(8, [0])) is None  # far from 10 x 9
    assert batcher.select(table_with(8, [2])) is not None  # its third step: the bound
    assert batcher.select(table_with(0, [0, 0])) is not None  # nothing else runs
    by_rows = LeaveBatcher(enabled=True, once_weight=10.0, max_wait=8, min_rows=3)
    assert by_rows.select(table_with(8, [0, 0])) is None
    assert by_rows.select(table_with(8, [0, 0, 0])) is not None
    off = LeaveBatcher(enabled=False, once_weight=1.0, max_wait=1, min_rows=None)
    assert off.select(table_with(0, [5])) is None


# ---- the simulator ----------------------------------------------------------------------


def test_the_simulator_prices_batched_leaves_for_huginn():
    """Simulated H200, Huginn-0125, uniform exits, 16 synthetic requests offline: with leaves
    batched in time refill spends a smaller share of its GPU time on once-per-token work
    and finishes sooner than without; Ouro's auto stays off."""
    from loopserve.sim.cost_model import HUGINN_0125, OURO_1P4B
    from loopserve.sim.hardware import get_device_profile
    from loopserve.sim.metrics import summarize
    from loopserve.sim.simulator import Simulator
    from loopserve.sim.workload import WorkloadSpec, build_workload

    h200 = get_device_profile("h200")
    spec = WorkloadSpec(num_requests=16, dataset="synthetic", input_len=64, output_len=24,
                        exit_dist="uniform")  # fmt: skip
    workload = build_workload(spec, HUGINN_0125.num_loops)
    results = {}
    for batching in ("off", "auto"):
        sim = Simulator(HUGINN_0125, h200, {"max_num_seqs": 8, "coda_batching": batching})
        assert sim.defers_leave == (batching == "auto")
        results[batching] = summarize(sim.run(workload))
    off, on = results["off"], results["auto"]
    assert on.num_output_tokens == off.num_output_tokens == sum(r.output_len for r in workload)
    assert on.once_time_share < off.once_time_share
    assert on.duration_s < off.duration_s
    assert off.leave_batches == 0 and on.leave_batches > 0
    assert on.mean_leave_batch_rows > 1 and on.mean_held_steps >= 1
    assert not Simulator(OURO_1P4B, h200).defers_leave


def test_bench_throughput_reports_the_batches_of_a_run(huginn_dir):
    """`loopserve bench throughput` reads the engine's counters: tokens per leave batch and
    steps held, printed for the arms that batched."""
    from loopserve.bench.throughput import REFILL, run_workload
    from loopserve.bench.throughput_report import RunResult, format_report
    from loopserve.bench.throughput_workload import make_workload, sampling_params

    engine = make_engine(huginn_dir, exit_criterion="latent-diff", max_num_seqs=8)
    requests = make_workload(8, input_len=8, output_len=10, range_ratio=0.25,
                             vocab_size=128, exit_probs=None, seed=1)  # fmt: skip
    params = [sampling_params(r, REFILL, 8, 0.1) for r in requests]
    run = run_workload(engine, requests, params, "refill")
    assert run.leave_batch_rows > 1 and run.held_steps >= 1
    unbatched = dataclasses.replace(run, leave_batch_rows=0.0, held_steps=0.0)
    result = {
        "arms": {"refill": {"median": dataclasses.asdict(run)},
                 "full_depth": {"median": dataclasses.asdict(unbatched)}},
        "ratios": {},
        "host_overhead_at_rows": {"rows": 8, "host_overhead_share": 0.1, "host_ms": 1.0,
                                  "step_ms": 10.0, "runner_host_ms": 0.5, "num_steps": 3},
    }  # fmt: skip
    text = format_report(result)
    assert f"refill      {run.leave_batch_rows:.1f} per batch" in text
    assert "full_depth  " not in text.split("coda batching in time")[1]
    assert isinstance(RunResult(**result["arms"]["refill"]["median"]), RunResult)


def test_a_token_started_ahead_and_preempted_gives_back_its_loop_budget(tiny_dir):
    """Brownout records one loop budget per token (`Request.loop_budgets`, which the dense
    reference replays by token index); a token started ahead of its predecessor's leave and
    then dropped by a preemption must not leave its budget behind."""
    engine = make_engine(tiny_dir, coda_batching="on", brownout_waiting_high=1)
    params = SamplingParams(max_tokens=6, brownout_floor=1, ignore_eos=True)
    engine.add_request("b", [5, 9, 13], params)
    scheduler = engine.scheduler
    while not scheduler.decode.held.any():
        engine.step()
    request = scheduler.requests["b"]
    budgets = list(request.loop_budgets)
    assert budgets  # the held token's among them
    leave = scheduler.leaver.start(scheduler.decode)  # its next token starts ahead, with a budget
    assert leave is not None and len(request.loop_budgets) == len(budgets) + 1
    scheduler.preempt("b")
    assert request.loop_budgets == budgets
