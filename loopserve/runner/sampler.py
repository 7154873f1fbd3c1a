"""Token sampling from coda logits: greedy, temperature, top-k, top-p, seeded generators.

Every row is sampled on its own with its own `torch.Generator`, so a request's tokens depend
only on its logits and its seed, never on which other rows share the batch. The dense
reference generator and the engine runner both sample through `sample_rows`.
"""

from __future__ import annotations

import torch

from loopserve.contracts import SampledToken, SampleSpec
from loopserve.runner.transfers import Transfers


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
    transfers: Transfers | None = None,
) -> list[SampledToken]:
    """Sample one token per row. logits [rows, vocab] in any float dtype.

    Everything is computed on the logits' device and read back in one copy (`transfers`):
    the sampled ids, and for rows that ask for log-probabilities the chosen token's and the
    top-k, packed into one float64 tensor (token ids are exact in float64)."""
    transfers = transfers or Transfers(logits.device)
    logits = logits.float()
    token_ids = torch.argmax(logits, dim=-1)  # [rows]; sampled rows overwritten below
    for row, spec in enumerate(specs):
        if spec.temperature != 0.0:
            probs = _filtered_probs(logits[row], spec)
            token_ids[row : row + 1] = torch.multinomial(probs, 1, generator=generators[row])
    wanted = [spec.num_logprobs for spec in specs if spec.num_logprobs is not None]
    if not wanted:
        return [SampledToken(int(token_id)) for token_id in transfers.to_host(token_ids)]
    num_top = max(wanted)
    logprobs_all = torch.log_softmax(logits, dim=-1)
    chosen = logprobs_all.gather(1, token_ids[:, None])[:, 0]  # [rows]
    parts = [token_ids.double(), chosen.double()]
    if num_top > 0:
        values, ids = torch.topk(logprobs_all, num_top)  # [rows, num_top], best first
        parts += [values.double().reshape(-1), ids.double().reshape(-1)]
    packed = transfers.to_host(torch.cat(parts))
    rows = len(specs)
    results: list[SampledToken] = []
    for row, spec in enumerate(specs):
        token_id = int(packed[row])
        if spec.num_logprobs is None:
            results.append(SampledToken(token_id))
            continue
        top: tuple[tuple[int, float], ...] = ()
        if spec.num_logprobs > 0:
            base = 2 * rows + row * num_top
            id_base = base + rows * num_top
            top = tuple(
                (int(packed[id_base + j]), packed[base + j]) for j in range(spec.num_logprobs)
            )
        results.append(SampledToken(token_id, packed[rows + row], top))
    return results
