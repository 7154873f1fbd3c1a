"""Huginn in the batched engine: every request's tokens and steps equal the dense reference
(itself equal to the authors' code, tests/test_huginn.py) under continuous depth batching,
per criterion, decode mode and prompt arm, with per-request thresholds and step bounds,
chunked prompts, prefix-cache hits, aborts and preemption."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from loopserve.errors import ConfigError, InvalidRequestError
from loopserve.exit.columns import CONTINUE, GATE
from loopserve.models.huginn_dense import generate, teacher_forced_logits
from loopserve.models.huginn_tiny import make_tiny_huginn_checkpoint
from loopserve.sampling_params import SamplingParams
from loopserve.sim.cost_model import ModelShape
from loopserve.sim.simulator import kv_bytes_per_block
from tests.engine_utils import make_engine, run_steps

PROMPT_ARMS = {
    "atomic": {"prefill_mode": "atomic"},
    "per_depth": {"prefill_mode": "per_depth"},
    "wavefront": {"prefill_mode": "wavefront"},
    "mixed": {"prefill_mode": "per_depth", "mixed_prefill_decode": True},
}
THRESHOLDS = {  # per criterion: request thresholds that exit at several steps on this model
    "kl": (0.01, 0.1),
    "minp-kl": (0.01, 0.001),
    "entropy-diff": (0.03, 0.1),
    "latent-diff": (0.1, 0.2),
    "cosine": (0.01, 0.003),
    "argmax-stability": (0.5,),  # < 1 turns it on; its steps: `exit_stable_steps` (2)
}
# Every criterion, decode mode and prompt arm, without the full product.
CASES = [
    ("kl", "refill", "atomic"),
    ("latent-diff", "refill", "per_depth"),
    ("entropy-diff", "refill", "wavefront"),
    ("minp-kl", "refill", "mixed"),
    ("cosine", "no_refill", "atomic"),
    ("argmax-stability", "no_refill", "per_depth"),
    ("kl", "no_refill", "wavefront"),
    ("latent-diff", "no_refill", "mixed"),
]
SHARED_PREFIX = [7, 3, 99, 42, 5, 17, 64, 11]  # two blocks: prefix-cache hits


@pytest.fixture(scope="module")
def huginn_dir(tmp_path_factory):
    return make_tiny_huginn_checkpoint(tmp_path_factory.mktemp("huginn"))


def workload(seed: int, criterion: str, count: int = 7):
    rng = random.Random(seed)
    work = []
    for i in range(count):
        prompt = [rng.randrange(128) for _ in range(rng.choice([1, 3, 9, 14]))]
        if i % 3 == 0:
            prompt = SHARED_PREFIX + prompt
        params = SamplingParams(
            max_tokens=rng.randrange(2, 9),
            temperature=0.0,
            exit_threshold=rng.choice([*THRESHOLDS[criterion], 1.0]),
            min_loops=rng.choice([1, 1, 3]),
            max_loops=rng.choice([None, None, 6]) if i % 3 else None,  # prefix sharers: r = 8
            ignore_eos=True,
        )
        # Requests with the shared prefix arrive after the first has cached it.
        arrival = rng.randrange(0, 6) + (12 if i % 3 == 0 and i else 0)
        work.append((f"r{i}", prompt, params, arrival))
    return work


def staggered_greedy(prefix: str, seed: int, prompt_len: int, max_tokens: int):
    """Four greedy kl requests of one prompt length, arriving one step apart, thresholds
    0.01 or 0.1: enough K/V to preempt in a small pool."""
    rng = random.Random(seed)
    return [
        (f"{prefix}{i}", [rng.randrange(128) for _ in range(prompt_len)],
         SamplingParams(max_tokens=max_tokens, temperature=0.0,
                        exit_threshold=rng.choice([0.01, 0.1]), ignore_eos=True), i)
        for i in range(4)
    ]  # fmt: skip


def reference(model, prompt, params, criterion, lookup="last_exited", **extra):
    early = params.exit_threshold < 1.0
    threshold = params.exit_threshold
    if criterion == "argmax-stability":  # its threshold is the request's stable steps
        threshold = params.exit_stable_steps or 2
    return generate(
        model, prompt, max_new_tokens=params.max_tokens, num_steps=params.max_loops,
        criterion=criterion if early else "none", threshold=threshold,
        min_steps=params.min_loops - 1, lookup=lookup, exit_in_prompt=False, **extra,
    )  # fmt: skip


def assert_matches_reference(engine, work, finished, criterion, aborted=(), **extra):
    steps = []
    for request_id, prompt, params, _ in work:
        ref = reference(engine.model, prompt, params, criterion, **extra)
        out = finished[request_id]
        if request_id in aborted:
            assert out.token_ids == ref.tokens[: len(out.token_ids)]
            continue
        assert (out.token_ids, out.exit_depths) == (ref.tokens, ref.steps), request_id
        steps += out.exit_depths
    return steps


def assert_released(engine):
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    assert engine.runner.num_live_handles == 0 and engine.runner.samplers == {}
    assert engine.runner.calls.latents == {} and engine.runner.prompt_lens == {}


@pytest.mark.parametrize("criterion, mode, arm", CASES, ids=["-".join(c) for c in CASES])
def test_engine_equals_the_dense_reference(huginn_dir, criterion, mode, arm):
    engine = make_engine(huginn_dir, mode=mode, exit_criterion=criterion, prefill_chunk_size=5,
                         **PROMPT_ARMS[arm])  # fmt: skip
    work = workload(CASES.index((criterion, mode, arm)), criterion)
    finished = run_steps(engine, work, abort_at={"r4": 3})
    steps = assert_matches_reference(engine, work, finished, criterion, aborted={"r4"})
    assert min(steps) < 8 and max(steps) == 8  # early exits and full-depth tokens
    assert engine.stats.num_prefix_cache_hit_tokens > 0
    assert_released(engine)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preempted_requests_resume_to_the_same_tokens(huginn_dir, preemption):
    # 9 planes (8 steps + the once plane) x 10 blocks of 4 positions: the pool holds one
    # request of 10 + 14 positions and part of another, so requests preempt mid-output.
    engine = make_engine(huginn_dir, num_blocks=9 * 10, exit_criterion="kl",
                         enable_prefix_caching=False, preemption_mode=preemption,
                         swap_space=9 * 10 * 2048)  # fmt: skip
    work = staggered_greedy("p", 5, 10, 14)
    finished = run_steps(engine, work)
    stats = engine.scheduler.memory_stats
    assert stats.num_preemptions > 0
    if preemption == "swap":
        assert stats.num_preemptions_swap > 0 and engine.kv.num_swapped_in_blocks > 0
    else:
        assert stats.num_replayed_rows > 0
    assert_matches_reference(engine, work, finished, "kl")
    assert_released(engine)
    assert engine.runner.moves.swapped_decode == {} == engine.runner.moves.swapped_inflight


def test_seeded_sampling_is_reproducible(huginn_dir):
    def run():
        engine = make_engine(huginn_dir, exit_criterion="kl")
        work = [(f"s{i}", [5, 17, 99, i], SamplingParams(max_tokens=6, temperature=1.0,
                 seed=i % 2, exit_threshold=0.01), 0) for i in range(4)]  # fmt: skip
        return {k: (v.token_ids, v.exit_depths) for k, v in run_steps(engine, work).items()}

    first, again = run(), run()
    assert first == again
    assert first["s0"][0] != first["s1"][0]  # other seed, other tokens


def test_more_once_layers_than_core_layers_fill_several_once_planes(tmp_path):
    """2 prelude + 1 coda layers beside 2 core layers: every plane has the core's 2 layers,
    so the once-per-position K/V takes ceil(3 / 2) = 2 planes (the second half full), the
    sizing the simulator plans with; outputs equal the dense reference under preemption."""
    model_dir = make_tiny_huginn_checkpoint(
        tmp_path / "wide", n_layers_in_recurrent_block=2, n_layers_in_coda=1
    )
    engine = make_engine(model_dir, exit_criterion="kl", num_blocks=10 * 8, block_size=4,
                         enable_prefix_caching=False, prefill_chunk_size=5,
                         prefill_mode="wavefront")  # fmt: skip
    config = engine.model.config
    assert config.extra_kv_planes == 2 and engine.kv.num_planes == 8 + 2
    assert engine.runner.kv_cache.shape[0] == 2  # layers per plane: the core's
    shape = ModelShape.from_config(config, dtype_bytes=4)
    assert shape.extra_kv_planes == config.extra_kv_planes
    assert engine.kv.bytes_per_block == kv_bytes_per_block(shape, 4)
    work = staggered_greedy("w", 8, 9, 10)
    finished = run_steps(engine, work)
    assert engine.scheduler.memory_stats.num_preemptions > 0
    steps = assert_matches_reference(engine, work, finished, "kl")
    assert min(steps) < 8
    assert_released(engine)


@pytest.mark.parametrize("arm", ["atomic", "wavefront", "mixed"])
def test_a_prompt_runs_its_requests_r_steps_not_the_models(huginn_dir, arm):
    """A request with r = 3 < 8 runs its prompt positions through 3 steps (the coda and its
    first token read step 3; deeper steps would be waste), in every arm, and a preempted one
    recomputes its prompt at r steps too; tokens and steps equal the dense reference."""
    engine = make_engine(huginn_dir, exit_criterion="kl", prefill_chunk_size=5,
                         num_blocks=99, enable_prefix_caching=False,
                         **PROMPT_ARMS[arm])  # fmt: skip
    rows: dict[str, int] = {}
    depths: dict[str, set] = {}

    def count(scheduled, _output) -> None:
        for group in scheduled.row_groups():
            if group.kind == "prompt":
                rows[group.request_id] = rows.get(group.request_id, 0) + (
                    group.token_count * group.num_depths
                )
                last = group.depth + group.num_depths - 1
                depths.setdefault(group.request_id, set()).update(range(group.depth, last + 1))

    engine.core.add_observer(count)
    work = [
        (f"q{i}", [(13 * i + 7 * j) % 128 for j in range(11)],
         SamplingParams(max_tokens=12, temperature=0.0, exit_threshold=0.1,
                        max_loops=3 if i % 2 else None, ignore_eos=True), i)
        for i in range(4)
    ]  # fmt: skip
    finished = run_steps(engine, work)
    assert_matches_reference(engine, work, finished, "kl")
    preempted = engine.scheduler.memory_stats.num_preemptions > 0
    for request_id, _, params, _ in work:
        r = params.max_loops or 8
        assert depths[request_id] == set(range(r)), request_id
        if finished[request_id].metrics.num_preemptions == 0:
            assert rows[request_id] == 11 * r, request_id  # every position, r steps, once
    assert preempted and any(finished[r].metrics.num_preemptions for r in finished)
    assert any(not finished[r].metrics.num_preemptions for r in ("q1", "q3"))
    assert_released(engine)


SHARED_CASES = [("latent-diff", "no_refill", "per_depth"), ("entropy-diff", "refill", "atomic")]


@pytest.mark.parametrize(
    "criterion, mode, arm", SHARED_CASES, ids=["-".join(c) for c in SHARED_CASES]
)
def test_shared_layout_equals_the_dense_reference(huginn_dir, criterion, mode, arm):
    """SHARED: one step plane per position, overwritten by each step, so later tokens read
    past positions at their last step, and prompts run one position at a time (the dense
    reference's `shared` lookup with `prompt_by_position`)."""
    engine = make_engine(huginn_dir, layout="shared", mode=mode, exit_criterion=criterion,
                         prefill_chunk_size=64, max_num_batched_tokens=256,
                         fill_prompt_chunks=False, **PROMPT_ARMS[arm])  # fmt: skip
    assert engine.kv.num_planes == 2  # the step plane and the once plane
    work = [  # the model's r for every request (SHARED runs prompts all r steps)
        (request_id, prompt, dataclasses.replace(params, max_loops=8), arrival)
        for request_id, prompt, params, arrival in workload(
            SHARED_CASES.index((criterion, mode, arm)) + 51, criterion, count=5
        )
    ]
    finished = run_steps(engine, work)
    steps = []
    for request_id, prompt, params, _ in work:
        ref = reference(engine.model, prompt, params, criterion, lookup="shared",
                        prompt_by_position=True)  # fmt: skip
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.tokens, ref.steps), request_id
        steps += out.exit_depths
    assert min(steps) < 8
    last_exited = [reference(engine.model, p, q, criterion) for _, p, q, _ in work]
    assert any(  # the layouts differ: this workload can tell them apart
        (ref.tokens, ref.steps) != (finished[r].token_ids, finished[r].exit_depths)
        for ref, (r, _, _, _) in zip(last_exited, work, strict=True)
    )
    assert_released(engine)


