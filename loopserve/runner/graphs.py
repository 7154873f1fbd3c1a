"""Decode core calls through static, row-bucketed buffers; captured as CUDA graphs on CUDA.

A looped model runs the same core weights at every loop, so one captured core call per
row-count bucket serves every depth: which plane a row reads and writes is data (its block
table and write slot), not part of the graph. `DecodeGraphs` holds, once per engine:

- static inputs sized for the largest bucket, shared by every bucket as leading views:
  `hidden [R, H]`, `positions [R]`, `write_slots [R]`, `block_tables [R, max_blocks]`
  (`max_blocks = ceil(max_context / block_size)`, padded with the dummy block) and
  `context_lens [R]` (position + 1; what a paged-attention kernel needs to skip the padded
  tail of a table; the torch backend masks by position instead);
- buckets 1, 2, 4, 8, 16, 24, 32, ... (multiples of 8) up to `max_rows` (`max_num_seqs`,
  always its own bucket); a call of n rows runs in the smallest bucket >= n;
- a context bound `max_context = min(max_model_len, GRAPH_MAX_CONTEXT)`: the torch backend
  gathers `max_blocks` blocks per row inside a graph (fixed shapes), so an unbounded context
  would cost `rows x max_model_len` K/V per layer (tens of GB for long-context models); calls
  with a row at a position >= `max_context` run eagerly;
- padding rows: zero hidden, position 0, a block table of only the dummy block and a write
  slot in it. The dummy block is one block past the scheduler's pool (`num_blocks`), owned by
  the runner: padding rows write there and attend only to what they just wrote, so they never
  touch a real request's K/V. Their outputs are dropped.

Modes: `emulate` runs the static function eagerly on the padded buffers (any device; CPU
tests prove that padding and buffers change no output); `capture` records one
`torch.cuda.CUDAGraph` per bucket at start-up (largest first, after two warm-up runs on a side
stream, all graphs in one shared memory pool) and replays it. Calls above the largest bucket
and every call with prompt rows or a longer context run eagerly (the caller checks `fits`).
"""

from __future__ import annotations

import gc
import logging
from collections import OrderedDict
from collections.abc import Callable

import torch

from loopserve.runner.attention.torch_paged import (
    PaddedGroup,
    PagedAttentionMetadata,
    TorchPagedAttention,
    Workspace,
)
from loopserve.runner.transfers import Transfers

GRAPH_MAX_CONTEXT = 2048  # positions a graphed decode row may attend to (see the docstring)


logger = logging.getLogger(__name__)


def graph_buckets(max_rows: int) -> tuple[int, ...]:
    """Row-count buckets: 1, 2, 4, 8, then multiples of 8, up to and including `max_rows`."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    candidates = [1, 2, 4, 8, *range(16, max_rows, 8)]
    return (*(b for b in candidates if b < max_rows), max_rows)


def bucket_for(buckets: tuple[int, ...], rows: int) -> int | None:
    """The smallest bucket that holds `rows`, or None above the largest."""
    for bucket in buckets:
        if bucket >= rows:
            return bucket
    return None


CoreFn = Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor]
# (graphs, rows) -> the attention backend of one static call over the first `rows` rows of the
# static buffers. It must read only device tensors (no host data) so that it can be captured;
# a paged-attention kernel reads `block_tables[:rows]`, `context_lens[:rows]`,
# `positions[:rows]` and `write_slots[:rows]`.
BackendFn = Callable[["DecodeGraphs", int], object]


def torch_backend(graphs: DecodeGraphs, rows: int) -> TorchPagedAttention:
    """The torch reference backend over the static buffers (`DecodeGraphs.metadata`); it
    gathers all `max_blocks` blocks of every row (the CPU emulation of the buffers)."""
    return TorchPagedAttention(
        graphs.kv_cache, graphs.metadata(rows), graphs.scale, graphs.workspace
    )


def paged_backend(attention) -> BackendFn:
    """A paged-kernel backend over the static buffers: `attention.graph_call` (the Triton
    backend) reads each row's block table up to its `context_lens` entry, so a graphed row
    reads only its live K/V."""

    def make(graphs: DecodeGraphs, rows: int):
        return attention.graph_call(
            write_slots=graphs.write_slots[:rows],
            tables=graphs.block_tables,
            table_index=graphs.table_index[:rows],
            row_index=graphs.query_index[:rows],
            seq_lens=graphs.context_lens[:rows],
            max_seq_len=graphs.max_blocks * graphs.block_size,
        )

    return make


class TableRows:
    """Which persistent table row holds which (request_id, plane), and how many entries of it
    are written. Host bookkeeping only; rows are reused least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._rows: OrderedDict[tuple[str, int], list[int]] = OrderedDict()  # [row, written, last]
        self._free = list(range(capacity - 1, -1, -1))

    def row_for(self, key: tuple[str, int], table: list[int], used: int) -> tuple[int, int]:
        """(row, entries already written) for a table of which `used` entries are needed. A
        table that no longer starts the way it was written (its blocks were replaced) is
        written again from its first entry."""
        entry = self._rows.get(key)
        if entry is None:
            if not self._free:
                _, evicted = self._rows.popitem(last=False)
                self._free.append(evicted[0])
            entry = self._rows[key] = [self._free.pop(), 0, -1]
        else:
            self._rows.move_to_end(key)
        row, written, last = entry
        if written and (written > len(table) or table[written - 1] != last):
            written = 0
        if written < used:
            entry[1], entry[2] = used, table[used - 1]
        return row, written

    def release(self, request_id: str) -> None:
        for key in [key for key in self._rows if key[0] == request_id]:
            self._free.append(self._rows.pop(key)[0])

    def clear(self) -> None:
        while self._rows:
            self._free.append(self._rows.popitem()[1][0])


