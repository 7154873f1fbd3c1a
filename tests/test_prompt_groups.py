"""Prompt groups: requests with the same prompt share one prefill (scheduler/groups.py).

Every arm checks the outputs against the dense reference and against the same engine with
groups off (independent requests), and counts the prompt work actually executed."""

from __future__ import annotations

import pytest
import torch

from loopserve.models.huginn_dense import generate as huginn_generate
from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopserve.sampling_params import SamplingParams
from tests.engine_utils import kv_planes, make_engine, reference_for, run_steps

PROMPT = [7, 3, 9, 1, 4, 4, 2, 8, 5, 6, 11, 30, 2]  # 13 tokens: 3 full blocks of 4 and one


def _samples(n: int, prompt=PROMPT, *, max_tokens: int = 6, arrival: int = 0):
    """n choices of one request, as the server makes them: seeds of their own, greedy and
    sampled, penalties on some."""
    work = []
    for i in range(n):
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if i % 3 == 0 else 0.9,
            seed=500 + i,
            exit_threshold=0.6,
            frequency_penalty=0.5 if i % 4 == 1 else 0.0,
        )
        work.append((f"s{i}", list(prompt), params, arrival))
    return work


def _outputs(finished, aborted=()):
    for request_id, out in finished.items():
        if request_id in aborted:
            assert out.finish_reason == "abort", request_id
        else:
            assert out.error is None and out.finish_reason != "abort", request_id
    return {rid: (out.token_ids, out.exit_depths) for rid, out in finished.items()}


def _check_reference(engine, work, outputs):
    for request_id, prompt, params, _ in work:
        ref = reference_for(engine, prompt, params)
        assert outputs[request_id] == (ref.token_ids, ref.exit_depths), request_id


ARMS = {
    "atomic": dict(prefill_mode="atomic"),
    "wavefront": dict(prefill_mode="wavefront", prefill_chunk_size=4),
    "mixed": dict(prefill_mode="per_depth", mixed_prefill_decode=True),
    "shared": dict(layout="shared"),
    "no_cache": dict(enable_prefix_caching=False),
}


def _same_prompt_kv(engine, seen: set):
    """`run_steps` hook: a running follower that has decoded holds its leader's prompt K/V
    in every plane (shared blocks, and its copy of the partly written last one)."""
    requests, tables = engine.scheduler.requests, engine.kv.tables
    leader = requests.get("s0")
    for request_id, request in requests.items():
        if request_id == "s0" or leader is None or request_id not in tables:
            continue
        if "s0" in tables and len(request.output_token_ids) >= 2:
            n = request.num_prompt_tokens
            assert torch.equal(kv_planes(engine, request_id, n), kv_planes(engine, "s0", n))
            seen.add(request_id)


@pytest.mark.parametrize("arm", list(ARMS))
@pytest.mark.parametrize("prompt_len", [13, 12])  # a partly written last block, and none
def test_n_samples_run_one_prefill_and_equal_independent_requests(tiny_dir, arm, prompt_len):
    prompt = PROMPT[:prompt_len]
    work = _samples(8, prompt)
    engine = make_engine(tiny_dir, max_num_seqs=8, **ARMS[arm])
    seen: set[str] = set()
    outputs = _outputs(run_steps(engine, work, on_step=lambda e: _same_prompt_kv(e, seen)))
    assert len(seen) >= 5
    alone = make_engine(tiny_dir, max_num_seqs=8, share_prompts=False, **ARMS[arm])
    assert outputs == _outputs(run_steps(alone, work))
    _check_reference(engine, work, outputs)
    loops = engine.runner.num_loops
    stats, alone_stats = engine.stats, alone.stats
    assert stats.num_prompt_row_loops == prompt_len * loops  # one prefill
    assert stats.num_forked_requests == 7
    assert alone_stats.num_forked_requests == 0
    assert alone_stats.num_prompt_row_loops > prompt_len * loops  # (caching may save some)
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def _run_both(tiny_dir, work, *, on_step=None, abort_at=None, **args):
    """The same workload with groups on and off: (engine, outputs on, outputs off)."""
    engine = make_engine(tiny_dir, **args)
    on = _outputs(run_steps(engine, work, on_step=on_step, abort_at=abort_at))
    off_engine = make_engine(tiny_dir, share_prompts=False, **args)
    off = _outputs(run_steps(off_engine, work, on_step=on_step, abort_at=abort_at))
    return engine, on, off