@pytest.mark.parametrize(
    "args, named",
    [
        (
            {"graph_mode": "emulate", "init_scale": 1.0},
            "Huginn-0125 does not run with graph_mode='emulate' with init_scale > 0",
        ),
        ({"exit_mode": "trace"}, "Huginn-0125 does not run exit_mode='trace'.*'criterion'"),
        ({"exit_mode": "ouro_delayed"}, "Huginn-0125 does not run exit_mode='ouro_delayed'"),
        (
            {"exit_mode": "criterion_delayed", "prompt_exits": True},
            "prompt_exits=True with exit_mode='criterion_delayed'",
        ),
        (
            {"async_scheduling": True, "exit_mode": "criterion"},
            "async_scheduling needs an exit rule known one loop ahead.*use "
            "exit_mode='criterion_delayed', or",
        ),
        (  # the default exit mode is Huginn's criterion: the message says so
            {"async_scheduling": True},
            "exit_mode='ouro' \\(the default: Ouro's gate, or a Huginn checkpoint's "
            "criterion\\).*'criterion_delayed' for Huginn's criterion",
        ),
    ],
)
def test_unsupported_combinations_are_start_up_errors(huginn_dir, args, named):
    with pytest.raises(ConfigError, match=named):
        make_engine(huginn_dir, **args)


