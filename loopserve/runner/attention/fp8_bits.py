"""Float to fp8 inside a Triton kernel, by integer arithmetic on the float's bits.

`kv_cache_dtype` fp8 stores K/V rounded by one rule (`models/kv_dtype.to_storage`: clamp to
the type's finite range, round to nearest even). A kernel that writes K/V (`write_kv`, the
fused rotary, the fused q/k/v GEMM) stores `fp8_bits` of each value instead of a cast: the same bytes as torch's
rounding, on every GPU target (Triton has no e4m3 cast before sm_89) and under the
interpreter on CPU (whose float-to-fp8 cast is wrong: 7.9 becomes 4.0 in e4m3 under Triton
3.9), so the kernels are checked against torch byte for byte. The caches are passed as
`uint8` views (`kv_write_target`); `FP8_CODES` names the formats a kernel's `FP8` constexpr selects.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# torch dtype -> the kernels' FP8 constexpr (0: the cache has the model's type; no encoding)
FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def fp8_code(cache: torch.Tensor, values: torch.Tensor) -> int:
    """The FP8 constexpr of a write of `values` into `cache`: 0 when no encoding is needed
    (same type), else the cache's format."""
    if cache.dtype == values.dtype:
        return 0
    return FP8_CODES[cache.dtype]


def kv_write_target(
    key_cache: torch.Tensor, value_cache: torch.Tensor, values: torch.Tensor
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(the FP8 constexpr, key cache, value cache) of a K/V write of `values`, the caches as
    the kernel writes them: their `uint8` views when it encodes."""
    code = fp8_code(key_cache, values)
    if code:
        return code, key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    return code, key_cache, value_cache


@triton.jit
def fp8_bits(value, FP8: tl.constexpr):
    """`value` as the cache holds it: itself when FP8 = 0 (the model's type), else its uint8
    bits in e4m3fn (FP8 = 1: bias 7, 3 mantissa bits, largest 448) or e5m2 (FP8 = 2: bias
    15, 2 mantissa bits, largest 57,344): clamped to the largest finite value, rounded to
    nearest even, NaN as 0x7F (0xFF with the sign bit), as torch's `to_storage` does. Every
    K/V write stores `fp8_bits(value, FP8)`, so the rule lives here alone."""
    if FP8 == 0:
        stored = value
    else:
        if FP8 == 1:
            BIAS: tl.constexpr = 7
            M: tl.constexpr = 3
            LARGEST: tl.constexpr = 448.0
        else:
            BIAS: tl.constexpr = 15
            M: tl.constexpr = 2
            LARGEST: tl.constexpr = 57344.0
        SHIFT: tl.constexpr = 23 - M
        x = value.to(tl.float32)
        negative = x.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 too
        a = tl.minimum(tl.abs(x), LARGEST)  # NaN handled below
        bits = a.to(tl.int32, bitcast=True)
        exponent = (bits >> 23) - 127
        # A normal result: drop SHIFT mantissa bits, ties to even; a carry moves the exponent.
        lsb = (bits >> SHIFT) & 1
        normal = ((bits + ((1 << (SHIFT - 1)) - 1) + lsb) >> SHIFT) - ((127 - BIAS) << M)
        # A subnormal result: the significand (implicit 1 included) shifted to units of the
        # smallest subnormal, 2^(1 - BIAS - M), ties to even; 2^M units is the smallest normal.
        mantissa = (bits & 0x7FFFFF) | 0x800000
        s = tl.minimum(tl.maximum(23 + 1 - BIAS - M - exponent, 1), 31)
        kept = mantissa >> s
        rest = mantissa & ((1 << s) - 1)
        half = 1 << (s - 1)
        up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
        subnormal = kept + up.to(tl.int32)
        code = tl.where(exponent < 1 - BIAS, subnormal, normal)
        code = tl.where(x != x, 0x7F, code)  # NaN (its sign kept, as torch keeps it)
        code = tl.where(negative, code | 0x80, code)
        stored = code.to(tl.uint8)
    return stored
