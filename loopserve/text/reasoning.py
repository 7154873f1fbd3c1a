"""Reasoning parsers: move a model's reasoning out of the answer text.

Thinking models (Ouro-1.4B/2.6B-Thinking, and most others) write their reasoning between
`<think>` and `</think>` before the answer; clients expect it apart, as `reasoning_content`
on the chat message and on stream deltas (vLLM's and DeepSeek's field). A parser splits a
choice's text into (reasoning, content), whole (`split`) or as the text streams
(`ReasoningStream`), where a tag may arrive cut across deltas.

- The reasoning is the text after the start tag up to the end tag, when the output starts
  with the start tag (leading whitespace allowed). A chat template that already opens the
  block in the prompt (its generation prompt ends with the start tag, as DeepSeek-R1's and
  Qwen3's do) makes the output start inside it: `started=True`.
- An output that opened the block and never closed it (cut by max_tokens) is all reasoning;
  an output that does not start with the tag is all content.

`PARSERS` names the parsers `--reasoning-parser` takes. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    start: str
    end: str

    def split(self, text: str, *, started: bool = False) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole output."""
        stream = ReasoningStream(self, started=started)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        reasoning += more_reasoning
        content += more_content
        return (reasoning if stream.saw_reasoning else None), content


class ReasoningStream:
    """Splits streamed text: `feed(delta)` -> (reasoning part, content part) of what can be
    told so far; a possible tag cut at the delta's end is held back until the next delta (or
    `finish`)."""

    def __init__(self, parser: ReasoningParser, *, started: bool = False) -> None:
        self.parser = parser
        # "before": the start tag may still come; "inside": reasoning; "after": content.
        self.state = "inside" if started else "before"
        self.saw_reasoning = started
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        text = self._held + delta
        self._held = ""
        reasoning, content = "", ""
        while text:
            if self.state == "before":
                stripped = text.lstrip()
                if not stripped:  # only whitespace yet: the tag may follow
                    self._held = text
                    return reasoning, content
                start = self.parser.start
                if stripped.startswith(start):
                    self.state, self.saw_reasoning = "inside", True
                    text = stripped[len(start) :]
                elif start.startswith(stripped):  # a cut start tag
                    self._held = text
                    return reasoning, content
                else:
                    self.state = "after"
            elif self.state == "inside":
                end = self.parser.end
                at = text.find(end)
                if at >= 0:
                    reasoning += text[:at]
                    text = text[at + len(end) :]
                    self.state = "after"
                    continue
                keep = _partial_suffix(text, end)
                reasoning += text[: len(text) - keep]
                self._held = text[len(text) - keep :]
                return reasoning, content
            else:
                content += text
                text = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output ended."""
        held, self._held = self._held, ""
        if self.state == "inside":
            return held, ""
        return "", held


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


THINK = ReasoningParser("think", "<think>", "</think>")
PARSERS = {parser.name: parser for parser in (THINK,)}


def reasoning_token_count(
    parser: ReasoningParser, decode, token_ids: list[int], *, started: bool = False
) -> int:
    """Output tokens that carry the reasoning: up to and including the token that completes
    the end tag (all of them when the block never closes; 0 without reasoning). `decode`:
    token ids -> text. A binary search over prefixes, on the final output only."""
    text = decode(token_ids)
    if parser.split(text, started=started)[0] is None:
        return 0
    if not _closes(parser, text, started):
        return len(token_ids)
    low, high = 1, len(token_ids)  # the smallest prefix whose text closed the block
    while low < high:
        middle = (low + high) // 2
        if _closes(parser, decode(token_ids[:middle]), started):
            high = middle
        else:
            low = middle + 1
    return low


def _closes(parser: ReasoningParser, text: str, started: bool) -> bool:
    stream = ReasoningStream(parser, started=started)
    stream.feed(text)
    return stream.state == "after" and stream.saw_reasoning
