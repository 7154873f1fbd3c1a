"""Fused rotary embedding and SiLU-and-multiply: one Triton kernel each, per layer.

`rope_qkv` takes a layer's merged q/k/v projection output [rows, (Hq + 2 Hkv) x Dh] and
returns q and k rotated and v, each contiguous [rows, heads, Dh], in one launch (one
program per row, all its heads in one tile). Unfused,
rotary costs about ten kernels per layer (per q and k: two products, a negation, a
concatenation and a sum), and the attention backend's K/V write copies the strided v
first. Two layouts:

- rotate-half (Ouro): element j pairs with j + Dh/2; `cos`/`sin` [rows, Dh] in the
  activations' dtype; every product and the sum rounded to that dtype, as the torch path
  rounds (`x * cos + rotate_half(x) * sin`);
- interleaved (Huginn): element 2j pairs with 2j + 1; `cos`/`sin` [rows, Dh/2] float32;
  the rotation in float32, rounded once, after an optional q/k bias added in the
  activations' dtype (`(q + bias).to(dtype)`).

With `cache=(key_cache, value_cache, slots)` the same launch stores rotated k and v into
the attention backend's caches at each row's slot instead of returning them: rotary inside
the K/V write (`TritonAttention.attend_rotated`), one kernel where there were two.

`silu_mul` takes a merged gate/up projection [rows, 2I] ([gate | up]) and returns
silu(gate) x up [rows, I], with silu's result rounded before the product, as torch does.

On CUDA a GPU may contract a product and a sum into one fused multiply-add, so results can
differ from torch's in the last place (tests bound it); on CPU tensors the kernels run under
Triton's interpreter (`triton_jit.device_kernel`), the tests' parity check. The runner turns
them on with the fused norms (`install_fused_kernels`): CUDA, Triton installed, not in
batch-invariant mode; the CPU torch path stays the oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loopserve.runner.attention.fp8_bits import fp8_bits, fp8_code, kv_write_target
from loopserve.runner.attention.triton_jit import device_kernel
from loopserve.runner.attention.triton_kernels import write_kv, write_rows_for

SILU_BLOCK = 1024


@device_kernel()
def _rope_qkv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    bias_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    slots_ptr,
    stride_row,
    stride_table,
    stride_kv_row,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WRITE: tl.constexpr,
    FP8: tl.constexpr = 0,
):
    # One program per row: every head of q, k and v as a [HEADS, BLOCK] tile of pairs. K and
    # V go to row `slots[row]` of the caches (WRITE), else to row `row` of their outputs.
    row = tl.program_id(0).to(tl.int64)
    if WRITE:
        kv_row = tl.load(slots_ptr + row).to(tl.int64)
    else:
        kv_row = row
    h = tl.arange(0, HEADS)[:, None]
    j = tl.arange(0, BLOCK)[None, :]
    mask = (h < HQ + 2 * HKV) & (j < D // 2)
    if INTERLEAVED:
        i1 = 2 * j
        i2 = 2 * j + 1
    else:
        i1 = j
        i2 = j + D // 2
    dtype = q_ptr.dtype.element_ty
    src = qkv_ptr + row * stride_row + h * D
    x1 = tl.load(src + i1, mask=mask, other=0.0)
    x2 = tl.load(src + i2, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    rotated = h < HQ + HKV  # q and k; v is copied as it is
    if HAS_BIAS:  # bias [2, H, Dh]: q's heads, then k's (Hq == Hkv)
        on = mask & rotated
        a = a + tl.load(bias_ptr + h * D + i1, mask=on, other=0.0).to(tl.float32)
        b = b + tl.load(bias_ptr + h * D + i2, mask=on, other=0.0).to(tl.float32)
        a = a.to(dtype).to(tl.float32)
        b = b.to(dtype).to(tl.float32)
    table = row * stride_table
    if INTERLEAVED:
        c = tl.load(cos_ptr + table + j, mask=j < D // 2, other=0.0)
        s = tl.load(sin_ptr + table + j, mask=j < D // 2, other=0.0)
        o1 = (a * c - b * s).to(dtype)
        o2 = (b * c + a * s).to(dtype)
    else:
        c1 = tl.load(cos_ptr + table + i1, mask=j < D // 2, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + table + i1, mask=j < D // 2, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + table + i2, mask=j < D // 2, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + table + i2, mask=j < D // 2, other=0.0).to(tl.float32)
        p1 = (a * c1).to(dtype).to(tl.float32)
        r1 = (-b * s1).to(dtype).to(tl.float32)
        p2 = (b * c2).to(dtype).to(tl.float32)
        r2 = (a * s2).to(dtype).to(tl.float32)
        o1 = (p1 + r1).to(dtype)
        o2 = (p2 + r2).to(dtype)
    is_q = mask & (h < HQ)
    is_k = mask & (h >= HQ) & rotated
    is_v = mask & (h >= HQ + HKV)
    q_dst = q_ptr + row * (HQ * D) + h * D
    tl.store(q_dst + i1, o1, mask=is_q)
    tl.store(q_dst + i2, o2, mask=is_q)
    k_dst = k_ptr + kv_row * stride_kv_row + (h - HQ) * D
    v_dst = v_ptr + kv_row * stride_kv_row + (h - HQ - HKV) * D
    tl.store(k_dst + i1, fp8_bits(o1, FP8), mask=is_k)  # as the cache holds them
    tl.store(k_dst + i2, fp8_bits(o2, FP8), mask=is_k)
    tl.store(v_dst + i1, fp8_bits(x1, FP8), mask=is_v)
    tl.store(v_dst + i2, fp8_bits(x2, FP8), mask=is_v)


def rope_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    interleaved: bool = False,
    bias: torch.Tensor | None = None,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(q, k, v), each [rows, heads, Dh] contiguous, from `qkv` [rows, (Hq + 2 Hkv) x Dh]:
    q and k rotated by `cos`/`sin` (rotate-half, or `interleaved`), after `bias` [2, H, Dh]
    when given (interleaved only). With `cache` = (key_cache, value_cache, slots), caches
    [slots, Hkv, Dh] as the attention backend keeps them, rotated k and v are written to row
    `slots[i]` of the caches instead (the backend's K/V write, in the same launch; an 8-bit
    cache gets its bytes, `fp8_bits`) and (q, None, None) is returned."""
    rows, width = qkv.shape
    head_dim = width // (num_heads + 2 * num_kv_heads)
    assert head_dim * (num_heads + 2 * num_kv_heads) == width and head_dim % 2 == 0
    assert bias is None or (interleaved and num_heads == num_kv_heads)
    if cache is not None and interleaved and fp8_code(cache[0], qkv):
        # Huginn's interleaved form holds every head of a row at once; with the 8-bit
        # encoding besides, Triton 3.6 spills it (255 registers and 232-400 bytes of stack on
        # sm_80). Rotate, then `write_kv` encodes: one launch more.
        q, k, v = rope_qkv(qkv, cos, sin, num_heads, num_kv_heads, interleaved=True, bias=bias)
        key_cache, value_cache, slots = cache
        write_kv(k, v, key_cache, value_cache, slots,
                 rows_per_program=write_rows_for(qkv.device.type))  # fmt: skip
        return q, None, None
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    q = qkv.new_empty((rows, num_heads, head_dim))
    fp8 = 0
    if cache is None:
        k = qkv.new_empty((rows, num_kv_heads, head_dim))
        v = qkv.new_empty((rows, num_kv_heads, head_dim))
        key_out, value_out, slots = k, v, q  # `slots` unread
    else:
        k = v = None
        key_out, value_out, slots = cache
        fp8, key_out, value_out = kv_write_target(key_out, value_out, qkv)
        assert key_out.stride() == value_out.stride() and key_out.shape[1:] == (
            num_kv_heads,
            head_dim,
        )
        assert key_out.stride(1) == head_dim and key_out.stride(2) == 1
    if rows:
        _rope_qkv_kernel[(rows,)](
            qkv, cos, sin, qkv if bias is None else bias.contiguous(), q, key_out, value_out,
            slots, qkv.stride(0), cos.stride(0), key_out.stride(0),
            HQ=num_heads, HKV=num_kv_heads, D=head_dim,
            HEADS=triton.next_power_of_2(num_heads + 2 * num_kv_heads),
            BLOCK=triton.next_power_of_2(head_dim // 2), INTERLEAVED=interleaved,
            HAS_BIAS=bias is not None, WRITE=cache is not None, FP8=fp8,
        )  # fmt: skip
    return q, k, v


@device_kernel()
def _silu_mul_kernel(x_ptr, out_ptr, stride_row, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inner
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_row + inner + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * inner + offs, (act * up).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) x up [rows, I] of `gate_up` [rows, 2I] = [gate | up]."""
    rows, width = gate_up.shape
    inner = width // 2
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    out = gate_up.new_empty((rows, inner))
    if rows:
        block = min(SILU_BLOCK, triton.next_power_of_2(inner))
        grid = (rows, triton.cdiv(inner, block))
        _silu_mul_kernel[grid](gate_up, out, gate_up.stride(0), inner, BLOCK=block)
    return out


def install_fused_kernels(
    model, *, linears: bool = False, max_positions: int | None = None
) -> None:
    """Give `model` the fused kernels its math takes (`use_fused_norms`, `use_fused_ops`,
    and with `linears` `use_fused_linears`, its rotary tables up to `max_positions`, where
    it has them). Importing this module needs Triton: the runner imports it lazily."""
    from loopserve.runner import fused_linear
    from loopserve.runner.fused_norms import add_norm_norm

    if hasattr(model, "use_fused_norms"):
        model.use_fused_norms(add_norm_norm)
    if hasattr(model, "use_fused_ops"):
        model.use_fused_ops(rope_qkv, silu_mul)
    if linears and hasattr(model, "use_fused_linears"):
        model.use_fused_linears(fused_linear.fused_linear, fused_linear.MAX_ROWS, max_positions)