def test_ouro_refuses_the_criterion_exit_mode(tiny_dir):
    with pytest.raises(ConfigError, match="Ouro does not run exit_mode='criterion'"):
        make_engine(tiny_dir, exit_mode="criterion")


def test_prompt_logprobs_are_the_teacher_forced_logprobs_at_r_steps(huginn_dir):
    """Prompt logprobs (what lm-eval's loglikelihood reads): every prompt position's coda at
    the request's r steps, in chunks and from a cached prefix (its positions scored from the
    score store through the leave that writes no K/V); the exit-loop rule:
    tests/test_huginn_prompt_scores.py."""
    engine = make_engine(huginn_dir, prefill_chunk_size=5)
    prompt = SHARED_PREFIX + [4, 5, 6, 9]
    work = [
        ("warm", prompt, SamplingParams(max_tokens=2, temperature=0.0), 0),
        ("scored", prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2), 6),
        ("r6", prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0,
                                      max_loops=6), 6),
    ]  # fmt: skip
    finished = run_steps(engine, work)
    for request_id, steps in (("scored", 8), ("r6", 6)):
        out = finished[request_id]
        assert out.error is None and out.prompt_logprobs[0] is None
        expected = torch.log_softmax(teacher_forced_logits(engine.model, prompt, num_steps=steps),
                                     dim=-1)  # fmt: skip
        for position, entry in enumerate(out.prompt_logprobs[1:]):
            token = prompt[position + 1]
            assert entry.logprob == pytest.approx(float(expected[position, token]), abs=1e-4)
            assert entry.loops == steps
    assert len(finished["scored"].prompt_logprobs[1].top_logprobs) == 2
    assert finished["scored"].metrics.num_cached_prompt_tokens == len(SHARED_PREFIX)
    assert finished["r6"].metrics.num_cached_prompt_tokens == 0  # pages keyed by r


def test_cached_prompt_pages_are_shared_only_at_the_same_step_count(huginn_dir):
    """A prompt's coda K/V depends on its request's r (`max_loops`): a request with another
    r must not reuse its pages, one with the same r must."""
    engine = make_engine(huginn_dir, exit_criterion="kl")
    prompt = SHARED_PREFIX + [1, 2, 3]
    params = {r: SamplingParams(max_tokens=4, temperature=0.0, max_loops=r, exit_threshold=0.01,
                                ignore_eos=True) for r in (6, 8)}  # fmt: skip
    work = [("first", prompt, params[6], 0), ("other_r", prompt, params[8], 8),
            ("same_r", prompt, params[6], 16)]  # fmt: skip
    hits = []
    finished = run_steps(
        engine, work, on_step=lambda e: hits.append(e.stats.num_prefix_cache_hit_tokens)
    )
    assert max(hits) == len(SHARED_PREFIX)  # only "same_r" hit the two cached pages
    for request_id, prompt_ids, request_params, _ in work:
        ref = reference(engine.model, prompt_ids, request_params, "kl")
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.tokens, ref.steps), request_id


GOLDEN = json.loads((Path(__file__).parent / "fixtures" / "huginn_golden.json").read_text())
ENGINE_CASES = [  # the authors' runs under the engine's rules: latest-m4, full-depth prompt
    case for case in GOLDEN["adaptive"]
    if case["lookup"] == "last_exited" and not case["exit_in_prompt"] and case["init_scale"] == 0.0
]  # fmt: skip


@pytest.mark.parametrize("case", ENGINE_CASES, ids=[c["criterion"] for c in ENGINE_CASES])
def test_engine_equals_the_authors_code(huginn_dir, case):
    """The batched engine against the authors' `generate_with_adaptive_compute` directly,
    with other requests in the same core calls."""
    criterion = case["criterion"]
    engine = make_engine(huginn_dir, exit_criterion="kl" if criterion == "none" else criterion)
    threshold = 1.0 if criterion == "none" else case["threshold"]
    steps = None
    if criterion == "argmax-stability":  # the authors' steps, per request; < 1 turns it on
        threshold, steps = 0.5, case["threshold"]
    params = SamplingParams(max_tokens=GOLDEN["max_new_tokens"], temperature=0.0,
                            exit_threshold=threshold, exit_stable_steps=steps,
                            ignore_eos=True)  # fmt: skip
    others = [(f"o{i}", [i + 1, 2 * i + 3], params, i) for i in range(3)]
    finished = run_steps(engine, [("golden", GOLDEN["prompt"], params, 1), *others])
    out = finished["golden"]
    assert (out.token_ids, out.exit_depths) == (case["tokens"], case["steps"])


