"""Small random Ouro checkpoints in the real Hugging Face format, for tests and demos.

`make_tiny_checkpoint` writes `config.json` + `model.safetensors` with the real tensor names
(seeded random weights) and, on request, a working byte-level BPE tokenizer. The weights are
scaled so that logits and exit hazards vary from token to token, which keeps sampling and
early-exit tests meaningful.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from loopserve.models.config import OuroConfig
from loopserve.models.loader import save_model
from loopserve.models.ouro import OuroForLoopedLM

DEFAULT_MODEL_DIR = Path(__file__).parent / "default"


def seeded_init(model, seed: int, value, *, sort_names: bool = False) -> None:
    """Every parameter from one seeded generator, in `named_parameters` order (or sorted by
    name): `value(name, noise)` is the weight given standard normal noise of its shape. The
    tiny checkpoints of every family are made this way, so anyone can rebuild them."""
    generator = torch.Generator().manual_seed(seed)
    params = model.named_parameters()
    with torch.no_grad():
        for name, param in sorted(params) if sort_names else params:
            param.copy_(value(name, torch.randn(param.shape, generator=generator)))


def _init_weights(model: OuroForLoopedLM, seed: int) -> None:
    hidden = model.config.hidden_size

    def value(name: str, noise: torch.Tensor) -> torch.Tensor:
        if name.endswith("norm.weight") or "layernorm" in name:
            return 1.0 + 0.1 * noise  # near one, but not exactly: misuse shows
        if "early_exit_gate.weight" in name:
            return noise * (3.0 / hidden**0.5)  # hazards spread over (0, 1)
        if "early_exit_gate.bias" in name:
            return noise * 0.5
        if "embed_tokens" in name:
            return noise
        return noise / noise.shape[-1] ** 0.5

    seeded_init(model, seed, value)


def make_tiny_checkpoint(
    path: str | os.PathLike,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    total_ut_steps: int = 4,
    intermediate_size: int | None = None,
    head_dim: int | None = None,
    seed: int = 0,
    with_tokenizer: bool = False,
    max_position_embeddings: int = 4096,
    max_shard_bytes: int = 0,
) -> Path:
    """Write a random Ouro-architecture checkpoint to `path` and return the path."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = OuroConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or int(hidden_size * 2.75),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        total_ut_steps=total_ut_steps,
        head_dim=head_dim,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=(2,) if with_tokenizer else (0,),
        bos_token_id=None,
        pad_token_id=0,
        extra={"torch_dtype": "float32"},
    )
    model = OuroForLoopedLM(config)
    _init_weights(model, seed)
    save_model(model, out, max_shard_bytes=max_shard_bytes)
    if with_tokenizer:
        from loopserve.text.toy_tokenizer import write_byte_level_bpe_tokenizer

        write_byte_level_bpe_tokenizer(out, vocab_size=vocab_size)
    return out


def make_default_model(path: str | os.PathLike) -> Path:
    """A random checkpoint of the old embedded default's shape (hidden 128, 4 layers, vocab 1024).

    The shipped default (`DEFAULT_MODEL_DIR`) is a trained model written by
    `tools/train_default_model.py`; this random stand-in no longer overwrites it.
    """
    return make_tiny_checkpoint(
        path,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=1024,
        intermediate_size=352,
        total_ut_steps=4,
        seed=1234,
        with_tokenizer=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random Ouro checkpoint.")
    parser.add_argument("path", nargs="?", default=None, help="output directory")
    parser.add_argument(
        "--default", action="store_true", help="a random model of the old default's shape"
    )
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--with-tokenizer", action="store_true")
    args = parser.parse_args()
    if args.path is None:
        parser.error("path is required")
    if args.default:
        print(make_default_model(args.path))
        return
    print(
        make_tiny_checkpoint(
            args.path,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            vocab_size=args.vocab_size,
            seed=args.seed,
            with_tokenizer=args.with_tokenizer,
        )
    )


if __name__ == "__main__":
    main()