def test_followers_beyond_the_seats_lead_a_group_of_their_own(tiny_dir):
    # Four seats for eight samples: s1..s3 fork from s0; s4 leads s5..s7 and runs its
    # prompt when a seat frees, from the prefix cache but for its last position, and as
    # many as have seats then fork from it; the others lead again, and so on.
    work = _samples(8)
    engine, on, off = _run_both(tiny_dir, work, max_num_seqs=4)
    assert on == off
    _check_reference(engine, work, on)
    groups = engine.scheduler.groups.stats
    assert groups.num_unforked == 0 and 3 <= groups.num_forked < 7
    leaders = 8 - groups.num_forked  # each ran the prompt: s0 whole, the others one position
    assert engine.stats.num_prompt_row_loops == (13 + leaders - 1) * engine.runner.num_loops
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_followers_without_blocks_queue_with_their_first_token(tiny_dir):
    # 13 prompt positions take 4 blocks x 4 planes; a fork takes 4 (its copy of the last
    # block). In 24 blocks s0 and two forks fit; s3 keeps its first token and queues, as a
    # request preempted by recompute does.
    work = _samples(4)
    engine, on, off = _run_both(tiny_dir, work, max_num_seqs=8, num_blocks=24)
    assert on == off
    _check_reference(engine, work, on)
    groups = engine.scheduler.groups.stats
    assert (groups.num_forked, groups.num_unforked) == (2, 1)
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("victim", ["s0", "s3"])  # the leader, a follower
def test_preempting_one_sample_leaves_every_output_exact(tiny_dir, preemption, victim):
    work = _samples(6, max_tokens=9)

    def preempt_once(engine):
        scheduler = engine.scheduler
        request = scheduler.requests.get(victim)
        if not getattr(engine, "_preempted", False) and request is not None:
            if len(request.output_token_ids) == 3 and request.status.value == "running":
                scheduler.preempt(victim)
                engine._preempted = True

    engine, on, off = _run_both(
        tiny_dir, work, on_step=preempt_once, max_num_seqs=8, preemption_mode=preemption
    )
    assert engine._preempted
    assert on == off
    _check_reference(engine, work, on)
    stats = engine.stats
    assert stats.num_preemptions_recompute + stats.num_preemptions_swap == 1
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_a_leader_aborted_in_its_prompt_hands_its_group_on(tiny_dir):
    # A long prompt under wavefront takes several steps; the leader leaves in the middle and
    # its oldest follower leads the rest; a follower aborted while waiting just leaves.
    prompt = PROMPT * 3
    work = _samples(5, prompt)
    engine = make_engine(tiny_dir, prefill_mode="wavefront", prefill_chunk_size=4,
                         max_num_batched_tokens=8, max_num_seqs=8)  # fmt: skip
    finished = run_steps(engine, work, abort_at={"s0": 2, "s2": 3})
    assert finished["s0"].token_ids == [] and finished["s2"].token_ids == []
    kept = [w for w in work if w[0] not in ("s0", "s2")]
    _check_reference(engine, kept, _outputs(finished, aborted=("s0", "s2")))
    assert engine.stats.num_forked_requests == 2  # s3 and s4 fork from s1
    assert engine.stats.num_prompt_row_loops < 2 * len(prompt) * engine.runner.num_loops
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    assert engine.runner.samplers == {}


def test_late_arrivals_and_other_loop_settings_start_their_own_prefill(tiny_dir):
    # b joins a (same prompt, arrives while a's prompt runs); c differs in its exit
    # threshold, d in max_loops: each runs its own prompt; e arrives after a's last prompt
    # step was planned (here: after a finished) and runs its own, hitting the prefix cache.
    prompt = PROMPT * 3
    base = SamplingParams(max_tokens=5, temperature=0.0, exit_threshold=0.6)
    other = SamplingParams(max_tokens=5, temperature=0.0, exit_threshold=0.3)
    shallow = SamplingParams(max_tokens=5, temperature=0.0, exit_threshold=0.6, max_loops=3)
    work = [("a", prompt, base, 0), ("b", prompt, base, 1), ("c", prompt, other, 1),
            ("d", prompt, shallow, 1), ("e", prompt, base, 80)]  # fmt: skip
    engine = make_engine(tiny_dir, prefill_mode="wavefront", prefill_chunk_size=4,
                         max_num_batched_tokens=8, max_num_seqs=8)  # fmt: skip
    finished = run_steps(engine, work)
    _check_reference(engine, work, _outputs(finished))
    assert engine.stats.num_forked_requests == 1
    assert finished["b"].metrics.num_cached_prompt_tokens == len(prompt)
    assert finished["e"].metrics.num_cached_prompt_tokens == 36  # 9 full pages of 39


@pytest.mark.parametrize(
    "args",
    [
        dict(async_scheduling=True, exit_mode="ouro_delayed"),
        dict(speculative_tokens=2),
        dict(kv_reservation="full"),
        dict(graph_mode="emulate"),
        dict(batch_invariant=True),
    ],
    ids=["async", "speculative", "full_reservation", "graphs", "batch_invariant"],
)
def test_forks_under_every_executor_feature(tiny_dir, args):
    one = SamplingParams(max_tokens=1, seed=9, exit_threshold=0.6)
    work = _samples(5) + [("one", list(PROMPT), one, 0)]
    engine, on, off = _run_both(tiny_dir, work, max_num_seqs=8, **args)
    assert on == off
    if args.get("speculative_tokens"):  # speculation keeps greedy outputs exact (and draws
        work = [w for w in work if w[2].temperature == 0]  # sampled ones in its own order)
    _check_reference(engine, work, on)
    assert engine.stats.num_forked_requests == 5
    assert on["one"][0] and len(on["one"][0]) == 1  # a follower done at its first token
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