def test_random_initial_states_are_the_authors_draws_through_chunks_and_preemption(huginn_dir):
    """`init_scale=1`: each request draws its initial states from its seed as the authors'
    code does (the dense reference's draws, golden-checked in test_huginn.py), also when its
    prompt is chunked and when it is preempted and recomputed."""
    engine = make_engine(huginn_dir, init_scale=1.0, exit_criterion="kl", prefill_chunk_size=5,
                         num_blocks=9 * 10, enable_prefix_caching=False)  # fmt: skip
    rng = random.Random(3)
    work = [
        (f"r{i}", [rng.randrange(128) for _ in range(rng.choice([3, 9, 12]))],
         SamplingParams(max_tokens=10, temperature=0.0, seed=100 + i, exit_threshold=0.01,
                        ignore_eos=True), 0)
        for i in range(5)
    ]  # fmt: skip
    finished = run_steps(engine, work)
    assert engine.scheduler.memory_stats.num_replayed_rows > 0
    steps = []
    for request_id, prompt, params, _ in work:
        ref = generate(
            engine.model, prompt, max_new_tokens=10, criterion="kl", threshold=0.01,
            lookup="last_exited", exit_in_prompt=False, init_scale=1.0, latent_seed=params.seed,
        )  # fmt: skip
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.tokens, ref.steps), request_id
        steps += out.exit_depths
    zeros = generate(engine.model, work[2][1], max_new_tokens=10, criterion="kl",
                     threshold=0.01, lookup="last_exited", exit_in_prompt=False)  # fmt: skip
    assert finished["r2"].exit_depths != zeros.steps  # the random state changed the run
    assert min(steps) < 8
    assert_released(engine)


PROMPT_EXIT_CASES = [  # the authors' own prompt rule: the prompt exits as one token
    case for case in GOLDEN["adaptive"]
    if case["lookup"] == "last_exited" and case["exit_in_prompt"] and case["criterion"] != "none"
]  # fmt: skip


@pytest.mark.parametrize(
    "case",
    PROMPT_EXIT_CASES,
    ids=[f"{c['criterion']}-min{c['min_steps']}-seed{c['latent_seed']}" for c in PROMPT_EXIT_CASES],
)
def test_prompt_exits_reproduce_the_authors_adaptive_generation(huginn_dir, case):
    """With `prompt_exits` the engine runs the authors' `generate_with_adaptive_compute`
    rule (the prompt exits as one token, `latest-m4`), with other requests in its calls."""
    engine = make_engine(
        huginn_dir, exit_criterion=case["criterion"], prompt_exits=True,
        enable_prefix_caching=False, init_scale=case["init_scale"],
    )  # fmt: skip
    threshold, steps = case["threshold"], None
    if case["criterion"] == "argmax-stability":  # the authors' steps, per request
        threshold, steps = 0.5, case["threshold"]
    params = SamplingParams(
        max_tokens=GOLDEN["max_new_tokens"], temperature=0.0, exit_threshold=threshold,
        exit_stable_steps=steps, min_loops=case["min_steps"] + 1, seed=case["latent_seed"],
        ignore_eos=True,
    )  # fmt: skip
    others = [(f"o{i}", [i + 1, 2 * i + 3, 7], params, i) for i in range(3)]
    finished = run_steps(engine, [("golden", GOLDEN["prompt"], params, 0), *others])
    out = finished["golden"]
    assert (out.token_ids, out.exit_depths) == (case["tokens"], case["steps"])
    assert out.exit_depths[0] < 8  # the prompt itself exited early
    assert_released(engine)


def test_prompt_exits_need_the_whole_prompt_in_one_chunk(huginn_dir):
    with pytest.raises(ConfigError, match="prompt_exits=True with prefix caching"):
        make_engine(huginn_dir, prompt_exits=True)
    with pytest.raises(ConfigError, match="prompt_exits=True outside prefill_mode='atomic'"):
        make_engine(huginn_dir, prompt_exits=True, enable_prefix_caching=False,
                    prefill_mode="per_depth")  # fmt: skip
    engine = make_engine(huginn_dir, prompt_exits=True, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=3, temperature=0.0, exit_threshold=0.01)
    finished = run_steps(engine, [("long", list(range(30)), params, 0),
                                  ("short", [1, 2, 3], params, 0)])  # fmt: skip
    assert "the whole prompt must be one chunk" in finished["long"].error
    assert len(finished["short"].token_ids) == 3 and finished["short"].error is None
    assert_released(engine)


def test_a_recomputed_prompt_that_exited_rebuilds_its_planes(huginn_dir):
    """Under prompt_exits the prompt exits as one token after e < r steps and its step-e K/V
    fills the deeper planes. A recompute preemption replays it through e steps and the same
    copies: every plane of every prompt position equals what it was (the cache is zeroed in
    between, so nothing stale can stand in), and the tokens equal an uninterrupted run."""
    from tests.engine_utils import kv_planes

    args = dict(exit_criterion="kl", prompt_exits=True, enable_prefix_caching=False)
    prompt = [12, 85, 3, 40, 7, 99, 64, 21, 5]
    params = SamplingParams(max_tokens=8, temperature=0.0, exit_threshold=0.3, ignore_eos=True)
    alone = run_steps(make_engine(huginn_dir, **args), [("p", prompt, params, 0)])["p"]
    assert alone.exit_depths[0] < 8  # the prompt exited early
    engine = make_engine(huginn_dir, **args)
    snapshots = {}

    def on_step(engine) -> None:
        request = engine.scheduler.requests.get("p")
        if request is None or request.in_prompt_phase or request.replay is not None:
            return
        if engine.scheduler.token_depth("p") != 0 or "p" not in engine.kv.tables:
            return
        planes = kv_planes(engine, "p", len(prompt))
        if not snapshots and len(request.output_token_ids) >= 3:
            snapshots["before"] = planes
            engine.scheduler.preempt("p")
            engine.runner.kv_cache.zero_()  # the freed blocks hold nothing of the request now
        elif "before" in snapshots and "after" not in snapshots:
            snapshots["after"] = planes

    out = run_steps(engine, [("p", prompt, params, 0)], on_step=on_step)["p"]
    assert engine.scheduler.memory_stats.num_preemptions_recompute == 1
    assert torch.equal(snapshots["after"], snapshots["before"])
    assert (out.token_ids, out.exit_depths) == (alone.token_ids, alone.exit_depths)


