"""Prompt logprobs at the exit loop for a criterion family (`prompt_logprobs_loop='exit'`).

A prompt runs all its loops (its K/V of every loop plane, and its leave's once-plane K/V at
its last loop, are what decode reads). Each scored row is then scored as a decode token at
its position would be: its criterion (the engine's, with the request's threshold, min and
max loops, checked from its initial state on) runs over the row's state after every loop,
and the row's logits are those of the loop where it fires (else its last). A criterion that
reads logits runs the leave at every checked loop; so does the score. For a family whose
leave attends (Huginn's coda layers), that leave reads the earlier positions' stored leave
K/V, final at the prompt's last loop, and the row's own K/V of that loop, which it must not
write (`LoopCalls.peek_leave`). Ouro's analogue picks rows by the hazards (`runner/coda.py`).

`models/huginn_dense.prompt_logprobs_at_exit` is the dense reference of the same semantics.
"""

from __future__ import annotations

import torch

from loopserve.exit.policies import ExitMode, TokenExit
from loopserve.runner.loop_calls import CriterionSlots, LoopCalls


class ExitScores:
    """Picks a criterion family's scored prompt rows at their exit loops (`pick`)."""

    def __init__(self, slots: CriterionSlots, calls: LoopCalls, stable_steps: dict[str, int]):
        self.slots, self.calls, self.stable_steps = slots, calls, stable_steps

    def _leave(self, rows: torch.Tensor, request_id: str, positions: list[int]) -> torch.Tensor:
        return self.calls.peek_leave(rows, request_id, positions)

    def pick(self, items, by_rule: list[int], loop_outputs) -> tuple[dict, dict]:
        """Per item with `score_rule`: its scored rows' logits at their exit loops [n, vocab]
        and those loops. `loop_outputs[i]`: the rows' carried state before loop 0, then after
        every loop the prompt ran."""
        logits_of, loops_of = {}, {}
        for i in by_rule:
            item = items[i]
            n = len(item.score_ids)
            outputs = [o[:n] for o in loop_outputs[i]]
            initial, after = outputs[0], outputs[1:]
            positions = list(range(item.token_start, item.token_start + n))
            rule = self.slots.rule()
            if self.slots.counts_steps:
                default = self.slots.default_steps
                rule.threshold = self.stable_steps.get(item.request_id, default)
            else:
                rule.threshold = item.score_rule.threshold
            rule.init(self.calls.model.latent(initial).unsqueeze(1))
            token = TokenExit(ExitMode.CRITERION, item.score_rule)
            device = initial.device
            loops = torch.zeros(n, dtype=torch.int64, device=device)  # 0: not exited yet
            picked = None  # [n, vocab] logits, or [n, W] states when the check reads none
            last = len(after) - 1
            for k, state in enumerate(after):
                plan = token.plan()
                decides = plan.needs_gate or plan.exit_now is True or k == last
                if not decides:
                    token.record(None, False)
                    continue
                value = state
                if rule.needs_logits:
                    value = self._leave(state, item.request_id, positions)
                fired = torch.ones(n, dtype=torch.bool, device=device)
                if plan.needs_gate:
                    checked, _ = rule.check(self.calls.model.latent(state).unsqueeze(1),
                                            value if rule.needs_logits else None)  # fmt: skip
                    fired = checked if plan.exit_now is not True and k < last else fired
                exits = fired & (loops == 0)  # on the device: no read per loop
                picked = torch.zeros_like(value) if picked is None else picked
                picked = torch.where(exits.unsqueeze(1), value, picked)
                loops = torch.where(exits, torch.full_like(loops, k + 1), loops)
                if plan.exit_now is True:
                    break
                token.record(None, False)
            if not rule.needs_logits:
                picked = self._leave(picked, item.request_id, positions)
            logits_of[i] = picked
            loops_of[i] = [int(loop) for loop in self.calls.transfers.to_host(loops)]
        return logits_of, loops_of
