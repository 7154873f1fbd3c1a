"""The scheduler: owns request progress and turns it into one core-call plan per step.

Each step: admit waiting requests (priority, then arrival) while sequences and KV allow;
then either a prompt step (the prompt policy's items: atomic chunks run all D loops, per-depth
and wavefront items one loop) or a decode step (one core call over the decode policy's
tokens, each at its own depth). When both kinds of work are ready, steps alternate
(`max_prefill_batches_before_decode` prompt steps, then one decode call). With
`mixed_prefill_decode` every step is one core call: decode rows first, then whole prompt
items until `max_num_batched_tokens`. `update()` applies the executor's results: depth +1,
the exit each token's executor decided (recorded, never re-derived), first tokens, stop
checks. Requests that leave RUNNING are announced to the executor in the next
`SchedulerOutput.finished_request_ids`. Torch-free; never touches tensors. `EngineCore`
(loopserve/engine/core.py) drives it.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable

from loopserve.config import EngineConfig
from loopserve.contracts import (
    ItemKind,
    NewRequestData,
    RunnerOutput,
    SampleSpec,
    SchedulerOutput,
    WorkItem,
)
from loopserve.errors import CapacityError, InvalidRequestError
from loopserve.exit import ExitMode, TokenExit
from loopserve.scheduler.kv_cache import KVCacheManager
from loopserve.scheduler.policies import (
    PROMPT_POLICIES,
    DecodePolicy,
    NoRefillPolicy,
    PromptPolicy,
    PromptWork,
    RefillPolicy,
)
from loopserve.scheduler.request import FinishReason, Request, RequestStatus


class Scheduler:
    def __init__(self, config: EngineConfig, *, num_loops: int, kv: KVCacheManager) -> None:
        self.config = config
        self.num_loops = num_loops
        self.kv = kv
        self.exit_mode = ExitMode(config.exit.mode)
        sched = config.scheduler
        self.max_num_seqs = sched.max_num_seqs
        self.max_rows = sched.max_num_batched_tokens
        self.decode_policy: DecodePolicy = (
            RefillPolicy() if sched.mode == "refill" else NoRefillPolicy()
        )
        # SHARED runs prompts position-major: a position is final before later ones read it.
        chunk_size = 1 if config.cache.layout == "shared" else sched.prefill_chunk_size
        self.mixed = sched.mixed_prefill_decode
        prompt_mode = sched.prefill_mode
        if self.mixed and prompt_mode == "atomic":
            prompt_mode = "per_depth"  # prompt rows ride in decode calls one depth at a time
        self.prompt_policy: PromptPolicy = PROMPT_POLICIES[prompt_mode](
            chunk_size, num_loops, self._handle
        )
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._arrivals = 0
        self._next_handle = 0
        self._step_id = 0
        self._prompt_steps_in_a_row = 0
        self._new_requests: list[NewRequestData] = []
        self._gone_request_ids: list[str] = []

    # ---- submission -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(
                f"request id {request.request_id!r} is already in use", "request_id"
            )
        if self.exit_mode is ExitMode.TRACE and not request.params.exit_trace:
            raise InvalidRequestError(
                "exit_mode 'trace' needs SamplingParams.exit_trace", "exit_trace"
            )
        if not self.kv.can_ever_fit(request.max_positions):
            needed = self.kv.blocks_needed(request.max_positions)
            raise CapacityError(
                f"request needs {needed} KV blocks ({request.max_positions} positions x "
                f"{self.kv.num_planes} planes) but the cache has {self.kv.num_blocks} in total; "
                "shorten the prompt or max_tokens, or raise num_blocks",
                param="max_tokens",
            )
        self.requests[request.request_id] = request
        # Kept sorted on insertion: admission order is (priority, arrival).
        bisect.insort(self.waiting, request, key=_admission_key)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        self.finish(request, FinishReason.ABORT)
        return request

    def finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.kv.free(request.request_id)
            self._gone_request_ids.append(request.request_id)
        request.transition(RequestStatus.FINISHED)
        request.finish_reason = reason
        request.times.finished_s = time.monotonic()
        self.decode_policy.on_request_gone(request.request_id)
        del self.requests[request.request_id]

    def has_pending_releases(self) -> bool:
        """True when requests left RUNNING since the last `SchedulerOutput` was built."""
        return bool(self._gone_request_ids)

    def return_releases(self, request_ids: Iterable[str]) -> None:
        """Put back releases whose bookkeeping-only output the executor failed to apply; the
        next `SchedulerOutput` carries them again."""
        self._gone_request_ids[:0] = list(request_ids)

    def schedule_releases(self) -> SchedulerOutput:
        """A bookkeeping-only output (no items) carrying the pending releases."""
        self._step_id += 1
        out = SchedulerOutput(
            step_id=self._step_id,
            items=(),
            block_tables={},
            new_requests=tuple(self._new_requests),
            finished_request_ids=tuple(self._gone_request_ids),
        )
        self._new_requests.clear()
        self._gone_request_ids.clear()
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- scheduling ---------------------------------------------------------------------

    def _admit(self) -> None:
        if not self.waiting:
            return
        admitted = []
        for request in self.waiting:
            if len(self.running) >= self.max_num_seqs:
                break
            if not self.kv.can_allocate(request.max_positions):
                break  # keep priority order: do not let later requests jump ahead
            self.kv.allocate(request.request_id, request.max_positions)
            request.transition(RequestStatus.RUNNING)
            request.times.first_scheduled_s = time.monotonic()
            self.running.append(request)
            admitted.append(request)
            params = request.params
            spec = SampleSpec(params.temperature, params.top_p, params.top_k, params.logprobs)
            self._new_requests.append(NewRequestData(request.request_id, spec, params.seed))
        for request in admitted:
            self.waiting.remove(request)

    def _handle(self) -> int:
        self._next_handle += 1
        return self._next_handle

    def schedule(self) -> SchedulerOutput:
        self._admit()
        prompt_requests: list[Request] = []
        decode_requests: list[Request] = []
        for request in self.running:  # one pass; both lists keep admission order
            if request.num_prefilled_tokens < request.num_prompt_tokens:
                prompt_requests.append(request)
            else:
                decode_requests.append(request)
        if self.mixed:
            items = self._mixed_items(prompt_requests, decode_requests)
        else:
            items = self._alternating_items(prompt_requests, decode_requests)
        self._step_id += 1
        tables = self.kv.tables
        out = SchedulerOutput(
            step_id=self._step_id,
            items=tuple(items),
            block_tables={item.request_id: tables[item.request_id] for item in items},
            new_requests=tuple(self._new_requests),
            finished_request_ids=tuple(self._gone_request_ids),
        )
        self._new_requests.clear()
        self._gone_request_ids.clear()
        return out

    def _alternating_items(self, prompt_requests, decode_requests) -> list[WorkItem]:
        """A prompt step or a decode step; alternate when both kinds of work are ready."""
        limit = self.config.scheduler.max_prefill_batches_before_decode
        if prompt_requests and (not decode_requests or self._prompt_steps_in_a_row < limit):
            work = self.prompt_policy.select(prompt_requests, self.max_rows)
            if work:
                self._prompt_steps_in_a_row += 1
                return [self._prompt_item(w) for w in work]
        self._prompt_steps_in_a_row = 0
        return self._decode_items(self.decode_policy.select(decode_requests, self.max_rows))

    def _mixed_items(self, prompt_requests, decode_requests) -> list[WorkItem]:
        """Every ready decode row first, then whole prompt items until the row budget."""
        items = self._decode_items(self.decode_policy.select(decode_requests, self.max_rows))
        work = self.prompt_policy.select(prompt_requests, self.max_rows - len(items))
        return items + [self._prompt_item(w) for w in work]

    def _prompt_item(self, work: PromptWork) -> WorkItem:
        request, chunk = work.request, work.chunk
        last = chunk.end == request.num_prompt_tokens
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
        )

    def _decode_items(self, requests: list[Request]) -> list[WorkItem]:
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

    # ---- applying results -----------------------------------------------------------------

    def update(self, scheduled: SchedulerOutput, output: RunnerOutput) -> list[Request]:
        """Apply one step's results; returns the requests that produced a token or finished."""
        now = time.monotonic()
        touched: list[Request] = []
        if len(output.results) != len(scheduled.items):
            raise RuntimeError(
                f"step {scheduled.step_id}: {len(scheduled.items)} items, "
                f"{len(output.results)} results"
            )
        for item, result in zip(scheduled.items, output.results):  # results come in item order
            if result.handle != item.handle:
                raise RuntimeError(f"step {scheduled.step_id}: results out of item order")
            request = self.requests.get(result.request_id)
            if request is None:
                continue  # aborted while the step ran; released with the next output
            if item.kind is ItemKind.PROMPT:
                if not self._advance_chunk(request, item) or not item.first_token:
                    continue
                assert result.sampled is not None and result.loops_used is not None
                reason = request.append_token(result.sampled, result.loops_used, now)
            else:
                token_exit = request.token_exit
                assert token_exit is not None
                # The executor decided the exit; record it (CDF, delayed commitment).
                token_exit.record(result.hazards[0] if result.hazards else None, result.exited)
                if not result.exited:
                    continue
                assert result.sampled is not None
                self.decode_policy.on_token_exit(request)
                reason = request.append_token(result.sampled, token_exit.loops_used, now)
            touched.append(request)
            if reason is not None:
                self.finish(request, reason)
            else:
                self._start_decode_token(request)
        return touched

    def _advance_chunk(self, request: Request, item: WorkItem) -> bool:
        """Record the depths a prompt chunk ran; True when it completed its final depth."""
        chunk = request.prompt_chunks[0] if request.prompt_chunks[0].handle == item.handle else None
        if chunk is None:
            chunk = next(c for c in request.prompt_chunks if c.handle == item.handle)
        assert chunk.next_depth == item.depth, "prompt chunk ran out of order"
        chunk.next_depth = item.last_depth + 1
        if chunk.next_depth < self.num_loops:
            return False
        # Chunks complete in order (c@d waits for c-1@d), so the frontier stays contiguous.
        assert chunk is request.prompt_chunks[0] and chunk.start == request.num_prefilled_tokens
        request.prompt_chunks.pop(0)
        request.num_prefilled_tokens = chunk.end
        return True

    def _start_decode_token(self, request: Request) -> None:
        trace_loops = request.trace_loops(len(request.output_token_ids))
        if request.token_exit is None:
            request.token_exit = TokenExit(self.exit_mode, request.exit_rule, trace_loops)
        else:
            request.token_exit.reset(trace_loops)
        request.decode_handle = None

    def fail_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Abort the requests of a step that raised; the engine reports them as failed."""
        failed = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self.finish(request, FinishReason.ABORT)
                failed.append(request)
        return failed

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        running_ids = {r.request_id for r in self.running}
        assert running_ids == set(self.kv.tables), "running requests and KV owners differ"
        assert len(self.running) <= self.max_num_seqs
        for request in self.running:
            assert request.status is RequestStatus.RUNNING
            if not request.in_prompt_phase:
                assert request.token_exit is not None and not request.token_exit.exited
        for request in self.waiting:
            assert request.status is RequestStatus.WAITING


def _admission_key(request: Request) -> tuple[int, int]:
    return (request.params.priority, request.arrival_order)