PD_CASES = {
    "last_exited-random-init": dict(init_scale=1.0),
    "prompt-exits": dict(prompt_exits=True, enable_prefix_caching=False, init_scale=1.0),
    "full-lookup-prompt-exits": dict(kv_lookup="full", prompt_exits=True,
                                     enable_prefix_caching=False),
    "shared": dict(layout="shared", prefill_chunk_size=64, max_num_batched_tokens=256),
}  # fmt: skip


@pytest.mark.parametrize("case", list(PD_CASES))
def test_handed_off_requests_decode_to_the_single_engines_tokens(huginn_dir, case):
    """Prefill/decode disaggregation: each request leaves the prefill engine after 1 or 3
    tokens with its K/V (step planes and once planes), sampler and runner state (random
    initial states, the steps each position ran) and finishes on a decode engine whose
    small pool preempts by recompute; tokens and steps equal one engine's, and both
    engines end clean."""
    from tests.test_pd_handoff import run_disaggregated

    args = dict(exit_criterion="kl", **PD_CASES[case])
    rng = random.Random(21)
    work = [
        (f"h{i}", [rng.randrange(128) for _ in range(rng.choice([3, 9]))],
         SamplingParams(max_tokens=rng.randrange(5, 10), temperature=rng.choice([0.0, 0.8]),
                        seed=40 + i, exit_threshold=rng.choice([0.1, 0.3]),
                        ignore_eos=True), rng.choice([1, 3]))
        for i in range(5)
    ]  # fmt: skip
    single = run_steps(make_engine(huginn_dir, **args), [(r, p, q, 0) for r, p, q, _ in work])
    prefill = make_engine(huginn_dir, **args)
    decode_blocks = 9 * 8 if case != "shared" else 2 * 8
    decode = make_engine(huginn_dir, num_blocks=decode_blocks, **args)
    finished, exported, _ = run_disaggregated(prefill, decode, work)
    assert sorted(exported) == sorted(r for r, *_ in work)
    steps = []
    for request_id, *_ in work:
        out, alone = finished[request_id], single[request_id]
        assert (out.token_ids, out.exit_depths) == (alone.token_ids, alone.exit_depths), request_id
        steps += out.exit_depths
    assert min(steps) < 8
    if case != "shared":
        assert decode.scheduler.memory_stats.num_preemptions > 0
    for engine in (prefill, decode):
        assert not engine.has_unfinished_requests()
        assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
        assert engine.runner.moves.staged_imports == {}
        assert_released(engine)


def test_shared_layout_refuses_a_smaller_r_per_request(huginn_dir):
    engine = make_engine(huginn_dir, layout="shared")
    params = {r: SamplingParams(max_tokens=3, temperature=0.0, max_loops=r) for r in (6, None)}
    finished = run_steps(engine, [("small_r", [1, 2, 3], params[6], 0),
                                  ("full_r", [4, 5, 6], params[None], 0)])  # fmt: skip
    assert "max_loops below it needs the last_exited layout" in finished["small_r"].error
    assert len(finished["full_r"].token_ids) == 3 and finished["full_r"].error is None


@pytest.mark.parametrize("graph_mode", ["off", "emulate"])
def test_the_triton_attention_kernels_serve_huginn(huginn_small_dir, monkeypatch, graph_mode):
    """The paged Triton kernels (under the interpreter on CPU) serving Huginn: the once plane
    and the step planes through the same kernels, eagerly and over the decode graphs' static
    buffers (`graph_call` for the core and for each once plane), equal to the dense
    reference. A small Huginn (1 + 2 + 1 layers, r = 3) keeps the interpreter's kernel
    launches few."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    engine = make_engine(huginn_small_dir, attention_backend="triton", exit_criterion="kl",
                         graph_mode=graph_mode)  # fmt: skip
    assert engine.runner.attention.name == "triton"
    work = [(f"t{i}", [3 * i + 1, 7, 11], SamplingParams(
        max_tokens=3, temperature=0.0, exit_threshold=0.2, ignore_eos=True), i)
        for i in range(2)]  # fmt: skip
    finished = run_steps(engine, work)
    steps = assert_matches_reference(engine, work, finished, "kl")
    assert min(steps) < 3  # early exits too
    assert (engine.stats.num_graph_calls > 0) == (graph_mode == "emulate")


def test_a_graphed_once_plane_read_covers_only_the_rows_that_keep_it(huginn_small_dir,
                                                                      monkeypatch):  # fmt: skip
    """Over the paged kernels a graphed call's prelude and coda attend over the once plane
    only for the rows that keep their output (rows that start a token; coda candidates and
    checked rows): every other row reads one position instead of its whole context, so a
    call pays the once plane's K/V reads for the rows that need them. Loop planes read each
    row's context; tokens stay the reference's."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    engine = make_engine(huginn_small_dir, attention_backend="triton", exit_criterion="kl",
                         graph_mode="emulate")  # fmt: skip
    attention, graphs = engine.runner.attention, engine.runner.graphs
    graph_call, reads = attention.graph_call, []

    def recorded(**kwargs):
        reads[-1]["lens"].append(kwargs["seq_lens"].clone())
        return graph_call(**kwargs)

    attention.graph_call = recorded
    launch = graphs.launch

    def watched(bucket, rows, host):
        reads.append({"rows": rows, "form": graphs.form(host), "lens": []})
        return launch(bucket, rows, host)

    graphs.launch = watched
    work = [(f"t{i}", [3 * i + 1, 7, 11], SamplingParams(
        max_tokens=3, temperature=0.0, exit_threshold=0.2, ignore_eos=True), i)
        for i in range(2)]  # fmt: skip
    finished = run_steps(engine, work)
    assert_matches_reference(engine, work, finished, "kl")
    short = 0
    for call in reads:
        rows, (enters, leaves), lens = call["rows"], call["form"], call["lens"]
        n, context = len(rows), torch.as_tensor(rows.positions + 1, dtype=torch.int32)
        assert len(lens) == 1 + enters + leaves
        kept = [torch.as_tensor(rows.depths == 0)] if enters else []
        kept += [None]  # the loop planes
        if leaves:
            kept.append(torch.as_tensor((rows.exit_code != CONTINUE) | rows.needs_gate))
        for read, keep in zip(lens, kept):
            expected = context if keep is None else torch.where(keep, context, 1)
            assert read[:n].tolist() == expected.tolist()
            short += int((read[:n] < context).sum())
    assert short > 0  # some rows read one position where they would have read their context


