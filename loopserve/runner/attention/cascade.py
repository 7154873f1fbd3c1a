"""Cascade (shared-prefix) attention: a group's prefix K/V read once, merged exactly.

`plan_prefix_groups` (torch-free, `prefix_groups.py`) says which one-row items of a call share
leading blocks of one plane. `CascadePlan` holds one call's groups; `attend_prefix` gathers
nothing itself (the backend passes the prefix blocks it gathered once per group) and attends
all the group's queries to that prefix at once, returning each row's output and
log-sum-exp. Each backend attends each row to its own suffix (positions `prefix_len ..
position`, through its table shifted by the prefix blocks) with its log-sum-exp (torch:
`attend_with_lse`; triton: its decode kernel), and `merge_partial` combines the halves:

    out = (e^{lse1} o1 + e^{lse2} o2) / (e^{lse1} + e^{lse2})

Log-sum-exps and the merge are float32 whatever the cache dtype. The result equals attention
over the whole context up to rounding (parity tests hold it to float32 tolerance against
plain paged attention and the dense reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loopserve.runner.attention.base import RowSegment
from loopserve.runner.attention.prefix_groups import PrefixGroup


@dataclass
class CascadePlan:
    """The prefix side of one call's groups, for any backend. `num_groups` groups padded to
    `max_rows` queries (`prefix_query_index` [G * max_rows] call rows; padding repeats a
    group's last row) over `prefix_blocks` [G * max_blocks] (padded with block 0;
    `prefix_mask` [G, 1, 1, C] hides the padding). Grouped rows in group order: `rows` [R]
    (their call rows), `prefix_pick` [R] (their index among the padded prefix queries) and
    `suffixes` (call row, segment past the prefix) for the backend's suffix attention."""

    num_groups: int
    max_rows: int
    prefix_query_index: torch.Tensor
    prefix_blocks: torch.Tensor
    prefix_mask: torch.Tensor
    prefix_pick: torch.Tensor
    rows: torch.Tensor
    suffixes: list[tuple[int, RowSegment]]
    groups: list[PrefixGroup]
    block_size: int

    @classmethod
    def build(
        cls,
        groups: list[PrefixGroup],
        singles: list[tuple[int, RowSegment]],
        block_size: int,
        device,
    ) -> CascadePlan:
        """`singles`: (call row, segment) of every one-row item, indexed by the groups' rows."""
        max_rows = max(len(group.rows) for group in groups)
        max_blocks = max(group.num_blocks for group in groups)
        query_index, blocks, lengths, pick, suffixes = [], [], [], [], []
        for g, group in enumerate(groups):
            table = singles[group.rows[0]][1].block_table
            blocks.extend(table[: group.num_blocks])
            blocks.extend([0] * (max_blocks - group.num_blocks))
            prefix_len = group.num_blocks * block_size
            lengths.append(prefix_len)
            for q in range(max_rows):
                query_index.append(singles[group.rows[min(q, len(group.rows) - 1)]][0])
            pick.extend(range(g * max_rows, g * max_rows + len(group.rows)))
            for index in group.rows:
                # The row's table without the shared blocks, its position shifted down.
                row, seg = singles[index]
                rest = RowSegment(seg.block_table[group.num_blocks :], seg.start - prefix_len, 1)
                suffixes.append((row, rest))

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        span = torch.arange(max_blocks * block_size, device=device)
        return cls(
            num_groups=len(groups),
            max_rows=max_rows,
            prefix_query_index=as_tensor(query_index),
            prefix_blocks=as_tensor(blocks),
            prefix_mask=span < as_tensor(lengths).view(-1, 1, 1, 1),  # [G, 1, 1, C]
            prefix_pick=as_tensor(pick),
            rows=as_tensor([row for row, _ in suffixes]),
            suffixes=suffixes,
            groups=groups,
            block_size=block_size,
        )

    def attend_prefix(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every group's queries over its prefix, gathered once per group: `keys`/`values`
        [G * max_blocks, block_size, Hkv, Dh] are `prefix_blocks` of one layer. Returns
        (out [R, Hq, Dh], lse [R, Hq]) float32, one entry per grouped row in group order."""
        num_heads, head_dim = query.shape[1], query.shape[2]
        n, rows = self.num_groups, self.max_rows
        context = (n, -1, keys.shape[2], head_dim)  # [G, prefix, Hkv, Dh]
        keys, values = keys.view(context), values.view(context)
        queries = query.index_select(0, self.prefix_query_index).view(n, rows, num_heads, -1)
        if query.device.type != "cpu" or _CPU_FLASH_WITH_LSE is None:
            # One group at a time over strided 3-D views (no copies of the prefix K/V).
            parts = []
            for g, group in enumerate(self.groups):
                length = group.num_blocks * self.block_size
                parts.append(
                    _attend_all_with_lse(
                        queries[g, : len(group.rows)], keys[g, :length], values[g, :length], scale
                    )
                )
            return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])
        out, lse = attend_with_lse(queries, keys, values, self.prefix_mask, scale)
        pick = self.prefix_pick
        return out.reshape(n * rows, num_heads, head_dim)[pick], lse.reshape(n * rows, -1)[pick]


def _attend_all_with_lse(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [Q, Hq, Dh] over every position of keys/values [C, Hkv, Dh] (no mask) ->
    (out [Q, Hq, Dh], lse [Q, Hq]) float32, through 3-D matmuls on strided views."""
    num_queries, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    # Query heads of one KV head side by side: [Hkv, group * Q, Dh].
    q = query.view(num_queries, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    q = q.reshape(num_kv_heads, group * num_queries, head_dim)
    scores = torch.matmul(q, keys.permute(1, 2, 0)).float().mul_(scale)  # [Hkv, gQ, C]
    lse = torch.logsumexp(scores, dim=-1)  # [Hkv, gQ]
    probs = torch.exp(scores - lse.unsqueeze(-1)).to(values.dtype)
    out = torch.matmul(probs, values.transpose(0, 1))  # [Hkv, gQ, Dh]
    out = out.view(num_kv_heads, group, num_queries, head_dim).permute(2, 0, 1, 3)
    lse = lse.view(num_kv_heads, group, num_queries).permute(2, 0, 1)
    return out.reshape(num_queries, num_heads, head_dim).float(), lse.reshape(num_queries, -1)


# The fused CPU attention kernel behind `scaled_dot_product_attention`, which also returns
# the log-sum-exp (float32, [n, Hq, Q]); None where this torch build lacks it.
_CPU_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend_with_lse(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention returning the output and its log-sum-exp.

    query [n, Q, Hq, Dh], keys/values [n, C, Hkv, Dh], mask [n, 1, Q or 1, C] (True: may
    attend; every query must see at least one key) -> (out [n, Q, Hq, Dh] float32,
    lse [n, Q, Hq] float32). On CPU this is the fused kernel of
    `scaled_dot_product_attention` on strided views (no copies of the gathered K/V);
    elsewhere plain matmuls (`attend_with_lse_matmul`)."""
    if query.device.type != "cpu" or _CPU_FLASH_WITH_LSE is None:
        return attend_with_lse_matmul(query, keys, values, mask, scale)
    bias = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
    bias.masked_fill_(~mask, float("-inf"))
    out, lse = _CPU_FLASH_WITH_LSE(
        query.transpose(1, 2),  # [n, Hq, Q, Dh]
        keys.transpose(1, 2),  # [n, Hkv, C, Dh]
        values.transpose(1, 2),
        0.0,
        False,
        attn_mask=bias,
        scale=scale,
    )
    return out.transpose(1, 2).float(), lse.transpose(1, 2).float()


def attend_with_lse_matmul(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend_with_lse` in plain matmuls (any device; float32 scores and softmax)."""
    n, num_queries, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[2]
    group = num_heads // num_kv_heads
    # Query heads of one KV head side by side: [n, Hkv, group * Q, Dh].
    q = query.view(n, num_queries, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(n, num_kv_heads, group * num_queries, head_dim)
    scores = torch.matmul(q, keys.permute(0, 2, 3, 1)).float().mul_(scale)  # [n, Hkv, gQ, C]
    scores = scores.view(n, num_kv_heads, group, num_queries, -1)
    scores.masked_fill_(~mask.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [n, Hkv, group, Q]
    probs = torch.exp(scores - lse.unsqueeze(-1)).to(values.dtype)
    out = torch.matmul(
        probs.view(n, num_kv_heads, group * num_queries, -1), values.transpose(1, 2)
    )  # [n, Hkv, group * Q, Dh]
    out = out.view(n, num_kv_heads, group, num_queries, head_dim).permute(0, 3, 1, 2, 4)
    lse = lse.permute(0, 3, 1, 2).reshape(n, num_queries, num_heads)
    return out.reshape(n, num_queries, num_heads, head_dim).float(), lse


def merge_partial(
    out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """Exact merge of two attentions over disjoint key sets: out [R, Hq, Dh], lse [R, Hq]."""
    top = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - top), torch.exp(lse2 - top)
    return (out1 * w1.unsqueeze(-1) + out2 * w2.unsqueeze(-1)) / (w1 + w2).unsqueeze(-1)
