"""Speculative rows' tokens at the end of a step (self-speculative decoding inside loop
batching, docs/speculative.md): a row that exits gets its real next token, a row that drafts
gets a draft of it; sampling rows keep each draft's filtered distribution under its handle
until the exit's speculative-sampling test reads it. The coda (`runner/coda.py`) calls it
once per step with the step's items."""

from __future__ import annotations

from collections.abc import Callable

import torch

from loopserve.contracts import ItemKind, SampledToken
from loopserve.runner.sampler import (
    batches_filtering,
    check_failures,
    draw_checks,
    is_greedy,
    row_probs,
    sampling_failure,
    speculative_sample,
)
from loopserve.runner.transfers import Transfers


class SpecSamples:
    """Explicit inputs: the (timed) coda function, the per-request samplers and the transfer
    counter; it owns the drafts' distributions."""

    def __init__(
        self, *, coda: Callable[..., torch.Tensor], samplers: dict, transfers: Transfers
    ) -> None:
        self.coda = coda
        self.samplers = samplers
        self.transfers = transfers
        # Rows that share sampling values filtered together (`sampler.row_probs`); None:
        # where operations are kernel launches (`batches_filtering` of the logits' device).
        self.batched: bool | None = None
        # (request id, handle) -> a speculative row's draft distribution q, until its exit.
        self.drafts: dict[tuple[str, int], torch.Tensor] = {}

    def drop(self, request_id: str, handle: int | None = None) -> None:
        """Forget a request's stored draft distributions (released or preempted), or only
        that of `handle` (a rolled-back speculative position)."""
        if handle is not None:
            self.drafts.pop((request_id, handle), None)
            return
        for key in [key for key in self.drafts if key[0] == request_id]:
            del self.drafts[key]

    def __call__(self, items, states, exited) -> tuple[dict[int, SampledToken], list]:
        """Speculative rows that exit (their real next token) or draft (a draft of it): one
        coda call and one copy of the tokens. Greedy rows take the argmax; sampling rows that
        share their values are filtered together on an accelerator (`sampler.row_probs`). A
        sampling row's
        draft is drawn from its filtered distribution q, kept under its handle; at its exit,
        with a next position running on that draft, its token is the speculative-sampling
        test (`speculative_sample`: the draft with probability min(1, p/q), else a draw
        from the normalized max(0, p - q)), so the token follows p, its exit distribution.
        A deeper loop's draft of a row that already drafted passes the earlier draft through
        the same rule from the earlier q to its own: the draft then follows the deepest q
        (which the exit's test uses) and changes only when the rule rejects it."""
        wanted = [
            i
            for i, item in enumerate(items)
            if item.kind is ItemKind.SPEC and (exited[i] or item.draft)
        ]
        if not wanted:
            return {}, []
        spans = lambda: [  # noqa: E731
            (items[i].request_id, items[i].token_start, items[i].token_count) for i in wanted
        ]
        logits = self.coda(torch.cat([states[i] for i in wanted]), spans).float()
        tokens = torch.argmax(logits, dim=-1)
        specs = [self.samplers[items[i].request_id][0] for i in wanted]
        batched = batches_filtering(logits.device) if self.batched is None else self.batched
        filtered = row_probs(logits, specs, batched=batched)
        failed = []
        drawn, dists = [], []  # rows that drew, and their distributions (checked on the read)
        for row, i in enumerate(wanted):
            item = items[i]
            spec, generator, _ = self.samplers[item.request_id]
            if is_greedy(spec):
                continue
            key = (item.request_id, item.handle)
            try:
                probs = filtered(row)
            except (RuntimeError, ValueError) as err:
                failed.append(sampling_failure(item.request_id, f"{type(err).__name__}: {err}"))
                continue
            if not exited[i]:  # a draft; a deeper loop's keeps the last one by the rule
                earlier = self.drafts.get(key)
                tokens[row] = speculative_sample(probs, earlier, item.verify_token, generator)
                self.drafts[key] = probs
            else:
                draft = self.drafts.pop(key, None)
                tokens[row] = speculative_sample(probs, draft, item.verify_token, generator)
            drawn.append(row)
            dists.append(probs)
        packed = tokens.double()
        if dists:  # multinomial's checks of each drawn distribution, read with the tokens
            packed = torch.cat([packed, draw_checks(torch.stack(dists))])
        values = self.transfers.to_host(packed)
        for row, error in check_failures(drawn, values[len(wanted) :]).items():
            failed.append(sampling_failure(items[wanted[row]].request_id, error))
        return {i: SampledToken(int(t)) for i, t in zip(wanted, values)}, failed
