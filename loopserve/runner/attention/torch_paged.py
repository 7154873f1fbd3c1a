"""Reference paged attention in plain torch (CPU and CUDA): the oracle for fast kernels.

K/V live in one tensor per engine: [num_layers, 2, num_slots, num_kv_heads, head_dim] with
`slot = block_id * block_size + position % block_size`. A core call's rows each name the
block table of the plane they read and write (the plane of their depth under LAST_EXITED,
plane 0 under SHARED). Per call, `PagedAttentionMetadata.build` computes the slots once; every
layer then writes the rows' K/V first and reads afterwards, so rows of one call never see a
half-written state.

Reads gather whole blocks (`index_select` of `[block_size, Hkv, Dh]` pieces) and run one fused
`scaled_dot_product_attention` per group, on strided views (no permute copies):
- single-row items (decode tokens) attend together over their padded contexts;
- multi-row items (prompt chunks) attend one at a time: a chunk's gathered context stays in
  cache while its scores are computed, which measured faster on CPU than one padded SDPA over
  all chunks (whose gather of every chunk's context at once is memory-bound); the prefix is
  fully visible, so only the chunk's own `[count, count]` block gets a causal mask, and
  grouped-query heads share their K/V without copies;
- with cascade attention on (`cascade=True`), one-row items that share leading blocks of one
  plane (prefix-cache hits, see `prefix_groups`) attend over that prefix once per group and
  over their own suffix per row, merged by log-sum-exp (`cascade.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loopserve.models.kv_dtype import to_storage
from loopserve.runner.attention.base import PagedAttentionBackend, RowSegment, write_slots_of
from loopserve.runner.attention.cascade import (
    CascadePlan,
    attend_with_lse,
    merge_partial,
)
from loopserve.runner.attention.prefix_groups import plan_prefix_groups

__all__ = [
    "PagedAttentionMetadata",
    "RowSegment",
    "TorchBackend",
    "TorchPagedAttention",
    "Workspace",
    "gather_blocks",
]


@dataclass
class PaddedGroup:
    """Items attended by one SDPA call: `num_items` items of up to `max_queries` rows each.

    `query_index` [num_items * max_queries] picks each padded query's row (padding repeats an
    item's last row); `out_index` / `out_rows` scatter the real ones back. `blocks`
    [num_items * max_blocks] are the items' context blocks (padded with block 0) and `mask`
    [num_items, 1, max_queries, max_blocks * block_size] allows key positions <= the query's.
    """

    num_items: int
    max_queries: int
    query_index: torch.Tensor
    out_index: torch.Tensor
    out_rows: torch.Tensor
    blocks: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def build(cls, segments: list[tuple[int, RowSegment]], block_size: int, device):
        """`segments`: (first row in the call, segment) of each item."""
        max_queries = max(seg.count for _, seg in segments)
        max_end = max(seg.start + seg.count for _, seg in segments)
        max_blocks = -(-max_end // block_size)
        query_index, query_positions, out_index, out_rows, blocks = [], [], [], [], []
        for i, (row, seg) in enumerate(segments):
            for q in range(max_queries):
                real = min(q, seg.count - 1)
                query_index.append(row + real)
                query_positions.append(seg.start + real)
            out_index.extend(range(i * max_queries, i * max_queries + seg.count))
            out_rows.extend(range(row, row + seg.count))
            table = seg.block_table[:max_blocks]
            blocks.extend(table)
            blocks.extend([0] * (max_blocks - len(table)))

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        positions = as_tensor(query_positions).view(len(segments), 1, max_queries, 1)
        span = torch.arange(max_blocks * block_size, device=device)
        mask = span <= positions  # [n, 1, Q, max_blocks * block_size]
        for i, (_, seg) in enumerate(segments):
            if seg.hidden:
                mask[i, :, :, as_tensor(list(seg.hidden))] = False
        return cls(
            num_items=len(segments),
            max_queries=max_queries,
            query_index=as_tensor(query_index),
            out_index=as_tensor(out_index),
            out_rows=as_tensor(out_rows),
            blocks=as_tensor(blocks),
            mask=mask,
        )


@dataclass(frozen=True, slots=True)
class ChunkSpan:
    """A multi-row item: rows `rows` of the call at positions [start, end) of its plane, whose
    context is the blocks `blocks` (`ceil(end / block_size)` of them)."""

    rows: slice
    blocks: torch.Tensor
    start: int
    end: int


@dataclass
class PagedAttentionMetadata:
    write_slots: torch.Tensor  # [rows] the slot each row's K/V is written to
    block_size: int
    single: PaddedGroup | None  # one-row items (decode) outside cascade groups
    multi: list[ChunkSpan]  # multi-row items (prompt chunks)
    causal: dict[int, torch.Tensor]  # count -> [count, count] bool "may not attend" mask
    cascade: CascadePlan | None = None  # one-row items grouped by a shared prefix
    cascade_suffix: PaddedGroup | None = None  # their suffixes, one query per grouped row

    @classmethod
    def build(
        cls,
        segments: list[RowSegment],
        block_size: int,
        device,
        *,
        cascade: bool = False,
        prefix_groups: list | None = None,
    ) -> PagedAttentionMetadata:
        write_slots = write_slots_of(segments, block_size)
        single, multi, causal = [], [], {}
        row = 0
        for seg in segments:
            table, end = seg.block_table, seg.start + seg.count
            if seg.count == 1:
                single.append((row, seg))
            else:
                blocks = torch.tensor(table[: -(-end // block_size)], device=device)
                multi.append(ChunkSpan(slice(row, row + seg.count), blocks, seg.start, end))
                if seg.count not in causal:
                    ones = torch.ones(seg.count, seg.count, dtype=torch.bool, device=device)
                    causal[seg.count] = ones.triu(1)
            row += seg.count
        plan = suffix = None
        if cascade and len(single) > 1:
            groups = prefix_groups
            if groups is None:
                tables = [seg.block_table for _, seg in single]
                groups = plan_prefix_groups(tables, [seg.start for _, seg in single], block_size)
            if groups:
                plan = CascadePlan.build(groups, single, block_size, device)
                suffix = PaddedGroup.build(plan.suffixes, block_size, device)
                grouped = {index for group in groups for index in group.rows}
                single = [entry for index, entry in enumerate(single) if index not in grouped]
        return cls(
            write_slots=torch.tensor(write_slots, dtype=torch.int64, device=device),
            block_size=block_size,
            single=PaddedGroup.build(single, block_size, device) if single else None,
            multi=multi,
            causal=causal,
            cascade=plan,
            cascade_suffix=suffix,
        )


class Workspace:
    """Scratch memory reused by every core call for the K/V gathers (one flat buffer per name,
    grown by 25% steps when a call needs more). Gathers are the largest temporaries of a call
    (tens of MB for 64 decode rows); allocating them afresh each layer made the allocator hand
    pages back to the OS and fault them in again (about a million page faults per thousand
    decode steps on CPU). Its size is at most the largest gather seen: on CPU at most
    `max_num_seqs` contexts of one layer's K and V."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype:
            size = numel if buffer is None else max(numel, buffer.numel() * 5 // 4)
            buffer = torch.empty(size, dtype=like.dtype, device=like.device)
            self._buffers[name] = buffer
        return buffer[:numel].view(shape)

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def gather_blocks(
    workspace: Workspace,
    name: str,
    cache: torch.Tensor,
    blocks: torch.Tensor,
    block_size: int,
    like: torch.Tensor,
) -> torch.Tensor:
    """Whole blocks of one layer's K or V, [len(blocks), block_size, Hkv, Dh], in `like`'s
    dtype: a cache stored narrower (`kv_cache_dtype` fp8) is gathered, then widened exactly."""
    pieces = cache.view(-1, block_size, cache.shape[1], cache.shape[2])
    shape = (blocks.numel(), *pieces.shape[1:])
    out = workspace.take(name, shape, cache)
    torch.index_select(pieces, 0, blocks, out=out)
    if cache.dtype == like.dtype:
        return out
    return workspace.take(name + "_wide", shape, like).copy_(out)


class TorchPagedAttention:
    """`AttentionBackend` for one core call over the engine's paged KV tensor."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        metadata: PagedAttentionMetadata,
        scale: float,
        workspace: Workspace | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.meta = metadata
        self.scale = scale
        self.workspace = workspace if workspace is not None else Workspace()

    def _gather(self, name: str, cache: torch.Tensor, blocks: torch.Tensor,
                like: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Whole blocks of one layer's K or V: [len(blocks), block_size, Hkv, Dh], in `like`'s
        dtype."""
        return gather_blocks(self.workspace, name, cache, blocks, self.meta.block_size, like)

    def attend(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        key_cache, value_cache = self.kv_cache[layer_idx, 0], self.kv_cache[layer_idx, 1]
        key_cache[self.meta.write_slots] = to_storage(key, key_cache.dtype)
        value_cache[self.meta.write_slots] = to_storage(value, value_cache.dtype)
        single = self.meta.single
        if not self.meta.multi and self.meta.cascade is None:
            # decode-only call without groups: every row is a one-row item, in row order
            assert single is not None
            return self._attend_single(single, query, key_cache, value_cache)
        out = torch.empty_like(query)
        if self.meta.cascade is not None:
            plan = self.meta.cascade
            out[plan.rows] = self._attend_cascade(plan, query, key_cache, value_cache)
        if single is not None:
            padded = self._attend_single(single, query, key_cache, value_cache)
            out[single.out_rows] = padded[single.out_index]
        for span in self.meta.multi:
            out[span.rows] = self._attend_chunk(span, query[span.rows], key_cache, value_cache)
        return out

    def _attend_chunk(self, span: ChunkSpan, query, key_cache, value_cache) -> torch.Tensor:
        """[count, Hq, Dh] for one prompt chunk over its whole context (itself included)."""
        count, num_heads, head_dim = query.shape
        num_kv_heads = key_cache.shape[1]
        group = num_heads // num_kv_heads
        keys = self._gather("chunk_k", key_cache, span.blocks, query).view(
            -1, num_kv_heads, head_dim
        )
        values = self._gather("chunk_v", value_cache, span.blocks, query)
        values = values.view(-1, num_kv_heads, head_dim)[: span.end].transpose(0, 1)
        # Query heads of one KV head side by side: [Hkv, group * count, Dh].
        q = query.view(count, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        q = q.reshape(num_kv_heads, group * count, head_dim)
        scores = torch.matmul(q, keys[: span.end].permute(1, 2, 0)).mul_(self.scale)
        scores = scores.view(num_kv_heads, group, count, span.end)
        scores[..., span.start :].masked_fill_(self.meta.causal[count], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(probs.view(num_kv_heads, group * count, span.end), values)
        return (
            out.view(num_kv_heads, group, count, head_dim)
            .permute(2, 0, 1, 3)
            .reshape(count, num_heads, head_dim)
        )

    def _attend_cascade(self, plan: CascadePlan, query, key_cache, value_cache) -> torch.Tensor:
        """[grouped rows, Hq, Dh] in `plan.rows` order: each group's prefix K/V gathered once
        for all its queries, each row's suffix on its own, merged exactly."""
        num_heads = query.shape[1]
        num_kv_heads, head_dim = key_cache.shape[1], key_cache.shape[2]
        keys = self._gather("prefix_k", key_cache, plan.prefix_blocks, query)
        values = self._gather("prefix_v", value_cache, plan.prefix_blocks, query)
        prefix_out, prefix_lse = plan.attend_prefix(query, keys, values, self.scale)
        suffix = self.meta.cascade_suffix
        assert suffix is not None
        keys = self._gather("suffix_k", key_cache, suffix.blocks, query)
        values = self._gather("suffix_v", value_cache, suffix.blocks, query)
        context = (suffix.num_items, -1, num_kv_heads, head_dim)  # [R, suffix, Hkv, Dh]
        queries = query.index_select(0, suffix.query_index).view(suffix.num_items, 1, num_heads, -1)
        suffix_out, suffix_lse = attend_with_lse(
            queries, keys.view(context), values.view(context), suffix.mask, self.scale
        )
        merged = merge_partial(
            prefix_out,
            prefix_lse,
            suffix_out.reshape(-1, num_heads, head_dim),
            suffix_lse.reshape(-1, num_heads),
        )
        return merged.to(query.dtype)

    def _attend_single(self, group: PaddedGroup, query, key_cache, value_cache) -> torch.Tensor:
        """[num_items * max_queries, Hq, Dh]: gather whole blocks, then one fused SDPA."""
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = key_cache.shape[1]
        n, q = group.num_items, group.max_queries
        keys = self._gather("single_k", key_cache, group.blocks, query)
        values = self._gather("single_v", value_cache, group.blocks, query)
        context = (n, -1, num_kv_heads, head_dim)  # [n, C, Hkv, Dh]
        queries = query.index_select(0, group.query_index).view(n, q, num_heads, head_dim)
        out = torch.nn.functional.scaled_dot_product_attention(
            queries.transpose(1, 2),  # [n, Hq, Q, Dh] (strided views, no copies)
            keys.view(context).transpose(1, 2),  # [n, Hkv, C, Dh]
            values.view(context).transpose(1, 2),
            attn_mask=group.mask,
            scale=self.scale,
            enable_gqa=num_kv_heads != num_heads,
        )
        return out.transpose(1, 2).reshape(n * q, num_heads, head_dim)


class TorchBackend(PagedAttentionBackend):
    """The reference backend: `TorchPagedAttention` per call, an indexed copy for finalize.
    Runs on any device and dtype; one `Workspace` serves every call of the engine."""

    name = "torch"
    supports_cascade = True

    def __init__(
        self,
        kv_cache: torch.Tensor,
        *,
        block_size: int,
        scale: float,
        cascade: bool = False,
        transfers=None,
    ) -> None:
        super().__init__(
            kv_cache, block_size=block_size, scale=scale, cascade=cascade, transfers=transfers
        )
        self.workspace = Workspace()

    def prepare(self, segments, *, prefix_groups=None) -> TorchPagedAttention:
        meta = PagedAttentionMetadata.build(
            list(segments),
            self.block_size,
            self.kv_cache.device,
            cascade=self.cascade,
            prefix_groups=prefix_groups,
        )
        if meta.cascade is not None:
            self.cascade_stats.count(meta.cascade.groups, self.block_size)
        return TorchPagedAttention(self.kv_cache, meta, self.scale, self.workspace)

    def finalize(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        self.kv_cache[:, :, dst_slots] = self.kv_cache[:, :, src_slots]
