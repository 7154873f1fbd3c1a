"""Sampling filters: temperature, top-k and top-p against an independent sort-based numpy
implementation, seeded sampling that only ever draws from the filtered support, and batched
sampling: rows that share their values are filtered together (a fixed number of device
operations per call, plus one draw per row) with each row's result equal to sampling it
alone."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from loopserve.bench.kernels import counting, kernels_of
from loopserve.contracts import SampleSpec
from loopserve.runner.logits_adjust import TokenHistory, adjust_rows
from loopserve.runner.sampler import (
    MAX_BATCHED_GROUPS,
    NO_MASS,
    NOT_A_DISTRIBUTION,
    batches_filtering,
    draw_failure,
    draw_one,
    draw_rows,
    filtered_probs,
    make_generator,
    read_samples,
    sample_on_device,
    sample_rows,
)
from loopserve.runner.transfers import Transfers


def reference_filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float):
    """Float64 reference. Returns (probabilities, margin).

    top-k keeps every token whose scaled logit is >= the k-th largest (ties at the k-th value
    are all kept); top-p then walks the renormalized top-k distribution from the most likely
    token and keeps a token while the mass strictly before it is < top_p (the token that
    crosses top_p is kept). `margin` is how far the top-p decisions are from flipping.
    """
    scaled = logits.astype(np.float64) / temperature
    keep = np.ones(scaled.shape, dtype=bool)
    if 0 < top_k < scaled.size:
        kth = np.sort(scaled)[::-1][top_k - 1]
        keep &= scaled >= kth
    margin = np.inf
    if top_p < 1.0:
        masked = np.where(keep, scaled, -np.inf)
        probs = np.exp(masked - masked.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        mass_before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
        kept_sorted = mass_before < top_p
        live = probs[order] > 0
        margin = float(np.min(np.abs(mass_before[live] - top_p)))
        keep_p = np.zeros_like(keep)
        keep_p[order] = kept_sorted
        keep &= keep_p
    out = np.where(keep, np.exp(scaled - scaled[keep].max()), 0.0)
    return out / out.sum(), margin


def torch_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    spec = SampleSpec(temperature=temperature, top_p=top_p, top_k=top_k)
    return filtered_probs(torch.tensor(logits, dtype=torch.float32), spec).double().numpy()


RANDOM_CASES = [
    (1.0, -1, 1.0),
    (1.0, 5, 1.0),
    (0.7, -1, 0.9),
    (1.3, -1, 0.5),
    (1.0, 10, 0.8),
    (0.5, 3, 0.95),
    (2.0, 20, 0.3),
    (1.0, 50, 1.0),  # k == vocab: no top-k filtering
]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), RANDOM_CASES)
def test_filtered_distribution_matches_sort_based_reference(temperature, top_k, top_p):
    rng = np.random.default_rng(20261201)
    for _ in range(5):
        logits = rng.normal(scale=3.0, size=50).astype(np.float32)
        expected, margin = reference_filtered_probs(logits, temperature, top_k, top_p)
        assert margin > 1e-4, "case too close to the top-p boundary to be well defined"
        got = torch_probs(logits, temperature, top_k, top_p)
        assert np.array_equal(got > 0, expected > 0), (temperature, top_k, top_p)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
        if top_k > 0 and top_k < 50 and top_p == 1.0:
            assert np.count_nonzero(got) == top_k  # continuous logits: no ties


def test_top_k_keeps_every_token_tied_at_the_kth_value():
    logits = np.array([3.0, 2.0, 2.0, 2.0, 1.0, 0.0], dtype=np.float32)
    got = torch_probs(logits, 1.0, 2, 1.0)
    # k = 2: the 2nd largest value is 2.0, held by three tokens; all of them stay.
    assert np.flatnonzero(got).tolist() == [0, 1, 2, 3]
    e = np.exp(1.0)
    np.testing.assert_allclose(got[:4], np.array([e, 1, 1, 1]) / (e + 3), rtol=1e-6)
    expected, _ = reference_filtered_probs(logits, 1.0, 2, 1.0)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_top_k_one_is_the_argmax_and_tie_free_boundary_keeps_exactly_k():
    logits = np.array([0.5, 4.0, -1.0, 3.0, 2.5], dtype=np.float32)
    assert torch_probs(logits, 0.8, 1, 1.0).tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert np.flatnonzero(torch_probs(logits, 0.8, 3, 1.0)).tolist() == [1, 3, 4]


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    logits = np.array([1.0, 3.0, 0.0, 2.0, -2.0], dtype=np.float32)
    probs, _ = reference_filtered_probs(logits, 1.0, -1, 1.0)
    top1, top2 = probs[1], probs[1] + probs[3]  # masses of the 1 and 2 most likely tokens
    cases = [
        (1e-6, [1]),  # tiny top_p: only the most likely token
        (top1 - 1e-4, [1]),  # the first token already crosses
        (top1 + 1e-4, [1, 3]),  # mass before token 3 is top1 < top_p: kept
        (top2 - 1e-4, [1, 3]),
        (top2 + 1e-4, [0, 1, 3]),
        (1.0, [0, 1, 2, 3, 4]),  # top_p 1: no filtering
    ]
    for top_p, support in cases:
        got = torch_probs(logits, 1.0, -1, top_p)
        assert np.flatnonzero(got).tolist() == support, top_p
        kept = probs[support]
        np.testing.assert_allclose(got[support], kept / kept.sum(), rtol=1e-5)


def test_top_p_applies_to_the_renormalized_top_k_distribution():
    logits = np.linspace(2.0, 1.1, 10).astype(np.float32)
    # After top-k 3 the survivors hold about 0.37, 0.33, 0.30: with top_p 0.5 the third has
    # 0.70 before it and is dropped. Over the whole vocabulary it would have only about 0.29
    # before it and stay, so this case tells the two readings apart.
    got = torch_probs(logits, 1.0, 3, 0.5)
    expected, margin = reference_filtered_probs(logits, 1.0, 3, 0.5)
    assert margin > 1e-4
    assert np.flatnonzero(got).tolist() == np.flatnonzero(expected).tolist() == [0, 1]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    full, _ = reference_filtered_probs(logits, 1.0, -1, 1.0)
    assert full[0] + full[1] < 0.5  # without renormalization token 2 would be kept


def test_top_p_boundary_on_exactly_representable_mass_with_ties():
    # Four equal tokens (0.25 each, exact in float32), the rest impossible. top_p 0.5: the
    # third token has exactly 0.5 before it, which reaches top_p, so two tokens stay; which
    # two of the tied ones is an ordering detail, the count and their mass are not.
    logits = np.array([0.0, -np.inf, 0.0, 0.0, -np.inf, 0.0], dtype=np.float32)
    got = torch_probs(logits, 1.0, -1, 0.5)
    support = np.flatnonzero(got).tolist()
    assert len(support) == 2 and set(support) <= {0, 2, 3, 5}
    np.testing.assert_allclose(got[support], [0.5, 0.5])


def test_seeded_sampling_draws_only_allowed_tokens_with_reference_frequencies():
    rng = np.random.default_rng(7)
    logits = rng.normal(scale=2.0, size=40).astype(np.float32)
    spec = SampleSpec(temperature=0.9, top_p=0.8, top_k=8)
    expected, margin = reference_filtered_probs(logits, 0.9, 8, 0.8)
    assert margin > 1e-4
    allowed = set(np.flatnonzero(expected).tolist())
    assert 2 <= len(allowed) < 8
    num_draws = 4000
    rows = torch.tensor(logits).expand(num_draws, -1)
    generator = make_generator(1234)
    tokens = [t.token_id for t in sample_rows(rows, [spec] * num_draws, [generator] * num_draws)]
    assert set(tokens) == allowed  # never outside the support, and every allowed token drawn
    freqs = np.bincount(tokens, minlength=logits.size) / num_draws
    assert np.max(np.abs(freqs - expected)) < 0.03
    again = make_generator(1234)
    repeat = sample_rows(rows[:50], [spec] * 50, [again] * 50)
    assert [t.token_id for t in repeat] == tokens[:50]  # the seed reproduces the draws


# Six groups of sampling values (more than MAX_BATCHED_GROUPS: the smallest are filtered row
# by row), one of a single row, and greedy rows between them.
MIXED_SPECS = (
    [SampleSpec(temperature=0.8, top_p=0.9)] * 7
    + [SampleSpec(temperature=0.0)] * 3
    + [SampleSpec(temperature=1.0, top_k=5)] * 4
    + [SampleSpec(temperature=0.6, top_k=20, top_p=0.7)] * 3
    + [SampleSpec(temperature=1.2)] * 2
    + [SampleSpec(temperature=0.9, top_p=0.5)] * 2
    + [SampleSpec(temperature=0.7, top_k=3, top_p=0.95)]
)


def test_batched_filtering_gives_every_row_what_it_gets_alone():
    assert len({(s.temperature, s.top_k, s.top_p) for s in MIXED_SPECS}) > MAX_BATCHED_GROUPS
    torch.manual_seed(0)
    logits = torch.randn(len(MIXED_SPECS), 4096) * 3
    logits[3, 100:110] = logits[3, 99]  # tied logits sort the same way in a batch and alone
    for spec in {s for s in MIXED_SPECS if s.temperature > 0}:
        batched = filtered_probs(logits, spec)
        for row in range(len(logits)):
            assert torch.equal(batched[row], filtered_probs(logits[row], spec)), (spec, row)


def test_a_batch_samples_each_row_as_that_row_alone_with_its_seed():
    torch.manual_seed(1)
    logits = torch.randn(len(MIXED_SPECS), 512) * 2
    logits[8, 7] = float("nan")  # a greedy row with a NaN logit draws nothing, fails nothing
    logits[5] = float("nan")  # a row of a batched group whose draw raises fails alone
    for draw in range(3):  # the generators move on between draws
        generators = [make_generator(100 * draw + row) for row in range(len(logits))]
        failures: dict[int, str] = {}
        batch = sample_on_device(logits, MIXED_SPECS, generators, failures, batched=True)
        tokens, _, failed = read_samples(batch, batch.packed.tolist())
        assert failures == {} and list(failed) == [5]  # found by the draw's checks, read back
        for row, spec in enumerate(MIXED_SPECS):
            if row == 5:
                continue
            alone = sample_rows(logits[row : row + 1], [spec], [make_generator(100 * draw + row)])
            assert tokens[row] == alone[0].token_id, (draw, row)


def test_sampling_a_call_costs_a_fixed_number_of_operations_plus_one_draw_per_row():
    """Device operations (kernels on a GPU), counted by dispatch: rows with the same values
    share one filtering, so 86 sampled rows with top-k and top-p cost 86 draws and a fixed
    handful, not about 16 operations each (1,378 before batching). A draw is one exponential
    fill: the distributions' checks, division and argmax run once for every row (a
    `torch.multinomial` per row counted as one operation here, but ran its checks, with two
    reads back to the host, its division and its argmax for each row). The default batches
    exactly where operations are launches."""
    spec = SampleSpec(temperature=0.8, top_k=50, top_p=0.9)

    def count(rows: int) -> int:
        seen: list = []
        generators = [make_generator(row) for row in range(rows)]
        sample = counting(functools.partial(sample_on_device, batched=True), seen)
        sample(torch.randn(rows, 1024), [spec] * rows, generators, {})
        return sum(kernels_of(seen[0]).values())

    fixed = count(1) - 1
    assert fixed <= 24
    assert count(86) == fixed + 86
    assert batches_filtering(torch.device("cuda")) and not batches_filtering(torch.device("cpu"))


def test_a_greedy_call_costs_one_operation_and_reads_its_token_ids_unconverted():
    """A call whose rows all take the argmax and want no log-probabilities (the common
    decode call) launches the argmax alone: its token ids are read back as they are (int64,
    exact), no conversion to the float64 a mixed read needs; the tokens are the argmax's."""
    logits = torch.randn(32, 1024)
    seen: list = []
    sample = counting(functools.partial(sample_on_device, batched=True), seen)
    batch = sample(logits, [SampleSpec(temperature=0.0)] * 32, [None] * 32, {})
    assert sum(kernels_of(seen[0]).values()) == 1
    assert batch.packed.dtype == torch.int64
    token_ids, with_logprobs, failed = read_samples(batch, batch.packed.tolist())
    assert token_ids == logits.argmax(dim=-1).tolist()
    assert with_logprobs == {} and failed == {}


