"""Row-selection policies, chosen once at construction (docs/architecture.md, "Scheduler"). Torch-free.

Decode policies pick which decode tokens (rows of the scheduler's `DecodeTable`) run in a core
call:
- `RefillPolicy` (continuous depth batching): every ready token, at any depth; a token that
  exits frees its row at once and its request's next token can take a row next step.
- `NoRefillPolicy` (cohort baseline): a cohort of tokens runs until all of them exit; exited
  requests wait for the cohort to drain before a new cohort forms.

Prompt policies pick prompt work (`PromptWork`: a chunk at a depth) in admission order under
a row budget, never splitting an item:
- `AtomicPromptPolicy` (arm A0): one new chunk per request per step, running all D loops in
  the step.
- `PerDepthPromptPolicy` (arm A1): one chunk per request in flight, one depth per step.
- `WavefrontPromptPolicy` (WCPB): chunks of one request at different depths share a call.
  Chunk c at depth d is ready once chunk c-1 finished depth d (LAST_EXITED: c@d reads only
  the depth-d KV of earlier chunks) and c finished depth d-1; a new chunk opens once the
  previous one finished depth 0.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from loopserve.scheduler.decode_table import DecodeTable
from loopserve.scheduler.request import PromptChunk, Request


class DecodePolicy(ABC):
    """Chooses rows of the scheduler's `DecodeTable` (the decode tokens in flight) for a
    call. Rows are numpy index arrays, oldest request first."""

    @abstractmethod
    def select(self, table: DecodeTable, max_rows: int) -> np.ndarray:
        """Rows whose in-flight decode token runs one loop this step."""

    def on_token_exits(self, table: DecodeTable, rows: np.ndarray) -> None:  # noqa: B027
        """These rows' decode tokens just exited (optional hook)."""

    def select_ahead(self, table: DecodeTable, leaving: np.ndarray, max_rows: int) -> np.ndarray:
        """Async scheduling: the rows of the next step chosen before this step's results are
        applied, where the tokens of rows `leaving` exit this step (their next token waits a
        step). Default: every other ready row, oldest first."""
        ready = table.ready.copy()
        ready[leaving] = False
        return table.oldest_first(ready.nonzero()[0])[:max_rows]


class RefillPolicy(DecodePolicy):
    def select(self, table: DecodeTable, max_rows: int) -> np.ndarray:
        return table.oldest_first(table.ready.nonzero()[0])[:max_rows]

    def select_ahead(self, table: DecodeTable, leaving: np.ndarray, max_rows: int) -> np.ndarray:
        """The same rows as `select`: a leaving token's request keeps its row for its next
        token (started by `update`, built into the step after it); a request that finishes
        instead is dropped then, and its row stays empty for that one step."""
        return self.select(table, max_rows)


class NoRefillPolicy(DecodePolicy):
    """The cohort is the table's `cohort` column (cleared when a row is freed)."""

    def select(self, table: DecodeTable, max_rows: int) -> np.ndarray:
        if not table.cohort.any():
            table.cohort[table.oldest_first(table.ready.nonzero()[0])[:max_rows]] = True
        return table.oldest_first((table.ready & table.cohort).nonzero()[0])

    def on_token_exits(self, table: DecodeTable, rows: np.ndarray) -> None:
        table.cohort[rows] = False

    def select_ahead(self, table: DecodeTable, leaving: np.ndarray, max_rows: int) -> np.ndarray:
        """The cohort minus its leaving tokens; none when the whole cohort leaves (a new cohort
        forms only once results are applied, as in synchronous scheduling)."""
        cohort = table.cohort & table.ready
        cohort[leaving] = False
        return table.oldest_first(cohort.nonzero()[0])


@dataclass(frozen=True, slots=True)
class PromptWork:
    """Run `chunk` of `request` from its next depth for `num_depths` loops this step."""

    request: Request
    chunk: PromptChunk
    num_depths: int

    @property
    def depth(self) -> int:
        return self.chunk.next_depth


NewHandle = Callable[[], int]


class PromptPolicy(ABC):
    def __init__(
        self, chunk_size: int, num_loops: int, new_handle: NewHandle, *, fill: bool = True
    ) -> None:
        self.chunk_size = chunk_size
        self.fill = fill  # cut new chunks to the rows left (`_open_chunk`)
        self.num_loops = num_loops
        self.new_handle = new_handle

    def select(self, prompt_requests: list[Request], max_rows: int) -> list[PromptWork]:
        """Whole prompt items in admission order until the next one does not fit."""
        work: list[PromptWork] = []
        rows = 0
        for request in prompt_requests:
            for chunk in self.ready_chunks(request, max_rows - rows):
                if chunk is None:
                    return work
                work.append(PromptWork(request, chunk, self.depths_per_step(request)))
                rows += chunk.count
        return work

    def depths_per_step(self, request: Request) -> int:
        """Loops a chunk of `request` runs in one step."""
        return 1

    @abstractmethod
    def ready_chunks(self, request: Request, rows_left: int) -> list[PromptChunk | None]:
        """The request's ready chunks in order; None marks one that does not fit (stop)."""

    def _open_chunk(self, request: Request, rows_left: int) -> PromptChunk | None:
        """A new chunk at the request's prompt frontier, cut to fill the call: its length is
        min(remaining prompt, rows left in the call, chunk size), fixed from now on. None
        when the call has no row left (with `fill` off: when the whole chunk does not fit)."""
        start = request.next_chunk_start
        count = min(self.chunk_size, request.num_prompt_tokens - start)
        if self.fill:
            count = min(count, rows_left)
        if count <= 0 or count > rows_left:
            return None
        chunk = PromptChunk(start, count, self.new_handle())
        request.next_chunk_start = chunk.end
        request.prompt_chunks.append(chunk)
        return chunk

    def _has_unchunked(self, request: Request) -> bool:
        return request.next_chunk_start < request.num_prompt_tokens


class AtomicPromptPolicy(PromptPolicy):
    def depths_per_step(self, request: Request) -> int:
        """Every loop its prompt positions run (the model's D, or the request's r)."""
        return request.prompt_loops or self.num_loops

    def ready_chunks(self, request: Request, rows_left: int) -> list[PromptChunk | None]:
        assert not request.prompt_chunks, "atomic chunks complete within their step"
        return [self._open_chunk(request, rows_left)]


class PerDepthPromptPolicy(PromptPolicy):
    def ready_chunks(self, request: Request, rows_left: int) -> list[PromptChunk | None]:
        if request.prompt_chunks:
            chunk = request.prompt_chunks[0]
            return [chunk if chunk.count <= rows_left else None]
        return [self._open_chunk(request, rows_left)]


class WavefrontPromptPolicy(PromptPolicy):
    def ready_chunks(self, request: Request, rows_left: int) -> list[PromptChunk | None]:
        ready: list[PromptChunk | None] = []
        previous: PromptChunk | None = None
        for chunk in request.prompt_chunks:
            if previous is None or previous.next_depth > chunk.next_depth:
                if chunk.count > rows_left:
                    return ready + [None]
                ready.append(chunk)
                rows_left -= chunk.count
            previous = chunk
        last = request.prompt_chunks[-1] if request.prompt_chunks else None
        if self._has_unchunked(request) and (last is None or last.next_depth >= 1):
            ready.append(self._open_chunk(request, rows_left))
        return ready


PROMPT_POLICIES: dict[str, type[PromptPolicy]] = {
    "atomic": AtomicPromptPolicy,
    "per_depth": PerDepthPromptPolicy,
    "wavefront": WavefrontPromptPolicy,
}
