"""Prompt exits (`prompt_exits`, a criterion family's option; the Huginn authors' adaptive
generation): a whole prompt is one token to the criterion, checked after every loop of its
one atomic chunk; when it fires, every prompt position stops at that loop, the leave runs
over all of them (its logits sample the first token) and, under LAST_EXITED, their K/V of
that loop fills the deeper planes. `PromptExits` is a collaborator of `EagerStep` with
explicit inputs: the criterion factory, the model's calls and the finalize copies."""

from __future__ import annotations

from collections.abc import Callable

import torch

from loopserve.contracts import ItemKind, PromptChunk
from loopserve.exit.criteria import ExitCriterion
from loopserve.runner.loop_calls import LoopCalls


def refused_items(items, prompt_lens: dict[str, int], *, prompt_exits: bool, scores_by_rule: bool):
    """Requests whose items this runner cannot run, with the reason (each fails alone): a
    prompt scored at its exit loops without a hazard to pick them (`scores_by_rule`), and,
    under `prompt_exits`, a prompt item that does not hold the whole prompt (`prompt_lens`),
    on its first pass and when it is recomputed after a preemption."""
    reasons = {}
    for item in items:
        if item.kind is not ItemKind.PROMPT:
            continue
        if item.score_rule is not None and not scores_by_rule:
            reasons[item.request_id] = (
                "prompt logprobs at the exit loop are not supported for a model whose exit "
                "signal is a convergence criterion (no hazards pick the loops; "
                "prompt_logprobs_loop='last' is)"
            )
        elif prompt_exits and (
            item.token_start > 0 or item.token_count != prompt_lens[item.request_id]
        ):
            reasons[item.request_id] = (
                "with prompt_exits the whole prompt must be one chunk: raise "
                "prefill_chunk_size and max_num_batched_tokens above its length"
            )
    return reasons


class PromptExits:
    """Per step: `begin`, `start` a whole prompt's criterion from its initial state, `check`
    after each call; `exited` maps an item to its (loops used, logits)."""

    def __init__(
        self,
        *,
        criterion: Callable[[], ExitCriterion],
        calls: LoopCalls,
        finalize: Callable[[list], int],
        num_loops: int,
        stable_steps: dict[str, int] | None = None,
    ) -> None:
        """`stable_steps`: argmax-stability's steps per request (the runner's)."""
        self.criterion, self.calls, self.finalize = criterion, calls, finalize
        self.stable_steps = stable_steps if stable_steps is not None else {}
        self.num_loops = num_loops
        self.rules: dict[int, ExitCriterion] = {}
        self.exited: dict[int, tuple[int, torch.Tensor]] = {}

    def begin(self) -> None:
        self.rules, self.exited = {}, {}

    def start(self, items, states) -> None:
        """Before call 0: the criterion of each first-pass whole prompt, from its initial
        state."""
        for i, item in enumerate(items):
            if item.kind is ItemKind.PROMPT and item.first_token and item.needs_prelude:
                rule = self.criterion()
                rule.init(self.calls.model.latent(states[i]).unsqueeze(0))
                self.rules[i] = rule

    def check(self, k: int, items, active, tables, states) -> int:
        """After call k: the criterion of each prompt that may exit; a prompt that exits gets
        its leave and its finalize copies now. Returns the tokens finalized."""
        copies = 0
        for i in active:
            rule = self.rules.get(i)
            if rule is None:
                continue
            item: PromptChunk = items[i]
            request_id, loop = item.request_id, item.depth + k  # 0-based
            state = states[i]
            assert item.exit_rule is not None and item.token_start == 0
            r = item.prompt_loops or self.num_loops
            positions = list(range(item.token_start, item.token_start + item.token_count))
            spans = lambda item=item: [(item.request_id, 0, item.token_count)]  # noqa: E731
            exits, logits = loop == r - 1, None
            checks = item.exit_rule.threshold < 1.0 and loop + 1 >= item.exit_rule.min_loops
            if checks and loop < r - 1:
                if rule.needs_logits:
                    logits = self.calls.leave(state, spans)
                if rule.name != "argmax-stability":
                    rule.threshold = item.exit_rule.threshold
                else:
                    rule.threshold = self.stable_steps.get(request_id, rule.threshold)
                last = None if logits is None else logits[-1:]
                fired, _ = rule.check(self.calls.model.latent(state).unsqueeze(0), last)
                exits = bool(fired[0])
            if not exits:
                continue
            if logits is None:
                logits = self.calls.leave(state, spans)
            self.exited[i] = (loop + 1, logits)
            self.calls.ran(request_id, positions, loop + 1)
            del self.rules[i]
            table = tables[request_id]
            copies += self.finalize([(table, p, loop) for p in positions])
        return copies
