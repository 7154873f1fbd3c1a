"""The prompt and replay items of the Huginn executor (`runner/huginn_runner.py`): replay rows
at their recorded exit (their coda K/V and finalize copies), and each item's result at the
end of a step: paused work kept under its handle, or a prompt chunk's coda over all its rows
at the request's r-th step (its first token sampled, its prompt logprobs scored)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from loopserve.contracts import ItemKind, ItemResult
from loopserve.execution import StepRules
from loopserve.exit import ExitMode, choose_exit_from_hazards
from loopserve.runner.handles import HandleTable
from loopserve.runner.huginn_exits import PromptExits
from loopserve.runner.huginn_parts import score_prompt_rows
from loopserve.runner.transfers import Transfers


class PromptItems:
    """Inputs: the handle table of paused work, the step rules, the requests' r, the prompt
    exits (and whether prompts exit as one token, `prompt_exits`), the coda, the finalize
    copies, the sampler, the steps record and the transfer counter."""

    def __init__(
        self,
        *,
        inflight: HandleTable,
        rules: StepRules,
        max_loops: dict,
        prompts: PromptExits,
        coda: Callable,
        finalize: Callable,
        sample: Callable,
        ran: Callable,
        transfers: Transfers,
        prompt_exits: bool = False,
    ) -> None:
        self.inflight, self.rules, self.prompt_exits = inflight, rules, prompt_exits
        self.max_loops, self.prompts, self.coda = max_loops, prompts, coda
        self.finalize, self.sample, self.ran, self.transfers = finalize, sample, ran, transfers
        self.num_loops = rules.num_loops

    def replays(self, k, items, active, tables, states, exited_items) -> int:
        """Replay rows at their recorded exit: their coda K/V and their finalize copies."""
        done = [i for i in active if items[i].kind is ItemKind.REPLAY and items[i].exit_now]
        if not done:
            return 0
        for i in done:
            exited_items[i] = True
            self.ran(items[i].request_id, [items[i].token_start], items[i].depth + k + 1)
        state = torch.cat([states[i][0] for i in done])
        spans = [(tables[items[i].request_id], items[i].token_start, 1) for i in done]
        self.coda(state, spans, [items[i].token_start for i in done])
        return self.finalize(
            [(tables[items[i].request_id], items[i].token_start, items[i].depth + k)
             for i in done]
        )  # fmt: skip

    def results(self, items, tables, states, loop_states, exited_items, failed):
        results: list[ItemResult] = []
        for i, item in enumerate(items):
            hazards: tuple[float, ...] = ()  # `criterion` reads no signal on prompts
            if item.kind is ItemKind.REPLAY:
                if not exited_items[i]:
                    self.inflight.keep(item.request_id, item.handle, (*states[i], None))
                else:
                    self.inflight.done(item.request_id, item.handle)
                results.append(ItemResult(item.request_id, item.handle, (), exited_items[i]))
                continue
            if item.last_depth < self.rules.final_prompt_depth(item):
                self.inflight.keep(item.request_id, item.handle, (*states[i], loop_states[i]))
                results.append(ItemResult(item.request_id, item.handle, hazards))
                continue
            self.inflight.done(item.request_id, item.handle)
            if i in self.prompts.exited:  # its coda ran at its exit
                loops, logits = self.prompts.exited[i]
                token = self.sample(logits[-1:], [item.request_id], failed)[0]
                scores = score_prompt_rows(item, logits, loops, self.transfers)
                results.append(
                    ItemResult(item.request_id, item.handle, (), token is not None, loops, token,
                               prompt_logprobs=scores)
                )  # fmt: skip
                continue
            state = loop_states[i]  # every row at the request's last loop
            loops = None
            if self.rules.samples_first_token(item):
                assert item.exit_rule is not None
                # Its prompt ran the request's r loops, and reads no criterion: r loops.
                loops = choose_exit_from_hazards(ExitMode.CRITERION, item.exit_rule, None)
            logits = self.coda(
                state,
                [(tables[item.request_id], item.token_start, item.token_count)],
                list(range(item.token_start, item.token_start + item.token_count)),
            )
            if self.prompt_exits and not item.first_token:
                # A recomputed prompt that exited as one token ran the loops it used then:
                # its K/V of that loop fills the deeper planes, as on its first pass.
                used = self.rules.final_prompt_depth(item) + 1
                positions = range(item.token_start, item.token_start + item.token_count)
                self.ran(item.request_id, positions, used)
                self.finalize([(tables[item.request_id], p, used - 1) for p in positions])
            scores = score_prompt_rows(
                item, logits, self.max_loops[item.request_id], self.transfers
            )
            if loops is None:
                results.append(
                    ItemResult(item.request_id, item.handle, hazards, prompt_logprobs=scores)
                )
                continue
            token = self.sample(logits[-1:], [item.request_id], failed)[0]
            results.append(
                ItemResult(item.request_id, item.handle, hazards, token is not None, loops, token,
                           prompt_logprobs=scores)
            )  # fmt: skip
        return results
