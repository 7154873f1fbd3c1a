"""Self-speculative decoding (scheduler/speculation.py) against the dense reference.

Greedy: every request's tokens and exit depths equal plain decoding's, with drafts accepted
and rejected in the same runs, across decode modes, exit modes, prompt arms, (K, d),
preemption and prefix-cache hits. Sampling: the speculative-sampling rule reproduces the
target distribution (exactly enumerated and by chi-square), and seeded runs repeat.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from loopserve.errors import ConfigError
from loopserve.models.tiny import DEFAULT_MODEL_DIR, make_tiny_checkpoint
from loopserve.runner.sampler import speculative_sample
from loopserve.sampling_params import SamplingParams
from tests.engine_utils import (
    assert_preempted_and_hit,
    kv_planes,
    make_engine,
    reference_for,
    run_steps,
)


@pytest.fixture(scope="module")
def calm_dir(tmp_path_factory):
    """A tiny random checkpoint whose loops move the state a little (the norms on each
    sublayer's output scaled by 0.2), so a draft after one or two loops is often the real
    token, and often not: both outcomes happen in small runs."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("calm"), seed=0)
    for shard in path.glob("*.safetensors"):
        tensors = load_file(shard)
        for name in tensors:
            if name.endswith(("input_layernorm_2.weight", "post_attention_layernorm_2.weight")):
                tensors[name] = tensors[name] * 0.2
        save_file(tensors, shard, metadata={"format": "pt"})
    return path


EXIT_MODES = ("ouro", "ouro_delayed", "random_lookahead", "trace")
PROMPT_ARMS = {
    "atomic": {"prefill_mode": "atomic"},
    "per_depth": {"prefill_mode": "per_depth"},
    "wavefront": {"prefill_mode": "wavefront"},
    "mixed": {"prefill_mode": "per_depth", "mixed_prefill_decode": True},
}
# (decode mode, exit mode, (K, d), prompt arm). CI runs every exit mode under both decode
# modes, each pair with one (K, d) and one prompt arm in turn (pairwise: time);
# LOOPSERVE_FULL_SPEC_MATRIX=1 runs the full product (96 cases; docs/speculative.md).
if os.environ.get("LOOPSERVE_FULL_SPEC_MATRIX") == "1":
    CASES = [
        (mode, exit_mode, kd, arm)
        for mode in ("refill", "no_refill")
        for exit_mode in EXIT_MODES
        for kd in ((1, 1), (1, 2), (3, 1), (3, 2))
        for arm in PROMPT_ARMS
    ]
else:
    CASES = [
        (mode, exit_mode, ((1, 1), (3, 2))[(i + j) % 2], list(PROMPT_ARMS)[(i + 2 * j) % 4])
        for i, mode in enumerate(("refill", "no_refill"))
        for j, exit_mode in enumerate(EXIT_MODES)
    ]


def spec_workload(seed: int, num_requests: int, vocab: int, *, sampled: bool = False):
    """Requests that run long enough to draft: most never exit early (threshold 1), some
    exit by their gate; request 4 decodes plainly (`speculative=False`) in the same engine."""
    rng = random.Random(seed)
    work = []
    for i in range(num_requests):
        prompt = [rng.randrange(vocab) for _ in range(rng.choice([2, 5, 13, 30]))]
        params = SamplingParams(
            max_tokens=rng.randrange(8, 16),
            temperature=rng.choice([0.7, 1.0]) if sampled and i % 2 else 0.0,
            top_k=rng.choice([-1, 30]),
            seed=3000 + i,
            exit_threshold=rng.choice([1.0, 1.0, 0.6, 0.9]),
            min_loops=rng.choice([1, 2]),
            exit_trace=tuple(rng.randrange(1, 5) for _ in range(rng.randrange(1, 6))),
            ignore_eos=True,
            speculative=i != 4,
            logprobs=1 if i == 5 else None,  # log-probabilities: decoded plainly
        )
        work.append((f"r{i}", prompt, params, rng.randrange(0, 6)))
    return work


def check_outputs(engine, work, finished, aborted=()) -> tuple[int, int, int]:
    """Greedy requests equal the reference (aborted ones: a prefix of it); returns the
    drafted, accepted and rejected totals."""
    totals = np.zeros(3, np.int64)
    for request_id, prompt, params, _ in work:
        out = finished[request_id]
        metrics = out.metrics
        counts = (metrics.spec_drafted, metrics.spec_accepted, metrics.spec_rejected)
        totals += counts
        if not params.speculative or params.logprobs is not None:
            assert counts == (0, 0, 0), request_id
        if params.temperature > 0:
            continue
        ref = reference_for(engine, prompt, params)
        if out.finish_reason == "abort":
            assert request_id in aborted
            n = len(out.token_ids)
            assert (out.token_ids, out.exit_depths) == (ref.token_ids[:n], ref.exit_depths[:n])
            continue
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), request_id
    return tuple(int(x) for x in totals)  # type: ignore[return-value]