class DecodeGraphs:
    def __init__(
        self,
        core: CoreFn,
        kv_cache: torch.Tensor,
        *,
        hidden_size: int,
        block_size: int,
        max_context: int,
        max_rows: int,
        dummy_block: int,
        scale: float,
        capture: bool,
        make_backend: BackendFn = torch_backend,
        num_planes: int = 1,
        transfers: Transfers | None = None,
    ) -> None:
        self.core = core
        self.transfers = transfers or Transfers(kv_cache.device)
        self.make_backend = make_backend
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.scale = scale
        self.buckets = graph_buckets(max_rows)
        self.max_rows = max_rows
        self.max_blocks = -(-max_context // block_size)
        self.dummy_block = dummy_block
        self.dummy_slot = dummy_block * block_size
        device, dtype = kv_cache.device, kv_cache.dtype
        self.device = device
        self.hidden = torch.zeros(max_rows, hidden_size, dtype=dtype, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.write_slots = torch.full((max_rows,), self.dummy_slot, device=device)
        # Persistent block tables: one row per (request, plane) seen lately (`TableRows`),
        # plus a last row of only the dummy block for padding rows. A call sends only the
        # entries its rows' tables gained since they were last written.
        self.table_rows = TableRows(max_rows * num_planes + max_rows)
        self.padding_table = self.table_rows.capacity
        self.block_tables = torch.full(
            (self.table_rows.capacity + 1, self.max_blocks), dummy_block, device=device
        )
        self.table_index = torch.full((max_rows,), self.padding_table, device=device)
        self.context_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        self.query_index = torch.arange(max_rows, device=device)
        self.paged = make_backend is not torch_backend
        # The torch backend's position mask, [max_blocks * block_size]; paged kernels need none.
        self.span = torch.arange(0 if self.paged else self.max_blocks * block_size, device=device)
        self.workspace = Workspace()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_calls = 0  # calls run through the static buffers (replays or emulated)
        self.num_padded_rows = 0
        if capture:
            self.capture()

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def fits(self, rows: int, max_position: int) -> bool:
        """True when a decode call of `rows` rows, the deepest at `max_position`, can run
        through the static buffers."""
        return rows <= self.max_rows and max_position < self.max_blocks * self.block_size

    def metadata(self, rows: int) -> PagedAttentionMetadata:
        """Torch-backend metadata computed on device from the static buffers (no host data,
        so it is capturable): one query per row over `max_blocks` blocks, masked by position."""
        positions = self.positions[:rows].view(rows, 1, 1, 1)
        index = self.query_index[:rows]
        group = PaddedGroup(
            num_items=rows,
            max_queries=1,
            query_index=index,
            out_index=index,
            out_rows=index,
            blocks=self.block_tables[self.table_index[:rows]].reshape(-1),
            mask=self.span <= positions,
        )
        return PagedAttentionMetadata(
            write_slots=self.write_slots[:rows],
            block_size=self.block_size,
            single=group,
            multi=[],
            causal={},
        )

    def _forward(self, rows: int) -> torch.Tensor:
        attn = self.make_backend(self, rows)
        return self.core(self.hidden[:rows], self.positions[:rows], attn)

    def load(
        self,
        hidden: torch.Tensor,
        positions: list[int],
        tables: list[list[int]],
        keys: list[tuple[str, int]] | None = None,
    ) -> int:
        """Copy n real rows into the static buffers, pad to the bucket; returns the bucket.

        `keys[i]` names row i's table, (request_id, plane): its persistent table row keeps
        the entries written by earlier calls, so host work and the copy are proportional to
        the rows plus the entries their tables gained (a new block every `block_size`
        positions), not to their contexts. One host-to-device copy carries positions, write
        slots, table rows and the new entries; the hidden rows are a device-to-device copy."""
        n = len(positions)
        bucket = bucket_for(self.buckets, n)
        assert bucket is not None, f"{n} rows exceed the largest bucket {self.max_rows}"
        if keys is None:
            keys = [("", row) for row in range(n)]  # anonymous rows: tables written afresh
            self.table_rows.clear()
        size, width, pad = self.block_size, self.max_blocks, bucket - n
        slots: list[int] = []
        rows: list[int] = []
        index: list[int] = []
        blocks: list[int] = []
        table_rows = self.table_rows
        for key, position, table in zip(keys, positions, tables):
            used = position // size + 1
            row, written = table_rows.row_for(key, table, used)
            if written < used:
                index.extend(range(row * width + written, row * width + used))
                blocks.extend(table[written:used])
            rows.append(row)
            slots.append(table[used - 1] * size + position % size)
        host = self.transfers.to_device(
            positions + [0] * pad + slots + [self.dummy_slot] * pad
            + rows + [self.padding_table] * pad + index + blocks
        )  # fmt: skip
        self.positions[:bucket].copy_(host[:bucket])
        self.write_slots[:bucket].copy_(host[bucket : 2 * bucket])
        self.table_index[:bucket].copy_(host[2 * bucket : 3 * bucket])
        self.context_lens[:bucket].copy_(host[:bucket] + 1)
        if index:
            start = 3 * bucket
            flat = host[start : start + len(index)]
            self.block_tables.view(-1).index_copy_(0, flat, host[start + len(index) :])
        self.hidden[:n].copy_(hidden)
        self.hidden[n:bucket].zero_()
        self.num_calls += 1
        self.num_padded_rows += pad
        return bucket

    def release(self, request_id: str) -> None:
        """Forget a request's table rows (finished, preempted or swapped: its blocks change)."""
        self.table_rows.release(request_id)

    def run(
        self, hidden: torch.Tensor, positions: list[int], tables: list[list[int]]
    ) -> torch.Tensor:
        """One decode core call of n rows: `hidden [n, H]`, each row's position and the block
        table of the plane it addresses. Returns the core's output `[n, H]` (a fresh tensor)."""
        bucket = self.load(hidden, positions, tables)
        return self.launch(bucket, len(positions))

    def launch(self, bucket: int, rows: int) -> torch.Tensor:
        """Replay (or, emulated, run) the bucket's call over the loaded buffers; the first
        `rows` outputs, as a fresh tensor."""
        graph = self.graphs.get(bucket)
        if graph is None:
            out = self._forward(bucket)
        else:
            graph.replay()
            out = self.outputs[bucket]
        return out[:rows].clone()

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one CUDA graph per bucket, largest first, in one shared memory pool.

        Inputs during warm-up and capture are all padding rows (they write only the dummy
        block). Warm-up runs first on one side stream (created once, so no stream per bucket
        keeps cached memory outside the plan) so lazy initialisation (cuBLAS handles, Triton
        compiles, the attention workspace at its largest size) happens outside the capture;
        capturing the largest bucket first lets smaller graphs reuse its pool memory.
        Garbage collection is off during capture (a collection could free tensors whose
        memory the graph is recording), and everything runs under the engine's device, so a
        `cuda:1` engine captures on its own GPU."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graph capture needs a CUDA device; use graph_mode=emulate")
        gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            with torch.cuda.device(self.device):
                pool = torch.cuda.graph_pool_handle()
                stream = torch.cuda.Stream(self.device)
                for bucket in sorted(self.buckets, reverse=True):
                    self.hidden[:bucket].zero_()
                    self.positions[:bucket].zero_()
                    self.write_slots[:bucket].fill_(self.dummy_slot)
                    self.table_index[:bucket].fill_(self.padding_table)
                    stream.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(stream):
                        for _ in range(2):
                            self._forward(bucket)
                    torch.cuda.current_stream(self.device).wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self.outputs[bucket] = self._forward(bucket)
                    self.graphs[bucket] = graph
                torch.cuda.synchronize(self.device)
        finally:
            if gc_was_enabled:
                gc.enable()
        self.num_calls = self.num_padded_rows = 0


def graph_max_context(paged: bool, max_model_len: int) -> int:
    """Positions a graphed row may attend to: `max_model_len` over a paged kernel (it reads
    live context only); `GRAPH_MAX_CONTEXT` for the torch gather, which reads every row's
    whole table."""
    return max_model_len if paged else min(max_model_len, GRAPH_MAX_CONTEXT)


def build_decode_graphs(
    graph_mode: str, core, kv_cache: torch.Tensor, *, attention, max_model_len: int, **kwargs
) -> tuple[DecodeGraphs | None, str | None]:
    """The runner's decode graphs for `graph_mode` ('off': none; 'emulate': static buffers,
    run eagerly; 'capture': CUDA graphs) and the capture error, if capturing failed (decode
    then runs eagerly: the failure is logged once, loudly, and reported, not raised).
    `attention` is the runner's backend: one with `graph_call` (Triton) runs inside the
    graphs over the static buffers; otherwise the torch gather does."""
    if graph_mode == "off":
        return None, None
    paged = hasattr(attention, "graph_call")
    graphs = DecodeGraphs(
        core,
        kv_cache,
        capture=False,
        make_backend=paged_backend(attention) if paged else torch_backend,
        max_context=graph_max_context(paged, max_model_len),
        **kwargs,
    )
    if graph_mode == "capture":
        try:
            graphs.capture()
        except Exception as err:  # keep serving eagerly; say why, once, loudly
            logger.exception("CUDA graph capture failed; decode runs eagerly")
            return None, f"{type(err).__name__}: {err}"
    return graphs, None
