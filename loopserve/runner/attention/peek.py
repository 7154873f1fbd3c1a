"""Attention that reads the paged K/V and writes nothing: a leave over rows that attend to
the stored K/V of earlier positions and to their own K/V of this call (`PeekAttention`).

A family whose leave attends (Huginn's coda layers) keeps, per position, the leave K/V of the
loop the position completed at, which later positions read. Scoring a prompt row at another
loop (`runner/exit_scores.py`), or a cached position again from its stored state (the score
store), needs that leave without overwriting the stored K/V: `LoopCalls.peek_leave`.
"""

from __future__ import annotations

import torch

from loopserve.models.kv_dtype import round_trip


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
        context = context.to(query.dtype)  # widened exactly from a narrower cache
        # The row's own K/V as the cache would hold it (the reference stores, then reads).
        key, value = round_trip(key, cache.dtype), round_trip(value, cache.dtype)
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
