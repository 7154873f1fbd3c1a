"""Streaming detokenization of one request's output, with stop strings.

`IncrementalDetokenizer` turns output ids into text piece by piece, holding back partial UTF-8
characters and any tail that could still grow into a stop string. Stop *token* ids and EOS are
the scheduler's business; only stop *strings* are matched here, because they live in text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loopserve.text.tokenizer import Tokenizer

# Prompt tokens decoded as left context for the first output token (vLLM uses the same 5), so
# tokenizers that drop a leading space at the start of a decode keep it between prompt and output.
_NUM_PROMPT_CONTEXT_TOKENS = 5
# Unread tokens held back at most while the text ends in a partial character.
_MAX_PENDING_TOKENS = 4


@dataclass(frozen=True, slots=True)
class DetokenizerUpdate:
    """What one output token released: text safe to stream now, and the stop string it hit."""

    new_text: str
    stop_hit: str | None = None


class IncrementalDetokenizer:
    """Streams one request's output text, decoding only a small window of recent tokens.

    The window (vLLM's prefix/read offsets) is `window_ids`: the tokens read last time (at first,
    up to 5 prompt tokens as context) followed by the unread ones from `read_offset` on.
    Invariant: `prefix_text` is the decode of `window_ids[:read_offset]`, already in `text` for
    output tokens; new text is the window's decode past it. Text is read only when the window
    does not end in U+FFFD (a partial UTF-8 character), and released only up to the longest tail
    that could still grow into a stop string. Tokens added after a stop string hit are ignored.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        assert all(stop), "stop strings must be non-empty"
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._max_stop_chars = max((len(s) for s in self._stop), default=0)
        self._skip_special_tokens = skip_special_tokens
        context_ids = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context_ids)
        if context_text.endswith("\ufffd"):
            # The prompt ends mid-character; its bytes must not swallow the output's first ones.
            context_ids, context_text = [], ""
        self._window_ids = context_ids
        self._read_offset = len(context_ids)
        self._prefix_text = context_text
        self._text = ""  # the text not yet released (released text is only kept as pieces)
        self._released: list[str] = []
        self._num_released_chars = 0  # of `_text`; 0 between calls
        self._stop_hit: str | None = None

    @property
    def text(self) -> str:
        """All output text so far, excluding a matched stop string and anything after it."""
        return "".join(self._released) + self._text

    @property
    def num_held_chars(self) -> int:
        """Characters read but not released (a partial stop string): what each token's work
        scans, bounded by the longest stop string rather than the output's length."""
        return len(self._text)

    @property
    def stop_hit(self) -> str | None:
        """The stop string that ended the text (found by add_token or finish), or None."""
        return self._stop_hit

    def add_token(self, token_id: int) -> DetokenizerUpdate:
        """Read one output token; return the text it made safe to stream and any stop hit."""
        if self._stop_hit is not None:
            return DetokenizerUpdate("")
        self._window_ids.append(token_id)
        window_text = self._decode(self._window_ids)
        num_read = len(self._window_ids)
        if window_text.endswith("\ufffd"):
            if num_read - self._read_offset <= _MAX_PENDING_TOKENS:
                return DetokenizerUpdate("")
            # Bytes this far back can no longer complete a character (a UTF-8 character spans
            # at most 4 bytes): read all but the last tokens, so broken byte runs stream.
            num_read -= _MAX_PENDING_TOKENS - 1
            window_text = self._decode(self._window_ids[:num_read])
        if len(window_text) <= len(self._prefix_text):
            return DetokenizerUpdate("")
        self._advance(window_text, num_read)
        stop_hit = self._stop_hit
        return DetokenizerUpdate(self._release(final=stop_hit is not None), stop_hit)

    def finish(self) -> str:
        """Release everything held back, partial characters included (as U+FFFD)."""
        if self._stop_hit is None:
            window_text = self._decode(self._window_ids)
            if len(window_text) > len(self._prefix_text):
                self._advance(window_text, len(self._window_ids))
        return self._release(final=True)

    def _advance(self, window_text: str, num_read: int) -> None:
        """Append the text of the window's first `num_read` tokens, move the offsets, and cut
        at the first stop string."""
        num_old_chars = len(self._text)
        self._text += window_text[len(self._prefix_text) :]
        # The new prefix is what was just read; older tokens are never decoded again.
        del self._window_ids[: self._read_offset]
        self._read_offset = num_read - self._read_offset
        self._prefix_text = self._decode(self._window_ids[: self._read_offset])
        if not self._stop:
            return
        # A new match must end in the new text, so it starts at most max_len - 1 chars earlier.
        search_from = max(0, num_old_chars - self._max_stop_chars + 1)
        matches = [(self._text.find(s, search_from), s) for s in self._stop]
        found = [(start, s) for start, s in matches if start >= 0]
        if found:
            start, self._stop_hit = min(found, key=lambda match: match[0])
            assert start >= self._num_released_chars, "released text overlaps a stop string"
            self._text = self._text[:start]

    def _release(self, *, final: bool) -> str:
        held_chars = 0 if final else self._stop_prefix_chars()
        end = max(self._num_released_chars, len(self._text) - held_chars)
        new_text = self._text[self._num_released_chars : end]
        if new_text:
            self._released.append(new_text)
        # Released text never holds (part of) a later stop match: it was released because no
        # stop string can start in it, so only the held tail is kept for the next search.
        self._text = self._text[end:]
        self._num_released_chars = 0
        return new_text

    def _stop_prefix_chars(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        text, longest = self._text, 0
        for stop in self._stop:
            # Candidate tails start with the stop's first character, within its length - 1 of
            # the end; the earliest one that the stop starts with is the longest.
            start = text.find(stop[0], max(0, len(text) - len(stop) + 1))
            while start != -1 and len(text) - start > longest:
                if stop.startswith(text[start:]):
                    longest = len(text) - start
                    break
                start = text.find(stop[0], start + 1)
        return longest

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