FULL_LOOKUP_CASES = [  # the authors' default lookup, under both prompt rules
    case for case in GOLDEN["adaptive"]
    if case["lookup"] == "full" and case["criterion"] in ("kl", "entropy-diff", "latent-diff")
]  # fmt: skip


@pytest.mark.parametrize(
    "case",
    FULL_LOOKUP_CASES,
    ids=[
        f"{c['criterion']}-{'prompt-exits' if c['exit_in_prompt'] else 'prompt-full'}"
        f"-seed{c['latent_seed']}"
        for c in FULL_LOOKUP_CASES
    ],
)
def test_full_lookup_reproduces_the_authors_default(huginn_dir, case):
    """`kv_lookup='full'`: an earlier position that did not run step t is invisible to a
    token's step t (no finalize copies; the torch backend masks it). With `prompt_exits` this
    is the authors' default `generate_with_adaptive_compute`."""
    engine = make_engine(
        huginn_dir, kv_lookup="full", exit_criterion=case["criterion"],
        prompt_exits=case["exit_in_prompt"], enable_prefix_caching=False,
        init_scale=case["init_scale"],
    )  # fmt: skip
    params = SamplingParams(
        max_tokens=GOLDEN["max_new_tokens"], temperature=0.0, exit_threshold=case["threshold"],
        seed=case["latent_seed"], ignore_eos=True,
    )  # fmt: skip
    others = [(f"o{i}", [i + 1, 2 * i + 3, 7], params, i) for i in range(3)]
    finished = run_steps(engine, [("golden", GOLDEN["prompt"], params, 0), *others])
    out = finished["golden"]
    assert (out.token_ids, out.exit_depths) == (case["tokens"], case["steps"])
    assert engine.runner.calls.steps_run == {}
    assert_released(engine)


def test_full_lookup_equals_the_dense_reference_under_preemption(huginn_dir):
    engine = make_engine(huginn_dir, kv_lookup="full", exit_criterion="kl", num_blocks=9 * 10,
                         enable_prefix_caching=False)  # fmt: skip
    work = staggered_greedy("f", 8, 10, 12)
    finished = run_steps(engine, work)
    assert engine.scheduler.memory_stats.num_replayed_rows > 0
    differs = False
    for request_id, prompt, params, _ in work:
        ref = reference(engine.model, prompt, params, "kl", lookup="full")
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.tokens, ref.steps), request_id
        latest = reference(engine.model, prompt, params, "kl")
        differs |= (latest.tokens, latest.steps) != (ref.tokens, ref.steps)
    assert differs  # the lookups disagree on this workload
    with pytest.raises(ConfigError, match="kv_lookup='full' outside layout='last_exited'"):
        make_engine(huginn_dir, kv_lookup="full", layout="shared")


@pytest.mark.parametrize("num_loops", [4, 12])
def test_the_engine_runs_huginn_at_another_step_bound(huginn_dir, num_loops):
    """`num_loops` sets the engine's D: fewer steps than the config's r = 8 (one plane per
    step fewer to hold) or more (Huginn's authors report gains up to 64 steps at r = 32);
    requests default to it and equal the dense reference at that step count."""
    engine = make_engine(huginn_dir, exit_criterion="kl", num_loops=num_loops)
    assert engine.num_loops == num_loops and engine.kv.num_planes == num_loops + 1
    rng = random.Random(num_loops)
    work = [
        (f"n{i}", [rng.randrange(128) for _ in range(rng.choice([3, 9]))],
         SamplingParams(max_tokens=6, temperature=0.0, exit_threshold=rng.choice([0.1, 1.0]),
                        ignore_eos=True), i)
        for i in range(4)
    ]  # fmt: skip
    finished = run_steps(engine, work)
    steps = []
    for request_id, prompt, params, _ in work:
        ref = generate(
            engine.model, prompt, max_new_tokens=6, num_steps=num_loops,
            criterion="kl" if params.exit_threshold < 1 else "none",
            threshold=params.exit_threshold, lookup="last_exited", exit_in_prompt=False,
        )  # fmt: skip
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.tokens, ref.steps), request_id
        steps += out.exit_depths
    assert max(steps) == num_loops and min(steps) < num_loops
    assert_released(engine)


