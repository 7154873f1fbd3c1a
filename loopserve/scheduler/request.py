"""A request's state inside the engine: status machine, progress, outputs, timings.

The status machine is data (`ALLOWED_TRANSITIONS`) and every move goes through
`Request.transition`, which raises on an illegal one. Torch-free.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loopserve.contracts import ReplayRow, SampledToken, WorkItem
from loopserve.exit import ExitRule
from loopserve.sampling_params import SamplingParams
from loopserve.scheduler.speculation import SpecStats, Speculation


@dataclass(slots=True)
class PromptChunk:
    """A fixed run of prompt positions advancing through the depths; `handle` names its
    hidden state in the runner between depths."""

    start: int
    count: int
    handle: int
    next_depth: int = 0

    @property
    def end(self) -> int:
        return self.start + self.count


class RequestStatus(enum.Enum):
    """Queue membership: which of the scheduler's lists holds the request (`Request.status`,
    derived from its `RequestState`)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestState(enum.Enum):
    """Where a request is in its life; the one field that says so (`Request.state`)."""

    WAITING = "waiting"  # queued, nothing on the device: new, or preempted for recompute
    WAITING_SWAPPED = "waiting_swapped"  # preempted by swap: its K/V in the host pool
    IMPORTING = "importing"  # handed off by another engine: its K/V staged in the runner
    RUNNING = "running"  # prompt chunks or decode loops
    REPLAYING = "replaying"  # running, re-computing positions a recompute preemption lost
    FINISHED = "finished"


_S = RequestState
# Every allowed transition, and what makes it.
ALLOWED_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    _S.WAITING: frozenset({_S.RUNNING, _S.IMPORTING, _S.FINISHED}),  # admitted / hand-off
    _S.WAITING_SWAPPED: frozenset({_S.RUNNING, _S.REPLAYING, _S.FINISHED}),  # swapped in
    _S.IMPORTING: frozenset({_S.RUNNING, _S.FINISHED}),  # admitted: K/V imported
    # preempted (recompute / swap); its recomputed prompt done with tokens to replay
    _S.RUNNING: frozenset({_S.WAITING, _S.WAITING_SWAPPED, _S.REPLAYING, _S.FINISHED}),
    _S.REPLAYING: frozenset({_S.RUNNING, _S.WAITING, _S.WAITING_SWAPPED, _S.FINISHED}),
    _S.FINISHED: frozenset(),
}
STATUS_OF: dict[RequestState, RequestStatus] = {
    _S.WAITING: RequestStatus.WAITING,
    _S.WAITING_SWAPPED: RequestStatus.WAITING,
    _S.IMPORTING: RequestStatus.WAITING,
    _S.RUNNING: RequestStatus.RUNNING,
    _S.REPLAYING: RequestStatus.RUNNING,
    _S.FINISHED: RequestStatus.FINISHED,
}


class IllegalTransitionError(RuntimeError):
    pass


@dataclass
class RequestTimes:
    arrival_s: float
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    finished_s: float | None = None


