"""Prompt logprobs at the exit loop for a criterion family (`prompt_logprobs_loop='exit'`).

A prompt runs all its loops (its K/V of every loop plane, and its leave's once-plane K/V at
its last loop, are what decode reads). Each scored row is then scored as a decode token at
its position would be: its criterion (the engine's, with the request's threshold, min and
max loops, checked from its initial state on) runs over the row's state after every loop,
and the row's logits are those of the loop where it fires (else its last). A criterion that
reads logits runs the leave at every checked loop; so does the score. For a family whose
leave attends (Huginn's coda layers), that leave reads the earlier positions' stored leave
K/V, final at the prompt's last loop, and the row's own K/V of that loop, which it must not
write: `PeekAttention`. Ouro's analogue picks rows by the hazards (`runner/coda.py`).

`models/huginn_dense.prompt_logprobs_at_exit` is the dense reference of the same semantics.
"""

from __future__ import annotations

import torch

from loopserve.exit.policies import ExitMode, TokenExit
from loopserve.runner.loop_calls import CriterionSlots, LoopCalls


class PeekAttention:
    """One leave call's attention for one once plane: row i, at position p of the request
    whose plane table is `tables[i]`, attends to the stored K/V of positions < p and to its
    own K/V of this call; nothing is written."""

    def __init__(self, kv_cache: torch.Tensor, tables, positions: list[int], block_size: int,
                 scale: float) -> None:  # fmt: skip
        self.kv_cache, self.scale = kv_cache, scale
        device = kv_cache.device
        max_blocks = max(1, -(-max(positions) // block_size))
        blocks = [list(table[:max_blocks]) + [0] * (max_blocks - len(table[:max_blocks]))
                  for table in tables]  # fmt: skip
        self.blocks = torch.tensor(blocks, dtype=torch.int64, device=device)  # [n, B]
        span = torch.arange(max_blocks * block_size, device=device)
        where = torch.tensor(positions, device=device).unsqueeze(1)
        self.allowed = span.unsqueeze(0) < where  # [n, C]: strictly earlier positions
        self.block_size = block_size

    def attend(self, layer_idx: int, query, key, value) -> torch.Tensor:
        n, num_heads, head_dim = query.shape
        cache = self.kv_cache[layer_idx]  # [2, slots, Hkv, Dh]
        pieces = cache.view(2, -1, self.block_size, cache.shape[2], head_dim)
        context = pieces[:, self.blocks.reshape(-1)].reshape(2, n, -1, cache.shape[2], head_dim)
        keys = torch.cat([context[0], key.unsqueeze(1)], dim=1)  # [n, C + 1, Hkv, Dh]
        values = torch.cat([context[1], value.unsqueeze(1)], dim=1)
        if cache.shape[2] != num_heads:
            keys = keys.repeat_interleave(num_heads // cache.shape[2], dim=2)
            values = values.repeat_interleave(num_heads // cache.shape[2], dim=2)
        own = torch.ones(n, 1, dtype=torch.bool, device=query.device)
        allowed = torch.cat([self.allowed, own], dim=1)  # [n, C + 1]
        scores = torch.einsum("nhd,nchd->nhc", query, keys) * self.scale
        scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.einsum("nhc,nchd->nhd", probs, values)


class ExitScores:
    """Picks a criterion family's scored prompt rows at their exit loops (`pick`)."""

    def __init__(
        self,
        slots: CriterionSlots,
        calls: LoopCalls,
        stable_steps: dict[str, int],
        *,
        kv_cache: torch.Tensor,
        block_size: int,
        scale: float,
    ) -> None:
        self.slots, self.calls, self.stable_steps = slots, calls, stable_steps
        self.kv_cache, self.block_size, self.scale = kv_cache, block_size, scale

    def _leave(self, rows: torch.Tensor, request_id: str, positions: list[int]) -> torch.Tensor:
        """Logits of rows at `positions` of one request, their once-plane K/V not written."""
        calls = self.calls
        if not calls.needs_context:
            return calls.leave(rows, lambda: [])
        tables = calls.tables[request_id]
        once = [
            PeekAttention(
                self.kv_cache,
                [tables[plane]] * len(positions),
                positions,
                self.block_size,
                self.scale,
            )  # fmt: skip
            for plane in calls.once_planes
        ]
        on_device = calls.transfers.to_device(positions)
        return calls.timed(calls.model.leave, rows, on_device, once)

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