def test_graph_mode_auto_starts_huginn_eagerly_and_drawn_states_refuse_graphs(huginn_dir):
    """`auto` (the default) runs Huginn eagerly on every device (its graphed step has not run
    captured on a GPU), so a CUDA engine starts without naming it; graphs with initial
    states drawn per request on the host are a start-up error naming both options."""
    from loopserve.config import EngineConfig, effective_graph_mode
    from loopserve.engine.model_setup import resolve_model_options
    from loopserve.models import load_model

    model = load_model(huginn_dir)
    math = (model.signal_kind, model.config.extra_kv_planes)
    cuda = EngineConfig.from_engine_args(device="cuda")
    assert effective_graph_mode(cuda) == "capture"  # what Ouro gets
    resolved = resolve_model_options(dataclasses.replace(cuda, device="cpu"), *math, "Huginn")
    assert effective_graph_mode(dataclasses.replace(resolved, device="cuda")) == "off"
    emulate = EngineConfig.from_engine_args(graph_mode="emulate")
    assert resolve_model_options(emulate, *math, "H").graph_mode == "emulate"
    with pytest.raises(ConfigError, match="graph_mode='emulate' with init_scale > 0"):
        resolve_model_options(dataclasses.replace(emulate, init_scale=1.0), *math, "H")


GRAPH_CASES = [  # criterion, layout, decode mode
    ("kl", "last_exited", "refill"),
    ("latent-diff", "last_exited", "no_refill"),
    ("kl", "shared", "refill"),
    ("argmax-stability", "last_exited", "refill"),
]


@pytest.mark.parametrize(
    "criterion, layout, mode", GRAPH_CASES, ids=["-".join(c) for c in GRAPH_CASES]
)
def test_the_decode_graphs_serve_huginn(huginn_dir, criterion, layout, mode):
    """Huginn's decode loop through the decode graphs' static buffers (`emulate`: the
    captured step, run eagerly): the prelude of rows that start and the coda of the coda
    candidates attend to the once plane from the static tables, the criterion is checked
    inside the step; tokens and steps equal the dense reference, every decode call runs
    graphed (one copy each way), with early exits. Under coda batching in time (on for a
    criterion that reads no logits) a step's batch of leaves adds its own copy in; its
    sampled tokens feed the loop-0 rows on the device and are read with the step's copy
    out."""
    engine = make_engine(huginn_dir, exit_criterion=criterion, layout=layout, mode=mode,
                         graph_mode="emulate")  # fmt: skip
    seed = GRAPH_CASES.index((criterion, layout, mode)) + 70
    work = workload(seed, criterion, count=6)
    if layout == "shared":  # the model's r for every request (SHARED runs prompts all r)
        work = [(r, p, dataclasses.replace(q, max_loops=8), a) for r, p, q, a in work]
    copies = []  # (H2D, D2H) of graphed decode-only steps, less their leave batch's copy in

    def watch(scheduled, output):
        if scheduled.decode is not None and not scheduled.items and output.stats.num_graph_calls:
            leave = scheduled.leave is not None
            stats = output.stats
            copies.append((stats.num_h2d_transfers - leave, stats.num_d2h_transfers))

    engine.core.add_observer(watch)
    finished = run_steps(engine, work, abort_at={"r4": 3})
    assert len(copies) > 10 and all(h2d == 1 and d2h <= 1 for h2d, d2h in copies), copies
    steps = []
    for request_id, prompt, params, _ in work:
        ref = reference(engine.model, prompt, params, criterion,
                        **({"lookup": "shared", "prompt_by_position": True} if layout == "shared" else {}))  # fmt: skip
        out = finished[request_id]
        if request_id == "r4":
            assert out.token_ids == ref.tokens[: len(out.token_ids)]
            continue
        assert (out.token_ids, out.exit_depths) == (ref.tokens, ref.steps), request_id
        steps += out.exit_depths
    assert min(steps) < 8
    assert engine.stats.num_graph_calls > 0
    assert_released(engine)


@pytest.mark.parametrize(
    "criterion, coda_batching, leaves",
    [
        ("latent-diff", "off", "candidates"),
        ("latent-diff", "on", "never"),
        ("kl", "auto", "always"),
    ],
)
def test_a_graphed_huginn_call_runs_its_prelude_and_coda_only_where_rows_need_them(
    huginn_dir, criterion, coda_batching, leaves
):
    """Huginn's prelude and coda layers weigh about as much as a core step: a graphed call
    runs its prelude only when some row starts a token, and its leave when a coda candidate
    needs it (not when coda batching in time runs leaves apart; in every call when the
    criterion reads logits). Each bucket is captured in those forms; tokens and steps stay
    the dense reference's."""
    engine = make_engine(huginn_dir, exit_criterion=criterion, coda_batching=coda_batching,
                         graph_mode="emulate")  # fmt: skip
    graphs = engine.runner.graphs
    counts = {"enter": 0, "leave": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    graphs.enter, graphs.leave = counted("enter", graphs.enter), counted("leave", graphs.leave)
    launch, calls = graphs.launch, []

    def watched(bucket, rows, host):
        before = dict(counts)
        out = launch(bucket, rows, host)
        ran = {name: counts[name] - before[name] for name in counts}
        calls.append((len(host.starts) > 0, len(host.candidates) > 0, ran["enter"], ran["leave"]))
        return out

    graphs.launch = watched
    work = workload(81, criterion, count=6)
    finished = run_steps(engine, work)
    for request_id, prompt, params, _ in work:
        ref = reference(engine.model, prompt, params, criterion)
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.tokens, ref.steps), request_id
    assert len(calls) > 10
    assert all(enter == int(starts) for starts, _, enter, _ in calls), calls
    expected = {
        "candidates": lambda candidates: int(candidates),
        "never": lambda candidates: 0,
        "always": lambda candidates: 1,
    }[leaves]
    assert all(leave == expected(candidates) for _, candidates, _, leave in calls), calls
    # Both sides of each choice occur, so the counts above tell the forms apart.
    assert {starts for starts, *_ in calls} == {True, False}
    assert {candidates for _, candidates, *_ in calls} == {True, False}


