"""GPT-2-style tokenizer files (`vocab.json` + `merges.txt`) as a `tokenizers` byte-level BPE.

Checkpoints saved by `GPT2Tokenizer` ship these files instead of `tokenizer.json`. `gpt2_backend`
builds the tokenizer `GPT2TokenizerFast` would: a BPE model from the two files, a byte-level
pre-tokenizer and decoder, and the added tokens (from `tokenizer_config.json`'s
`added_tokens_decoder` and `added_tokens.json`) at the ids the checkpoint gives them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from loopserve.errors import ModelLoadError


def gpt2_backend(
    directory: Path, config: dict[str, Any], added_tokens: dict[str, Any]
) -> tokenizers.Tokenizer:
    """A byte-level BPE from GPT-2-style `vocab.json` + `merges.txt`, as `GPT2Tokenizer` builds
    it, with the added tokens placed at the ids the checkpoint gives them."""
    try:
        model = models.BPE.from_file(str(directory / "vocab.json"), str(directory / "merges.txt"))
    except Exception as exc:  # the Rust loader raises plain Exception on bad files
        raise ModelLoadError(f"cannot load vocab.json + merges.txt in {directory}: {exc}") from exc
    backend = tokenizers.Tokenizer(model)
    add_prefix_space = bool(config.get("add_prefix_space", False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    backend.decoder = decoders.ByteLevel()
    added: dict[int, tokenizers.AddedToken] = {}
    for token, token_id in added_tokens.items():
        if isinstance(token_id, int):
            added[token_id] = tokenizers.AddedToken(token, special=True, normalized=False)
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        if isinstance(entry, dict) and isinstance(entry.get("content"), str) and key.isdigit():
            added[int(key)] = tokenizers.AddedToken(
                entry["content"],
                single_word=bool(entry.get("single_word", False)),
                lstrip=bool(entry.get("lstrip", False)),
                rstrip=bool(entry.get("rstrip", False)),
                normalized=bool(entry.get("normalized", False)),
                special=bool(entry.get("special", True)),
            )
    for token_id in sorted(added):  # new tokens get the next free id, so add them in id order
        token = added[token_id]
        if token.special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
        if backend.token_to_id(token.content) != token_id:
            raise ModelLoadError(
                f"added token {token.content!r} should have id {token_id} in {directory}, "
                f"but the vocabulary gives it {backend.token_to_id(token.content)}"
            )
    return backend
