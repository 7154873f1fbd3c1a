"""Triton kernel for prompt-chunk attention over per-depth KV planes, and its launcher.

`prefill_attention`: tiles of up to `block_m` consecutive rows of one prompt chunk, one
program per (tile, query head); a tile attends to its plane's positions `<=` each row's own
(the request's cached context plus, causally, the chunk itself). Tiles of many chunks
(different requests, depths) share one launch. Cache layout, slots and precision as in
`triton_kernels` (softmax and accumulation in float32; fp32 dot products without TF32).
"""

from __future__ import annotations

import torch
import triton.language as tl

from loopserve.runner.attention.triton_jit import device_kernel
from loopserve.runner.attention.triton_kernels import _pow2


# The block-table width (its row stride) changes per call: not specialized on.
@device_kernel(do_not_specialize=("stride_table",))
def _prefill_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    tables_ptr,
    tile_table_ptr,
    tile_row_ptr,
    tile_pos_ptr,
    tile_count_ptr,
    out_ptr,
    scale,
    stride_q_row,
    stride_q_head,
    stride_o_row,
    stride_o_head,
    stride_c_slot,
    stride_c_head,
    stride_table,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    table = tables_ptr + tl.load(tile_table_ptr + tile).to(tl.int64) * stride_table
    row0 = tl.load(tile_row_ptr + tile)
    pos0 = tl.load(tile_pos_ptr + tile)
    count = tl.load(tile_count_ptr + tile)
    end = pos0 + count  # keys [0, end): context plus the tile's rows

    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_mask = m < count
    d_mask = d < HEAD_DIM
    q_pos = pos0 + m
    q_offs = (row0 + m)[:, None] * stride_q_row + head * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [M, D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=p_mask, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_offs = slot[:, None] * stride_c_slot + kv_head * stride_c_head + d[None, :]
        kv_mask = p_mask[:, None] & d_mask[None, :]
        # [N, D] in the query's dtype (a no-op unless the cache is stored narrower: fp8)
        k = tl.load(key_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale  # [M, N], float32
        allowed = (pos[None, :] <= q_pos[:, None]) & p_mask[None, :]
        s = tl.where(allowed, s, float("-inf"))
        # Key 0 is allowed for every row in the first tile, so m_new is finite from then on.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(value_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    out = acc / l_i[:, None]
    o_offs = (row0 + m)[:, None] * stride_o_row + head * stride_o_head + d[None, :]
    tl.store(
        out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :]
    )


def prompt_launch_options(capability: int) -> dict[str, int]:
    """Warps and software-pipelining stages of the prompt kernel for a compute capability
    (e.g. 90). Ahead-of-time compiles (`triton_aot`) at head_dim 128: 8 warps keep 64x64
    bf16 tiles in registers; on sm_80 the default 3 stages still spill (16 B of stack at
    128 registers), 2 do not."""
    return {"num_warps": 8, "num_stages": 2 if capability < 90 else 3}


def prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    tables: torch.Tensor,
    tile_table: torch.Tensor,
    tile_row: torch.Tensor,
    tile_pos: torch.Tensor,
    tile_count: torch.Tensor,
    scale: float,
    block_size: int,
    block_m: int,
    block_n: int,
    num_warps: int = 8,
    num_stages: int = 3,
) -> None:
    """Tile t: rows [tile_row[t], +tile_count[t]) at positions from tile_pos[t] attend
    causally over block table `tables[tile_table[t]]`. `tile_count[t] <= block_m`."""
    num_tiles = tile_row.numel()
    if num_tiles == 0:
        return
    num_heads, head_dim = query.shape[1], query.shape[2]
    group = num_heads // key_cache.shape[1]
    _prefill_kernel[(num_tiles, num_heads)](
        query,
        key_cache,
        value_cache,
        tables,
        tile_table,
        tile_row,
        tile_pos,
        tile_count,
        out,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        tables.stride(0),
        BLOCK_SIZE=block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=_pow2(head_dim, 16),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IEEE=query.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
