"""A tiny byte-level BPE tokenizer trained on an embedded corpus, for toy checkpoints.

Tests and the embedded default model need a real `tokenizer.json` without a download; this
writes one (plus `tokenizer_config.json` with a ChatML template and `generation_config.json`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from loopserve.text.tokenizer import CHATML_TEMPLATE, MIN_VOCAB_SIZE, SPECIAL_TOKENS, _write_json

_CORPUS = """\
The quick brown fox jumps over the lazy dog. This sentence uses every letter of the alphabet,
and for that reason it has been used for many years to test typewriters and computer fonts.

A language model reads a sequence of tokens and predicts the next one. A looped language model
applies the same stack of layers more than once before it makes that prediction. Each pass over
the stack is called a loop. Some tokens are easy and need only one or two loops; other tokens are
hard and need all of them. When the model is confident, it may exit early and save compute.

On Monday, March 3rd, 2025, the team met at 9:30 in the morning. They had 12 tasks, 4 engineers
and 1 deadline. "Can we finish by Friday?" asked the manager. "Yes, if nothing breaks," said
the lead. It was not a promise; it was a plan. By 5:45 p.m. they had closed 7 of the 12 tasks.

Numbers appear everywhere: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100, 256, 512, 1024, 2048,
3.14159, 2.71828, 1,000,000 and -17. Prices are written as $19.99 or 45%; times as 12:00;
dates as 2024-06-30; versions as v1.2.3; and ratios as 3/4 or 16:9.

Good software is simple to read. Write small functions that do one thing. Name things for what
they are, not for how they are built. Test the behaviour you promise, and keep the tests fast.
When something fails, the error message should say what went wrong and how to fix it. Comments
should explain why the code is the way it is, because the code itself already says what it does.

The weather today is cold and wet. Rain fell all night, and the river is high. The children
stayed inside, read books, played games and drank hot chocolate. In the evening the sky cleared,
the wind dropped, and the first stars came out over the hills. Tomorrow should be warm and dry.

Questions and answers:
Q: What is the capital of France?
A: The capital of France is Paris.
Q: How many days are there in a week?
A: There are seven days in a week.
Q: Who wrote the play Hamlet?
A: William Shakespeare wrote it, around the year 1600.

A small cafe on the corner sells coffee, tea, bread and soup. Its owner, a naive but kind man
from Zurich, opens at 7 and closes at 19. People say the café is the best in town; the crème
brûlée is famous, and the piñata at the party was a hit. Everyone is welcome, they say, and
nobody leaves hungry.

Lists help the reader:
- first, gather the data;
- second, clean it and check it;
- third, train the model;
- finally, measure the results and write them down.

(Parentheses), [brackets], {braces}, <angle brackets>, 'single quotes', "double quotes",
back\\slashes, under_scores, hyphen-ated words, and email@example.com are all part of text too!
Is that right? Yes! No... maybe; perhaps: who knows?
"""


def write_byte_level_bpe_tokenizer(path: str | os.PathLike[str], *, vocab_size: int = 512) -> None:
    """Train a byte-level BPE tokenizer on the embedded corpus and save it into directory `path`.

    Writes `tokenizer.json`, `tokenizer_config.json` (ChatML template, EOS `<|im_end|>`) and
    `generation_config.json`; other files in `path` are left alone. `vocab_size` counts the
    special tokens, the 256 byte symbols and the merges. The output is deterministic.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    train_byte_level_bpe(_CORPUS.splitlines(keepends=True), vocab_size, path)


def train_byte_level_bpe(
    texts: Iterable[str], vocab_size: int, path: str | os.PathLike[str]
) -> None:
    """Train a byte-level BPE on `texts` and save it with a ChatML config into `path`.

    The special tokens take ids 0..2; EOS is `<|im_end|>` (and `<|endoftext|>`). Raises
    `ValueError` when `texts` cannot reach `vocab_size` tokens. Deterministic.
    """
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(texts, trainer)
    if backend.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the training text supports at most {backend.get_vocab_size()} tokens, "
            f"got vocab_size={vocab_size}"
        )
    special_ids = {token: backend.token_to_id(token) for token in SPECIAL_TOKENS}
    assert list(special_ids.values()) == list(range(len(SPECIAL_TOKENS))), special_ids
    eos_token, pad_token = "<|im_end|>", "<|endoftext|>"
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for token, token_id in special_ids.items()
        },
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (eos_token, pad_token)],
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos_token,
        "model_max_length": 32768,
        "pad_token": pad_token,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    generation_config = {
        "eos_token_id": [special_ids[eos_token], special_ids[pad_token]],
        "bos_token_id": None,
    }
    out_dir = Path(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    backend.save(str(out_dir / "tokenizer.json"), pretty=True)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "generation_config.json", generation_config)
