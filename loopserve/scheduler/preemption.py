"""Preemption: victim choice and the recompute replay of generated tokens. Torch-free.

A running request that cannot grow its KV (or, under `scheduling_policy="priority"`, one
outranked by a waiting request) is preempted: the victim is the lowest-priority running
request (largest `priority` value), then the latest arrival. Its KV is freed or swapped to
host memory and it goes back to the waiting queue (sorted by priority, then arrival, so it
precedes everything that arrived after it).

Recompute rebuilds exactly the KV an uninterrupted run holds:
1. the prompt re-runs through the normal prompt policy at full depth, but its last chunk does
   not sample (the first token is known);
2. each generated position t (token `output[t - P]`, fed back at position t) is replayed by
   one-row `REPLAY` items through loops `0..e_t-1`, where `e_t` is the loop count of the token
   it produced; an exit before depth D-1 applies the LAST_EXITED finalize copy, exactly as
   decode did. No coda, no sampling, no gate.
3. the token in flight restarts at loop 0: with identical KV its loops, hazards and exit are
   recomputed identically, and its sampler's generator was never advanced by the replay.

Replay order. LAST_EXITED: position t at depth d reads plane d of every earlier position,
which is final once that position ran loop d or exited (and was finalized). So position t may
run depth d when every earlier unfinished position has already run depth d — a wavefront over
positions: a replay of n tokens takes about n + D steps, and its rows ride in decode calls
next to other requests. SHARED: every position reads the final K/V of earlier positions, so
replay is strictly position-major (one position through all its loops, then the next).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from loopserve.contracts import ItemKind, WorkItem
from loopserve.scheduler.request import Request


def pick_victim(candidates: list[Request]) -> Request:
    """Lowest priority (largest value), then latest arrival."""
    return max(candidates, key=lambda r: (r.params.priority, r.arrival_order))


def reset_for_recompute(request: Request) -> None:
    """Forget all device-side progress; keep the tokens, exit depths and sampler state."""
    request.num_prefilled_tokens = 0
    request.next_chunk_start = 0
    request.prompt_chunks = []
    request.replay = None
    request.decode_handle = None
    if request.token_exit is not None:
        request.token_exit.reset(request.trace_loops(len(request.output_token_ids)))


@dataclass(slots=True)
class ReplayState:
    """Generated positions `start + i` to re-run, token `token_ids[i]` for `loops[i]` loops."""

    start: int
    token_ids: list[int]
    loops: list[int]
    next_depth: list[int] = field(default_factory=list)
    handles: list[int] = field(default_factory=list)
    first: int = 0  # every index before it is done

    @classmethod
    def for_request(cls, request: Request) -> ReplayState | None:
        """Positions the request wrote before it was preempted, after its prompt."""
        num = len(request.output_token_ids) - 1  # the last token is the one in flight
        if num <= 0:
            return None
        return cls(
            start=request.num_prompt_tokens,
            token_ids=request.output_token_ids[:num],
            loops=request.exit_depths[1 : num + 1],
            next_depth=[0] * num,
            handles=[0] * num,
        )

    def done(self, i: int) -> bool:
        return self.next_depth[i] >= self.loops[i]

    @property
    def finished(self) -> bool:
        return self.first >= len(self.loops)

    def ready(self, shared: bool) -> list[int]:
        """Indices that may run their next depth this step (see the module docstring)."""
        ready = []
        frontier = None  # min next depth over earlier unfinished positions
        for i in range(self.first, len(self.loops)):
            if self.done(i):
                continue
            depth = self.next_depth[i]
            if frontier is None or depth < frontier:
                ready.append(i)
            if shared:
                break
            frontier = depth if frontier is None else min(frontier, depth)
            if frontier == 0:
                break
        return ready

    def items(self, request_id: str, rows: int, shared: bool, new_handle: Callable[[], int]):
        items = []
        for i in self.ready(shared)[:rows]:
            depth = self.next_depth[i]
            if depth == 0:
                self.handles[i] = new_handle()
            items.append(
                WorkItem(
                    request_id,
                    ItemKind.REPLAY,
                    self.start + i,
                    1,
                    depth,
                    1,
                    self.handles[i],
                    depth == 0,
                    (self.token_ids[i],) if depth == 0 else (),
                    False,
                    depth == self.loops[i] - 1,
                )
            )
        return items

    def advance(self, item: WorkItem) -> None:
        i = item.token_start - self.start
        assert self.next_depth[i] == item.depth, "replay position ran out of order"
        self.next_depth[i] += 1
        while self.first < len(self.loops) and self.done(self.first):
            self.first += 1
