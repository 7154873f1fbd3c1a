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

import logging
from collections.abc import Callable

import torch

from loopserve.runner.attention.torch_paged import (
    PaddedGroup,
    PagedAttentionMetadata,
    TorchPagedAttention,
    Workspace,
)

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
            tables=graphs.block_tables[:rows],
            row_index=graphs.query_index[:rows],
            seq_lens=graphs.context_lens[:rows],
            max_seq_len=graphs.max_blocks * graphs.block_size,
        )

    return make


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
    ) -> None:
        self.core = core
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
        self.block_tables = torch.full((max_rows, self.max_blocks), dummy_block, device=device)
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
            blocks=self.block_tables[:rows].reshape(-1),
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

    def _load(self, hidden: torch.Tensor, positions: list[int], tables: list[list[int]]) -> int:
        """Copy n real rows into the static buffers, pad to the bucket; returns the bucket.

        Host work is proportional to the rows' real context blocks, not to `max_blocks`: the
        table buffer is reset to the dummy block on device and only the used entries are
        scattered in (flat index `row * max_blocks + column`), in one host-to-device copy."""
        n = len(positions)
        bucket = bucket_for(self.buckets, n)
        assert bucket is not None, f"{n} rows exceed the largest bucket {self.max_rows}"
        size, width, pad = self.block_size, self.max_blocks, bucket - n
        index: list[int] = []
        blocks: list[int] = []
        slots: list[int] = []
        for row, (position, table) in enumerate(zip(positions, tables)):
            used = position // size + 1
            index.extend(range(row * width, row * width + used))
            blocks.extend(table[:used])
            slots.append(table[used - 1] * size + position % size)
        host = torch.tensor(
            positions + [0] * pad + slots + [self.dummy_slot] * pad + index + blocks,
            dtype=torch.int64,
        ).to(self.device)
        self.positions[:bucket].copy_(host[:bucket])
        self.write_slots[:bucket].copy_(host[bucket : 2 * bucket])
        self.context_lens[:bucket].copy_(host[:bucket] + 1)
        self.block_tables[:bucket].fill_(self.dummy_block)
        used_entries = len(index)
        flat_index = host[2 * bucket : 2 * bucket + used_entries]
        self.block_tables.view(-1).index_copy_(0, flat_index, host[2 * bucket + used_entries :])
        self.hidden[:n].copy_(hidden)
        self.hidden[n:bucket].zero_()
        self.num_calls += 1
        self.num_padded_rows += pad
        return bucket

    def run(
        self, hidden: torch.Tensor, positions: list[int], tables: list[list[int]]
    ) -> torch.Tensor:
        """One decode core call of n rows: `hidden [n, H]`, each row's position and the block
        table of the plane it addresses. Returns the core's output `[n, H]` (a fresh tensor)."""
        bucket = self._load(hidden, positions, tables)
        graph = self.graphs.get(bucket)
        if graph is None:
            out = self._forward(bucket)
        else:
            graph.replay()
            out = self.outputs[bucket]
        return out[: len(positions)].clone()

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one CUDA graph per bucket, largest first, in one shared memory pool.

        Inputs during warm-up and capture are all padding rows (they write only the dummy
        block). Warm-up runs first on a side stream so lazy initialisation (cuBLAS handles,
        the attention workspace at its largest size) happens outside the capture; capturing
        the largest bucket first lets smaller graphs reuse its pool memory."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graph capture needs a CUDA device; use graph_mode=emulate")
        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.buckets, reverse=True):
            self.hidden[:bucket].zero_()
            self.positions[:bucket].zero_()
            self.write_slots[:bucket].fill_(self.dummy_slot)
            self.block_tables[:bucket].fill_(self.dummy_block)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(bucket)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._forward(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        self.num_calls = self.num_padded_rows = 0


def graph_max_context(attention, max_model_len: int) -> int:
    """Positions a graphed row may attend to: `max_model_len` over a paged kernel (it reads
    live context only); `GRAPH_MAX_CONTEXT` for the torch gather, which reads every row's
    whole table."""
    if hasattr(attention, "graph_call"):
        return max_model_len
    return min(max_model_len, GRAPH_MAX_CONTEXT)


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
    make_backend = paged_backend(attention) if hasattr(attention, "graph_call") else torch_backend
    graphs = DecodeGraphs(
        core,
        kv_cache,
        capture=False,
        make_backend=make_backend,
        max_context=graph_max_context(attention, max_model_len),
        **kwargs,
    )
    if graph_mode == "capture":
        try:
            graphs.capture()
        except Exception as err:  # keep serving eagerly; say why, once, loudly
            logger.exception("CUDA graph capture failed; decode runs eagerly")
            return None, f"{type(err).__name__}: {err}"
    return graphs, None
