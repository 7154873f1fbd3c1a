"""A small seeded MomentumLoop checkpoint (`models/momentum.py`), for tests."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from loopserve.models.loader import save_model
from loopserve.models.momentum import MomentumConfig, MomentumLoopLM
from loopserve.models.tiny import seeded_init


def make_tiny_momentum_checkpoint(
    path: str | os.PathLike, *, seed: int = 2, head_gain: float = 6.0, **overrides
) -> Path:
    """A seeded tiny checkpoint: 2 layers, hidden 32, 4 heads over 2 K/V heads, D = 4; the LM
    head is scaled by `head_gain` so that the confidence spreads over (0, 1) and exits
    happen at every loop."""
    fields = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_core_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_loops=4,
                  extra={"torch_dtype": "float32"})  # fmt: skip
    model = MomentumLoopLM(MomentumConfig(**{**fields, **overrides}))

    def value(name: str, noise: torch.Tensor) -> torch.Tensor:
        if "norm" in name:
            return 1.0 + 0.1 * noise
        gain = head_gain if name == "lm_head.weight" else 1.0
        return gain * noise / noise.shape[-1] ** 0.5

    seeded_init(model, seed, value, sort_names=True)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, out)
    return out
