"""Token sampling from coda logits (after their adjustments): greedy, temperature, top-k,
top-p, seeded generators.

Every row draws from its own `torch.Generator`, so a request's tokens depend only on its
logits, its tokens and its seed, never on which other rows share the batch. Rows that share
their sampling values (temperature, top-k, top-p) are filtered together, in one batched
`filtered_probs` whose every operation works along the vocabulary (a row's probabilities
are bit for bit those it gets alone), and each then makes one draw (`draw_rows`: the draw
`torch.multinomial` makes, with only the exponential fill per row): a call costs a fixed
number of device operations plus one per sampled row, where filtering rows one by one cost
5-17 operations each (each a kernel launch on a GPU). On CPU rows are filtered one by one
(`batches_filtering`: there an operation costs its arithmetic, not a launch). The dense
reference generator and the engine runner both sample through `sample_rows` /
`sample_on_device`.

Logits adjustments (penalties, logit bias, `min_tokens`, a grammar's mask) are applied first,
by `runner/logits_adjust.py` (`adjust_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from loopserve.contracts import RequestFailure, SampledToken, SampleSpec
from loopserve.runner.logits_adjust import TokenHistory, adjust_rows
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


def filtered_probs(logits: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
    """logits [..., vocab] float32 -> probabilities after temperature, top-k and top-p, each
    row on its own: every operation works along the vocabulary, so a row's result does not
    depend on the other rows (on CPU bit for bit, tested). The top-p sort is stable on CUDA,
    where it costs nothing, so tied logits keep one order whatever the batch; on CPU the
    unstable sort orders each row the same in any batch and is 12-25% faster."""
    scaled = logits / spec.temperature
    vocab = scaled.shape[-1]
    if 0 < spec.top_k < vocab:
        kth = torch.topk(scaled, spec.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if spec.top_p < 1.0:
        stable = scaled.is_cuda
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=stable)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= spec.top_p
        # The most likely token always stays: a top_p that rounds to 0 in float32 (1e-300)
        # would otherwise drop every token.
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.softmax(scaled, dim=-1)


def sampling_groups(specs: Sequence[SampleSpec]) -> dict[tuple[float, int, float], list[int]]:
    """The rows that sample (not greedy), by their (temperature, top_k, top_p): rows of one
    group get their probabilities from one batched `filtered_probs`."""
    groups: dict[tuple[float, int, float], list[int]] = {}
    for row, spec in enumerate(specs):
        if not is_greedy(spec):
            groups.setdefault((spec.temperature, spec.top_k, spec.top_p), []).append(row)
    return groups


# Groups of sampling values whose probabilities are computed over every row of the call at
# once (the most rows first); rows of further groups, and a group of one row, are filtered
# alone. A batched group costs a fixed number of device operations whatever its size, where
# rows filtered alone cost that many each; the bound keeps a call with many distinct values
# from filtering every row many times over.
MAX_BATCHED_GROUPS = 4


def batches_filtering(device: torch.device) -> bool:
    """Whether `sample_on_device` filters a group's rows together by default: on an
    accelerator, where each operation is a kernel launch. On CPU an operation costs its
    arithmetic, and filtering row by row keeps a row's vocabulary in cache through every
    step (batched, a call of 11 rows over a 49,152-token vocabulary took about 15% longer)."""
    return device.type != "cpu"


def row_probs(
    logits: torch.Tensor, specs: Sequence[SampleSpec], *, batched: bool
) -> Callable[[int], torch.Tensor]:
    """`probs(row)`: a sampling row's filtered distribution (`filtered_probs` of its logits
    and spec). With `batched`, the rows of the `MAX_BATCHED_GROUPS` largest groups of shared
    values (two rows or more) read one `filtered_probs` over every row of the call, computed
    when the group's first row asks; other rows are filtered alone. A row gets the same
    probabilities either way (tested); a group whose filtering raises raises for each of its
    rows that asks, so a caller can fail them one by one."""
    together: dict[int, tuple[float, int, float]] = {}
    if batched:
        groups = sorted(sampling_groups(specs).items(), key=lambda kv: len(kv[1]), reverse=True)
        for key, rows in groups[:MAX_BATCHED_GROUPS]:
            if len(rows) > 1:
                together.update((row, key) for row in rows)
    computed: dict[tuple[float, int, float], torch.Tensor] = {}

    def probs(row: int) -> torch.Tensor:
        key = together.get(row)
        if key is None:
            return filtered_probs(logits[row], specs[row])
        if key not in computed:
            computed[key] = filtered_probs(logits, specs[row])
        return computed[key][row]

    return probs


# Why a distribution cannot be drawn from: torch.multinomial's checks and messages.
NOT_A_DISTRIBUTION = "probability tensor contains either inf, nan or element < 0"
NO_MASS = "invalid multinomial distribution (sum of probabilities <= 0)"


def draw_failure(mass: float, lowest: float) -> str | None:
    """Why a distribution whose values sum to `mass` and whose least value is `lowest`
    cannot be drawn from (None: it can). A mass is finite exactly when no value is NaN or
    inf (values <= 1 cannot overflow it)."""
    if not (math.isfinite(mass) and lowest >= 0):
        return NOT_A_DISTRIBUTION
    if mass <= 0:
        return NO_MASS
    return None


def draw_rows(
    probs: Callable[[int], torch.Tensor],
    rows: list[int],
    generators: Sequence[torch.Generator | None],
    token_ids: torch.Tensor,
    failures: dict[int, str] | None,
) -> tuple[tuple[int, ...], torch.Tensor | None]:
    """Each of `rows` draws its token from `probs(row)` with its own generator, into
    `token_ids[row]`: the draw `torch.multinomial(p, 1, generator=g)` makes, bit for bit (it
    takes argmax(p / q) with q ~ Exp(1) filled from g, and the generator ends in the same
    state; tested), with one exponential fill per row and the division and argmax once for
    all rows, where multinomial costs each row its own checks (each read back to the host: a
    synchronization on a GPU), division and argmax. Nothing is read here: what multinomial
    checks (inf, NaN, a negative value, no mass) comes back with the caller's one read, as
    each drawn row's mass and least value (float64, masses first; `draw_failure` reads
    them), and a row that fails them has a meaningless token (its request fails). A row
    whose filtering raises draws nothing and is recorded in `failures` ("Type: message");
    without `failures` it raises. Returns (the rows drawn, their checks), or ((), None)."""
    kept, dists = [], []
    for row in rows:
        try:
            dists.append(probs(row))
        except (RuntimeError, ValueError) as err:
            if failures is None:
                raise
            failures[row] = f"{type(err).__name__}: {err}"
            continue
        kept.append(row)
    if not kept:
        return (), None
    stacked = torch.stack(dists)  # [kept, vocab]
    checks = draw_checks(stacked)
    exponential = torch.empty_like(stacked)
    for i, row in enumerate(kept):
        exponential[i].exponential_(generator=generators[row])
    drawn = torch.argmax(torch.div(stacked, exponential, out=exponential), dim=-1)
    first, count = kept[0], len(kept)
    if kept[-1] - first + 1 == count:  # a run of rows (often all of them): one copy
        token_ids[first : first + count].copy_(drawn)
    else:  # each row into its slot (no index tensor to send to the device)
        for i, row in enumerate(kept):
            token_ids[row : row + 1].copy_(drawn[i : i + 1])
    return tuple(kept), checks


def speculative_sample(
    probs: torch.Tensor, draft: torch.Tensor | None, draft_token: int, generator
) -> torch.Tensor:
    """A token from `probs` (p) given a draft `draft_token` drawn from `draft` (q): keep the
    draft with probability min(1, p/q), else draw from max(0, p - q) normalized (the
    speculative-sampling rule; the result follows p). Without a draft, a plain draw from p.
    On the device, without a sync: the residual draw is made either way (fresh randomness,
    discarded when the draft is kept). Each draw is `draw_one`'s: multinomial's without its
    checks, which the caller reads along with its tokens (`draw_failure`)."""
    if draft is None or draft_token < 0:
        return draw_one(probs, generator)
    keep = torch.rand((), generator=generator, device=probs.device) * draft[draft_token]
    keep = keep <= probs[draft_token]
    residual = (probs - draft).clamp_min(0.0)
    # p == q leaves no residual, and then the draft is always kept: any valid row will do.
    residual = torch.where(residual.sum() > 0, residual, probs)
    resampled = draw_one(residual, generator)
    return torch.where(keep, resampled.new_full((), draft_token), resampled)


def draw_one(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """A token from `probs` [vocab] with `generator`: the draw `torch.multinomial(probs, 1)`
    makes, bit for bit, and the generator's state after it (argmax(p / q), q ~ Exp(1) from
    the generator), in three operations and without multinomial's checks and their two
    reads back to the host; the caller checks the distribution with its read
    (`draw_checks`, `draw_failure`)."""
    return torch.argmax(probs / torch.empty_like(probs).exponential_(generator=generator))


def draw_checks(stacked: torch.Tensor) -> torch.Tensor:
    """What `draw_failure` needs of each distribution (a row of `stacked` [rows, vocab]), as
    float64 for a read along with the tokens: every mass, then every least value."""
    return torch.stack([stacked.sum(dim=-1), stacked.amin(dim=-1)]).double().reshape(-1)


def check_failures(rows: Sequence[int], checks: Sequence[float]) -> dict[int, str]:
    """Row -> "RuntimeError: reason" for each of `rows` whose distribution `draw_checks`
    read back as `checks` cannot be drawn from."""
    num, failed = len(rows), {}
    for row, mass, lowest in zip(rows, checks[:num], checks[num : 2 * num], strict=True):
        reason = draw_failure(mass, lowest)
        if reason is not None:
            failed[row] = f"RuntimeError: {reason}"
    return failed


def sampling_failure(request_id: str, error: str) -> RequestFailure:
    """A request that fails alone because its sampling raised (`error`: "Type: message")."""
    return RequestFailure(request_id, f"sampling failed: {error}")


class SampleBatch(NamedTuple):
    """Sampled rows on the device, not read yet: `packed` holds the token ids (alone: as the
    argmax gave them, int64; else float64, where token ids are exact), then, when a row asks for log-probabilities, every row's chosen token's
    log-prob and top `num_top` values and ids, then the checks of the rows `drawn`
    (`draw_rows`: their masses, then their least values); `read_samples` unpacks it."""

    packed: torch.Tensor
    num_logprobs: tuple[int | None, ...]  # per row: its request's `num_logprobs`
    num_top: int
    drawn: tuple[int, ...] = ()  # the rows that drew from a distribution (checks last)
    has_logprobs: bool = False


def sample_on_device(
    logits: torch.Tensor,
    specs: list[SampleSpec],
    generators: list[torch.Generator | None],
    failures: dict[int, str] | None = None,
    histories: Sequence[TokenHistory | None] | None = None,
    *,
    batched: bool | None = None,
) -> SampleBatch:
    """Sample one token per row on the logits' device. logits [rows, vocab] in any float
    dtype; `histories[row]`: the row's `TokenHistory` when its spec adjusts logits;
    `batched`: filter rows that share their values together (None: `batches_filtering` of
    the device; either way every row gets the same token).

    `failures`: when given, a row whose adjustments or filtering raise is recorded there
    (row -> "Type: message") and gets the greedy token instead, so one request's values
    never fail the other rows of the call (the caller fails that request); without it the
    error raises. A row whose distribution cannot be drawn from is found when the batch is
    read (`read_samples` returns it; no read back here)."""
    logits = logits.float()
    batched = batches_filtering(logits.device) if batched is None else batched
    if histories is not None:
        logits = adjust_rows(logits, specs, histories, failures, batched)
    token_ids = torch.argmax(logits, dim=-1)  # [rows]; sampled rows overwritten below
    # One pass over the specs (the hot path: every decode call reads its candidates' specs).
    floor = GREEDY_BELOW_TEMPERATURE
    sampled = [row for row, spec in enumerate(specs) if spec.temperature >= floor]
    num_logprobs = tuple([spec.num_logprobs for spec in specs])
    wanted = [n for n in num_logprobs if n is not None]
    if not sampled and not wanted:  # only the token ids: read as they are (int64, exact)
        return SampleBatch(token_ids, num_logprobs, 0)
    drawn: tuple[int, ...] = ()
    checks = None
    if sampled:
        probs = row_probs(logits, specs, batched=batched)
        drawn, checks = draw_rows(probs, sampled, generators, token_ids, failures)
    parts = [token_ids.double()]
    num_top = max(wanted) if wanted else 0
    if wanted:
        logprobs_all = torch.log_softmax(logits, dim=-1)
        chosen = logprobs_all.gather(1, token_ids[:, None])[:, 0]  # [rows]
        parts.append(chosen.double())
        if num_top > 0:
            values, ids = torch.topk(logprobs_all, num_top)  # [rows, num_top], best first
            parts += [values.double().reshape(-1), ids.double().reshape(-1)]
    if checks is not None:
        parts.append(checks)
    packed = parts[0] if len(parts) == 1 else torch.cat(parts)
    return SampleBatch(packed, num_logprobs, num_top, drawn, bool(wanted))


def read_samples(
    batch: SampleBatch, packed: list[float]
) -> tuple[list[int], dict[int, SampledToken], dict[int, str]]:
    """From `batch.packed` read to the host: the token id of every row, the `SampledToken`
    (log-prob and top alternatives) of each row whose request asked for log-probabilities,
    and the rows whose distribution could not be drawn from ("RuntimeError: reason": their
    requests fail alone, as when `sample_on_device` records a failure)."""
    rows = len(batch.num_logprobs)
    token_ids = [int(value) for value in packed[:rows]]
    with_logprobs: dict[int, SampledToken] = {}
    failed: dict[int, str] = {}
    if batch.drawn:
        failed = check_failures(batch.drawn, packed[len(packed) - 2 * len(batch.drawn) :])
    if not batch.has_logprobs:
        return token_ids, with_logprobs, failed
    num_top = batch.num_top
    for row, wanted in enumerate(batch.num_logprobs):
        if wanted is None:
            continue
        top: tuple[tuple[int, float], ...] = ()
        if wanted > 0:
            base = 2 * rows + row * num_top
            id_base = base + rows * num_top
            top = tuple((int(packed[id_base + j]), packed[base + j]) for j in range(wanted))
        with_logprobs[row] = SampledToken(token_ids[row], packed[rows + row], top)
    return token_ids, with_logprobs, failed


def sample_rows(
    logits: torch.Tensor,
    specs: list[SampleSpec],
    generators: list[torch.Generator | None],
    transfers: Transfers | None = None,
    failures: dict[int, str] | None = None,
    histories: Sequence[TokenHistory | None] | None = None,
) -> list[SampledToken]:
    """`sample_on_device`, read back in one copy (`transfers`): one `SampledToken` per row."""
    transfers = transfers or Transfers(logits.device)
    batch = sample_on_device(logits, specs, generators, failures, histories)
    token_ids, with_logprobs, failed = read_samples(batch, transfers.to_host(batch.packed))
    if failed and failures is None:
        raise RuntimeError(failed[min(failed)].removeprefix("RuntimeError: "))
    if failures is not None:
        failures.update(failed)
    return [with_logprobs.get(row) or SampledToken(t) for row, t in enumerate(token_ids)]


def generator_state(generator: torch.Generator | None) -> bytes | None:
    """A request's random stream as bytes, for a hand-off (None: greedy, no stream)."""
    return None if generator is None else generator.get_state().numpy().tobytes()


def restore_generator(generator: torch.Generator, state: bytes | None) -> None:
    """Continue the random stream `generator_state` saved (no-op for None)."""
    if state is not None:
        generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
