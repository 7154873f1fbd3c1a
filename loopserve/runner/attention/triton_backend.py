"""The `triton` attention backend: per-call metadata for the kernels in `triton_kernels`.

`TritonBackend.prepare` turns a core call's `RowSegment`s into small int32 tensors once per
call (every layer reuses them): the write slots; one block table per item (truncated to the
blocks the item reads); the decode rows (one-row items) with their table and context length;
and the prompt tiles (up to `block_m` consecutive rows of one multi-row item). Each layer then
costs three launches: KV write, decode attention (plus its split-K reduce), prompt attention.
`finalize` is one launch for every exiting row and every layer.

Cascade attention (`cascade=True`): one-row items that share leading blocks of a plane
(`prefix_groups.plan_prefix_groups`) leave the plain decode launch. Their shared prefix is
gathered once per group and attended by all the group's queries in torch matmuls
(`CascadePlan.attend_prefix`); their suffixes run through the same decode kernel over the
tables shifted past the prefix, which also returns each row's log-sum-exp (its split-and-reduce
path); the two halves are merged by log-sum-exp in float32.

Eager calls rebuild the metadata on the host per call. Graphed decode calls
(`TritonBackend.graph_call`) read it from the static buffers of `runner.graphs.DecodeGraphs`
instead: block tables as wide as `max_model_len`, the context lengths, the write slots, and
a split count fixed per bucket at capture. The kernel's loop stops at each row's own context
length, so a graphed row reads only its live K/V whatever the table width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loopserve.runner.attention import triton_kernels as kernels
from loopserve.runner.attention import triton_prefill
from loopserve.runner.attention.base import PagedAttentionBackend, RowSegment, write_slots_of
from loopserve.runner.attention.cascade import CascadePlan, merge_partial
from loopserve.runner.attention.prefix_groups import plan_prefix_groups
from loopserve.runner.transfers import Staged, Transfers

SPLIT_COUNTERS = 4096  # (row, KV head) pairs a splitting decode launch may merge in-launch


@dataclass(frozen=True)
class TritonCallMetadata:
    write_slots: torch.Tensor  # [rows] int64
    tables: torch.Tensor  # [num_items, max_blocks] int32, padded with block 0
    decode_rows: torch.Tensor  # [num_decode] int32: call row of each one-row item
    decode_table: torch.Tensor  # [num_decode] int32: its row in `tables`
    decode_seq_lens: torch.Tensor  # [num_decode] int32: position + 1
    max_decode_seq_len: int
    tile_table: torch.Tensor  # [num_tiles] int32
    tile_row: torch.Tensor  # [num_tiles] int32: first call row of the tile
    tile_pos: torch.Tensor  # [num_tiles] int32: its position
    tile_count: torch.Tensor  # [num_tiles] int32: rows in the tile (<= block_m)
    cascade: CascadePlan | None = None  # one-row items grouped by a shared prefix
    suffix: SuffixRows | None = None  # their suffixes, for the decode kernel
    # Fixed decode split length (graphed calls fix it per bucket at capture); None: chosen
    # per call from the rows and `max_decode_seq_len`.
    decode_split_len: int | None = None

    @classmethod
    def build(
        cls,
        segments: Sequence[RowSegment],
        block_size: int,
        block_m: int,
        transfers: Transfers,
        *,
        cascade: bool = False,
        prefix_groups: list | None = None,
    ) -> TritonCallMetadata:
        """Every integer of the call's metadata goes to the device in one staged copy (the
        cascade parts, when rows share a prefix, in copies of their own)."""
        device = transfers.device
        num_blocks = [-(-(seg.start + seg.count) // block_size) for seg in segments]
        width = max(num_blocks)
        tables: list[int] = []
        decode: list[tuple[int, int, int]] = []  # (row, table, seq_len)
        tiles: list[tuple[int, int, int, int]] = []  # (table, row, pos, count)
        row = 0
        for index, (seg, needed) in enumerate(zip(segments, num_blocks)):
            tables.extend(seg.block_table[:needed])
            tables.extend([0] * (width - needed))
            if seg.count == 1:
                decode.append((row, index, seg.start + 1))
            else:
                for offset in range(0, seg.count, block_m):
                    count = min(block_m, seg.count - offset)
                    tiles.append((index, row + offset, seg.start + offset, count))
            row += seg.count

        plan = suffix = None
        if cascade and len(decode) > 1:
            singles = [(row, segments[index]) for row, index, _ in decode]
            groups = prefix_groups
            if groups is None:
                tables_of = [seg.block_table for _, seg in singles]
                starts = [seg.start for _, seg in singles]
                groups = plan_prefix_groups(tables_of, starts, block_size)
            if groups:
                plan = CascadePlan.build(groups, singles, block_size, device)
                suffix = SuffixRows.build(plan.suffixes, block_size, transfers)
                grouped = {index for group in groups for index in group.rows}
                decode = [entry for index, entry in enumerate(decode) if index not in grouped]

        decode_cols = list(zip(*decode)) if decode else [(), (), ()]
        tile_cols = list(zip(*tiles)) if tiles else [(), (), (), ()]
        staged = Staged()
        staged.add(write_slots_of(segments, block_size))
        for values in (tables, *decode_cols, *tile_cols):
            staged.add(values)
        write_slots, *small = staged.send(transfers)  # the call's metadata: one copy
        table_t, rows_t, table_idx_t, lens_t, tile_table_t, tile_row_t, tile_pos_t, count_t = (
            part.to(torch.int32) for part in small
        )
        return cls(
            write_slots=write_slots,
            tables=table_t.view(len(segments), width),
            decode_rows=rows_t,
            decode_table=table_idx_t,
            decode_seq_lens=lens_t,
            max_decode_seq_len=max(decode_cols[2], default=0),
            tile_table=tile_table_t,
            tile_row=tile_row_t,
            tile_pos=tile_pos_t,
            tile_count=count_t,
            cascade=plan,
            suffix=suffix,
        )


@dataclass(frozen=True)
class SuffixRows:
    """Grouped rows past their shared prefix, as decode-kernel inputs: row i reads positions
    [0, seq_lens[i]) of `tables[i]` (its table without the prefix blocks)."""

    rows: torch.Tensor  # [R] int32: call rows
    tables: torch.Tensor  # [R, max_blocks] int32, padded with block 0
    table_idx: torch.Tensor  # [R] int32: 0..R-1
    seq_lens: torch.Tensor  # [R] int32: suffix length (position - prefix_len + 1)
    max_seq_len: int

    @classmethod
    def build(
        cls, suffixes: list[tuple[int, RowSegment]], block_size: int, transfers: Transfers
    ) -> SuffixRows:
        seq_lens = [seg.start + 1 for _, seg in suffixes]
        width = -(-max(seq_lens) // block_size)
        tables: list[int] = []
        for (_, seg), length in zip(suffixes, seq_lens):
            needed = -(-length // block_size)
            tables.extend(seg.block_table[:needed])
            tables.extend([0] * (width - needed))

        staged = Staged()
        for values in ([row for row, _ in suffixes], tables, range(len(suffixes)), seq_lens):
            staged.add(values)
        rows, table, table_idx, lens = (part.to(torch.int32) for part in staged.send(transfers))
        return cls(
            rows=rows,
            tables=table.view(len(suffixes), width),
            table_idx=table_idx,
            seq_lens=lens,
            max_seq_len=max(seq_lens),
        )


def auto_split_len(
    num_rows: int, num_kv_heads: int, max_seq_len: int, num_sms: int, *, min_split: int = 128
) -> int:
    """Positions per decode split so that (rows x KV heads x splits) programs fill about two
    waves of `num_sms` multiprocessors, never splitting below `min_split` positions (below
    that the reduce costs more than the parallelism gains). >= max_seq_len means one split."""
    programs = max(1, num_rows * num_kv_heads)
    wanted = -(-2 * num_sms // programs)
    splits = max(1, min(wanted, max_seq_len // min_split))
    return -(-max_seq_len // splits) if max_seq_len else min_split


class TritonAttention:
    """The per-call object the model's layers call (`AttentionBackend` protocol)."""

    def __init__(self, backend: TritonBackend, meta: TritonCallMetadata) -> None:
        self.backend = backend
        self.meta = meta

    def attend(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        backend, meta = self.backend, self.meta
        key_cache = backend.kv_cache[layer_idx, 0]  # [slots, Hkv, Dh]
        value_cache = backend.kv_cache[layer_idx, 1]
        kernels.write_kv(
            key,
            value,
            key_cache,
            value_cache,
            meta.write_slots,
            rows_per_program=backend.write_rows,
        )
        return self._attend_cached(query, key_cache, value_cache)

    def attend_rotated(self, layer_idx: int, qkv: torch.Tensor, rotate) -> torch.Tensor:
        """`attend` of a merged projection whose fused rotary writes rotated K and V into
        the caches itself (`AttentionBackend.attend_rotated`): one launch for both (into an
        8-bit cache, its bytes: `fp8_bits`)."""
        key_cache = self.backend.kv_cache[layer_idx, 0]
        value_cache = self.backend.kv_cache[layer_idx, 1]
        query, _, _ = rotate(qkv, cache=(key_cache, value_cache, self.meta.write_slots))
        return self._attend_cached(query, key_cache, value_cache)

    def _attend_cached(self, query, key_cache, value_cache) -> torch.Tensor:
        """Every row's attention over the caches, this call's K/V already written."""
        backend, meta = self.backend, self.meta
        out = torch.empty_like(query)
        kernels.decode_attention(
            query,
            key_cache,
            value_cache,
            out,
            tables=meta.tables,
            table_idx=meta.decode_table,
            rows=meta.decode_rows,
            seq_lens=meta.decode_seq_lens,
            max_seq_len=meta.max_decode_seq_len,
            scale=backend.scale,
            block_size=backend.block_size,
            split_len=backend.decode_split_len(meta),
            block_n=backend.decode_block_n,
            counters=backend.split_counters,
        )
        triton_prefill.prefill_attention(
            query,
            key_cache,
            value_cache,
            out,
            tables=meta.tables,
            tile_table=meta.tile_table,
            tile_row=meta.tile_row,
            tile_pos=meta.tile_pos,
            tile_count=meta.tile_count,
            scale=backend.scale,
            block_size=backend.block_size,
            block_m=backend.prefill_block_m,
            block_n=backend.prefill_block_n,
            **backend.prompt_options,
        )
        if meta.cascade is not None:
            out[meta.cascade.rows] = self._attend_cascade(query, key_cache, value_cache)
        return out

    def _attend_cascade(self, query, key_cache, value_cache) -> torch.Tensor:
        """[grouped rows, Hq, Dh] in `cascade.rows` order: prefix once per group (torch),
        suffix through the decode kernel with its log-sum-exp, merged in float32."""
        backend, plan, suffix = self.backend, self.meta.cascade, self.meta.suffix
        assert plan is not None and suffix is not None
        pieces = (-1, backend.block_size, key_cache.shape[1], key_cache.shape[2])
        keys = key_cache.view(pieces).index_select(0, plan.prefix_blocks).to(query.dtype)
        values = value_cache.view(pieces).index_select(0, plan.prefix_blocks).to(query.dtype)
        prefix_out, prefix_lse = plan.attend_prefix(query, keys, values, backend.scale)
        suffix_out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
        suffix_lse = torch.empty(
            (suffix.rows.numel(), query.shape[1]), dtype=torch.float32, device=query.device
        )
        kernels.decode_attention(
            query,
            key_cache,
            value_cache,
            suffix_out,
            tables=suffix.tables,
            table_idx=suffix.table_idx,
            rows=suffix.rows,
            seq_lens=suffix.seq_lens,
            max_seq_len=suffix.max_seq_len,
            scale=backend.scale,
            block_size=backend.block_size,
            split_len=backend.split_len_for(suffix.rows.numel(), suffix.max_seq_len),
            block_n=backend.decode_block_n,
            lse_out=suffix_lse,
        )
        merged = merge_partial(prefix_out, prefix_lse, suffix_out[plan.rows], suffix_lse)
        return merged.to(query.dtype)


class TritonBackend(PagedAttentionBackend):
    """Paged attention with Triton kernels (CUDA, or CPU under `TRITON_INTERPRET=1`).

    `split_len`: context positions per decode split; a decode call whose longest context
    exceeds it runs flash-decoding with `ceil(max_len / split_len)` splits. None: chosen per
    call by `auto_split_len` (few rows with long contexts split; full batches do not). Tile sizes are
    kernel launch parameters (powers of two; `prefill_block_*` >= 16 for `tl.dot`)."""

    name = "triton"
    supports_cascade = True

    def __init__(
        self,
        kv_cache: torch.Tensor,
        *,
        block_size: int,
        scale: float,
        split_len: int | None = None,
        decode_block_n: int | None = None,
        prefill_block_m: int | None = None,
        prefill_block_n: int | None = None,
        cascade: bool = False,
        transfers: Transfers | None = None,
    ) -> None:
        super().__init__(
            kv_cache, block_size=block_size, scale=scale, cascade=cascade, transfers=transfers
        )
        assert kv_cache.is_contiguous()
        tile_m, tile_n, decode_n = self.tile_sizes(kv_cache.device.type, kv_cache.dtype)
        self.write_rows = kernels.write_rows_for(kv_cache.device.type)
        self.split_len = split_len  # None: `auto_split_len` per call
        device = kv_cache.device
        # Zeros the decode launch's splits count on to merge in the launch (it leaves them
        # zeros; a graph replays with the same buffer). Calls that split have few rows.
        self.split_counters = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)
        # multiprocessors to fill; on CPU (interpreter) a nominal count keeps the same logic
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 4
        )
        capability = 0
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            capability = 10 * major + minor
        self.prompt_options = triton_prefill.prompt_launch_options(capability)
        self.decode_block_n = decode_block_n or decode_n
        self.prefill_block_m = prefill_block_m or tile_m
        self.prefill_block_n = prefill_block_n or tile_n

    @staticmethod
    def tile_sizes(device_type: str, dtype: torch.dtype) -> tuple[int, int, int]:
        """(prompt tile rows, prompt tile positions, decode positions per step).

        The interpreter (CPU) pays per element of a tile: 16-wide tiles suit its short
        contexts. On CUDA 64-wide prompt tiles keep loads coalesced; in fp32 at head_dim 128
        they spill to the stack (ahead-of-time compiles, `triton_aot`), 32x32 do not. Decode
        holds a [group, block_n, head_dim] float32 product per step: at most 32 positions,
        fewer for wide groups (`triton_kernels.decode_block_n`)."""
        if device_type == "cpu":
            return 16, 16, 16
        tile = 32 if dtype == torch.float32 else 64
        return tile, tile, 32

    def decode_split_len(self, meta: TritonCallMetadata) -> int:
        if meta.decode_split_len is not None:
            return meta.decode_split_len
        return self.split_len_for(meta.decode_rows.numel(), meta.max_decode_seq_len)

    def graph_call(
        self,
        *,
        write_slots: torch.Tensor,
        tables: torch.Tensor,
        table_index: torch.Tensor,
        row_index: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
    ) -> TritonAttention:
        """A decode-only call over static device buffers (capturable: no host data is read).
        Row i is call row `row_index[i]`, reads `tables[table_index[i]]` up to `seq_lens[i]`.
        The split length is fixed from the row count and `max_seq_len` (the buffers' bound),
        so the launch grid never depends on the live contexts."""
        rows = row_index.numel()
        empty = row_index[:0].to(torch.int32)
        meta = TritonCallMetadata(
            write_slots=write_slots,
            tables=tables,
            decode_rows=row_index,
            decode_table=table_index,
            decode_seq_lens=seq_lens,
            max_decode_seq_len=max_seq_len,
            tile_table=empty,
            tile_row=empty,
            tile_pos=empty,
            tile_count=empty,
            decode_split_len=self.split_len_for(rows, max_seq_len),
        )
        return TritonAttention(self, meta)

    def split_len_for(self, num_rows: int, max_len: int) -> int:
        if self.split_len is not None:
            return self.split_len
        return auto_split_len(num_rows, self.kv_cache.shape[3], max_len, self.num_sms)

    def prepare(
        self, segments: Sequence[RowSegment], *, prefix_groups: list | None = None
    ) -> TritonAttention:
        meta = TritonCallMetadata.build(
            segments,
            self.block_size,
            self.prefill_block_m,
            self.transfers,
            cascade=self.cascade,
            prefix_groups=prefix_groups,
        )
        if meta.cascade is not None:
            self.cascade_stats.count(meta.cascade.groups, self.block_size)
        return TritonAttention(self, meta)

    def finalize(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        kernels.copy_slots(self.kv_cache, src_slots, dst_slots)
