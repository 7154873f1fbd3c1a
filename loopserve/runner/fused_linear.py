"""Skinny GEMMs with their neighbours fused in: a decode layer in five launches.

At a few rows a decode loop is bound by how many kernels it launches, not by what they read
(every launch costs its gap, ramp-up and tail, even inside a CUDA graph). With the fused
norms and ops an Ouro layer is 9 launches: two add-and-norms, the q/k/v GEMM, the rotary
with the K/V write, attention, o_proj, gate/up, SiLU-and-multiply, down_proj.
`fused_linear` folds each elementwise neighbour of a GEMM into it:

- prologue `add_norm`: the residual add of the previous branch's normed output (Ouro's
  `residual + norm_a(branch)`, or Huginn's `norm_a(branch + residual)`) and the norm of the
  result, computed per K chunk from the raw inputs (each program recomputes the rows' two
  sums of squares first; the activations are a few KB, read from L2); program 0 stores the
  new residual;
- prologue `silu`: silu(gate) x up of a merged gate/up output, as the A operand of
  down_proj;
- epilogue `rope`: each program owns `BLOCK_N` rotary pairs of one head (their first
  elements in one accumulator, their partners in another: j and j + D/2 for rotate-half,
  2j and 2j + 1 for interleaved), so the rotary is applied to the GEMM's output tile, q
  goes to its buffer and rotated k and v to the attention backend's caches at each row's
  slot (`rope_qkv`'s interface: `attend_rotated` calls it); cos/sin either per row or
  tables over every position read by each row's position.

So a layer is: [add+norm+q/k/v+rotary+K/V write] [attention] [o_proj] [add+norm+gate/up]
[SiLU+down_proj] = 5 launches, and a loop's first norm folds into its first GEMM.

Rows are one `BLOCK_M` tile (at most `MAX_ROWS`): each program reads its weight columns
once for every row. More rows would re-read the weights per tile, so the model keeps the
cuBLAS GEMMs above `MAX_ROWS` (prompt chunks, large decode buckets). Every elementwise step
rounds where the torch path rounds (the norms and SiLU as in `fused_norms` / `fused_ops`);
the GEMM accumulates in float32 and rounds once, as cuBLAS does, in its own order, so
results equal the torch path within a tolerance, not bitwise. On CPU tensors the kernel runs
under Triton's interpreter (the tests' parity check); the runner turns it on only on CUDA
and only when asked (`RunnerOptions.fused_linears`, off by default until a GPU measures it
against cuBLAS).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loopserve.runner.attention.fp8_bits import fp8_bits, kv_write_target
from loopserve.runner.attention.triton_jit import device_kernel

MAX_ROWS = 16  # one tl.dot tile of rows; the smallest M tl.dot takes
BLOCK_K = 128
PLAIN, ADD_NORM, SILU = 0, 1, 2  # prologues


@device_kernel(do_not_specialize=("rows",))
def _fused_linear_kernel(
    x_ptr,  # the A operand (PLAIN), the branch (ADD_NORM), [gate | up] (SILU)
    res_ptr,  # ADD_NORM: the residual
    w_a_ptr,
    w_b_ptr,
    weight_ptr,  # [n_out, K]
    out_ptr,  # [rows, n_out], or q [rows, HQ, D] with ROPE
    out_res_ptr,
    cos_ptr,
    sin_ptr,
    bias_ptr,
    pos_ptr,
    slots_ptr,
    k_ptr,
    v_ptr,
    rows,
    n_out,
    stride_x,
    stride_table,
    stride_kv_row,
    eps_a,
    eps_b,
    K: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_BRANCH: tl.constexpr,
    NORM_SUM: tl.constexpr,
    ROPE: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_POS: tl.constexpr,
    WRITE: tl.constexpr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    FP8: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    dtype = weight_ptr.dtype.element_ty
    m = tl.arange(0, BLOCK_M)[:, None]
    m_ok = m < rows
    if ROPE:  # BLOCK_N rotary pairs of one head: their first elements here, seconds in acc_hi
        per_head: tl.constexpr = (D // 2 + BLOCK_N - 1) // BLOCK_N
        head = pid // per_head
        half = (pid % per_head) * BLOCK_N + tl.arange(0, BLOCK_N)  # pair index in the head
        if INTERLEAVED:  # pairs (2j, 2j + 1)
            i1 = 2 * half
            i2 = 2 * half + 1
        else:  # rotate-half: pairs (j, j + D/2)
            i1 = half
            i2 = half + D // 2
        cols = head * D + i1
        n_ok = half < D // 2
    else:
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = cols < n_out
    inv_a = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    inv_b = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    if PROLOGUE == 1:
        # The rows' sums of squares: of the branch (norm_a), then of the new residual.
        if HAS_BRANCH:
            ss = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)[None, :]
                mk = m_ok & (k < K)
                y = tl.load(x_ptr + m * stride_x + k, mask=mk, other=0.0).to(tl.float32)
                if NORM_SUM:  # norm_a(branch + residual) (Huginn's sandwich)
                    res = tl.load(res_ptr + m * K + k, mask=mk, other=0.0).to(tl.float32)
                    y = (y + res).to(dtype).to(tl.float32)
                ss += tl.sum(y * y, axis=1, keep_dims=True)
            inv_a = tl.rsqrt(ss / K + eps_a)
        ss = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)[None, :]
            mk = m_ok & (k < K)
            res = tl.load(res_ptr + m * K + k, mask=mk, other=0.0).to(tl.float32)
            if HAS_BRANCH:
                y = tl.load(x_ptr + m * stride_x + k, mask=mk, other=0.0).to(tl.float32)
                w_a = tl.load(w_a_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                if NORM_SUM:
                    y = (y + res).to(dtype).to(tl.float32)
                    res = (w_a * (y * inv_a).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
                else:  # residual + norm_a(branch) (Ouro's)
                    y = (w_a * (y * inv_a).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
                    res = (res + y).to(dtype).to(tl.float32)
                if pid == 0:
                    tl.store(out_res_ptr + m * K + k, res.to(dtype), mask=mk)
            ss += tl.sum(res * res, axis=1, keep_dims=True)
        inv_b = tl.rsqrt(ss / K + eps_b)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)[None, :]
        mk = m_ok & (k < K)
        if PROLOGUE == 1:
            a = tl.load(res_ptr + m * K + k, mask=mk, other=0.0).to(tl.float32)
            if HAS_BRANCH:
                y = tl.load(x_ptr + m * stride_x + k, mask=mk, other=0.0).to(tl.float32)
                w_a = tl.load(w_a_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                if NORM_SUM:
                    y = (y + a).to(dtype).to(tl.float32)
                    a = (w_a * (y * inv_a).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
                else:
                    y = (w_a * (y * inv_a).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
                    a = (a + y).to(dtype).to(tl.float32)
            w_b = tl.load(w_b_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            a = (w_b * (a * inv_b).to(dtype).to(tl.float32)).to(dtype)
        elif PROLOGUE == 2:
            gate = tl.load(x_ptr + m * stride_x + k, mask=mk, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + m * stride_x + K + k, mask=mk, other=0.0).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            a = (act * up).to(dtype)
        else:
            a = tl.load(x_ptr + m * stride_x + k, mask=mk, other=0.0).to(dtype)
        w = tl.load(weight_ptr + cols[:, None] * K + k, mask=n_ok[:, None] & (k < K), other=0.0)
        if FP32_DOT:
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
        if ROPE:
            w_hi = tl.load(
                weight_ptr + (cols[:, None] + i2[:, None] - i1[:, None]) * K + k,
                mask=n_ok[:, None] & (k < K),
                other=0.0,
            )
            if FP32_DOT:
                acc_hi += tl.dot(
                    a.to(tl.float32), tl.trans(w_hi.to(tl.float32)), input_precision="ieee"
                )
            else:
                acc_hi += tl.dot(a, tl.trans(w_hi))
    if ROPE:
        # The projection rounded as F.linear rounds it, then the rotary as `rope_qkv` does.
        j = half[None, :]
        c1 = i1[None, :]
        c2 = i2[None, :]
        ok = m_ok & n_ok[None, :]
        x1 = acc.to(dtype)
        x2 = acc_hi.to(dtype)
        a1 = x1.to(tl.float32)
        b1 = x2.to(tl.float32)
        if HAS_BIAS:  # bias [2, H, D]: q's heads, then k's (HQ == HKV)
            if head < HQ + HKV:
                a1 = a1 + tl.load(bias_ptr + head * D + c1, mask=ok, other=0.0).to(tl.float32)
                b1 = b1 + tl.load(bias_ptr + head * D + c2, mask=ok, other=0.0).to(tl.float32)
                a1 = a1.to(dtype).to(tl.float32)
                b1 = b1.to(dtype).to(tl.float32)
        if HAS_POS:  # tables over every position, a row's by its position
            table = tl.load(pos_ptr + m, mask=m_ok, other=0).to(tl.int64) * stride_table
        else:  # a table row per row
            table = m.to(tl.int64) * stride_table
        if INTERLEAVED:  # float32 tables [rows, D/2], one rounding
            cs = tl.load(cos_ptr + table + j, mask=ok, other=0.0)
            sn = tl.load(sin_ptr + table + j, mask=ok, other=0.0)
            o1 = (a1 * cs - b1 * sn).to(dtype)
            o2 = (b1 * cs + a1 * sn).to(dtype)
        else:  # tables [rows, D] in the activations' dtype, every product rounded
            cs1 = tl.load(cos_ptr + table + c1, mask=ok, other=0.0).to(tl.float32)
            sn1 = tl.load(sin_ptr + table + c1, mask=ok, other=0.0).to(tl.float32)
            cs2 = tl.load(cos_ptr + table + c2, mask=ok, other=0.0).to(tl.float32)
            sn2 = tl.load(sin_ptr + table + c2, mask=ok, other=0.0).to(tl.float32)
            p1 = (a1 * cs1).to(dtype).to(tl.float32) + (-b1 * sn1).to(dtype).to(tl.float32)
            p2 = (b1 * cs2).to(dtype).to(tl.float32) + (a1 * sn2).to(dtype).to(tl.float32)
            o1 = p1.to(dtype)
            o2 = p2.to(dtype)
        if head < HQ:
            dst = out_ptr + m * (HQ * D) + head * D
            tl.store(dst + c1, o1, mask=ok)
            tl.store(dst + c2, o2, mask=ok)
        else:
            if WRITE:
                kv_row = tl.load(slots_ptr + m, mask=m_ok, other=0).to(tl.int64)
            else:
                kv_row = m.to(tl.int64)
            if head < HQ + HKV:
                kv_dst = k_ptr + kv_row * stride_kv_row + (head - HQ) * D
                first, second = o1, o2
            else:
                kv_dst = v_ptr + kv_row * stride_kv_row + (head - HQ - HKV) * D
                first, second = x1, x2
            tl.store(kv_dst + c1, fp8_bits(first, FP8), mask=ok)  # as the cache holds them
            tl.store(kv_dst + c2, fp8_bits(second, FP8), mask=ok)
    else:
        tl.store(out_ptr + m * n_out + cols[None, :], acc.to(dtype), mask=m_ok & n_ok[None, :])


def fits(rows: int, weight: torch.Tensor) -> bool:
    """Whether `fused_linear` takes `rows` rows of this weight (one row tile; contiguous)."""
    return 0 < rows <= MAX_ROWS and weight.is_contiguous()


# Under the interpreter each program runs in Python: the widest tiles there (the fewest
# programs). The launch-form test turns it off to launch what a GPU launches.
WIDE_TILES_ON_CPU = True


def _block_n(n_out: int, device: torch.device, head_dim: int | None = None) -> int:
    """Columns (with `head_dim`: rotary pairs of one head) per program. On a GPU the widest
    of 64, 32, 16 that still gives ~2 programs per SM of a 132-SM GPU (decode GEMMs are
    weight reads; too few programs leave SMs idle), 16 pairs for the rotary epilogue; on
    the CPU (`WIDE_TILES_ON_CPU`) the widest."""
    if device.type == "cpu" and WIDE_TILES_ON_CPU:
        return 64 if head_dim is None else max(16, min(64, triton.next_power_of_2(head_dim // 2)))
    if head_dim is not None:
        return 16
    for block in (64, 32):
        if n_out // block >= 264:
            return block
    return 16


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    norm_a=None,
    norm_b=None,
    norm_sum: bool = False,
    silu: bool = False,
    rope: tuple[torch.Tensor, torch.Tensor, int, int] | None = None,
    interleaved: bool = False,
    bias: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
):
    """One launch of A @ weight.T for A of at most `MAX_ROWS` rows, where A is

    - `x` (neither `residual` nor `silu`);
    - with `residual` and `norm_b`: norm_b(r) of the new residual r = residual +
      norm_a(x) (with `norm_sum`, Huginn's order: r = norm_a(x + residual)), or of r =
      `residual` when `x` is None; returns (out, r);
    - with `silu`: silu(gate) x up of `x` = [gate | up] [rows, 2K].

    With `rope` = (cos, sin, Hq, Hkv) the weight is a merged q/k/v projection and the result
    is `rope_qkv`'s with the same arguments (`interleaved`, `bias`, `cache`): (q, k, v)
    rotated, or (q, None, None) with `cache` = (key_cache, value_cache, slots), k and v
    written there. With `positions` [rows], cos/sin are tables over every position and row
    i reads row `positions[i]` of them (no per-call table kernels); else one row per row."""
    n_out, k_dim = weight.shape
    source = residual if residual is not None else x
    rows = source.shape[0]
    assert fits(rows, weight), f"fused_linear takes 1..{MAX_ROWS} rows and a contiguous weight"
    prologue = ADD_NORM if residual is not None else SILU if silu else PLAIN
    has_branch = prologue == ADD_NORM and x is not None
    if prologue == ADD_NORM:
        assert norm_b is not None and (norm_a is not None or not has_branch)
        residual = residual.contiguous()
    if x is not None and x.stride(1) != 1:
        x = x.contiguous()
    x_arg = x if x is not None else residual
    out_res = torch.empty_like(residual) if has_branch else residual
    q = k = v = None
    cos = sin = slots = key_out = value_out = weight  # unread unless `rope`
    stride_table = stride_kv = fp8 = 0
    num_heads = num_kv_heads = head_dim = 1
    if rope is None:
        out = weight.new_empty((rows, n_out))
        block_n = _block_n(n_out, weight.device)
        grid = (triton.cdiv(n_out, block_n),)
    else:
        cos, sin, num_heads, num_kv_heads = rope
        head_dim = n_out // (num_heads + 2 * num_kv_heads)
        assert bias is None or (interleaved and num_heads == num_kv_heads)
        cos, sin = cos.contiguous(), sin.contiguous()
        stride_table = cos.stride(0)
        block_n = _block_n(n_out, weight.device, head_dim)
        out = q = weight.new_empty((rows, num_heads, head_dim))
        if cache is None:
            k = key_out = weight.new_empty((rows, num_kv_heads, head_dim))
            v = value_out = weight.new_empty((rows, num_kv_heads, head_dim))
            slots = q
        else:
            key_out, value_out, slots = cache
            assert key_out.stride() == value_out.stride() and key_out.stride(1) == head_dim
            fp8, key_out, value_out = kv_write_target(key_out, value_out, weight)
        stride_kv = key_out.stride(0)
        grid = ((num_heads + 2 * num_kv_heads) * triton.cdiv(head_dim // 2, block_n),)
    norm_a = norm_a or norm_b
    _fused_linear_kernel[grid](
        x_arg, residual if residual is not None else x_arg,
        weight if norm_a is None else norm_a.weight, weight if norm_b is None else norm_b.weight,
        weight, out, weight if out_res is None else out_res, cos, sin,
        weight if bias is None else bias.contiguous(),
        weight if positions is None else positions.contiguous(),
        slots, key_out, value_out,
        rows, n_out, x_arg.stride(0), stride_table, stride_kv,
        1e-6 if norm_a is None else norm_a.eps, 1e-6 if norm_b is None else norm_b.eps,
        K=k_dim, PROLOGUE=prologue, HAS_BRANCH=has_branch, NORM_SUM=norm_sum,
        ROPE=rope is not None, INTERLEAVED=interleaved, HAS_BIAS=bias is not None,
        HAS_POS=positions is not None,
        WRITE=cache is not None, HQ=num_heads, HKV=num_kv_heads, D=head_dim,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        # float32 products, exact for bfloat16 operands: for float32 weights (no TF32), and
        # under the interpreter, which has no bfloat16 dot.
        FP32_DOT=weight.dtype == torch.float32 or weight.device.type == "cpu", FP8=fp8,
    )  # fmt: skip
    if rope is not None:
        out = (q, k, v)
    if prologue == ADD_NORM:
        return out, out_res
    return out
