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


# Temperatures below this sample greedily: dividing float32 logits by 1e-38 (or 5e-324)
# overflows to inf and the softmax to NaN. The same floor as vLLM's.
GREEDY_BELOW_TEMPERATURE = 1e-5


def is_greedy(spec: SampleSpec) -> bool:
    return spec.temperature < GREEDY_BELOW_TEMPERATURE


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
        # The most likely token always stays: a top_p that rounds to 0 in float32 (1e-300)
        # would otherwise drop every token.
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.softmax(scaled, dim=-1)


def sample_rows(
    logits: torch.Tensor,
    specs: list[SampleSpec],
    generators: list[torch.Generator | None],
    transfers: Transfers | None = None,
    failures: dict[int, str] | None = None,
) -> list[SampledToken]:
    """Sample one token per row. logits [rows, vocab] in any float dtype.

    Everything is computed on the logits' device and read back in one copy (`transfers`):
    the sampled ids, and for rows that ask for log-probabilities the chosen token's and the
    top-k, packed into one float64 tensor (token ids are exact in float64).

    `failures`: when given, a row whose sampling raises is recorded there (row -> "Type:
    message") and gets the greedy token instead, so one request's values never fail the
    other rows of the call (the caller fails that request); without it the error raises."""
    transfers = transfers or Transfers(logits.device)
    logits = logits.float()
    token_ids = torch.argmax(logits, dim=-1)  # [rows]; sampled rows overwritten below
    for row, spec in enumerate(specs):
        if is_greedy(spec):
            continue
        try:
            probs = _filtered_probs(logits[row], spec)
            token_ids[row : row + 1] = torch.multinomial(probs, 1, generator=generators[row])
        except (RuntimeError, ValueError) as err:
            if failures is None:
                raise
            failures[row] = f"{type(err).__name__}: {err}"
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


def generator_state(generator: torch.Generator | None) -> bytes | None:
    """A request's random stream as bytes, for a hand-off (None: greedy, no stream)."""
    return None if generator is None else generator.get_state().numpy().tobytes()


def restore_generator(generator: torch.Generator, state: bytes | None) -> None:
    """Continue the random stream `generator_state` saved (no-op for None)."""
    if state is not None:
        generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
