"""Sampling controls: presence / frequency / repetition penalties, logit_bias, min_tokens.

The logits math is checked against a numpy implementation written from vLLM's documented
semantics (independent of `runner/sampler.py`); the engine is checked against the dense
reference (which samples through the same `TokenHistory`, so it only proves the engine feeds
it the right history: prompt, final tokens only, across graphs, early exits, mixed batches,
preemption and hand-offs), and the controls must have changed the output (a control run
without them differs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loopserve.contracts import SampleSpec
from loopserve.errors import InvalidRequestError
from loopserve.runner import sampler
from loopserve.runner.logits_adjust import TokenHistory
from loopserve.runner.transfers import Transfers
from loopserve.sampling_params import SamplingParams
from tests.engine_utils import make_engine, reference_for, run_steps

VOCAB = 50


def numpy_adjust(logits, *, prompt, output, presence, frequency, repetition, bias, min_tokens,
                 stop_ids):  # fmt: skip
    """vLLM's order: logit bias, min_tokens (stop tokens forbidden), repetition penalty over
    prompt and output tokens, then frequency and presence penalties over output counts."""
    x = np.array(logits, dtype=np.float64)
    for token, value in bias.items():
        x[token] += value
    if len(output) < min_tokens:
        for token in stop_ids:
            x[token] = -np.inf
    counts = np.bincount(np.array(output, dtype=np.int64), minlength=VOCAB).astype(np.float64)
    seen = counts > 0
    for token in prompt:
        seen[token] = True
    if repetition != 1.0:
        x = np.where(seen, np.where(x > 0, x / repetition, x * repetition), x)
    x = x - frequency * counts - presence * (counts > 0)
    return x


@pytest.mark.parametrize("seed", range(6))
def test_adjusted_logits_equal_a_numpy_implementation(seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, VOCAB).astype(np.float32)
    prompt = rng.integers(0, VOCAB, 12).tolist()
    output = rng.integers(0, VOCAB, 7).tolist()
    bias = {int(t): float(rng.uniform(-5, 5)) for t in rng.choice(VOCAB, 4, replace=False)}
    spec = SampleSpec(
        temperature=0.7,
        presence_penalty=float(rng.uniform(-2, 2)),
        frequency_penalty=float(rng.uniform(-2, 2)),
        repetition_penalty=float(rng.uniform(0.5, 2.0)),
        logit_bias=tuple(sorted(bias.items())),
        min_tokens=int(rng.integers(0, 12)),
        stop_token_ids=(3, 17),
    )
    history = TokenHistory(spec, VOCAB, Transfers(torch.device("cpu")), prompt_token_ids=prompt)
    for token in output:
        history.record(token)
    got = history.adjust(torch.from_numpy(logits), spec).numpy()
    expected = numpy_adjust(
        logits, prompt=prompt, output=output, presence=spec.presence_penalty,
        frequency=spec.frequency_penalty, repetition=spec.repetition_penalty, bias=bias,
        min_tokens=spec.min_tokens, stop_ids=spec.stop_token_ids,
    )  # fmt: skip
    np.testing.assert_allclose(got, expected.astype(np.float32), rtol=1e-6, atol=1e-5)
    # Outputs handed over at construction (a hand-off) count as recorded ones.
    again = TokenHistory(
        spec, VOCAB, Transfers(torch.device("cpu")), prompt_token_ids=prompt,
        output_token_ids=output,
    )  # fmt: skip
    assert torch.equal(again.adjust(torch.from_numpy(logits), spec), torch.from_numpy(got))


def test_invalid_controls_raise_a_typed_error_naming_the_field():
    for field, value in [
        ("presence_penalty", 2.5),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("logit_bias", {3: 101.0}),
        ("logit_bias", {-1: 1.0}),
        ("min_tokens", 20),  # above max_tokens (16)
    ]:
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**{field: value})
        assert info.value.param == field
    assert SamplingParams(logit_bias={9: 1.0, 2: -1.0}).logit_bias == ((2, -1.0), (9, 1.0))


PENALIZED = [
    SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.8, exit_threshold=0.5),
    SamplingParams(max_tokens=10, temperature=0.0, presence_penalty=1.5, frequency_penalty=0.8),
    SamplingParams(
        max_tokens=9,
        temperature=0.9,
        seed=7,
        frequency_penalty=1.2,
        logit_bias={5: 4.0, 40: -100.0},
        exit_threshold=0.6,
    ),  # fmt: skip
    SamplingParams(max_tokens=8, temperature=0.0, min_tokens=6, exit_threshold=0.4),
]


def _work(params_list, *, stop_token=None):
    work = []
    for i, params in enumerate(params_list):
        prompt = [(13 * i + 7 * j) % 200 + 3 for j in range(5 + 4 * i)]
        work.append((f"p{i}", prompt, params, i))
    return work


@pytest.mark.parametrize(
    "engine_args",
    [
        {},
        {"graph_mode": "emulate"},
        {"prefill_mode": "wavefront", "mixed_prefill_decode": True, "exit_mode": "ouro_delayed"},
        {"preemption_mode": "recompute", "num_blocks": 18 * 4},
        {"graph_mode": "emulate", "batched": True},
    ],
    ids=["eager", "graphs", "mixed", "preemption", "graphs-batched"],
)
def test_controlled_requests_equal_the_dense_reference_in_a_busy_engine(
    tiny_dir, engine_args, monkeypatch
):
    """`batched`: the engine adjusts and filters rows together as on a GPU (the reference
    samples row by row)."""
    engine_args = dict(engine_args)
    if engine_args.pop("batched", False):
        monkeypatch.setattr(sampler, "batches_filtering", lambda device: True)
    engine = make_engine(tiny_dir, **engine_args)
    plain = [
        SamplingParams(max_tokens=12, temperature=0.0, exit_threshold=0.5),
        SamplingParams(max_tokens=11, temperature=1.0, seed=3),
    ]
    work = _work(PENALIZED + plain)
    finished = run_steps(engine, work)
    for request_id, prompt, params, _ in work:
        ref = reference_for(engine, prompt, params)
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), request_id
    if "num_blocks" in engine_args:
        assert engine.stats.num_preemptions > 0
    # The controls changed the outputs: the same requests without them differ.
    changed = 0
    for request_id, prompt, params, _ in work[:3]:
        neutral = SamplingParams(
            max_tokens=params.max_tokens, temperature=params.temperature, seed=params.seed,
            exit_threshold=params.exit_threshold,
        )  # fmt: skip
        changed += (
            reference_for(engine, prompt, neutral).token_ids != finished[request_id].token_ids
        )
    assert changed >= 2


def test_min_tokens_holds_back_the_stop_token_then_releases_it(tiny_dir):
    engine = make_engine(tiny_dir)
    prompt = [250, 13, 2]  # greedy output of distinct tokens (tiny checkpoint, seed 0)
    free = reference_for(engine, prompt, SamplingParams(max_tokens=12, temperature=0.0))
    tokens = free.token_ids
    # A stop token that greedy decoding produces early (first at index `at` < 4).
    at = next(i for i in range(1, 4) if tokens[i] not in tokens[:i])
    stop = tokens[at]
    stopped = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop])
    held = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop], min_tokens=5)
    work = [("stopped", prompt, stopped, 0), ("held", prompt, held, 0)]
    finished = run_steps(engine, work)
    assert finished["stopped"].token_ids == tokens[: at + 1]
    out = finished["held"]
    assert len(out.token_ids) >= 5 and stop not in out.token_ids[:5]
    ref = reference_for(engine, prompt, held)
    assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths)


def test_a_large_logit_bias_makes_greedy_pick_the_token(tiny_dir):
    engine = make_engine(tiny_dir)
    params = SamplingParams(max_tokens=5, temperature=0.0, logit_bias={77: 100.0})
    finished = run_steps(engine, [("b", [5, 6, 7], params, 0)])
    assert finished["b"].token_ids == [77] * 5


def test_out_of_vocabulary_logit_bias_is_rejected_at_submission(tiny_dir):
    engine = make_engine(tiny_dir)
    vocab = engine.model.config.vocab_size
    with pytest.raises(InvalidRequestError, match="outside the vocabulary") as info:
        engine.add_request("x", [1, 2], SamplingParams(logit_bias={vocab: 1.0}))
    assert info.value.param == "logit_bias"


def test_a_handed_off_request_keeps_its_history(tiny_dir):
    """The importing engine counts the tokens the exporter produced (they come with the
    request's announcement), so its penalties continue exactly."""
    params = SamplingParams(max_tokens=10, temperature=0.0, presence_penalty=2.0,
                            repetition_penalty=1.5)  # fmt: skip
    prompt = [31, 8, 8, 50, 2, 9]
    prefill, decode = make_engine(tiny_dir), make_engine(tiny_dir)
    prefill.add_request("h", prompt, params)
    while not prefill.can_export("h"):
        prefill.step()
    decode.import_request(prefill.export_request("h"))
    finished = run_steps(decode, [])
    ref = reference_for(decode, prompt, params)
    assert (finished["h"].token_ids, finished["h"].exit_depths) == (ref.token_ids, ref.exit_depths)


def test_rows_sharing_their_values_are_adjusted_and_filtered_together_exactly(
    tiny_dir, monkeypatch
):
    """As on a GPU (`batches_filtering`): requests with the same penalties and sampling values
    (each its own seed and history) are adjusted and filtered as one batch per call, and each
    still gets the dense reference's tokens, which samples it alone."""
    monkeypatch.setattr(sampler, "batches_filtering", lambda device: True)
    shared = dict(temperature=0.9, top_p=0.9, presence_penalty=0.5, repetition_penalty=1.2)
    params = [SamplingParams(max_tokens=10, seed=10 + i, exit_threshold=0.5, **shared)
              for i in range(6)]  # fmt: skip
    params += [SamplingParams(max_tokens=9, temperature=0.7, top_k=20, seed=20 + i)
               for i in range(3)]  # fmt: skip
    engine = make_engine(tiny_dir, graph_mode="emulate")
    work = _work(params)
    finished = run_steps(engine, work)
    for request_id, prompt, request_params, _ in work:
        ref = reference_for(engine, prompt, request_params)
        out = finished[request_id]
        assert (out.token_ids, out.exit_depths) == (ref.token_ids, ref.exit_depths), request_id
