"""Token sampling from coda logits: greedy, temperature, top-k, top-p, seeded generators.

Every row is sampled on its own with its own `torch.Generator`, so a request's tokens depend
only on its logits and its seed, never on which other rows share the batch. The dense
reference generator and the engine runner both sample through `sample_rows`.
"""

from __future__ import annotations

import torch

from loopserve.contracts import SampledToken, SampleSpec


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's private generator; an unseeded request draws a fresh random seed."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        # Same seed for every value torch accepts (-1 and 2**64 - 1 are one seed), and never an
        # OverflowError: one request's seed can never fail the setup of a batch.
        generator.manual_seed(seed % 2**64)
    return generator


def _filtered_probs(logits: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
    """logits [vocab] float32 -> probabilities after temperature, top-k and top-p."""
    scaled = logits / spec.temperature
    vocab = scaled.shape[-1]
    if 0 < spec.top_k < vocab:
        kth = torch.topk(scaled, spec.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if spec.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= spec.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.softmax(scaled, dim=-1)


def sample_rows(
    logits: torch.Tensor,
    specs: list[SampleSpec],
    generators: list[torch.Generator | None],
) -> list[SampledToken]:
    """Sample one token per row. logits [rows, vocab] in any float dtype."""
    logits = logits.float()
    results: list[SampledToken] = []
    logprobs_all = None
    if any(spec.num_logprobs is not None for spec in specs):
        logprobs_all = torch.log_softmax(logits, dim=-1)
    greedy_ids = torch.argmax(logits, dim=-1).tolist()
    for row, spec in enumerate(specs):
        if spec.temperature == 0.0:
            token_id = greedy_ids[row]
        else:
            probs = _filtered_probs(logits[row], spec)
            token_id = int(torch.multinomial(probs, 1, generator=generators[row]).item())
        if spec.num_logprobs is None or logprobs_all is None:
            results.append(SampledToken(token_id))
            continue
        row_logprobs = logprobs_all[row]
        top: tuple[tuple[int, float], ...] = ()
        if spec.num_logprobs > 0:
            values, ids = torch.topk(row_logprobs, spec.num_logprobs)
            top = tuple(zip(ids.tolist(), values.tolist()))
        results.append(SampledToken(token_id, float(row_logprobs[token_id]), top))
    return results
