"""Fused RMSNorm for a layer's sandwich norms: residual add and two norms in one kernel.

Ouro's layer normalizes each branch's output before adding it to the residual, then
normalizes the sum for the next branch:

    h = h + norm_a(branch)          # input_layernorm_2 / post_attention_layernorm_2
    x = norm_b(h)                   # post_attention_layernorm / next layer's input_layernorm

Unfused that is two RMSNorms of 8 kernels each (casts, pow, mean, add, rsqrt, mul, mul,
cast) plus the add: 17 kernels; `add_norm_norm` is one. Huginn's sandwich block normalizes
the sum instead (`norm_sum`):

    h = norm_a(branch + h)          # norm_2 / norm_4
    x = norm_b(h)                   # norm_3 / next block's norm_1 (none after the last)

Each RMSNorm is computed as the checkpoint's code does it: in float32, cast back to the
activations' dtype, then multiplied by the weight in that dtype. Without a branch
(`branch=None`) it is one RMSNorm of `h`.

One program per row, the row in one block (hidden sizes up to 16,384). On CPU tensors the
kernel runs under Triton's interpreter (`triton_jit.device_kernel`): the tests' parity check
against the torch path; the runner turns the fused path on for CUDA only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loopserve.runner.attention.triton_jit import device_kernel

MAX_HIDDEN = 16384


@device_kernel()
def _add_norm_norm_kernel(
    res_ptr,
    branch_ptr,
    w_a_ptr,
    w_b_ptr,
    out_res_ptr,
    out_norm_ptr,
    stride_row,
    hidden,
    eps_a,
    eps_b,
    HAS_BRANCH: tl.constexpr,
    NORM_SUM: tl.constexpr,
    HAS_NORM_B: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Arithmetic in float32, rounded to the activations' dtype exactly where the torch path
    # rounds (after each norm, each product with a weight, the residual add).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    base = row * stride_row
    dtype = out_norm_ptr.dtype.element_ty
    res = tl.load(res_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BRANCH:
        y = tl.load(branch_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        w_a = tl.load(w_a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if NORM_SUM:  # res = norm_a(branch + res) (Huginn's sandwich)
            y = (y + res).to(dtype).to(tl.float32)
            y = y * tl.rsqrt(tl.sum(y * y, axis=0) / hidden + eps_a)
            res = (w_a * y.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        else:  # res = res + norm_a(branch) (Ouro's)
            y = y * tl.rsqrt(tl.sum(y * y, axis=0) / hidden + eps_a)
            branch = (w_a * y.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            res = (res + branch).to(dtype).to(tl.float32)
        tl.store(out_res_ptr + base + offs, res.to(dtype), mask=mask)
    if HAS_NORM_B:
        h = res * tl.rsqrt(tl.sum(res * res, axis=0) / hidden + eps_b)
        w_b = tl.load(w_b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        out = (w_b * h.to(dtype).to(tl.float32)).to(dtype)
        tl.store(out_norm_ptr + base + offs, out, mask=mask)


def add_norm_norm(
    residual: torch.Tensor,
    branch: torch.Tensor | None,
    norm_a,
    norm_b,
    *,
    norm_sum: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(residual + norm_a(branch), norm_b(that)) for rows [n, hidden]; with `norm_sum`
    (Huginn's order) the new residual is norm_a(branch + residual) instead. `norm_a` /
    `norm_b` are RMSNorm modules (`weight`, `eps`). Without a branch: (residual,
    norm_b(residual)); without `norm_b`, the second is None."""
    rows, hidden = residual.shape
    if hidden > MAX_HIDDEN:
        raise ValueError(f"fused norms take hidden sizes up to {MAX_HIDDEN}, got {hidden}")
    assert branch is not None or norm_b is not None, "nothing to compute"
    residual = residual.contiguous()
    out_norm = None if norm_b is None else torch.empty_like(residual)
    out_res = residual if branch is None else torch.empty_like(residual)
    branch_arg = residual if branch is None else branch.contiguous()
    block = triton.next_power_of_2(hidden)
    any_norm = norm_b if norm_a is None else norm_a
    norm_b = norm_b or any_norm
    if rows:
        _add_norm_norm_kernel[(rows,)](
            residual, branch_arg, any_norm.weight, norm_b.weight, out_res,
            out_res if out_norm is None else out_norm,
            residual.stride(0), hidden, any_norm.eps, norm_b.eps,
            HAS_BRANCH=branch is not None, NORM_SUM=norm_sum, HAS_NORM_B=out_norm is not None,
            BLOCK=block, num_warps=min(16, max(4, block // 512)),
        )  # fmt: skip
    return out_res, out_norm
