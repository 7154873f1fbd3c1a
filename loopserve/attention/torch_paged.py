"""Reference paged attention in plain torch (CPU and CUDA): the oracle for fast kernels.

K/V live in one tensor per engine: [num_layers, 2, num_slots, num_kv_heads, head_dim] with
`slot = block_id * block_size + position % block_size`. A core call's rows each name the
block table of the plane they read and write (the plane of their depth under LAST_EXITED,
plane 0 under SHARED). Per call, `PagedAttentionMetadata.build` computes the slots once; every
layer then writes the rows' K/V first and reads afterwards, so rows of one call never see a
half-written state. Single-row items (decode) attend together over a padded context; prompt
items (many rows) attend one item at a time with a causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loopserve.models.attention import attention_reference


@dataclass(frozen=True, slots=True)
class RowSegment:
    """Consecutive rows of one item: positions [start, start+count) in one plane."""

    block_table: list[int]
    start: int
    count: int


def position_slots(
    block_table: list[int], num_positions: int, block_size: int, device
) -> torch.Tensor:
    """Slots of positions [0, num_positions) of one plane. [num_positions] int64."""
    num_blocks = -(-num_positions // block_size)
    blocks = torch.tensor(block_table[:num_blocks], dtype=torch.int64, device=device)
    offsets = torch.arange(block_size, dtype=torch.int64, device=device)
    return (blocks.unsqueeze(1) * block_size + offsets).flatten()[:num_positions]


@dataclass
class PagedAttentionMetadata:
    write_slots: torch.Tensor  # [rows]
    single_rows: torch.Tensor  # [num_single] row indices of one-row segments
    single_blocks: torch.Tensor  # [num_single * max_blocks] block ids (padded with 0)
    single_valid: torch.Tensor  # [num_single, 1, 1, max_blocks * block_size] bool
    block_size: int
    multi: list[tuple[slice, torch.Tensor, torch.Tensor]]  # (rows, context slots, allowed)

    @classmethod
    def build(cls, segments: list[RowSegment], block_size: int, device) -> PagedAttentionMetadata:
        write_slots: list[torch.Tensor] = []
        single_rows: list[int] = []
        single_tables: list[list[int]] = []
        single_positions: list[int] = []
        multi = []
        row = 0
        for seg in segments:
            end = seg.start + seg.count
            if seg.count == 1:
                single_rows.append(row)
                single_tables.append(seg.block_table)
                single_positions.append(seg.start)
                block, offset = divmod(seg.start, block_size)
                write_slots.append(torch.tensor([seg.block_table[block] * block_size + offset]))
            else:
                context = position_slots(seg.block_table, end, block_size, device)
                span = torch.arange(end, device=device)
                queries = torch.arange(seg.start, end, device=device)
                allowed = span.unsqueeze(0) <= queries.unsqueeze(1)  # [count, end]
                multi.append((slice(row, row + seg.count), context, allowed))
                write_slots.append(context[seg.start : end].cpu())
            row += seg.count
        single_blocks, single_valid = _padded_context(
            single_tables, single_positions, block_size, device
        )
        return cls(
            write_slots=torch.cat(write_slots).to(device)
            if write_slots
            else torch.empty(0, dtype=torch.int64),
            single_rows=torch.tensor(single_rows, dtype=torch.int64, device=device),
            single_blocks=single_blocks,
            single_valid=single_valid,
            block_size=block_size,
            multi=multi,
        )


def _padded_context(tables: list[list[int]], positions: list[int], block_size: int, device):
    if not tables:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, torch.empty(0, 1, 1, 0, dtype=torch.bool, device=device)
    max_blocks = -(-(max(positions) + 1) // block_size)
    padded = [t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks])) for t in tables]
    blocks = torch.tensor(padded, dtype=torch.int64, device=device).flatten()
    pos = torch.tensor(positions, dtype=torch.int64, device=device)
    span = torch.arange(max_blocks * block_size, device=device)
    valid = span.unsqueeze(0) <= pos.unsqueeze(1)  # [n, max_blocks * block_size]
    return blocks, valid[:, None, None, :]


class TorchPagedAttention:
    """`AttentionBackend` for one core call over the engine's paged KV tensor."""

    def __init__(
        self, kv_cache: torch.Tensor, metadata: PagedAttentionMetadata, scale: float
    ) -> None:
        self.kv_cache = kv_cache
        self.meta = metadata
        self.scale = scale

    def attend(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        key_cache, value_cache = self.kv_cache[layer_idx, 0], self.kv_cache[layer_idx, 1]
        key_cache[self.meta.write_slots] = key
        value_cache[self.meta.write_slots] = value
        out = torch.empty_like(query)
        meta = self.meta
        if meta.single_rows.numel():
            out[meta.single_rows] = self._attend_single(
                query[meta.single_rows], key_cache, value_cache
            )
        for rows, context, allowed in meta.multi:
            out[rows] = attention_reference(
                query[rows], key_cache[context], value_cache[context], allowed, self.scale
            )
        return out

    def _attend_single(self, query, key_cache, value_cache) -> torch.Tensor:
        """One query row per item: gather whole blocks (index_select), then fused SDPA."""
        num_rows, num_heads, head_dim = query.shape
        num_kv_heads, block_size = key_cache.shape[1], self.meta.block_size
        shape = (num_rows, -1, num_kv_heads, head_dim)  # [n, C, Hkv, Dh]
        blocks = self.meta.single_blocks
        keys = key_cache.view(-1, block_size, num_kv_heads, head_dim).index_select(0, blocks)
        values = value_cache.view(-1, block_size, num_kv_heads, head_dim).index_select(0, blocks)
        out = torch.nn.functional.scaled_dot_product_attention(
            query.unsqueeze(2),  # [n, Hq, 1, Dh]
            keys.view(shape).transpose(1, 2),  # [n, Hkv, C, Dh] (strided view, no copy)
            values.view(shape).transpose(1, 2),
            attn_mask=self.meta.single_valid,
            scale=self.scale,
            enable_gqa=num_kv_heads != num_heads,
        )
        return out.squeeze(2)
