"""Triton kernels for paged attention over per-depth KV planes, and their launchers.

Cache layout (one layer's K or V): `[num_slots, num_kv_heads, head_dim]`, `slot = block_id *
block_size + position % block_size`; a position's block comes from the block table of the
plane its row addresses, so every row (or prompt chunk) of one launch may read a different
request and plane. Any `block_size` works (the slot is computed per position, not per tile).

- `write_kv`: K/V of every row of a call into its slot, a few rows (all heads) per program.
- `decode_attention`: one query row per item; one program per (row, KV head, split) serving
  all query heads of the KV head's group (grouped-query attention without K/V copies); with
  more than one split (flash-decoding) each split writes a partial output and its
  log-sum-exp, and `_decode_reduce_kernel` merges them.
- `prefill_attention` lives in `triton_prefill`: tiles of prompt-chunk rows attending to their
  plane's cached context and, causally, the chunk itself.
- `copy_slots`: the LAST_EXITED finalize copy, every (src, dst) pair and every layer's K and
  V in one launch.

Softmax and accumulation are float32 for every input dtype; fp32 dot products request IEEE
precision (no TF32) so fp32 results match the torch reference. Written against triton >= 3.6;
`triton_jit.device_kernel` launches them compiled on CUDA tensors and under Triton's
interpreter on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loopserve.runner.attention.fp8_bits import fp8_bits, kv_write_target
from loopserve.runner.attention.triton_jit import device_kernel


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(n))


# Elements of the decode kernel's [group, block_n, head_dim] float32 products: 4096 is 32
# registers a thread at 4 warps. Ahead-of-time compiles (`triton_aot`) at head_dim 128: 8192
# still spilled for a GQA group of 4 in bf16 on sm_90 (8 bytes of stack); 4096 does not.
DECODE_PRODUCT_ELEMS = 4096


def decode_block_n(block_n: int, group: int, head_dim: int) -> int:
    """Positions per decode step: `block_n`, lowered so the product stays in registers."""
    cap = max(1, DECODE_PRODUCT_ELEMS // (_pow2(group, 2) * _pow2(head_dim)))
    return max(8, min(block_n, 1 << (cap.bit_length() - 1)))  # a power of two


@device_kernel(do_not_specialize=("num_rows",))
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slots_ptr,
    num_rows,
    stride_c_slot,
    ROW_ELEMS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    FP8: tl.constexpr = 0,
):
    # A row's K (and V) is ROW_ELEMS = Hkv * Dh contiguous elements both in the call's tensor
    # and in its cache slot, so a program copies BLOCK_R rows x BLOCK_W elements at once.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    r_mask = r < num_rows
    mask = r_mask[:, None] & (w[None, :] < ROW_ELEMS)
    slot = tl.load(slots_ptr + r, mask=r_mask, other=0).to(tl.int64)
    src = r.to(tl.int64)[:, None] * ROW_ELEMS + w[None, :]
    dst = slot[:, None] * stride_c_slot + w[None, :]
    # as the cache holds them (an 8-bit cache: their bytes)
    tl.store(key_cache_ptr + dst, fp8_bits(tl.load(key_ptr + src, mask=mask), FP8), mask=mask)
    tl.store(value_cache_ptr + dst, fp8_bits(tl.load(value_ptr + src, mask=mask), FP8), mask=mask)


def write_rows_for(device_type: str) -> int:
    """Rows per K/V-write program on `device_type` (the backend's writes and the rotary's)."""
    return 16 if device_type == "cpu" else 2


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    rows_per_program: int = 8,
) -> None:
    """key/value [rows, Hkv, Dh] -> caches [slots, Hkv, Dh] at `slots` [rows]; into an 8-bit
    cache (`kv_cache_dtype` fp8) rounded in the kernel (`fp8_bits`)."""
    rows = key.shape[0]
    if rows == 0:
        return
    key, value = key.contiguous(), value.contiguous()
    fp8, key_cache, value_cache = kv_write_target(key_cache, value_cache, key)
    assert key_cache.stride(1) == key_cache.shape[2] and key_cache.stride(2) == 1
    row_elems = key.shape[1] * key.shape[2]
    block_w = min(2048, _pow2(row_elems))
    grid = (triton.cdiv(rows, rows_per_program), triton.cdiv(row_elems, block_w))
    _write_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slots,
        rows,
        key_cache.stride(0),
        ROW_ELEMS=row_elems,
        BLOCK_R=rows_per_program,
        BLOCK_W=block_w,
        FP8=fp8,
    )


@device_kernel()
def _copy_slots_kernel(
    cache_ptr,
    src_ptr,
    dst_ptr,
    stride_part,
    stride_slot,
    SLOT_ELEMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0)
    part = tl.program_id(1)  # layer * 2 + (0 for K, 1 for V)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    base = cache_ptr + part.to(tl.int64) * stride_part
    limit = tl.where(src != dst, SLOT_ELEMS, 0)  # a pair masked to a self-copy moves nothing
    for start in range(0, SLOT_ELEMS, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < limit
        x = tl.load(base + src * stride_slot + offs, mask=mask)
        tl.store(base + dst * stride_slot + offs, x, mask=mask)


def copy_slots(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """kv_cache [L, 2, slots, Hkv, Dh] (contiguous): slot src[i] -> dst[i], all layers, K and V.
    No dst may be another pair's src (finalize copies one exiting token's slot to deeper planes
    of the same token); a pair with src == dst (masked on the device) moves nothing."""
    if src.numel() == 0:
        return
    assert kv_cache.is_contiguous()
    num_layers, _, num_slots, num_kv_heads, head_dim = kv_cache.shape
    slot_elems = num_kv_heads * head_dim
    _copy_slots_kernel[(src.numel(), num_layers * 2)](
        kv_cache,
        src,
        dst,
        num_slots * slot_elems,
        slot_elems,
        SLOT_ELEMS=slot_elems,
        BLOCK=min(1024, _pow2(slot_elems)),
    )


MERGE_SPLITS = 8  # splits the in-launch merge reads at a time (a constant: one compile)


# Per-call integers (split length, the partial buffers' strides, which depend on the split
# count) are not specialized on: one compile serves every call of a model.
@device_kernel(
    do_not_specialize=(
        "stride_table",
        "stride_po_row",
        "stride_po_head",
        "stride_pl_row",
        "stride_pl_head",
    )
)
def _decode_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    tables_ptr,
    table_idx_ptr,
    rows_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counters_ptr,
    scale,
    stride_q_row,
    stride_q_head,
    stride_o_row,
    stride_o_head,
    stride_c_slot,
    stride_c_head,
    stride_table,
    stride_po_row,
    stride_po_head,
    stride_po_split,
    stride_pl_row,
    stride_pl_head,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    MERGE: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows_ptr + i)
    table = tables_ptr + tl.load(table_idx_ptr + i).to(tl.int64) * stride_table
    seq_len = tl.load(seq_lens_ptr + i)
    # Each row splits its own context over the launch's splits (whole BLOCK_N tiles each), so
    # a short row in a launch sized for long ones uses its programs instead of idling them.
    num_splits = tl.num_programs(2)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(seq_len, start + split_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q_offs = row * stride_q_row + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(tl.float32)  # [G, D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        p_mask = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=p_mask, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_offs = slot[:, None] * stride_c_slot + kv_head * stride_c_head + d[None, :]
        kv_mask = p_mask[:, None] & d_mask[None, :]
        k = tl.load(key_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)  # [N, D]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, N]
        s = tl.where(p_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(value_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    empty = l_i == 0.0  # a split past the end of this row's context
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    store_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        po = i * stride_po_row + heads[:, None] * stride_po_head + split * stride_po_split
        tl.store(part_out_ptr + po + d[None, :], out, mask=store_mask)
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        pl = i * stride_pl_row + heads * stride_pl_head + split
        tl.store(part_lse_ptr + pl, lse, mask=g_mask)
        if MERGE:
            # The last of this (row, KV head)'s splits to finish merges them all (what the
            # reduce kernel would do in a launch of its own) and resets the counter for the
            # next launch (a graph replay included). The barrier puts every thread's stores
            # before the one-thread acquire-release add that publishes them; the merge reads
            # around L1 (".cg"), which may hold lines of partials another split wrote since.
            # Each split's output weighs exp(lse - max lse), BLOCK_S splits at a time with a
            # running max.
            counter = counters_ptr + i * tl.num_programs(1) + kv_head
            tl.debug_barrier()
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed")
                top = tl.full([BLOCK_G], float("-inf"), tl.float32)
                total = tl.zeros([BLOCK_G], tl.float32)
                merged = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
                for s0 in range(0, num_splits, BLOCK_S):
                    merge_s = s0 + tl.arange(0, BLOCK_S)
                    merge_mask = g_mask[:, None] & (merge_s[None, :] < num_splits)
                    merge_pl = (
                        i * stride_pl_row + heads[:, None] * stride_pl_head + merge_s[None, :]
                    )
                    merge_lse = tl.load(
                        part_lse_ptr + merge_pl, mask=merge_mask, other=float("-inf"),
                        cache_modifier=".cg",
                    )  # fmt: skip
                    # Split 0 is never empty, so the max is finite from the first tile on;
                    # padding heads (all -inf) take 0, not inf - inf.
                    new_top = tl.where(g_mask, tl.maximum(top, tl.max(merge_lse, axis=1)), 0.0)
                    rescale = tl.exp(top - new_top)
                    weight = tl.exp(merge_lse - new_top[:, None])  # [G, S]
                    merge_po = (i * stride_po_row + heads[:, None, None] * stride_po_head
                                + merge_s[None, :, None] * stride_po_split
                                + d[None, None, :])  # fmt: skip
                    parts = tl.load(part_out_ptr + merge_po, other=0.0, cache_modifier=".cg",
                                    mask=merge_mask[:, :, None] & d_mask[None, None, :])  # fmt: skip
                    total = total * rescale + tl.sum(weight, axis=1)
                    merged = merged * rescale[:, None] + tl.sum(weight[:, :, None] * parts, axis=1)
                    top = new_top
                total = tl.where(g_mask, total, 1.0)  # padding heads: no 0 / 0
                o_offs = row * stride_o_row + heads[:, None] * stride_o_head + d[None, :]
                tl.store(out_ptr + o_offs, (merged / total[:, None]).to(out_ptr.dtype.element_ty),
                         mask=store_mask)  # fmt: skip
    else:
        o_offs = row * stride_o_row + heads[:, None] * stride_o_head + d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=store_mask)


@device_kernel(
    do_not_specialize=(
        "num_splits",
        "stride_po_row",
        "stride_po_head",
        "stride_pl_row",
        "stride_pl_head",
        "stride_lse_row",
    )
)
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    rows_ptr,
    out_ptr,
    lse_ptr,
    num_splits,
    stride_po_row,
    stride_po_head,
    stride_po_split,
    stride_pl_row,
    stride_pl_head,
    stride_o_row,
    stride_o_head,
    stride_lse_row,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    i = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(rows_ptr + i)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    d_mask = d < HEAD_DIM
    lse = tl.load(
        part_lse_ptr + i * stride_pl_row + head * stride_pl_head + s,
        mask=s_mask,
        other=float("-inf"),
    )
    top = tl.max(lse, axis=0)  # split 0 is never empty: the max is finite
    weight = tl.exp(lse - top)
    po = i * stride_po_row + head * stride_po_head + s[:, None] * stride_po_split + d[None, :]
    parts = tl.load(part_out_ptr + po, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(weight, axis=0)
    out = tl.sum(weight[:, None] * parts, axis=0) / total
    o_offs = row * stride_o_row + head * stride_o_head + d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=d_mask)
    if WRITE_LSE:  # the row's log-sum-exp over all splits (cascade attention merges with it)
        tl.store(lse_ptr + i * stride_lse_row + head, top + tl.log(total))


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    tables: torch.Tensor,
    table_idx: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    block_size: int,
    split_len: int,
    block_n: int,
    lse_out: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> None:
    """Rows `rows` [n] of query [rows, Hq, Dh] attend to positions [0, seq_lens[i]) of block
    table `tables[table_idx[i]]`; results go to the same rows of `out`. The launch runs
    ceil(max_seq_len / split_len) splits (`split_len` rounded up to a multiple of `block_n`);
    each row divides its own context among them in whole `block_n` tiles, on the device (a
    row shorter than the splits' tiles leaves the rest empty); one split writes `out`
    directly.
    `lse_out` (float32 [n, Hq]): also write each row's log-sum-exp (always through the
    split-and-reduce path, which has it). `counters` (int32, zeros, at least n x Hkv; left
    zeros): with more than one split and no `lse_out`, the last split of each row and KV head
    to finish merges the splits inside the launch instead of a second, reduce launch."""
    num_rows = rows.numel()
    if num_rows == 0:
        return
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[1]
    group = num_heads // num_kv_heads
    block_n = decode_block_n(block_n, group, head_dim)
    split_len = triton.cdiv(split_len, block_n) * block_n
    num_splits = triton.cdiv(max_seq_len, split_len)
    split = num_splits > 1 or lse_out is not None
    merge = (
        num_splits > 1
        and lse_out is None
        and counters is not None
        and counters.numel() >= num_rows * num_kv_heads
    )
    if split:
        part_out = torch.empty(
            (num_rows, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            (num_rows, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
    else:
        part_out = part_lse = out  # unused
    po_strides = part_out.stride()[:3] if split else (0, 0, 0)
    pl_strides = part_lse.stride()[:2] if split else (0, 0)
    block_d = _pow2(head_dim)
    _decode_kernel[(num_rows, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        tables,
        table_idx,
        rows,
        seq_lens,
        out,
        part_out,
        part_lse,
        counters if merge else part_lse,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        tables.stride(0),
        *po_strides,
        *pl_strides,
        BLOCK_SIZE=block_size,
        GROUP=group,
        BLOCK_G=_pow2(group, 2),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        SPLIT=split,
        MERGE=merge,
        BLOCK_S=MERGE_SPLITS,
    )
    if split and not merge:
        _decode_reduce_kernel[(num_rows, num_heads)](
            part_out,
            part_lse,
            rows,
            out,
            lse_out if lse_out is not None else part_lse,
            num_splits,
            *po_strides,
            *pl_strides,
            out.stride(0),
            out.stride(1),
            lse_out.stride(0) if lse_out is not None else 0,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=_pow2(num_splits, 2),
            WRITE_LSE=lse_out is not None,
        )