@pytest.mark.parametrize("vocab", [7, 512, 49_152])
def test_draws_are_multinomials_bit_for_bit_and_leave_each_generator_where_it_would(vocab):
    """`draw_rows` (one exponential fill per row, the rest batched) against a
    `torch.multinomial(p, 1)` per row with the same seeds: the same token in every row and
    every generator in the same state after, draw after draw, over peaked, flat, filtered
    (zeros) and one-token distributions; greedy rows in between keep their tokens. And
    `draw_one`, a row alone, the same."""
    torch.manual_seed(vocab)
    logits = torch.randn(6, vocab) * torch.tensor([[0.1], [1.0], [4.0], [1.0], [2.0], [1.0]])
    dists = torch.softmax(logits, dim=-1)
    dists[3, vocab // 2 :] = 0.0  # a filtered support
    dists[5] = 0.0
    dists[5, vocab - 1] = 1.0  # a single token
    rows = [0, 2, 3, 4, 5]  # row 1 is greedy
    ours = [make_generator(10 + row) for row in range(6)]
    theirs = [make_generator(10 + row) for row in range(6)]
    for _ in range(4):
        token_ids = torch.full((6,), -7, dtype=torch.int64)
        draw_rows(lambda row: dists[row], rows, ours, token_ids, {})
        expected = [
            int(torch.multinomial(dists[row], 1, generator=theirs[row])) if row in rows else -7
            for row in range(6)
        ]
        assert token_ids.tolist() == expected
        for mine, reference in zip(ours, theirs, strict=True):
            assert torch.equal(mine.get_state(), reference.get_state())
    # One row alone (`draw_one`, the speculative rows' draw) makes the same draws too.
    one, reference = make_generator(3), make_generator(3)
    for row in rows:
        assert int(draw_one(dists[row], one)) == int(
            torch.multinomial(dists[row], 1, generator=reference)
        )
        assert torch.equal(one.get_state(), reference.get_state())


def test_a_row_that_is_no_distribution_fails_alone_as_multinomial_would():
    """NaN, inf, a negative value or no mass: the draw's checks, read back with the tokens,
    give that row multinomial's reason; a row whose filtering raises is recorded at once and
    draws nothing (its generator does not move); the other rows draw what they draw alone.
    Through `sample_rows` without `failures`, such a row raises."""
    dists = torch.softmax(torch.randn(7, 64), dim=-1)
    dists[1, 3] = float("nan")
    dists[2, 5] = float("inf")
    dists[3, 9] = -0.5
    dists[4] = 0.0

    def probs(row: int) -> torch.Tensor:
        if row == 5:
            raise ValueError("the row's filtering failed")
        return dists[row]

    generators = [make_generator(row) for row in range(7)]
    token_ids = torch.full((7,), -1, dtype=torch.int64)
    failures: dict[int, str] = {}
    drawn, checks = draw_rows(probs, list(range(7)), generators, token_ids, failures)
    assert failures == {5: "ValueError: the row's filtering failed"}
    assert drawn == (0, 1, 2, 3, 4, 6)
    values = checks.tolist()
    reasons = {row: draw_failure(m, low) for row, m, low in zip(drawn, values[:6], values[6:])}
    assert reasons == {0: None, 1: NOT_A_DISTRIBUTION, 2: NOT_A_DISTRIBUTION,
                       3: NOT_A_DISTRIBUTION, 4: NO_MASS, 6: None}  # fmt: skip
    assert int(token_ids[5]) == -1
    assert torch.equal(generators[5].get_state(), make_generator(5).get_state())
    for row in (0, 6):
        alone = torch.multinomial(dists[row], 1, generator=make_generator(row))
        assert int(token_ids[row]) == int(alone)
    logits = torch.randn(2, 64)
    logits[1] = float("nan")
    spec = SampleSpec(temperature=0.8)
    failed: dict[int, str] = {}
    sample_rows(logits, [spec, spec], [make_generator(0), make_generator(1)], failures=failed)
    assert failed == {1: f"RuntimeError: {NOT_A_DISTRIBUTION}"}
    with pytest.raises(RuntimeError, match="inf, nan"):
        sample_rows(logits, [spec, spec], [make_generator(0), make_generator(1)])


class _EveryOtherToken:
    """A grammar that allows the even token ids only (a `Matcher`)."""

    def allowed(self) -> np.ndarray:
        return np.arange(VOCAB) % 2 == 0

    def consume(self, token_id: int) -> None:
        pass


VOCAB = 256
PENALIZED = SampleSpec(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.4)
BIASED = SampleSpec(temperature=0.0, frequency_penalty=0.7, logit_bias=((3, 5.0), (9, -2.0)))
HELD_BACK = SampleSpec(temperature=0.0, presence_penalty=0.4, min_tokens=5, stop_token_ids=(7,))


def _histories(seed: int) -> tuple[list[SampleSpec], list[TokenHistory | None]]:
    """Rows of two batched groups (one with prompts, one with a bias), a lone row of a third
    (differing from the first only in its repetition penalty),
    rows adjusted alone (a grammar; min_tokens holding back a stop token) and rows without
    adjustments, interleaved."""
    rng = np.random.default_rng(seed)
    transfers = Transfers(torch.device("cpu"))
    plan = [PENALIZED, BIASED, None, PENALIZED, HELD_BACK, BIASED, PENALIZED, "grammar",
            SampleSpec(temperature=0.0, repetition_penalty=0.8, presence_penalty=0.4), None,
            BIASED]  # fmt: skip
    specs, histories = [], []
    for entry in plan:
        spec = PENALIZED if entry == "grammar" else entry or SampleSpec(temperature=0.5)
        specs.append(spec)
        if entry is None:
            histories.append(None)
            continue
        outputs = rng.integers(0, VOCAB, size=int(rng.integers(1, 30))).tolist()
        prompt = rng.integers(0, VOCAB, size=12).tolist() if spec.repetition_penalty != 1 else []
        matcher = _EveryOtherToken() if entry == "grammar" else None
        histories.append(TokenHistory(spec, VOCAB, transfers, prompt_token_ids=prompt,
                                      output_token_ids=outputs, matcher=matcher))  # fmt: skip
    return specs, histories


def test_batched_adjustments_equal_each_rows_own():
    specs, histories = _histories(3)
    torch.manual_seed(3)
    logits = torch.randn(len(specs), VOCAB) * 4
    alone = logits.clone()
    for row, history in enumerate(histories):
        if history is not None:
            alone[row] = history.adjust(alone[row], specs[row])
    batched = adjust_rows(logits.clone(), specs, histories, {}, batched=True)
    assert torch.equal(batched, alone)
    assert not torch.equal(alone, logits)  # the adjustments did something
    # A call whose rows are one group is adjusted without copies, to the same values.
    same = [PENALIZED] * 5
    group = [_histories(row)[1][0] for row in range(5)]
    one = adjust_rows(logits[:5].clone(), same, group, {}, batched=True)
    assert torch.equal(
        one, torch.stack([h.adjust(logits[r], PENALIZED) for r, h in enumerate(group)])
    )


def test_penalized_rows_cost_a_fixed_number_of_operations_plus_one_draw_per_row():
    """86 rows with the same repetition and presence penalties: one adjustment and one
    filtering for the call, then a draw per row (1,292 operations when each row adjusted
    and filtered alone)."""
    spec = SampleSpec(temperature=0.8, repetition_penalty=1.1, presence_penalty=0.5)
    transfers = Transfers(torch.device("cpu"))

    def count(rows: int) -> int:
        histories = [TokenHistory(spec, 1024, transfers, prompt_token_ids=[1, 2, 3],
                                  output_token_ids=[4, 5]) for _ in range(rows)]  # fmt: skip
        generators = [make_generator(row) for row in range(rows)]
        seen: list = []
        sample = counting(functools.partial(sample_on_device, batched=True), seen)
        sample(torch.randn(rows, 1024), [spec] * rows, generators, {}, histories)
        return sum(kernels_of(seen[0]).values())

    fixed = count(2) - 2
    assert fixed <= 30
    assert count(86) == fixed + 86


def _spec_step(batched: bool, logits: torch.Tensor, specs, seed: int, drafts=None):
    """One `SpecSamples` call over speculative rows (even rows draft, odd rows exit and test
    a draft of token 2 against the stored draft distribution of their handle, when one is
    stored), each request seeded with `seed` + its row; the coda returns `logits`."""
    from loopserve.contracts import SpecRow
    from loopserve.runner.spec_samples import SpecSamples

    rows = len(specs)
    samplers = {
        f"r{row}": (spec, make_generator(seed + row), None) for row, spec in enumerate(specs)
    }
    samples = SpecSamples(
        coda=lambda states, spans: states,
        samplers=samplers,
        transfers=Transfers(torch.device("cpu")),
    )
    samples.batched = batched
    samples.drafts = dict(drafts or {})
    items = [
        SpecRow(
            f"r{row}",
            10,
            1,
            0,
            1,
            handle=row,
            needs_prelude=False,
            draft=row % 2 == 0,
            verify_token=2 if row % 2 else -1,
        )  # fmt: skip
        for row in range(rows)
    ]
    exited = [row % 2 == 1 for row in range(rows)]
    tokens, failed = samples(items, [logits[row : row + 1] for row in range(rows)], exited)
    return tokens, failed, samples.drafts


def test_speculative_rows_filtered_together_sample_as_alone():
    """Speculative rows (drafts and exit tests) of shared sampling values take one filtering
    per group when batched, and every row's token and stored draft distribution equal those
    of the row filtered alone, draw after draw; a row whose draw raises fails alone."""
    torch.manual_seed(3)
    logits = torch.randn(len(MIXED_SPECS), 512) * 2
    logits[5] = float("nan")  # a row of a batched group whose sampling raises
    drafts = {
        (f"r{row}", row): torch.softmax(torch.randn(512), -1)
        for row in range(1, len(MIXED_SPECS), 2)
    }
    for seed in (0, 50):
        tokens, failed, kept = _spec_step(True, logits, MIXED_SPECS, seed, drafts)
        alone, failed_alone, kept_alone = _spec_step(False, logits, MIXED_SPECS, seed, drafts)
        assert [f.request_id for f in failed] == [f.request_id for f in failed_alone] == ["r5"]
        assert tokens == alone
        assert kept.keys() == kept_alone.keys()
        assert all(torch.equal(kept[key], kept_alone[key]) for key in kept)


def test_speculative_rows_cost_a_fixed_filtering_plus_their_draws():
    """Counted by dispatch: 40 sampling speculative rows with top-k and top-p filter once
    together (a fixed handful of operations), then each row's draft or exit test; filtered
    row by row they cost about 16 operations more per row."""
    spec = SampleSpec(temperature=0.8, top_k=50, top_p=0.9)

    def count(rows: int, batched: bool) -> int:
        seen: list = []
        step = counting(functools.partial(_spec_step, batched), seen)
        step(torch.randn(rows, 1024), [spec] * rows, 0)
        return sum(kernels_of(seen[0]).values())

    per_row = (count(40, True) - count(2, True)) / 38
    per_row_alone = (count(40, False) - count(2, False)) / 38
    assert per_row_alone - per_row >= 10, (per_row, per_row_alone)