def test_decode_rows_report_the_criterions_score_and_exit_where_it_crosses(huginn_dir):
    """Under the `criterion` exit mode a decode row's signal is its criterion's score (here
    latent-diff: the relative change of the state), read only on the loops the plan lets the
    criterion decide (GATE: from min_loops on); a row exits there iff its score is below the
    request's threshold. Nothing is folded into a CDF: plans carry cdf 0, survival 1."""
    engine = make_engine(huginn_dir, exit_criterion="latent-diff")
    assert engine.config.exit.mode == "criterion"  # what the default 'ouro' means for Huginn
    threshold = 0.2
    params = SamplingParams(max_tokens=6, temperature=0.0, exit_threshold=threshold,
                            min_loops=3, ignore_eos=True)  # fmt: skip
    work = [(f"s{i}", [5 + i, 9, 30 + 2 * i], params, i) for i in range(3)]
    seen = {"checked": 0, "exited_by_score": 0, "continued": 0}

    def watch(scheduled, output):
        rows, results = scheduled.decode, output.decode
        if rows is None:
            return
        gate = rows.exit_code == GATE
        assert (rows.needs_gate == gate).all()  # no signal outside GATE rows
        assert (rows.depths[gate] + 1 >= params.min_loops).all()
        assert (rows.cdf_before == 0.0).all() and (rows.survival_before == 1.0).all()
        assert np.isnan(results.hazards[~gate]).all()
        scores = results.hazards[gate]
        assert np.isfinite(scores).all() and (scores >= 0.0).all()
        exited = results.exited[gate]
        assert (exited == (scores < threshold)).all()
        seen["checked"] += int(gate.sum())
        seen["exited_by_score"] += int(exited.sum())
        seen["continued"] += int((~exited).sum())

    engine.core.add_observer(watch)
    finished = run_steps(engine, work)
    assert_matches_reference(engine, work, finished, "latent-diff")
    # the criterion both stopped tokens early and let others go on
    assert seen["exited_by_score"] > 0 and seen["continued"] > 0


def test_cascade_attention_serves_huginn_rows_that_share_cached_pages(huginn_dir):
    """The one executor's cascade attention runs for Huginn: decode rows of requests that
    hit the same cached prompt pages read that prefix once per group (in their step planes
    and, for the prelude and coda, in their once planes); tokens and steps equal the dense
    reference and the run with cascade off."""
    prompt = SHARED_PREFIX + [4, 5, 6, 9, 2, 8, 7, 1]
    params = SamplingParams(max_tokens=6, temperature=0.0, exit_threshold=0.1, ignore_eos=True)
    work = [(f"c{i}", prompt[: len(prompt) - i], params, 2 * (i > 0)) for i in range(4)]
    runs = {}
    for cascade in (True, False):
        engine = make_engine(huginn_dir, cascade_attention=cascade, exit_criterion="kl")
        runs[cascade] = run_steps(engine, work)
        if cascade:
            stats = engine.runner.attention.cascade_stats
            assert stats.num_groups > 0 and stats.num_shared_positions > 0
            assert_matches_reference(engine, work, runs[cascade], "kl")
        else:
            assert engine.runner.attention.cascade_stats.num_groups == 0
    for request_id, *_ in work:
        on, off = runs[True][request_id], runs[False][request_id]
        assert (on.token_ids, on.exit_depths) == (off.token_ids, off.exit_depths)


def test_argmax_stability_steps_are_per_request(huginn_dir):
    """argmax-stability's stable steps come from each request (`exit_stable_steps`, default
    the authors' 2), in the same core calls: each request equals the dense reference at its
    own steps, and the steps change where tokens exit. Out-of-range steps are refused."""
    engine = make_engine(huginn_dir, exit_criterion="argmax-stability")
    prompt = [5, 9, 30, 2]
    work = [
        (f"s{steps}", prompt, SamplingParams(max_tokens=6, temperature=0.0, exit_threshold=0.5,
                                             exit_stable_steps=steps, ignore_eos=True), 0)
        for steps in (1, 2, 4, None)
    ]  # fmt: skip
    finished = run_steps(engine, work)
    assert_matches_reference(engine, work, finished, "argmax-stability")
    depths = {rid: finished[rid].exit_depths for rid, *_ in work}
    assert depths["sNone"] == depths["s2"]  # the default is the authors' 2
    assert sum(depths["s1"]) < sum(depths["s2"]) < sum(depths["s4"])
    with pytest.raises(InvalidRequestError, match="exit_stable_steps"):
        SamplingParams(exit_stable_steps=0)


DELAYED_RUNS = [  # (criterion, async scheduling, graph mode, decode mode)
    ("latent-diff", False, "off", "refill"),
    ("kl", True, "off", "refill"),
    ("argmax-stability", True, "emulate", "no_refill"),
    ("entropy-diff", True, "emulate", "refill"),
]


@pytest.mark.parametrize(
    "criterion, use_async, graph_mode, mode",
    DELAYED_RUNS,
    ids=["-".join(map(str, r)) for r in DELAYED_RUNS],
)
def test_criterion_delayed_equals_the_delayed_reference_under_async_scheduling(
    huginn_dir, criterion, use_async, graph_mode, mode
):
    """`criterion_delayed` (a token exits one step after its criterion fires, so each exit is
    known a loop ahead): every request equals the dense reference run with the same delay,
    with async scheduling planning steps while the previous one runs, eager and through the
    decode graphs; and the delay is real: tokens whose criterion fired before the last step
    use one step more than under the authors' `criterion`."""
    engine = make_engine(huginn_dir, exit_mode="criterion_delayed", exit_criterion=criterion,
                         async_scheduling=use_async, graph_mode=graph_mode, mode=mode)  # fmt: skip
    work = workload(DELAYED_RUNS.index((criterion, use_async, graph_mode, mode)), criterion)
    finished = run_steps(engine, work)
    delayed_steps, authors_steps = [], []
    for request_id, prompt, params, _ in work:
        delayed = reference(engine.model, prompt, params, criterion, delayed=True)
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (delayed.tokens, delayed.steps), request_id
        authors = reference(engine.model, prompt, params, criterion)
        if authors.tokens[:1] == delayed.tokens[:1]:
            delayed_steps.append(delayed.steps[1:2])
            authors_steps.append(authors.steps[1:2])
    assert any(d and a and d[0] == a[0] + 1 for d, a in zip(delayed_steps, authors_steps))
    stats = engine.stats
    assert (stats.num_steps_scheduled_ahead > 0) == use_async
    assert (stats.num_graph_calls > 0) == (graph_mode != "off")
    assert_released(engine)
