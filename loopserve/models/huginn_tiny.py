"""Small random Huginn checkpoints in the published layout, for tests and golden files.

Same layout as Huginn-0125 (2 prelude, 4 core, 2 coda layers, tied embeddings, q/k bias, the
`transformer.*` tensor names), tiny widths. The weights are seeded; the adapter's half that
reads the previous state is scaled down so the recurrence settles within a few steps, which
gives the convergence exit criteria something to decide.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from loopserve.models.huginn import HuginnForLoopedLM
from loopserve.models.huginn_config import HuginnConfig
from loopserve.models.loader import save_model
from loopserve.models.tiny import seeded_init


def tiny_huginn_config(**overrides) -> HuginnConfig:
    fields = {
        "vocab_size": 128, "n_embd": 32, "n_heads": 4, "intermediate_size": 64,
        "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2,
        "mean_recurrence": 8, "block_size": 256, "extra": {"torch_dtype": "float32"},
    }  # fmt: skip
    return HuginnConfig(**{**fields, **overrides})


def init_huginn_weights(model: HuginnForLoopedLM, seed: int, *, state_gain: float) -> None:
    """Seeded weights in sorted-name order (anyone can rebuild them from the seed)."""
    width = model.config.n_embd

    def value(name: str, noise: torch.Tensor) -> torch.Tensor:
        if ".norm_" in name or name.endswith("ln_f.weight"):
            return 1.0 + 0.1 * noise
        if name.endswith("qk_bias"):
            return 0.1 * noise
        if name.endswith("wte.weight"):
            return noise / width**0.5
        if name.endswith("adapter.weight"):
            scaled = noise / (2 * width) ** 0.5
            scaled[:, :width] *= state_gain  # the previous state's half
            return scaled
        return noise / noise.shape[-1] ** 0.5

    seeded_init(model, seed, value, sort_names=True)


def make_tiny_huginn_checkpoint(
    path: str | os.PathLike,
    *,
    seed: int = 1,
    state_gain: float = 0.5,
    with_tokenizer: bool = False,
    **overrides,
) -> Path:
    """`with_tokenizer`: also write a byte-level BPE tokenizer of the model's vocabulary
    (at least 259 tokens: pass `vocab_size`)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model = HuginnForLoopedLM(tiny_huginn_config(**overrides))
    init_huginn_weights(model, seed, state_gain=state_gain)
    save_model(model, out)
    if with_tokenizer:
        from loopserve.text.toy_tokenizer import write_byte_level_bpe_tokenizer

        write_byte_level_bpe_tokenizer(out, vocab_size=model.config.vocab_size)
    return out


def weights_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over sorted names and float32 bytes: ties a golden file to the weights it was
    made from (scripts/huginn_golden.py computes the same)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()
