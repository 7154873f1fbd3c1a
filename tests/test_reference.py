"""The dense reference generator (the oracle of every batching test)."""

from __future__ import annotations

import pytest
import torch

from loopserve.errors import InvalidRequestError
from loopserve.exit import ExitMode, ExitRule, choose_exit_from_hazards
from loopserve.models.attention import DenseAttention, DenseKV
from loopserve.reference import generate
from loopserve.sampling_params import SamplingParams
from tests.test_model import full_forward_logits

PROMPT = [7, 3, 100, 42, 9, 250, 11]


def test_full_depth_greedy_decode_equals_dense_recompute(tiny_model):
    out = generate(tiny_model, PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out.exit_depths == [4] * 8
    logits = full_forward_logits(tiny_model, PROMPT + out.token_ids[:-1])[-1]
    assert logits[len(PROMPT) - 1 :].argmax(-1).tolist() == out.token_ids


def test_first_token_exit_is_chosen_from_prompt_hazards(tiny_model):
    params = SamplingParams(max_tokens=1, temperature=0, exit_threshold=0.4)
    out = generate(tiny_model, PROMPT, params)
    config = tiny_model.config
    kv = DenseKV(num_planes=4, num_layers=config.num_hidden_layers, max_len=len(PROMPT),
                 num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                 dtype=torch.float32)  # fmt: skip
    positions = torch.arange(len(PROMPT))
    hidden = tiny_model.prelude(torch.tensor(PROMPT))
    outputs, hazards = [], []
    for depth in range(4):
        attn = DenseAttention(kv, depth, positions, config.head_dim**-0.5)
        hidden = tiny_model.core(hidden, positions, attn)
        outputs.append(hidden[-1:])
        hazards.append(float(tiny_model.gate(hidden[-1:])[0]))
    loops = choose_exit_from_hazards(ExitMode.OURO, ExitRule(1, 4, 0.4), hazards)
    assert out.exit_depths == [loops]
    assert out.token_ids == [int(tiny_model.coda(outputs[loops - 1]).argmax())]


def test_early_exit_thresholds_produce_varied_depths(tiny_model):
    out = generate(
        tiny_model,
        PROMPT,
        SamplingParams(max_tokens=24, temperature=0, exit_threshold=0.5, ignore_eos=True),
    )
    assert len(set(out.exit_depths)) > 1
    assert min(out.exit_depths) < 4  # some tokens really exited early
    # threshold 1.0 never exits early (the semantics): every token runs all 4 loops
    full = generate(tiny_model, PROMPT, SamplingParams(max_tokens=24, temperature=0,
                                                        ignore_eos=True))  # fmt: skip
    assert full.exit_depths == [4] * 24


def test_trace_mode_replays_the_trace(tiny_model):
    params = SamplingParams(max_tokens=6, temperature=0, exit_trace=(2, 1, 4), ignore_eos=True)
    out = generate(tiny_model, PROMPT, params, exit_mode="trace")
    assert out.exit_depths == [2, 1, 4, 2, 1, 4]


def test_min_and_max_loops_bound_every_token(tiny_model):
    params = SamplingParams(
        max_tokens=12, temperature=0, exit_threshold=0.0, min_loops=2, max_loops=3, ignore_eos=True
    )
    out = generate(tiny_model, PROMPT, params)
    assert set(out.exit_depths) == {2}
    params = SamplingParams(max_tokens=12, temperature=0, max_loops=2, ignore_eos=True)
    assert set(generate(tiny_model, PROMPT, params).exit_depths) == {2}


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_model):
    def run(seed):
        params = SamplingParams(
            max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=seed, ignore_eos=True
        )
        return generate(tiny_model, PROMPT, params).token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_eos_stops_generation_unless_ignored(tiny_model):
    first = generate(tiny_model, PROMPT, SamplingParams(max_tokens=3, temperature=0)).token_ids[0]
    out = generate(
        tiny_model, PROMPT, SamplingParams(max_tokens=3, temperature=0), eos_token_ids=[first]
    )
    assert out.token_ids == [first]
    out = generate(
        tiny_model, PROMPT, SamplingParams(max_tokens=3, temperature=0, stop_token_ids=[first])
    )
    assert out.token_ids == [first]
    ignored = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    assert len(generate(tiny_model, PROMPT, ignored, eos_token_ids=[first]).token_ids) == 3


def test_bad_inputs_raise_typed_errors(tiny_model):
    with pytest.raises(InvalidRequestError):
        generate(tiny_model, [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="exit_trace"):
        generate(tiny_model, PROMPT, SamplingParams(), exit_mode="trace")
    with pytest.raises(InvalidRequestError, match="max_loops"):
        generate(tiny_model, PROMPT, SamplingParams(max_loops=5))
    with pytest.raises(InvalidRequestError, match="layout"):
        generate(tiny_model, PROMPT, SamplingParams(), layout="paged")
