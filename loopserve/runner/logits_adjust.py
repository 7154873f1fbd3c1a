"""Logits adjustments before sampling (vLLM's semantics and order): logit bias, `min_tokens`
(stop tokens forbidden until then), the repetition penalty over prompt and output tokens,
then the frequency and presence penalties over output counts, and a grammar's mask.

A request whose `SampleSpec.adjusts_logits` keeps a `TokenHistory` holding, on the device,
what they read: its logit bias as a dense [vocab] vector, its stop tokens (for
`min_tokens`), the tokens of its prompt (a mask, for the repetition penalty) and the counts
of its output tokens, which the caller updates with `record` as each token becomes final.
Rows without adjustments pay nothing. A request with structured output also holds its
grammar matcher (`loopserve.text.structured`, on the host): the logits of tokens the
grammar does not allow next are set to -inf (the mask reaches the device once per token),
and the matcher consumes each final token. `adjust_rows` applies a call's adjustments:
rows whose adjustments are the same penalties (and a bias) as one batch over their stacked
histories where the sampler batches (`runner/sampler.py`), the rest row by row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from loopserve.contracts import NewRequestData, SampleSpec
from loopserve.errors import InvalidRequestError, describe_failure
from loopserve.runner.transfers import Transfers
from loopserve.sampling_params import StructuredOutput


class Matcher(Protocol):
    """A request's grammar state (`loopserve.text.structured.GrammarMatcher`)."""

    def allowed(self) -> np.ndarray: ...  # bool [vocab]: the tokens allowed next
    def consume(self, token_id: int) -> None: ...


class TokenHistory:
    """One request's state for its logits adjustments (see the module docstring)."""

    def __init__(
        self,
        spec: SampleSpec,
        vocab_size: int,
        transfers: Transfers,
        *,
        prompt_token_ids: Sequence[int] = (),
        output_token_ids: Sequence[int] = (),
        matcher: Matcher | None = None,
    ) -> None:
        """Built once per request; its host values reach the device through `transfers`.
        `matcher`: the grammar of a request with structured output, at its start."""
        device = transfers.device
        send = transfers.to_device
        self.transfers = transfers
        self.matcher = matcher
        self._allowed: torch.Tensor | None = None  # the matcher's mask on the device
        for token_id in output_token_ids if matcher is not None else ():
            matcher.consume(token_id)  # a handed-off request: the outputs it already has
        self.num_output = len(output_token_ids)
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if output_token_ids:
            self.counts.index_add_(
                0, send(list(output_token_ids)), torch.ones(len(output_token_ids), device=device)
            )
        self.bias: torch.Tensor | None = None
        if spec.logit_bias:
            ids, values = zip(*spec.logit_bias)
            self.bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            self.bias[send(list(ids))] = send(list(values), torch.float32)
        stop_ids = [t for t in spec.stop_token_ids if t < vocab_size]  # others never sampled
        self.stop_ids = send(stop_ids) if spec.min_tokens and stop_ids else None
        self._stop_ids_host = np.array(stop_ids, np.int64)
        self.prompt_seen: torch.Tensor | None = None
        if spec.repetition_penalty != 1.0 and prompt_token_ids:
            self.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.prompt_seen[send(list(prompt_token_ids))] = True

    def record(self, token_id: int) -> None:
        """A token of this request became final (sampled and kept)."""
        self.counts[token_id] += 1
        self.num_output += 1
        if self.matcher is not None:
            self.matcher.consume(token_id)
            self._allowed = None

    def _check_grammar_reaches_min_tokens(self, allowed: np.ndarray, min_tokens: int) -> None:
        """On the host mask: the grammar must allow some token that is not a stop token while
        `min_tokens` forbids those; otherwise no token can be sampled (a 400, not a 500)."""
        open_ids = allowed.copy()
        open_ids[self._stop_ids_host] = False
        if not open_ids.any():
            raise InvalidRequestError(
                f"structured output: the grammar ends after {self.num_output} tokens, before "
                f"min_tokens ({min_tokens})",
                param="min_tokens",
            )

    def adjust(self, logits: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
        """logits [vocab] float32 -> the adjusted logits (a new tensor)."""
        if self.matcher is not None:
            if self._allowed is None:
                allowed = self.matcher.allowed()
                if self.holds_back_stops(spec):
                    self._check_grammar_reaches_min_tokens(allowed, spec.min_tokens)
                mask = allowed.view(np.uint8)
                self._allowed = self.transfers.to_device(mask, torch.uint8).bool()
            logits = logits.masked_fill(~self._allowed, float("-inf"))
        if self.bias is not None:
            logits = logits + self.bias
        if self.holds_back_stops(spec):
            logits = logits.index_fill(0, self.stop_ids, float("-inf"))
        return penalized(logits, spec, self.counts, self.prompt_seen)

    def holds_back_stops(self, spec: SampleSpec) -> bool:
        """`min_tokens` still forbids the stop tokens."""
        return self.stop_ids is not None and self.num_output < spec.min_tokens

    def penalties_only(self, spec: SampleSpec) -> bool:
        """True when `adjust` does nothing but the penalties (and the bias): no grammar, no
        stop tokens held back for `min_tokens` now, so rows like it adjust as a batch."""
        return self.matcher is None and not self.holds_back_stops(spec)


def penalized(
    logits: torch.Tensor,
    spec: SampleSpec,
    counts: torch.Tensor,
    prompt_seen: torch.Tensor | None,
) -> torch.Tensor:
    """The repetition, frequency and presence penalties over logits [..., vocab], with each
    row's output token `counts` and the prompt's tokens (`prompt_seen`, or None) alike."""
    if spec.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt_seen is not None:
            seen = seen | prompt_seen
        penalty = spec.repetition_penalty
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, scaled, logits)
    if spec.frequency_penalty != 0.0:
        logits = logits - spec.frequency_penalty * counts
    if spec.presence_penalty != 0.0:
        logits = logits - spec.presence_penalty * (counts > 0).float()
    return logits