@pytest.fixture(scope="module")
def huginn_dir(tmp_path_factory):
    return make_tiny_huginn_checkpoint(tmp_path_factory.mktemp("huginn"))


@pytest.mark.parametrize(
    "args",
    [
        dict(exit_criterion="kl"),
        dict(exit_criterion="latent-diff", prefill_mode="wavefront", enable_prefix_caching=False),
        dict(
            exit_criterion="kl",
            prompt_exits=True,
            enable_prefix_caching=False,
            kv_lookup="full",
            prefill_chunk_size=16,
        ),
    ],  # fmt: skip
    ids=["kl", "latent_diff_wavefront", "prompt_exits_full_lookup"],
)
def test_huginn_groups_fork_its_once_planes_and_runner_state(huginn_dir, args):
    """Huginn's prelude and coda keep K/V once per position (once planes, forked with the
    loop planes); a prompt exit records its loops in the runner (`full` lookup), which the
    followers inherit."""
    work = []
    for i in range(4):
        params = SamplingParams(max_tokens=5, temperature=0.0 if i % 2 == 0 else 0.8,
                                seed=40 + i, exit_threshold=0.01, ignore_eos=True)  # fmt: skip
        work.append((f"s{i}", list(PROMPT), params, 0))
    engine, on, off = _run_both(huginn_dir, work, **{"prefill_chunk_size": 5, **args})
    assert on == off
    assert engine.stats.num_forked_requests == 3
    assert engine.stats.num_prompt_row_loops == len(PROMPT) * 8  # r = 8
    lookup = args.get("kv_lookup", "last_exited")
    for request_id, prompt, params, _ in work:
        if params.temperature == 0:
            ref = huginn_generate(
                engine.model, prompt, max_new_tokens=params.max_tokens, num_steps=None,
                criterion=args["exit_criterion"], threshold=params.exit_threshold,
                min_steps=0, lookup=lookup, exit_in_prompt=args.get("prompt_exits", False),
            )  # fmt: skip
            assert on[request_id] == (ref.tokens, ref.steps), request_id
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_forked_samples_hand_off_right_after_their_first_token(tiny_dir, layout):
    # Exported as soon as they can be: a follower's copy of its leader's last block is
    # still pending then (it runs with the next step); the export delivers it first.
    from tests.test_pd_handoff import assert_clean, run_disaggregated

    work = [(rid, prompt, params, 1) for rid, prompt, params, _ in _samples(4)]
    prefill = make_engine(tiny_dir, layout=layout)
    decode = make_engine(tiny_dir, layout=layout, num_blocks=300)
    finished, exported, _ = run_disaggregated(prefill, decode, work)
    assert sorted(exported) == ["s0", "s1", "s2", "s3"]
    assert prefill.stats.num_forked_requests == 3
    _check_reference(prefill, work, _outputs(finished))
    assert_clean(prefill)
    assert_clean(decode)


def test_a_leader_whose_setup_fails_leaves_its_followers_to_run_alone(tiny_dir, monkeypatch):
    # Atomic prefill admits the leader, runs its whole prompt and seals its followers in one
    # step; the leader's setup fails there, so its item runs nothing and the followers get
    # no first token: they queue and run the prompt themselves.
    from loopserve.engine import llm_engine
    from tests.fault_runner import FAIL_SEED, SetupFaultRunner

    monkeypatch.setattr(llm_engine, "ModelRunner", SetupFaultRunner)
    work = _samples(4, PROMPT[:10])  # one chunk: the whole prompt in the first step
    work[0] = ("s0", work[0][1], SamplingParams(max_tokens=6, seed=FAIL_SEED,
                                                exit_threshold=0.6), 0)  # fmt: skip
    engine = make_engine(tiny_dir, max_num_seqs=8)
    finished = run_steps(engine, work)
    assert finished["s0"].finish_reason == "abort" and finished["s0"].error
    _check_reference(engine, work[1:], _outputs(finished, aborted=("s0",)))
    assert engine.stats.num_forked_requests == 2  # s2 and s3 fork from s1, the new leader
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks


def test_a_follower_whose_sampling_fails_fails_alone(tiny_dir, monkeypatch):
    from tests.fault_runner import fail_sampling

    fail_sampling(monkeypatch)
    work = _samples(4)
    bad = SamplingParams(max_tokens=6, temperature=0.8, top_k=13, seed=3, exit_threshold=0.6)
    work[2] = ("s2", work[2][1], bad, 0)
    engine = make_engine(tiny_dir, max_num_seqs=8)
    finished = run_steps(engine, work)
    assert "sampling failed" in finished["s2"].error
    kept = [w for w in work if w[0] != "s2"]
    _check_reference(engine, kept, _outputs(finished, aborted=("s2",)))
    assert engine.stats.num_forked_requests == 2
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
