"""How K/V are stored: the KV cache's element type (`kv_cache_dtype`).

`auto` stores K and V in the model's dtype. `fp8_e4m3` and `fp8_e5m2` store one byte per
element (torch's `float8_e4m3fn`, largest finite value 448, and `float8_e5m2`, 57,344): the
cache holds twice the tokens of a bf16 one in the same memory, and every loop reads half the
bytes. A looped model reads and keeps a K/V plane per loop, so its K/V outweighs a dense
model's D times over; halving it moves both the memory ceiling and the decode read.

The conversion is one rule everywhere: clamp to the storage type's finite range (no scale
factor), then round to nearest (`to_storage`); every read converts back exactly (fp8 values
are exact in bf16, fp16 and fp32). The engine stores this way on every path that writes K/V
(the torch and Triton backends, the batch-invariant path); the dense references
(`loopserve.reference`, `models.huginn_dense`) round each written K/V through the same
conversion (`round_trip`), so an fp8 engine is checked for exact equality against them as
the default one is.
"""

from __future__ import annotations

import torch

# Triton converts float8 e4m3 (its fp8e4nv) from compute capability 8.9 on, e5m2 on every
# GPU: the engine refuses e4m3 with the Triton backend below it (`engine.model_setup`).
FP8_E4M3_MIN_CAPABILITY = 89

# kv_cache_dtype name -> storage dtype (`auto`: the model's own, see `kv_storage_dtype`)
KV_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_storage_dtype(name: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of a cache of `kv_cache_dtype` `name` (None or `auto`: the model's)."""
    if name in (None, "auto"):
        return model_dtype
    if name not in KV_STORAGE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {sorted(KV_STORAGE_DTYPES)}")
    return KV_STORAGE_DTYPES[name]


def to_storage(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as stored in a cache of element type `dtype`: clamped to its finite range (a
    value past it saturates, never becomes inf or NaN), then rounded to nearest."""
    if x.dtype == dtype:
        return x
    if dtype.itemsize < x.dtype.itemsize:
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def round_trip(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`x` stored at `dtype` and read back in its own dtype (None: unchanged)."""
    if dtype is None or dtype == x.dtype:
        return x
    return to_storage(x, dtype).to(x.dtype)
