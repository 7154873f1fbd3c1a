"""Attention backends by name, imported lazily: `torch` (reference) and `triton` (kernels).

`resolve_attention_backend` turns `auto` into a concrete name for a device and rejects
combinations that cannot run (Triton on CPU runs only under its interpreter, which is slow
and for tests: the engine takes it only when `TRITON_INTERPRET=1` says so; the kernels then
pick the interpreter per launch, `triton_jit.device_kernel`; batch-invariant mode
runs only on the torch path, whose row-invariant variant lives in
`loopserve.runner.batch_invariant`). `make_attention_backend` is the one call the runner makes.
Importing this module imports neither backend, so a CPU-only install without triton never
touches it.
"""

from __future__ import annotations

import importlib
import os

import torch

from loopserve.engine_args import ATTENTION_BACKENDS
from loopserve.errors import ConfigError
from loopserve.runner.attention.base import PagedAttentionBackend
from loopserve.runner.transfers import Transfers

_IMPLEMENTATIONS = {
    "torch": ("loopserve.runner.attention.torch_paged", "TorchBackend"),
    "triton": ("loopserve.runner.attention.triton_backend", "TritonBackend"),
}
_ROW_INVARIANT = ("loopserve.runner.batch_invariant", "RowInvariantTorchBackend")


def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_attention_backend(
    name: str, device: str | torch.device, *, batch_invariant: bool = False
) -> str:
    """`auto` -> triton on CUDA, torch elsewhere (always torch in batch-invariant mode);
    validates an explicit choice."""
    device_type = torch.device(device).type
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; got {name!r}"
        )
    if batch_invariant and name == "triton":
        raise ConfigError(
            "batch_invariant=True runs only on the torch attention path; use "
            "attention_backend='torch' or 'auto'"
        )
    if name == "auto":
        return "triton" if device_type == "cuda" and not batch_invariant else "torch"
    if name == "triton" and device_type != "cuda" and not triton_interpreter_enabled():
        raise ConfigError(
            f"attention_backend='triton' on device {device_type!r} needs the Triton interpreter: "
            "set TRITON_INTERPRET=1 before starting (slow; for tests), or use "
            "attention_backend='torch' (or 'auto') on CPU"
        )
    return name


def make_attention_backend(
    name: str,
    kv_cache: torch.Tensor,
    *,
    block_size: int,
    scale: float,
    batch_invariant: bool = False,
    cascade: bool = False,
    transfers: Transfers | None = None,
) -> PagedAttentionBackend:
    """The backend `name` (`auto` resolved for the cache's device) over `kv_cache`; with
    `batch_invariant`, the torch path's row-invariant variant (never cascade: grouping rows
    would make a row's bits depend on the others); `cascade` asks for cascade attention
    (honoured where the backend `supports_cascade`)."""
    resolved = resolve_attention_backend(name, kv_cache.device, batch_invariant=batch_invariant)
    module_name, class_name = _ROW_INVARIANT if batch_invariant else _IMPLEMENTATIONS[resolved]
    cascade = cascade and not batch_invariant
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(
            f"attention_backend={resolved!r} needs a package that is not installed ({err}); "
            "install the gpu extra (`pip install loopserve[gpu]`) or choose 'torch'"
        ) from err
    backend_class = getattr(module, class_name)
    return backend_class(
        kv_cache, block_size=block_size, scale=scale, cascade=cascade, transfers=transfers
    )
