"""Building a step's work items: the decode policy's tokens, the prompt policy's chunks and
recompute replay rows, alternating prompt and decode steps or mixing them in one call.

`ItemBuilder` is a collaborator the `Scheduler` owns, with explicit inputs: the prompt and
decode policies, the row budget, the exit mode, the handle allocator and the `MemoryStats`
it counts recompute rows into; its one piece of state is how many prompt steps ran in a row.
The items are the `WorkItem`s of `loopserve.contracts`; the decode path is the scheduler's
hot loop (one item per running request per loop), so it builds NamedTuples positionally.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable

from loopserve.contracts import ItemKind, WorkItem
from loopserve.exit import ExitMode
from loopserve.scheduler.admission import MemoryStats
from loopserve.scheduler.policies import DecodePolicy, PromptPolicy, PromptWork
from loopserve.scheduler.request import Request


class ItemBuilder:
    """Work-item building for the `Scheduler` (see the module docstring)."""

    def __init__(
        self,
        *,
        prompt_policy: PromptPolicy,
        decode_policy: DecodePolicy,
        max_rows: int,
        max_prompt_steps_in_a_row: int,
        exit_mode: ExitMode,
        num_loops: int,
        shared: bool,
        new_handle: Callable[[], int],
        memory_stats: MemoryStats,
    ) -> None:
        self.prompt_policy = prompt_policy
        self.decode_policy = decode_policy
        self.max_rows = max_rows
        self.max_prompt_steps_in_a_row = max_prompt_steps_in_a_row
        self.exit_mode = exit_mode
        self.num_loops = num_loops
        self.shared = shared
        self._handle = new_handle
        self.memory_stats = memory_stats
        self.prompt_steps_in_a_row = 0

    def alternating(self, prompt_requests, decode_requests, replay_requests):
        """A prompt step or a decode step; alternate when both kinds of work are ready.
        Replay rows (recompute after preemption) ride in decode steps."""
        limit = self.max_prompt_steps_in_a_row
        decode_ready = decode_requests or replay_requests
        if prompt_requests and (not decode_ready or self.prompt_steps_in_a_row < limit):
            work = self.prompt_policy.select(prompt_requests, self.max_rows)
            if work:
                self.prompt_steps_in_a_row += 1
                return [self._prompt_item(w) for w in work]
        self.prompt_steps_in_a_row = 0
        items = self.decode_items(self.decode_policy.select(decode_requests, self.max_rows))
        return items + self._replay_items(replay_requests, self.max_rows - len(items))

    def mixed(self, prompt_requests, decode_requests, replay_requests) -> list[WorkItem]:
        """Every ready decode row first, then replay rows, then whole prompt items until the
        row budget."""
        items = self.decode_items(self.decode_policy.select(decode_requests, self.max_rows))
        items += self._replay_items(replay_requests, self.max_rows - len(items))
        work = self.prompt_policy.select(prompt_requests, self.max_rows - len(items))
        return items + [self._prompt_item(w) for w in work]

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

    def _prompt_item(self, work: PromptWork) -> WorkItem:
        request, chunk = work.request, work.chunk
        # The last prompt position samples the first token, unless this prompt is recomputed
        # after a preemption (the first token is known).
        last = chunk.end == request.num_prompt_tokens and not request.output_token_ids
        if request.output_token_ids:
            self.memory_stats.num_recompute_prompt_rows += chunk.count * work.num_depths
        # Prompt logprobs: scored once, by the item that runs the chunk's last loop (a
        # recompute after the first token re-runs the prompt, its logprobs already known).
        score_ids: tuple[int, ...] = ()
        top = request.params.prompt_logprobs
        if (
            top is not None
            and not request.output_token_ids
            and work.depth + work.num_depths == self.num_loops
        ):
            score_ids = tuple(request.prompt_token_ids[chunk.start + 1 : chunk.end + 1])
        return WorkItem(
            request_id=request.request_id,
            kind=ItemKind.PROMPT,
            token_start=chunk.start,
            token_count=chunk.count,
            depth=work.depth,
            num_depths=work.num_depths,
            handle=chunk.handle,
            needs_prelude=work.depth == 0,
            token_ids=tuple(request.prompt_token_ids[chunk.start : chunk.end])
            if work.depth == 0
            else (),
            needs_gate=last and self.exit_mode.uses_gate,
            first_token=last,
            exit_rule=request.exit_rule if last else None,
            trace_loops=request.trace_loops(0) if last else None,
            score_ids=score_ids,
            score_top=top or 0,
        )

    def decode_items(self, requests: list[Request]) -> list[WorkItem]:
        """One loop of each request's in-flight decode token.

        The hot path of every decode step (one item per running request per loop), so it
        builds the NamedTuple positionally, in field order."""
        items = []
        for request in requests:
            token_exit = request.token_exit
            assert token_exit is not None
            plan = token_exit.plan()
            depth = token_exit.depth
            if depth == 0:
                request.decode_handle = self._handle()
            state = plan.state_before
            items.append(
                WorkItem(
                    request.request_id,
                    ItemKind.DECODE,
                    request.num_prompt_tokens + len(request.output_token_ids) - 1,  # position
                    1,  # token_count
                    depth,
                    1,  # num_depths
                    request.decode_handle,
                    depth == 0,  # needs_prelude
                    (request.output_token_ids[-1],) if depth == 0 else (),
                    plan.needs_gate,
                    plan.exit_now,
                    state.cdf,
                    state.survival,
                    plan.threshold,
                )
            )
        return items