def adjust_rows(
    logits: torch.Tensor,
    specs: Sequence[SampleSpec],
    histories: Sequence[TokenHistory | None],
    failures: dict[int, str] | None,
    batched: bool,
) -> torch.Tensor:
    """Each row's logits adjustments (`TokenHistory.adjust`); returns the logits (the same
    tensor, written in place, unless every row was adjusted as one batch). `batched`: rows
    whose adjustments are only the bias and the same penalties are adjusted together, a
    fixed number of operations and one copy back per row (none when they are all the rows),
    the same values as row by row; other rows (a grammar, `min_tokens` holding back stop
    tokens) adjust alone."""
    groups: dict[tuple, list[int]] = {}
    for row, history in enumerate(histories):
        if history is None:
            continue
        spec = specs[row]
        if batched and history.penalties_only(spec):
            key = (spec.repetition_penalty, spec.frequency_penalty, spec.presence_penalty,
                   history.bias is not None, history.prompt_seen is not None)  # fmt: skip
            groups.setdefault(key, []).append(row)
            continue
        try:
            logits[row] = history.adjust(logits[row], spec)
        except (RuntimeError, InvalidRequestError) as err:  # a grammar in error
            if failures is None:
                raise
            failures[row] = describe_failure(err)
    for rows in groups.values():
        group = [history for row in rows if (history := histories[row]) is not None]
        if len(rows) == 1:
            logits[rows[0]] = group[0].adjust(logits[rows[0]], specs[rows[0]])
            continue
        every = len(rows) == len(logits)  # the rows are all of them, in order
        values = logits if every else torch.stack([logits[row] for row in rows])
        biases = [h.bias for h in group if h.bias is not None]  # all or none (the key)
        if biases:
            values = values + torch.stack(biases)
        prompts = [h.prompt_seen for h in group if h.prompt_seen is not None]
        seen = torch.stack(prompts) if prompts else None
        counts = torch.stack([h.counts for h in group])
        values = penalized(values, specs[rows[0]], counts, seen)
        if every:
            logits = values
        else:
            for j, row in enumerate(rows):
                logits[row] = values[j]
    return logits


def token_history(
    new: NewRequestData,
    vocab_size: int,
    transfers: Transfers,
    make_matcher: Callable[[StructuredOutput], Matcher] | None,
) -> TokenHistory | None:
    """A new request's logits-adjustment history (None when its sampling adjusts nothing),
    with a fresh grammar matcher for structured output (`make_matcher`: the tokenizer's)."""
    spec = new.sample_spec
    if not spec.adjusts_logits:
        return None
    matcher = None
    if spec.structured is not None:
        if make_matcher is None:
            raise InvalidRequestError("structured output needs the model's tokenizer")
        matcher = make_matcher(spec.structured)
    return TokenHistory(
        spec, vocab_size, transfers, prompt_token_ids=new.prompt_token_ids,
        output_token_ids=new.output_token_ids, matcher=matcher,
    )  # fmt: skip
