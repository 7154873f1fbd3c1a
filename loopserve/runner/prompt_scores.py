"""Prompt logprobs at the end of a step (`SamplingParams.prompt_logprobs`): the scored rows
of a step's prompt items, from their last loop's output or, with a `score_rule`, the output
of the loop the rule picks per row (a criterion family's pick, `ExitScores`, with its
logits), after the stored outputs of cached positions; one coda call and one copy to the
host. The coda (`runner/coda.py`) calls it once per step with the step's items."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from loopserve.contracts import ItemKind, SampledToken
from loopserve.exit import ExitMode, choose_exit_from_hazards
from loopserve.runner.exit_scores import ExitScores
from loopserve.runner.transfers import Transfers


class PromptScores:
    """Explicit inputs: the loops per token, the (timed) coda function, a leave that writes
    no K/V for cached positions (`peek`, a family whose leave writes K/V), the exit-signal
    function and the transfer counter."""

    def __init__(
        self,
        *,
        num_loops: int,
        coda: Callable[..., torch.Tensor],
        peek: Callable[..., torch.Tensor] | None,
        hazards: Callable[[torch.Tensor], torch.Tensor],
        transfers: Transfers,
    ) -> None:
        self.num_loops = num_loops
        self.coda = coda
        self.peek = peek
        self.hazards = hazards
        self.transfers = transfers

    def __call__(
        self, items, states, loop_outputs, cached_rows, completed, exit_scores: ExitScores | None
    ) -> dict[int, tuple[SampledToken, ...]]:
        """Prompt logprobs of the items with `score_ids`, from their rows' last-loop output
        (or, with `score_rule`, the output of the loop the rule picks per row), after the
        stored outputs of the cached positions an item scores first (`score_cached`): one
        coda call over all of them and one copy to the host. An item whose leave already ran
        (`completed`) is scored from those logits."""
        scored = [
            i for i, item in enumerate(items) if item.kind is ItemKind.PROMPT and item.score_ids
        ]
        if not scored:
            return {}
        by_rule = [i for i in scored if items[i].score_rule is not None]
        if exit_scores is not None:  # a criterion picks them, with their logits
            ready, picked_loops = exit_scores.pick(items, by_rule, loop_outputs)
            picked = {}
        else:
            ready = {}
            picked, picked_loops = self._rows_at_exit_loops(items, by_rule, loop_outputs)
        parts, spans = [], []
        for i in scored:
            own = len(items[i].score_ids) - items[i].score_cached
            if i in ready:
                continue
            if i in completed:
                ready[i] = completed[i][0][:own]
                if i in cached_rows:  # the store's rows, through the leave that writes nothing
                    assert self.peek is not None, "a completed leave is a family's that writes K/V"
                    cached = range(items[i].score_cached)
                    before = self.peek(cached_rows[i], items[i].request_id, list(cached))
                    ready[i] = torch.cat([before, ready[i]])
                continue
            if i in cached_rows:
                parts.append(cached_rows[i])
                spans.append((items[i].request_id, 0, items[i].score_cached))
            parts.append(picked[i] if i in picked else states[i][:own])
            spans.append((items[i].request_id, items[i].token_start, own))
        # Rows in `scored` order: those needing the leave, then those with logits already.
        scored = [i for i in scored if i not in ready] + [i for i in scored if i in ready]
        logits = [self.coda(torch.cat(parts), lambda: spans)] if parts else []
        logits += [ready[i] for i in scored if i in ready]
        logprobs = torch.log_softmax(torch.cat(logits).float(), dim=-1)
        ids = [t for i in scored for t in items[i].score_ids]
        index = self.transfers.to_device(ids)
        chosen = logprobs.gather(1, index[:, None])
        rank = (logprobs > chosen).sum(dim=1, keepdim=True) + 1
        columns = [chosen.double(), rank.double()]
        top = max(items[i].score_top for i in scored)
        if top:
            values, indices = logprobs.topk(top, dim=-1)
            columns += [values.double(), indices.double()]
        width = 2 + 2 * top  # per row: the chosen logprob, its rank, top values, top ids
        flat = self.transfers.to_host(torch.cat(columns, dim=1).reshape(-1))
        scores: dict[int, tuple[SampledToken, ...]] = {}
        at = 0
        for i in scored:
            k = items[i].score_top
            entries = []
            loops = picked_loops.get(i) or [
                (completed.get(i, (None, None))[1] or items[i].prompt_loops or self.num_loops)
            ] * len(items[i].score_ids)
            for token_id, loop in zip(items[i].score_ids, loops):
                row = flat[at : at + width]
                alternatives = tuple((int(row[2 + top + j]), row[2 + j]) for j in range(k))
                entries.append(SampledToken(token_id, row[0], alternatives, int(row[1]), loop))
                at += width
            scores[i] = tuple(entries)
        return scores

    def _rows_at_exit_loops(self, items, by_rule: list[int], loop_outputs) -> tuple[dict, dict]:
        """Per item with `score_rule`: each scored row's output at the loop the rule picks
        over that row's exit signals (the CDF threshold within min/max loops, as the first
        output token's exit is chosen), and those loops: one exit-signal call over every
        loop's rows of all such items and one copy of the hazards to the host."""
        if not by_rule:
            return {}, {}
        stacked = {}  # item -> its rows' outputs of every loop [D, n, H]
        for i in by_rule:
            outputs = loop_outputs[i]
            assert len(outputs) == self.num_loops, "scored before every loop ran"
            stacked[i] = torch.stack([o[: len(items[i].score_ids)] for o in outputs])
        hidden = torch.cat([s.reshape(-1, s.shape[-1]) for s in stacked.values()])
        hazards = self.transfers.to_host(self.hazards(hidden).float())
        picked, picked_loops, at = {}, {}, 0
        for i, outputs in stacked.items():
            num_loops, n = outputs.shape[:2]
            table = np.array(hazards[at : at + num_loops * n]).reshape(num_loops, n)
            at += num_loops * n
            rule = items[i].score_rule
            columns = table.T.tolist()  # host array
            loops = [choose_exit_from_hazards(ExitMode.OURO, rule, c) for c in columns]
            index = self.transfers.to_device([loop - 1 for loop in loops])
            picked[i] = outputs[index, torch.arange(n, device=outputs.device)]
            picked_loops[i] = loops
        return picked, picked_loops
