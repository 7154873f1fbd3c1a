"""The convergence criterion of speculative positions (`SpecRow`) for a criterion family.

Decode rows keep their criterion's fields per decode slot (`loop_calls.CriterionSlots`); a
speculating request's positions are items under handles instead, so their fields live here,
per (request id, handle): started from the position's initial state at its loop 0, moved on
by each check its plan asks for, dropped when the position exits, is rolled back, or its
request is released or preempted. A check reads what a decode row's check reads: the latent
of the carried state and, for a criterion that reads logits, the leave over the checked
rows (which writes their once-plane K/V, as a decode row's check does); the threshold is the
row's (argmax-stability: the request's stable steps).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loopserve.runner.loop_calls import CriterionSlots, LoopCalls


class SpecCriteria:
    def __init__(
        self, slots: CriterionSlots, calls: LoopCalls, stable_steps: dict[str, int]
    ) -> None:
        self.slots, self.calls, self.stable_steps = slots, calls, stable_steps
        self.fields: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    def _keep(self, keys: list[tuple[str, int]], rule) -> None:
        for j, key in enumerate(keys):
            self.fields[key] = {
                name: getattr(rule, name)[j : j + 1] for name in self.slots.state_fields
            }

    def start(self, keys: list[tuple[str, int]], carried: torch.Tensor) -> None:
        """Positions at their loop 0: their criterion from their carried state before it."""
        rule = self.slots.rule()
        rule.init(self.calls.model.latent(carried).unsqueeze(1))
        self._keep(keys, rule)

    def check(
        self,
        keys: list[tuple[str, int]],
        carried: torch.Tensor,
        thresholds: list[float],
        spans: Callable[[], list[tuple[str, int, int]]],
    ) -> torch.Tensor:
        """One check of these positions after their loop (`carried` [n, W], `spans` where
        their rows are, for the leave): fired, bool [n] on the device."""
        rule = self.slots.rule()
        for name in self.slots.state_fields:
            setattr(rule, name, torch.cat([self.fields[key][name] for key in keys]))
        steps = self.stable_steps
        if self.slots.counts_steps:
            thresholds = [steps.get(key[0], self.slots.default_steps) for key in keys]
        rule.threshold = torch.tensor(thresholds, dtype=torch.float64, device=carried.device)
        logits = self.calls.leave(carried, spans) if rule.needs_logits else None
        fires, _ = rule.check(self.calls.model.latent(carried).unsqueeze(1), logits)
        self._keep(keys, rule)
        return fires

    def drop(self, request_id: str, handle: int | None = None) -> None:
        """Forget one position's fields (exited or rolled back), or a request's."""
        if handle is not None:
            self.fields.pop((request_id, handle), None)
            return
        for key in [key for key in self.fields if key[0] == request_id]:
            del self.fields[key]
