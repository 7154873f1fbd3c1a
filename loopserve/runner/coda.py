"""The end of a step in the model runner: coda and sampling of the exiting rows, and each
item's result (its hidden state kept for the next step or released).

Rows exit in two ways: a decode token whose loop decided to exit (its last hidden state goes
to the coda), and a request's last prompt chunk reaching the last depth (the first token's
exit is chosen from the last position's D hazards, `choose_exit_from_hazards`, and that
loop's output goes to the coda). One coda call and one sampling pass serve them all; a row
whose sampling raises fails its request alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loopserve.contracts import ItemKind, ItemResult, RequestFailure, SampledToken, StepRules
from loopserve.exit import ExitMode, choose_exit_from_hazards
from loopserve.runner.handles import HandleTable
from loopserve.runner.sampler import sample_rows
from loopserve.runner.swap import InFlight
from loopserve.runner.transfers import Transfers


class Coda:
    """Explicit inputs: the step rules, the exit mode, the (timed) coda function, the
    per-request samplers, the transfer counter and the in-flight handle table."""

    def __init__(
        self,
        *,
        rules: StepRules,
        exit_mode: ExitMode,
        coda: Callable[[torch.Tensor], torch.Tensor],
        samplers: dict,
        transfers: Transfers,
        inflight: HandleTable[InFlight],
    ) -> None:
        self.rules = rules
        self.exit_mode = exit_mode
        self.coda = coda
        self.samplers = samplers
        self.transfers = transfers
        self.inflight = inflight

    def __call__(
        self, items, states, hazards, last_outputs, exited
    ) -> tuple[list[ItemResult], tuple[RequestFailure, ...]]:
        """Coda and sampling of the exiting rows; the items' results and the requests whose
        sampling raised (each fails alone)."""
        failed: list[RequestFailure] = []
        coda_rows: list[torch.Tensor] = []
        coda_items: list[int] = []
        loops_used: dict[int, int] = {}
        scores = self._score_prompts(items, states)
        first_tokens = [self.rules.samples_first_token(item) for item in items]
        if any(first_tokens):
            self.transfers.flush()  # the first token's exit is chosen from its hazards
        for i, item in enumerate(items):
            if item.kind is ItemKind.DECODE and exited[i]:
                coda_rows.append(states[i])
                coda_items.append(i)
                loops_used[i] = item.depth + 1
            elif first_tokens[i]:
                assert item.exit_rule is not None
                loops = choose_exit_from_hazards(
                    self.exit_mode, item.exit_rule, hazards[i] or None, item.trace_loops
                )
                coda_rows.append(last_outputs[i][loops - 1])
                coda_items.append(i)
                loops_used[i] = loops
        sampled: dict[int, SampledToken] = {}
        if coda_rows:
            logits = self.coda(torch.cat(coda_rows))
            specs, generators = zip(*(self.samplers[items[i].request_id] for i in coda_items))
            failures: dict[int, str] = {}
            tokens = sample_rows(logits, list(specs), list(generators), self.transfers, failures)
            for row, (i, token) in enumerate(zip(coda_items, tokens)):
                if row in failures:  # this request fails alone; the call's other rows go on
                    failed.append(
                        RequestFailure(items[i].request_id, f"sampling failed: {failures[row]}")
                    )
                    continue
                sampled[i] = token
        self.transfers.flush()  # hazards not read yet (no coda this step)
        results = []
        for i, item in enumerate(items):
            token = sampled.get(i)
            if self.rules.releases_handle(item, exited[i], token is not None):
                self.inflight.done(item.request_id, item.handle)
            else:
                state = InFlight(states[i], hazards[i], last_outputs[i])
                self.inflight.keep(item.request_id, item.handle, state)
            item_hazards = tuple(hazards[i][-item.num_depths :]) if item.needs_gate else ()
            exited_now = bool(exited[i]) or token is not None
            results.append(
                ItemResult(
                    item.request_id,
                    item.handle,
                    item_hazards,
                    exited_now,
                    loops_used.get(i),
                    token,
                    (),
                    scores.get(i, ()),
                )
            )
        return results, tuple(failed)

    def _score_prompts(self, items, states) -> dict[int, tuple[SampledToken, ...]]:
        """Prompt logprobs of the items with `score_ids`, from their rows' last-loop output:
        one coda call over all of them and one copy to the host."""
        scored = [i for i, item in enumerate(items) if item.score_ids]
        if not scored:
            return {}
        rows = torch.cat([states[i][: len(items[i].score_ids)] for i in scored])
        logprobs = torch.log_softmax(self.coda(rows).float(), dim=-1)
        ids = [t for i in scored for t in items[i].score_ids]
        index = torch.tensor(ids, dtype=torch.int64, device=logprobs.device)
        columns = [logprobs.gather(1, index[:, None]).double()]
        top = max(items[i].score_top for i in scored)
        if top:
            values, indices = logprobs.topk(top, dim=-1)
            columns += [values.double(), indices.double()]
        width = 1 + 2 * top  # per row: the chosen logprob, top values, top ids
        flat = self.transfers.to_host(torch.cat(columns, dim=1).reshape(-1))
        scores: dict[int, tuple[SampledToken, ...]] = {}
        at = 0
        for i in scored:
            k = items[i].score_top
            entries = []
            for token_id in items[i].score_ids:
                row = flat[at : at + width]
                alternatives = tuple((int(row[1 + top + j]), row[1 + j]) for j in range(k))
                entries.append(SampledToken(token_id, row[0], alternatives))
                at += width
            scores[i] = tuple(entries)
        return scores
