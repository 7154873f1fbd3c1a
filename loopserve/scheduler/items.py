"""Building a step's work items: the decode policy's tokens, the prompt policy's chunks and
recompute replay rows, alternating prompt and decode steps or mixing them in one call.

`ItemBuilder` is a collaborator the `Scheduler` owns, with explicit inputs: the prompt and
decode policies, the row budget, the exit mode, the handle allocator and the `MemoryStats`
it counts recompute rows into; its one piece of state is how many prompt steps ran in a row.
Prompt, replay and speculative work are items (`PromptChunk`, `ReplayRow`, `SpecRow` in
`loopserve.contracts`); decode tokens are rows of
the scheduler's `DecodeTable`, planned as `DecodeRows` columns (the hot path: every running
request, every loop).
Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from loopserve.contracts import DecodeRows, PromptChunk, WorkItem
from loopserve.exit import ExitMode
from loopserve.scheduler.admission import MemoryStats
from loopserve.scheduler.decode_table import DecodeTable
from loopserve.scheduler.policies import DecodePolicy, PromptPolicy, PromptWork
from loopserve.scheduler.request import Request


class StepWork(NamedTuple):
    """A step's work: prompt and replay items, and the decode rows (columns) of its call."""

    items: list[WorkItem]
    decode: DecodeRows | None


class ItemBuilder:
    """Work-item building for the `Scheduler` (see the module docstring)."""

    def __init__(
        self,
        *,
        prompt_policy: PromptPolicy,
        decode_policy: DecodePolicy,
        decode: DecodeTable,
        max_rows: int,
        max_prompt_steps_in_a_row: int,
        exit_mode: ExitMode,
        num_loops: int,
        shared: bool,
        new_handle: Callable[[], int],
        memory_stats: MemoryStats,
        num_running: Callable[[], int] = lambda: 0,
        speculative_max_seqs: int = 0,
    ) -> None:
        self.prompt_policy = prompt_policy
        self.decode_policy = decode_policy
        self.decode = decode
        self.max_rows = max_rows
        self.max_prompt_steps_in_a_row = max_prompt_steps_in_a_row
        self.exit_mode = exit_mode
        self.num_loops = num_loops
        self.shared = shared
        self._handle = new_handle
        self.memory_stats = memory_stats
        self.num_running = num_running
        self.speculative_max_seqs = speculative_max_seqs
        self.prompt_steps_in_a_row = 0

    def alternating(self, prompt_requests, replay_requests, spec_requests=()) -> StepWork:
        """A prompt step or a decode step; alternate when both kinds of work are ready.
        Replay rows (recompute after preemption) and speculative positions ride in decode
        steps."""
        limit = self.max_prompt_steps_in_a_row
        decode_ready = self.decode.num_ready > 0 or bool(replay_requests) or bool(spec_requests)
        if prompt_requests and (not decode_ready or self.prompt_steps_in_a_row < limit):
            work = self.prompt_policy.select(prompt_requests, self.max_rows)
            if work:
                self.prompt_steps_in_a_row += 1
                return StepWork([self._prompt_item(w) for w in work], None)
        self.prompt_steps_in_a_row = 0
        decode = self.decode_rows(self.decode_policy.select(self.decode, self.max_rows))
        rows = 0 if decode is None else len(decode)
        items = self._spec_items(spec_requests, self.max_rows - rows)
        items += self._replay_items(replay_requests, self.max_rows - rows - len(items))
        return StepWork(items, decode)

    def mixed(self, prompt_requests, replay_requests, spec_requests=()) -> StepWork:
        """Every ready decode row first, then speculative positions, replay rows, then whole
        prompt items until the row budget."""
        decode = self.decode_rows(self.decode_policy.select(self.decode, self.max_rows))
        rows = 0 if decode is None else len(decode)
        items = self._spec_items(spec_requests, self.max_rows - rows)
        items += self._replay_items(replay_requests, self.max_rows - rows - len(items))
        work = self.prompt_policy.select(prompt_requests, self.max_rows - rows - len(items))
        return StepWork(items + [self._prompt_item(w) for w in work], decode)

    def decode_rows(self, rows: np.ndarray) -> DecodeRows | None:
        """One loop of these rows' decode tokens, as columns (None for no row)."""
        return self.decode.decode_rows(rows) if len(rows) else None

    def _spec_items(self, spec_requests, rows: int) -> list[WorkItem]:
        """One loop of each speculating request's positions that may run, oldest request
        first; a request's positions run together or wait (a younger position must not
        overtake the loops of an older one)."""
        items: list[WorkItem] = []
        # Drafts only while few requests run: in a fuller call they would take rows (and
        # compute) from real work.
        drafts = self.num_running() <= self.speculative_max_seqs
        for request in spec_requests:
            assert request.spec is not None
            mine = request.spec.items(request.request_id, request.max_positions - 1, drafts)
            if len(mine) <= rows - len(items):
                items += mine
        return items

    def _replay_items(self, replay_requests: list[Request], rows: int) -> list[WorkItem]:
        items: list[WorkItem] = []
        for request in replay_requests:
            if rows - len(items) <= 0:
                break
            assert request.replay is not None
            items += request.replay.items(
                request.request_id, rows - len(items), self.shared, self._handle
            )
        self.memory_stats.num_replayed_rows += len(items)
        return items

    def _prompt_item(self, work: PromptWork) -> PromptChunk:
        request, chunk = work.request, work.chunk
        # The last prompt position samples the first token, unless this prompt is recomputed
        # after a preemption (the first token is known).
        last = chunk.end == request.num_prompt_tokens and not request.output_token_ids
        if request.output_token_ids:
            self.memory_stats.num_recompute_prompt_rows += chunk.count * work.num_depths
        # Prompt logprobs: scored once, by the item that runs the chunk's last loop (a
        # recompute after the first token re-runs the prompt, its logprobs already known).
        score_ids: tuple[int, ...] = ()
        score_cached = 0
        top = request.params.prompt_logprobs
        scores = top is not None and not request.output_token_ids
        if scores and work.depth + work.num_depths == (request.prompt_loops or self.num_loops):
            # The first chunk after prefix-cache hits also scores the cached positions
            # before it (from the runner's score store).
            if chunk.start > 0 and chunk.start == request.num_hit_positions:
                score_cached = chunk.start
            start = chunk.start - score_cached
            score_ids = tuple(request.prompt_token_ids[start + 1 : chunk.end + 1])
        # Scored at the loops the exit rule picks: every depth keeps its outputs.
        by_rule = scores and request.params.prompt_logprobs_loop == "exit"
        return PromptChunk(
            request_id=request.request_id,
            token_start=chunk.start,
            token_count=chunk.count,
            depth=work.depth,
            num_depths=work.num_depths,
            handle=chunk.handle,
            needs_prelude=work.depth == 0,
            token_ids=tuple(request.prompt_token_ids[chunk.start : chunk.end])
            if work.depth == 0
            else (),
            # the CDF modes read the last position's hazard at every depth; a criterion
            # reads nothing on prompts (the first token runs the request's loop bound)
            needs_gate=last and self.exit_mode.folds_hazards,
            first_token=last,
            exit_rule=request.exit_rule if last else None,
            trace_loops=request.trace_loops(0) if last else None,
            score_ids=score_ids,
            score_top=top or 0,
            score_rule=request.exit_rule if by_rule else None,
            score_cached=score_cached,
            prompt_loops=request.prompt_loops,
        )