class Request:
    """Everything the scheduler tracks about one request."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        arrival_order: int,
        eos_token_ids: frozenset[int],
        arrival_s: float | None = None,
    ) -> None:
        assert params.max_loops is not None, "params must be resolved against the model depth"
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.arrival_order = arrival_order
        self.exit_rule = ExitRule(params.min_loops, params.max_loops, params.exit_threshold)
        # Loops every prompt position runs: the model's D, unless the scheduler's family runs
        # prompts at the request's loop bound (`Scheduler.add_request`).
        self.prompt_loops = 0
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= eos_token_ids
        self.stop_token_ids = frozenset(stop_ids)
        self.state = RequestState.WAITING
        self.finish_reason: FinishReason | None = None
        self.output_token_ids: list[int] = []
        self.exit_depths: list[int] = []
        # With overload brownout and `brownout_floor`: each decode token's max_loops, as its
        # loop 0 started (the first token's is the request's own; `scheduler/brownout.py`).
        self.loop_budgets: list[int] = []
        self.logprobs: list[SampledToken] = []
        self.prompt_logprobs: list[SampledToken] = []  # prompt tokens 1.., when asked for
        # Prompt progress: positions [0, num_prefilled_tokens) are complete at every depth.
        self.num_prefilled_tokens = 0
        self.next_chunk_start = 0  # first prompt position not yet in any chunk
        self.prompt_chunks: list[PromptChunk] = []  # created, not yet complete at all depths
        # Decode progress (the token in flight) lives in the scheduler's `DecodeTable`.
        # Memory: preemptions so far; whether the runner knows the request (its sampler
        # survives preemption); the positions to replay (state REPLAYING, or WAITING_SWAPPED
        # when swapped out while replaying).
        self.num_preemptions = 0
        self.announced = False
        self.replay: ReplayState | None = None
        # Self-speculative decoding (scheduler/speculation.py): whether this request runs it,
        # its positions in flight while decoding, and its draft statistics.
        self.speculative = False
        self.spec: Speculation | None = None
        self.spec_stats = SpecStats()
        self.num_cached_prompt_tokens = 0  # prompt positions served by the prefix cache
        self.num_hit_positions = 0  # of them at the latest admission (scored from the store)
        self.times = RequestTimes(arrival_s=time.monotonic() if arrival_s is None else arrival_s)

    @property
    def scores_cached_positions(self) -> bool:
        """Asked for prompt logprobs and still to score the positions its latest admission
        took from the prefix cache (they are scored from the runner's score store)."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_hit_positions
        )

    def transition(self, new_state: RequestState) -> None:
        if new_state not in ALLOWED_TRANSITIONS[self.state]:
            raise IllegalTransitionError(
                f"request {self.request_id}: {self.state.value} -> {new_state.value} is not allowed"
            )
        self.state = new_state

    @property
    def status(self) -> RequestStatus:
        return STATUS_OF[self.state]

    @property
    def swapped(self) -> bool:
        return self.state is RequestState.WAITING_SWAPPED

    @property
    def pending_import(self) -> bool:
        return self.state is RequestState.IMPORTING

    @property
    def in_prompt_phase(self) -> bool:
        return self.num_prefilled_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def max_positions(self) -> int:
        """KV positions the request can ever write: the last sampled token is never fed."""
        return self.num_prompt_tokens + self.params.max_tokens - 1

    @property
    def next_position(self) -> int:
        """Position of the decode token in flight (the last output token, fed back)."""
        return self.num_prompt_tokens + len(self.output_token_ids) - 1

    def trace_loops(self, token_index: int) -> int | None:
        trace = self.params.exit_trace
        return None if trace is None else trace[token_index % len(trace)]

    def restore_outputs(
        self,
        output_token_ids: list[int],
        exit_depths: list[int],
        *,
        logprobs: list[SampledToken],
        prompt_logprobs: list[SampledToken],
        num_cached_prompt_tokens: int,
        first_scheduled_s: float | None,
        first_token_s: float | None,
        token_times_s: list[float],
    ) -> None:
        """Take the outputs and times a request produced elsewhere (a hand-off from another
        engine), before it is queued here."""
        assert not self.output_token_ids, "outputs restore only into a new request"
        self.output_token_ids = list(output_token_ids)
        self.exit_depths = list(exit_depths)
        self.logprobs = list(logprobs)
        self.prompt_logprobs = list(prompt_logprobs)
        self.num_cached_prompt_tokens = num_cached_prompt_tokens
        times = self.times
        times.first_scheduled_s, times.first_token_s = first_scheduled_s, first_token_s
        times.token_times_s = list(token_times_s)

    def prompt_positions_done(self, depth: int) -> int:
        """Prompt positions `[0, n)` that ran `depth` (or every depth): a chunk runs a depth
        only after the chunk before it did, so they are a prefix."""
        done = self.num_prefilled_tokens
        for chunk in self.prompt_chunks:
            if chunk.next_depth <= depth:
                break
            done = chunk.end
        return done

    def advance_chunk(self, item: WorkItem, num_loops: int) -> bool:
        """Record the depths a prompt chunk ran (`item`); True when it completed its final
        depth, `num_loops - 1` (the prompt's complete prefix then extends over it)."""
        chunks = self.prompt_chunks
        chunk = chunks[0] if chunks[0].handle == item.handle else None
        if chunk is None:
            chunk = next(c for c in chunks if c.handle == item.handle)
        assert chunk.next_depth == item.depth, "prompt chunk ran out of order"
        chunk.next_depth = item.last_depth + 1
        if chunk.next_depth < num_loops:
            return False
        # Chunks complete in order (c@d waits for c-1@d), so the frontier stays contiguous.
        assert chunk is chunks[0] and chunk.start == self.num_prefilled_tokens
        chunks.pop(0)
        self.num_prefilled_tokens = chunk.end
        return True

    def append_token(
        self, token_id: int, loops_used: int, now_s: float, sampled: SampledToken | None = None
    ) -> FinishReason | None:
        """Record one output token (`sampled`: with its log-probabilities, when the request
        asked for them); returns the finish reason it triggers, if any."""
        self.output_token_ids.append(token_id)
        self.exit_depths.append(loops_used)
        if self.params.logprobs is not None:
            self.logprobs.append(sampled or SampledToken(token_id))
        if self.times.first_token_s is None:
            self.times.first_token_s = now_s
        self.times.token_times_s.append(now_s)
        if token_id in self.stop_token_ids:
            return FinishReason.STOP
        if len(self.output_token_ids) >= self.params.max_tokens:
            return FinishReason.LENGTH
        return None


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
                ReplayRow(
                    request_id,
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
