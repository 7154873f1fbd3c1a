"""Batch-invariant execution: every row of a core call gets bits that depend only on its own
inputs (its hidden state, its position, its own K/V context), never on how many other rows
share the call or where in the call it sits.

Why the default path is not: CPU float32 GEMM picks its kernel by the call's row count (one
row: a GEMV; more rows: blocked micro-kernels), so `F.linear` gives a row different bits in a
1-row and a 4-row call; the paged attention pads every one-row item to the longest context of
its call, and a masked reduction over a longer padded row rounds differently; a vectorised
elementwise op over `rows x N` elements runs its last `numel % 32` elements through scalar
code, so when `N` is not a multiple of 32 (the tiny test model's SwiGLU width, 176) a row's
activation bits depend on the row count.

What this mode runs instead, for the model the runner owns (`make_batch_invariant`):
- every `nn.Linear` (q/k/v/o, the MLP, the exit gate, `lm_head`) becomes `RowInvariantLinear`:
  one `[1, in] x [in, out]` product per row through `torch.bmm` over a stride-0 view of the
  weight (bmm runs one GEMM per batch entry; `torch.matmul` would fold the broadcast back
  into one GEMM). Same parameters, same checkpoint names;
- the MLP's SiLU becomes `RowwiseSiLU`: one call per row, so every row sees the same
  vector/scalar split of its `N` elements;
- hazards are computed one row per call (`row_by_row`), which also covers the seeded
  lookahead head;
- attention is `RowInvariantTorchBackend`: each row attends alone, with one fused SDPA over
  exactly its own context (positions `<=` its own; no padding, no masking), whether the row
  is a decode token or one row of a prompt chunk.
Everything else in a core call is row-invariant as it is (measured on CPU float32:
embedding, RMSNorm, RoPE, residual adds, log-softmax / argmax / per-row sampling).

Cost: linears re-read their weight once per row (memory-bound GEMVs instead of one GEMM) and
attention makes one SDPA call per row; see docs/benchmarks.md. Not available with the Triton
backend or with graph buckets (the config rejects both); verified on CPU only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from loopserve.models.kv_dtype import to_storage
from loopserve.runner.attention.base import RowSegment, write_slots_of
from loopserve.runner.attention.torch_paged import TorchBackend, Workspace, gather_blocks


def row_invariant_linear(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear` computed one row at a time: hidden [..., in] -> [..., out]."""
    rows = hidden.reshape(-1, 1, hidden.shape[-1])  # [rows, 1, in]
    # [rows, in, out], a stride-0 view: no copy of the weight.
    weights = weight.t().unsqueeze(0).expand(rows.shape[0], -1, -1)
    out = torch.bmm(rows, weights)  # [rows, 1, out], one [1, in] x [in, out] GEMM per row
    if bias is not None:
        out = out + bias
    return out.view(*hidden.shape[:-1], weight.shape[0])


class RowInvariantLinear(nn.Module):
    """An `nn.Linear`'s parameters (shared, not copied) behind `row_invariant_linear`."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return row_invariant_linear(hidden, self.weight, self.bias)


class RowwiseSiLU(nn.Module):
    """SiLU over [rows, N], one call per row (see the module docstring for why)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] == 0:
            return nn.functional.silu(hidden)
        return torch.stack([nn.functional.silu(row) for row in hidden.unbind(0)])


def make_batch_invariant(model: nn.Module) -> None:
    """Swap, in place, every `nn.Linear` for `RowInvariantLinear` and every `nn.SiLU` for
    `RowwiseSiLU`. Parameters and their names are unchanged; the forward code is untouched."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, RowInvariantLinear(child))
            elif type(child) is nn.SiLU:
                setattr(parent, name, RowwiseSiLU())


def row_by_row(
    fn: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`fn` over [rows, ...] -> [rows, ...], called one row at a time."""

    def per_row(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] == 0:
            return fn(hidden)
        return torch.cat([fn(row) for row in hidden.split(1)])

    return per_row


@dataclass(frozen=True, slots=True)
class ItemRows:
    """One item of the call: rows [first_row, first_row + count) at positions [start, ...),
    reading the context blocks `blocks` (enough for its last row)."""

    first_row: int
    start: int
    count: int
    blocks: torch.Tensor


class RowInvariantPagedAttention:
    """`AttentionBackend` for one core call in which every row attends alone.

    Writes every row's K/V first (as the reference backend), then per item gathers its
    context blocks once, and per row runs one SDPA over exactly positions [0, position]:
    shapes, and so the kernel and its reduction order, depend only on the row's own context.
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        segments: Sequence[RowSegment],
        *,
        block_size: int,
        scale: float,
        workspace: Workspace,
    ) -> None:
        device = kv_cache.device
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.scale = scale
        self.workspace = workspace
        slots = write_slots_of(segments, block_size)
        self.write_slots = torch.tensor(slots, dtype=torch.int64, device=device)
        self.items: list[ItemRows] = []
        row = 0
        for seg in segments:
            num_blocks = -(-(seg.start + seg.count) // block_size)
            blocks = torch.tensor(seg.block_table[:num_blocks], dtype=torch.int64, device=device)
            self.items.append(ItemRows(row, seg.start, seg.count, blocks))
            row += seg.count

    def _gather(self, name: str, cache: torch.Tensor, blocks: torch.Tensor,
                like: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """[len(blocks) * block_size, Hkv, Dh]: the item's context, whole blocks, in
        `like`'s dtype."""
        out = gather_blocks(self.workspace, name, cache, blocks, self.block_size, like)
        return out.view(-1, cache.shape[1], cache.shape[2])

    def attend(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        key_cache, value_cache = self.kv_cache[layer_idx, 0], self.kv_cache[layer_idx, 1]
        key_cache[self.write_slots] = to_storage(key, key_cache.dtype)
        value_cache[self.write_slots] = to_storage(value, value_cache.dtype)
        num_heads, head_dim = query.shape[1], query.shape[2]
        gqa = key_cache.shape[1] != num_heads
        out = torch.empty_like(query)
        for item in self.items:
            keys = self._gather("row_k", key_cache, item.blocks, query)  # [C, Hkv, Dh]
            values = self._gather("row_v", value_cache, item.blocks, query)
            for offset in range(item.count):
                row, length = item.first_row + offset, item.start + offset + 1
                out[row] = torch.nn.functional.scaled_dot_product_attention(
                    query[row].view(1, num_heads, 1, head_dim),
                    keys[:length].transpose(0, 1).unsqueeze(0),  # [1, Hkv, length, Dh]
                    values[:length].transpose(0, 1).unsqueeze(0),
                    scale=self.scale,
                    enable_gqa=gqa,
                ).view(num_heads, head_dim)
        return out


class RowInvariantTorchBackend(TorchBackend):
    """The torch backend with `RowInvariantPagedAttention` per call; finalize is the same
    indexed copy (copies are exact)."""

    name = "torch"

    def prepare(
        self, segments: Sequence[RowSegment], *, prefix_groups: list | None = None
    ) -> RowInvariantPagedAttention:
        return RowInvariantPagedAttention(
            self.kv_cache,
            segments,
            block_size=self.block_size,
            scale=self.scale,
            workspace=self.workspace,
        )