def assert_released(engine) -> None:
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    assert engine.runner.num_live_handles == 0
    assert engine.runner.coda.spec.drafts == {}


@pytest.mark.parametrize(
    "mode,exit_mode,kd,arm", CASES, ids=[f"{m}-{e}-K{k}d{d}-{a}" for m, e, (k, d), a in CASES]
)
def test_greedy_speculation_equals_plain_decoding(calm_dir, mode, exit_mode, kd, arm):
    num_tokens, draft_loops = kd
    engine = make_engine(
        calm_dir,
        mode=mode,
        exit_mode=exit_mode,
        speculative_tokens=num_tokens,
        draft_loops=draft_loops,
        **PROMPT_ARMS[arm],
    )
    work = spec_workload(11 + CASES.index((mode, exit_mode, kd, arm)), 6, 64)
    speculated_rows = []

    def on_step(engine) -> None:
        # After every step (run_steps also checks the scheduler's invariants): the runner
        # keeps hidden states and draft distributions only of positions in flight (or rolled
        # back and announced to it in the next output), never of older rollbacks.
        pending = set(engine.scheduler.outbox.dropped_handles)
        for request in engine.scheduler.running:
            if request.spec is not None:
                speculated_rows.append(len(request.spec.positions))
                rid = request.request_id
                live = {p.handle for p in request.spec.positions}
                live |= {h for r, h in pending if r == rid}
                assert engine.runner.inflight.handles_of(rid) <= live
                assert {h for r, h in engine.runner.coda.spec.drafts if r == rid} <= live

    finished = run_steps(engine, work, abort_at={"r2": 12}, on_step=on_step)
    drafted, accepted, rejected = check_outputs(engine, work, finished, aborted={"r2"})
    assert drafted > 0 and accepted > 0 and rejected > 0, (drafted, accepted, rejected)
    assert max(speculated_rows) > 1  # positions ran on drafts beside the verified one
    assert_released(engine)


@pytest.mark.parametrize("loops", [1, 2, 3])
def test_tokens_that_exit_within_the_draft_loops_need_no_draft(calm_dir, loops):
    """d = 2: a token that exits after one or two loops is final at its exit (no draft, no
    verification, a token costs its loops); one that runs three loops drafts."""
    engine = make_engine(
        calm_dir, exit_mode="trace", speculative_tokens=3, draft_loops=2, max_num_seqs=1
    )
    params = SamplingParams(max_tokens=10, temperature=0.0, exit_trace=(loops,), ignore_eos=True)
    work = [("a", [5, 9, 2], params, 0)]
    finished = run_steps(engine, work)
    check_outputs(engine, work, finished)
    drafted = finished["a"].metrics.spec_drafted
    if loops <= 2:
        assert drafted == 0
        # The prompt's 4 loops (one atomic step), then 9 decode tokens of `loops` calls each.
        assert engine.stats.num_core_calls == 4 + 9 * loops
    else:
        assert drafted > 0 and engine.stats.num_core_calls < 4 + 9 * loops


def test_one_loop_drafts_of_the_trained_default_model_are_accepted_and_exact():
    """The embedded (trained) model: drafts after one loop are often right, and speculation
    still equals plain decoding."""
    engine = make_engine(
        DEFAULT_MODEL_DIR, speculative_tokens=3, draft_loops=1, max_num_batched_tokens=64
    )
    rng = random.Random(2)
    work = [
        (
            f"d{i}",
            [rng.randrange(engine.model.config.vocab_size) for _ in range(6)],
            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
            0,
        )
        for i in range(3)
    ]
    finished = run_steps(engine, work)
    drafted, accepted, rejected = check_outputs(engine, work, finished)
    assert accepted > 0 and rejected > 0, (drafted, accepted, rejected)
    assert_released(engine)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_speculation_under_preemption_and_prefix_hits(calm_dir, preemption):
    """A pool barely larger than one request: speculating requests are preempted (drafts
    dropped, the last final token restarts) and their prompts hit the prefix cache."""
    engine = make_engine(
        calm_dir,
        speculative_tokens=2,
        draft_loops=2,
        preemption_mode=preemption,
        num_blocks=4 * 14,
        swap_space=2048 * 48,
        enable_prefix_caching=True,
    )
    work = spec_workload(5, 8, 64, sampled=True)
    shared = [7, 7, 3, 9, 1, 2, 5, 4]  # two full blocks every prompt shares
    work = [(rid, shared + prompt, params, at) for rid, prompt, params, at in work]
    finished = run_steps(engine, work)
    assert_preempted_and_hit(engine, preemption)
    drafted, accepted, rejected = check_outputs(engine, work, finished)
    assert accepted > 0 and rejected > 0
    assert_released(engine)


