"""The attention interface between the model and whoever owns K/V.

The model computes q/k/v for a flat batch of rows and hands them to an `AttentionBackend`
passed as an argument to every core call; the backend stores the new K/V (in the plane of
each row's depth) and returns the attention output. Nothing here is global state.

`attention_reference` is the plain-torch math every backend must match; `DenseKV` /
`DenseAttention` keep contiguous per-plane K/V for a single request and back the dense
reference generator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from loopserve.models.kv_dtype import round_trip


class AttentionBackend(Protocol):
    """Stores this call's K/V and attends. Shapes: q [rows, Hq, Dh], k/v [rows, Hkv, Dh].

    A backend may also offer `attend_rotated(layer_idx, qkv, rotate)`: the layer's merged
    q/k/v projection and its fused rotary (`rotate(qkv, cache=(key_cache, value_cache,
    slots))` writes rotated K and V into the caches' rows `slots` and returns (q, None,
    None)), so that rotary and the K/V write are one kernel (`attend_qkv` picks it)."""

    def attend(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor: ...


def attend_qkv(
    attn: AttentionBackend, layer_idx: int, qkv: torch.Tensor, rotate: Callable
) -> torch.Tensor:
    """Attention output [rows, Hq, Dh] of a merged projection `qkv` [rows, (Hq + 2 Hkv) Dh]
    whose rotary is the fused `rotate(qkv, cache=None) -> (q, k, v)`: through the backend's
    `attend_rotated` where it has one (rotary inside the K/V write), else rotated first."""
    attend_rotated = getattr(attn, "attend_rotated", None)
    if attend_rotated is not None:
        return attend_rotated(layer_idx, qkv, rotate)
    return attn.attend(layer_idx, *rotate(qkv))


def attend_projected(
    attn: AttentionBackend, layer_idx: int, project: Callable
) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention output [rows, Hq, Dh], new residual) of a projection that also advances the
    residual: `project(cache=None) -> ((q, k, v), residual)` (the runner's `fused_linear`
    with its add-and-norm prologue and rotary epilogue), through `attend_qkv`."""
    residual: list[torch.Tensor] = []

    def rotate(_, cache=None):
        qkv, new_residual = project(cache=cache)
        residual.append(new_residual)
        return qkv

    return attend_qkv(attn, layer_idx, None, rotate), residual[0]


def attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Softmax attention of `query` over `key`/`value` where `allowed` is True.

    query [n, Hq, Dh]; key/value [m, Hkv, Dh]; allowed [n, m] bool. Returns [n, Hq, Dh].
    KV head `h // (Hq // Hkv)` serves query head `h` (grouped-query attention).
    """
    num_q_heads, num_kv_heads = query.shape[1], key.shape[1]
    if num_q_heads != num_kv_heads:
        repeats = num_q_heads // num_kv_heads
        key = key.repeat_interleave(repeats, dim=1)
        value = value.repeat_interleave(repeats, dim=1)
    q = query.transpose(0, 1)  # [Hq, n, Dh]
    k = key.transpose(0, 1)  # [Hq, m, Dh]
    v = value.transpose(0, 1)  # [Hq, m, Dh]
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [Hq, n, m]
    scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, v).transpose(0, 1)  # [n, Hq, Dh]


class DenseKV:
    """Contiguous K/V of one request: `num_planes` planes × layers × [max_len, Hkv, Dh].
    `storage_dtype`: each written K/V is rounded as a cache of that element type stores it
    (`kv_dtype.round_trip`; None or `dtype`: kept as computed)."""

    def __init__(
        self,
        *,
        num_planes: int,
        num_layers: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        storage_dtype: torch.dtype | None = None,
    ) -> None:
        self.storage_dtype = storage_dtype
        shape = (num_planes, num_layers, max_len, num_kv_heads, head_dim)
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)

    def copy_position(self, src_plane: int, dst_plane: int, position: int) -> None:
        """Copy one position's K/V of every layer from one plane to another (finalize)."""
        self.key[dst_plane, :, position] = self.key[src_plane, :, position]
        self.value[dst_plane, :, position] = self.value[src_plane, :, position]


class DenseAttention:
    """Backend over `DenseKV` for rows that each name their plane and position.

    Writes every row's K/V at (plane, position) first, then lets each row attend to every
    position `<=` its own in its plane. Rows of one plane are attended together.
    """

    def __init__(
        self, kv: DenseKV, planes: int | list[int], positions: torch.Tensor, scale: float
    ) -> None:
        self.kv = kv
        self.positions = positions
        self.scale = scale
        if isinstance(planes, int):
            planes = [planes] * positions.shape[0]
        self.planes = planes
        self.groups: list[tuple[int, torch.Tensor, torch.Tensor, int]] = []
        for plane in sorted(set(planes)):
            rows = torch.tensor([i for i, p in enumerate(planes) if p == plane])
            rows = rows.to(positions.device)
            row_positions = positions[rows]
            context_len = int(row_positions.max().item()) + 1
            span = torch.arange(context_len, device=positions.device)
            allowed = span.unsqueeze(0) <= row_positions.unsqueeze(1)  # [rows, context_len]
            self.groups.append((plane, rows, allowed, context_len))

    def attend(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        key, value = (
            round_trip(key, self.kv.storage_dtype),
            round_trip(value, self.kv.storage_dtype),
        )
        for plane, rows, _, _ in self.groups:
            self.kv.key[plane, layer_idx, self.positions[rows]] = key[rows]
            self.kv.value[plane, layer_idx, self.positions[rows]] = value[rows]
        for plane, rows, allowed, context_len in self.groups:
            keys = self.kv.key[plane, layer_idx, :context_len]
            values = self.kv.value[plane, layer_idx, :context_len]
            out[rows] = attention_reference(query[rows], keys, values, allowed, self.scale)
        return out
