"""The decode graphs' static plumbing: row buckets, each plane set's static buffers, and the
attention backends a captured step builds over them (`runner/graphs.py` runs the step).

A call of n decode rows runs in the smallest bucket >= n (1, 2, 4, 8, then multiples of 8 up
to `max_rows`). A plane set's buffers (`PlaneBuffers`) hold its rows' write slots, table rows
and read lengths; a backend (`BackendFn`) turns them into one static attention call that
reads only device tensors, so it can be captured: the torch gather (`torch_backend`, every
row's `max_blocks` blocks masked by position: the CPU emulation) or a paged kernel's
`graph_call` (`paged_backend`: each row reads up to its own length).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from loopserve.runner.attention.torch_paged import (
    PaddedGroup,
    PagedAttentionMetadata,
    TorchPagedAttention,
)

GRAPH_MAX_CONTEXT = 2048  # positions a graphed row may attend to over the torch gather


class DecodeGraphs(Protocol):
    """What a backend reads of the decode graphs (`runner.graphs.DecodeGraphs`): the static
    buffers every plane set shares."""

    kv_cache: torch.Tensor
    positions: torch.Tensor  # [max_rows] int64
    context_lens: torch.Tensor  # [max_rows] int32
    query_index: torch.Tensor  # arange(max_rows)
    block_tables: torch.Tensor  # [table rows, max_blocks]
    span: torch.Tensor  # the torch gather's position mask
    block_size: int
    max_blocks: int
    scale: float
    workspace: object


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
# (graphs, rows, plane buffers) -> the attention backend of one static call over the first
# `rows` rows of the static buffers, in the planes the buffers name (`PlaneBuffers`: the rows'
# write slots and table rows; the loop planes' for the core, a once plane's for a family's
# prelude and coda). It must read only device tensors (no host data) so that it can be
# captured; a paged-attention kernel reads `block_tables[:rows]`, `context_lens[:rows]`,
# `positions[:rows]` and `write_slots[:rows]`.
BackendFn = Callable[["DecodeGraphs", int, "PlaneBuffers"], object]


class PlaneBuffers:
    """Static write slots, table rows and read lengths of a graphed call's rows in one set of
    planes. `seq_lens`: positions each row reads (a paged kernel reads no further); the loop
    planes share the call's context lengths, a once plane's rows that do not keep its
    output read one position (their output is dropped: a prelude of a row that resumes, a
    coda of a row that is no candidate)."""

    def __init__(
        self, max_rows: int, dummy_slot: int, padding_row: int, device, seq_lens=None
    ) -> None:
        self.write_slots = torch.full((max_rows,), dummy_slot, device=device)
        self.table_index = torch.full((max_rows,), padding_row, device=device)
        if seq_lens is None:
            seq_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        self.seq_lens = seq_lens


def torch_backend(graphs: DecodeGraphs, rows: int, planes: PlaneBuffers) -> TorchPagedAttention:
    """The torch reference backend over the static buffers (`torch_metadata`); it
    gathers all `max_blocks` blocks of every row (the CPU emulation of the buffers)."""
    return TorchPagedAttention(
        graphs.kv_cache, torch_metadata(graphs, rows, planes), graphs.scale, graphs.workspace
    )


def paged_backend(attention) -> BackendFn:
    """A paged-kernel backend over the static buffers: `attention.graph_call` (the Triton
    backend) reads each row's block table up to its `context_lens` entry, so a graphed row
    reads only its live K/V."""

    def make(graphs: DecodeGraphs, rows: int, planes: PlaneBuffers):
        return attention.graph_call(
            write_slots=planes.write_slots[:rows],
            tables=graphs.block_tables,
            table_index=planes.table_index[:rows],
            row_index=graphs.query_index[:rows],
            seq_lens=planes.seq_lens[:rows],
            max_seq_len=graphs.max_blocks * graphs.block_size,
        )

    return make


def torch_metadata(graphs: DecodeGraphs, rows: int, planes: PlaneBuffers) -> PagedAttentionMetadata:
    """Torch-backend metadata computed on device from the static buffers (no host data, so it
    is capturable): one query per row over `max_blocks` blocks, masked by position."""
    positions = graphs.positions[:rows].view(rows, 1, 1, 1)
    index = graphs.query_index[:rows]
    group = PaddedGroup(
        num_items=rows,
        max_queries=1,
        query_index=index,
        out_index=index,
        out_rows=index,
        blocks=graphs.block_tables[planes.table_index[:rows]].reshape(-1),
        mask=graphs.span <= positions,
    )
    return PagedAttentionMetadata(
        write_slots=planes.write_slots[:rows],
        block_size=graphs.block_size,
        single=group,
        multi=[],
        causal={},
    )


def graph_max_context(paged: bool, max_model_len: int) -> int:
    """Positions a graphed row may attend to: `max_model_len` over a paged kernel (it reads
    live context only); `GRAPH_MAX_CONTEXT` for the torch gather, which reads every row's
    whole table."""
    return max_model_len if paged else min(max_model_len, GRAPH_MAX_CONTEXT)