def test_rolled_back_positions_leave_planes_as_plain_decoding(calm_dir):
    """After rejected drafts, every plane of every final position equals, bit for bit, the
    planes of plain decoding (batch-invariant mode), finalize copies included."""
    params = SamplingParams(max_tokens=14, temperature=0.0, exit_threshold=0.6, ignore_eos=True)
    prompt = [5, 17, 3, 41, 8]
    planes = []
    for tokens in (0, 2):
        engine = make_engine(
            calm_dir, batch_invariant=True, speculative_tokens=tokens, draft_loops=2
        )
        engine.add_request("a", prompt, params)
        while True:
            engine.step()
            request = engine.scheduler.requests["a"]
            if len(request.output_token_ids) >= 12:
                break
        written = len(prompt) + 11  # the positions of the prompt and 11 fed-back tokens
        planes.append(kv_planes(engine, "a", written))
        if tokens:
            stats = request.spec_stats
            assert stats.rejected + stats.redrafted > 0 and stats.accepted > 0
            assert len(request.output_token_ids) >= 12
    assert torch.equal(planes[0], planes[1])


def test_speculative_sampling_rule_reproduces_the_target_distribution():
    """Exactly (enumerating the draft) and empirically: a token drawn by the rule from a
    draft x ~ q follows p."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0])
    q = torch.tensor([0.1, 0.4, 0.1, 0.2, 0.2])
    # Exact: P(y) = q(y) min(1, p/q) + (sum_x q(x) max(0, 1 - p(x)/q(x))) * residual(y).
    accept = torch.minimum(q, p)
    residual = (p - q).clamp_min(0)
    exact = accept + (1 - accept.sum()) * residual / residual.sum()
    assert torch.allclose(exact, p)
    n = 6000
    counts = np.zeros(5)
    for _ in range(n):
        x = int(torch.multinomial(q, 1, generator=gen))
        counts[int(speculative_sample(p, q, x, gen))] += 1
    expected = p.numpy() * n
    live = expected > 0
    assert counts[~live].sum() == 0  # a token p forbids is never emitted
    chi2 = (((counts - expected)[live]) ** 2 / expected[live]).sum()
    assert chi2 < 16.3, chi2  # 3 degrees of freedom, p = 0.001


def test_sampled_speculation_is_seeded_and_matches_plain_marginals(calm_dir):
    """Sampling with speculation: the same seeds give the same outputs, and the second
    token's distribution matches plain decoding's (two-sample chi-square)."""
    prompt = [3, 1, 4, 1, 5]
    base = dict(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)

    def run(tokens: int, seeds) -> list[tuple[int, ...]]:
        engine = make_engine(
            calm_dir,
            speculative_tokens=tokens,
            draft_loops=2,
            max_num_seqs=16,
            speculative_max_seqs=16,
        )
        work = [(f"s{s}", prompt, SamplingParams(seed=s, **base), 0) for s in seeds]
        finished = run_steps(engine, work)
        if tokens:
            assert sum(finished[r].metrics.spec_drafted for r, *_ in work) > 0
        return [tuple(finished[r].token_ids) for r, *_ in work]

    seeds = range(150)
    spec = run(2, seeds)
    assert spec[:20] == run(2, range(20))  # seeded: repeatable
    plain = run(0, range(10_000, 10_150))
    pairs = sorted({out[:2] for out in spec + plain})
    a = np.array([sum(out[:2] == pair for out in spec) for pair in pairs], float)
    b = np.array([sum(out[:2] == pair for out in plain) for pair in pairs], float)
    keep = a + b >= 10  # pool sparse bins
    a = np.append(a[keep], a[~keep].sum())
    b = np.append(b[keep], b[~keep].sum())
    live = a + b > 0
    a, b = a[live], b[live]
    total = a + b
    ea, eb = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    chi2 = ((a - ea) ** 2 / ea + (b - eb) ** 2 / eb).sum()
    dof = len(total) - 1
    assert dof >= 3  # several (first, second) token pairs
    assert chi2 < dof + 4 * np.sqrt(2 * dof), (chi2, dof)


def test_speculation_start_up_errors(tiny_dir):
    with pytest.raises(ConfigError, match="last_exited"):
        make_engine(tiny_dir, speculative_tokens=2, layout="shared")
    with pytest.raises(ConfigError, match="draft_loops"):
        make_engine(tiny_dir, speculative_tokens=2, draft_loops=4)
    with pytest.raises(ConfigError, match="speculative_tokens"):
        make_engine(tiny_dir, speculative_tokens=-1)
    # Huginn's refusals (drawn initial states, the `full` lookup): tests/test_huginn_speculation.py


@pytest.mark.parametrize(
    "args",
    [
        {"exit_mode": "ouro_delayed", "async_scheduling": True},
        {"graph_mode": "emulate"},
        {"kv_reservation": "full"},
    ],
    ids=["async", "graph_buffers", "full_reservation"],
)
def test_speculation_composes_with_engine_options(calm_dir, args):
    """Asynchronous scheduling (steps with speculative positions are planned synchronously),
    the static graph buffers (decode-only calls) and full reservation: still exact."""
    engine = make_engine(calm_dir, speculative_tokens=3, draft_loops=1, **args)
    work = spec_workload(23, 6, 64)
    finished = run_steps(engine, work)
    drafted, accepted, rejected = check_outputs(engine, work, finished)
    assert accepted > 0 and rejected > 0
    assert_released(engine)


def test_server_streams_speculative_and_plain_requests_alike(tmp_path):
    """One server, the extension field switching speculation per request: a streamed
    speculative completion equals the plain one, and /metrics counts the drafts."""
    pytest.importorskip("httpx")
    from loopserve.engine.llm_engine import LLMEngine
    from tests.server_utils import in_process_calls, prometheus_values, sse_payloads

    engine = LLMEngine.from_engine_args(
        model=str(DEFAULT_MODEL_DIR), dtype="float32", speculative_tokens=3, draft_loops=1
    )
    body = {
        "model": "m",
        "prompt": "Once upon a time there was",
        "max_tokens": 24,
        "temperature": 0,
    }

    async def calls(client):
        plain = await client.post("/v1/completions", json={**body, "speculative": False})
        streamed = await client.post("/v1/completions", json={**body, "stream": True})
        bad = await client.post("/v1/completions", json={**body, "speculative": "yes"})
        return plain, streamed, bad, await client.get("/metrics")

    plain, streamed, bad, scraped = in_process_calls(engine, "m", calls)
    assert plain.status_code == 200, plain.text
    chunks = [p for p in sse_payloads(streamed.text.splitlines()) if isinstance(p, dict)]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == plain.json()["choices"][0]["text"]
    assert bad.status_code == 400
    values = prometheus_values(scraped.text)
    assert values["loopserve_spec_drafted_total"] > 0
    assert values["loopserve_spec_accepted_total"] > 0


def test_a_decode_replica_speculates_on_handed_off_requests(calm_dir):
    """Prefill/decode hand-off: the importing engine starts each request's pipeline from
    the handed-off token; greedy outputs equal the reference, streamed exactly once."""
    from tests.test_pd_handoff import assert_clean, handoff_workload, run_disaggregated

    prefill = make_engine(calm_dir)
    decode = make_engine(calm_dir, num_blocks=300, speculative_tokens=3, draft_loops=1)
    work = handoff_workload(5, 6, 64)
    finished, exported, streamed = run_disaggregated(prefill, decode, work)
    assert sorted(exported) == sorted(r for r, *_ in work)
    for request_id, prompt, params, _ in work:
        output = finished[request_id]
        assert streamed[request_id] == output.token_ids
        if params.temperature == 0:
            expected = reference_for(prefill, prompt, params)
            assert (output.token_ids, output.exit_depths) == (
                expected.token_ids,
                expected.exit_depths,
            ), request_id
    assert decode.stats.num_spec_drafted > 0 and decode.stats.num_spec_accepted > 0
    assert_clean(prefill)
    assert_clean(decode)


@pytest.mark.parametrize("stable", [(1.0, 0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 1.0)])
def test_the_simulator_runs_speculation_through_the_same_scheduler(stable):
    """Drafts always right from loop 0: about one core call per token at one stream (four
    without speculation); never right before the last loop: no gain, still every token."""
    from loopserve.sim.cost_model import OURO_1P4B
    from loopserve.sim.hardware import get_device_profile
    from loopserve.sim.metrics import summarize
    from loopserve.sim.simulator import Simulator
    from loopserve.sim.workload import WorkloadSpec, build_workload

    workload = build_workload(
        WorkloadSpec(4, dataset="synthetic", input_len=16, output_len=40, exit_dist="full"), 4
    )
    results = {}
    for tokens in (0, 3):
        sim = Simulator(
            OURO_1P4B,
            get_device_profile("h200"),
            {"max_num_seqs": 1, "num_blocks": 256, "speculative_tokens": tokens, "draft_loops": 1},
            draft_stable_dist=stable,
        )
        run = sim.run(workload, on_step=lambda s: s.check_invariants())
        result = summarize(run)
        assert result.num_output_tokens == sum(r.output_len for r in workload)
        assert sim.core.stats().kv_blocks_used == 0 and sim.executor.num_live_handles == 0
        results[tokens] = (result.output_throughput, sim.core.stats())
    plain, spec = results[0], results[3]
    calls = [stats.num_core_calls / stats.num_output_tokens for _, stats in (plain, spec)]
    if stable[0] == 1.0:
        assert calls[1] < 0.5 * calls[0] and spec[0] > 2 * plain[0]
        assert spec[1].num_spec_accepted > 0 and spec[1].num_spec_rejected == 0
    else:
        assert calls[1] >= calls[0] and spec[0] < plain[0]
        assert spec[1].num_spec_accepted == 0


def test_bench_speculative_runs_side_by_side(tmp_path):
    from loopserve.cli.main import main

    out = tmp_path / "spec.json"
    assert (
        main(
            [
                "bench",
                "speculative",
                "--streams",
                "1",
                "--temperatures",
                "0",
                "--configs",
                "2:1",
                "--repeats",
                "1",
                "--output-len",
                "8",
                "--no-progress",
                "--output-json",
                str(out),
            ]  # fmt: skip
        )
        == 0
    )
    import json

    (row,) = json.loads(out.read_text())["results"]
    plain, spec = row["configs"]
    assert (plain["K"], spec["K"], spec["d"]) == (0, 2, 1)
    assert spec["drafted"] > 0 and spec["core_calls_per_token"] < plain["core_calls_per_token"]
    assert abs(sum(row["stable_loop_dist"]) - 1) < 1e-9


def test_bench_speculative_runs_on_a_huginn_checkpoint(tmp_path):
    """Its stable-loop distribution comes from the family's own dense reference (it called
    Ouro's, and crashed on Huginn with a TypeError)."""
    import json

    from loopserve.cli.main import main
    from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint

    model_dir = make_tiny_huginn_checkpoint(tmp_path / "huginn", mean_recurrence=3)
    out = tmp_path / "spec.json"
    argv = ["bench", "speculative", "--model", str(model_dir), "--streams", "1",
            "--temperatures", "0", "--configs", "2:1", "--repeats", "1", "--output-len", "6",
            "--no-progress", "--output-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    (row,) = json.loads(out.read_text())["results"]
    distribution = row["stable_loop_dist"]
    assert len(distribution) == 3 and abs(sum(distribution) - 1.0) < 1e-9


def test_a_speculative_row_whose_sampling_raises_fails_only_its_request(calm_dir, monkeypatch):
    """A sampling request's draft or exit test raising (fault injected in the speculative
    rows' filter for top_k 13): that request fails alone with the error every sampling
    failure carries ("sampling failed: ..."), and the other request equals plain decoding."""
    from loopserve.runner import sampler

    real = sampler.filtered_probs

    def faulty(logits, spec):
        if spec.top_k == 13:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, spec)

    monkeypatch.setattr(sampler, "filtered_probs", faulty)
    engine = make_engine(calm_dir, exit_mode="trace", speculative_tokens=2, draft_loops=1)
    bad = SamplingParams(max_tokens=8, temperature=0.8, top_k=13, seed=3, exit_trace=(3,),
                         ignore_eos=True)  # fmt: skip
    good = SamplingParams(max_tokens=8, temperature=0.0, exit_trace=(3,), ignore_eos=True)
    work = [("bad", [5, 9, 2], bad, 0), ("good", [7, 1], good, 0)]
    finished = run_steps(engine, work)
    out = finished["bad"]
    assert out.finish_reason == "abort" and out.error.startswith("sampling failed: Runtime")
    ref = reference_for(engine, [7, 1], good)
    assert (finished["good"].token_ids, finished["good"].exit_depths) == (
        ref.token_ids,
        ref.exit_depths,
    )
