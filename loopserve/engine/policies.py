"""Row-selection policies, chosen once at construction (DESIGN §6).

Decode policies pick which decode tokens take rows in a decode core call:
- `RefillPolicy` (continuous depth batching): every ready token, at any depth; a token that
  exits frees its row at once and its request's next token can take a row next step.
- `NoRefillPolicy` (cohort baseline): a cohort of tokens runs until all of them exit; exited
  requests wait for the cohort to drain before a new cohort forms.

Prompt policies turn prompt-phase requests into prompt chunks:
- `AtomicPromptPolicy`: one chunk per request per step, each running all D loops inside the
  step, packed in admission order under the row budget.
Torch-free.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from loopserve.engine.request import Request


class DecodePolicy(ABC):
    @abstractmethod
    def select(self, decode_requests: list[Request], max_rows: int) -> list[Request]:
        """Requests whose in-flight decode token runs one loop this step (oldest first)."""

    def on_token_exit(self, request: Request) -> None:  # noqa: B027 - optional hook
        """A request's decode token just exited."""

    def on_request_gone(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """A request finished, was aborted or was preempted."""


class RefillPolicy(DecodePolicy):
    def select(self, decode_requests: list[Request], max_rows: int) -> list[Request]:
        return decode_requests[:max_rows]


class NoRefillPolicy(DecodePolicy):
    def __init__(self) -> None:
        self.cohort: set[str] = set()

    def select(self, decode_requests: list[Request], max_rows: int) -> list[Request]:
        if not self.cohort:
            self.cohort = {r.request_id for r in decode_requests[:max_rows]}
        return [r for r in decode_requests if r.request_id in self.cohort]

    def on_token_exit(self, request: Request) -> None:
        self.cohort.discard(request.request_id)

    def on_request_gone(self, request_id: str) -> None:
        self.cohort.discard(request_id)


@dataclass(frozen=True, slots=True)
class PromptChunk:
    request: Request
    start: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.count

    @property
    def holds_last_position(self) -> bool:
        return self.end == self.request.num_prompt_tokens


class PromptPolicy(ABC):
    @abstractmethod
    def select(self, prompt_requests: list[Request], max_rows: int) -> list[PromptChunk]:
        """Prompt chunks to run this step, in admission order."""


class AtomicPromptPolicy(PromptPolicy):
    """Chunks of `chunk_size` positions (1 under SHARED: prompts run position-major)."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    def select(self, prompt_requests: list[Request], max_rows: int) -> list[PromptChunk]:
        chunks: list[PromptChunk] = []
        rows = 0
        for request in prompt_requests:
            start = request.next_chunk_start
            count = min(self.chunk_size, request.num_prompt_tokens - start)
            if rows + count > max_rows:
                break
            chunks.append(PromptChunk(request, start, count))
            rows += count
        return chunks
