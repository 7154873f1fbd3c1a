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
from dataclasses import dataclass

from loopserve.config import EngineConfig
from loopserve.contracts import (
    ItemKind,
    KVTransfer,
    NewRequestData,
    RunnerOutput,
    SampleSpec,
    SchedulerOutput,
    SwapKind,
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
from loopserve.scheduler.preemption import ReplayState, pick_victim, reset_for_recompute
from loopserve.scheduler.request import FinishReason, Request, RequestStatus


@dataclass
class MemoryStats:
    """Preemption totals (the KV manager counts swapped blocks)."""

    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_replayed_rows: int = 0  # REPLAY items scheduled (one row, one loop each)
    num_recompute_prompt_rows: int = 0  # prompt rows x loops re-run after recompute preemption

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap


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
        # Memory management (see `preemption`): reservation, preemption mode, policy.
        cache = config.cache
        self.full_reservation = cache.kv_reservation == "full"
        self.swap_preemption = sched.preemption_mode == "swap"
        self.priority_preemption = sched.scheduling_policy == "priority"
        self.shared = cache.layout == "shared"
        self.memory_stats = MemoryStats()
        self._preempted_ids: list[str] = []
        self._transfers: list[KVTransfer] = []

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

    def add_prefilled_request(self, request: Request) -> None:
        """Queue a request whose prompt ran on another engine (prefill/decode disaggregation).

        `request` carries exactly one output token (the first, sampled by the prefill engine);
        its prompt KV is complete at every plane. It waits for a seat and KV like any request;
        admission allocates prompt + 1 positions without consulting the prefix cache, and the
        request decodes from its second token. The executor must already hold the imported
        pages (the simulator prices the transfer outside the scheduler)."""
        if len(request.output_token_ids) != 1 or request.status is not RequestStatus.WAITING:
            raise InvalidRequestError(
                f"request {request.request_id!r}: a prefilled request carries exactly its first "
                "token and has not started here",
                "request_id",
            )
        request.num_prefilled_tokens = request.next_chunk_start = request.num_prompt_tokens
        self.add_request(request)
        self._start_decode_token(request)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        self.finish(request, FinishReason.ABORT)
        return request

    def finish(self, request: Request, reason: FinishReason) -> None:
        """The one place a request's finish reason is set. A stop string completed by the token
        that also reached max_tokens finishes the request a second time, with STOP: text cut at
        a stop string reads "stop", as in the OpenAI API; any other repeat is a no-op."""
        if request.is_finished:
            if reason is FinishReason.STOP and request.finish_reason is FinishReason.LENGTH:
                request.finish_reason = reason
            return
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
            if request.swapped:
                self.kv.drop_swapped(request.request_id)
            if request.announced:  # preempted earlier: the runner still holds its sampler
                self._gone_request_ids.append(request.request_id)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.kv.free(request.request_id)
            self._gone_request_ids.append(request.request_id)
        self.kv.forget(request.request_id)
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
        return self._output([])

    def _output(self, items: list[WorkItem]) -> SchedulerOutput:
        """The next `SchedulerOutput`: `items` plus every pending announcement, release,
        preemption and KV transfer (each delivered exactly once)."""
        self._step_id += 1
        tables = self.kv.tables
        out = SchedulerOutput(
            step_id=self._step_id,
            items=tuple(items),
            block_tables={item.request_id: tables[item.request_id] for item in items},
            new_requests=tuple(self._new_requests),
            finished_request_ids=tuple(self._gone_request_ids),
            preempted_request_ids=tuple(self._preempted_ids),
            kv_transfers=tuple(self._transfers),
        )
        self._new_requests.clear()
        self._gone_request_ids.clear()
        self._preempted_ids.clear()
        self._transfers.clear()
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
        """Admit waiting requests in (priority, arrival) order while seats and KV allow; stop
        at the first that does not fit, so later requests never jump ahead."""
        victims: set[str] = set()
        while self.waiting:
            request = self.waiting[0]
            if request.request_id in victims:
                break  # preempted by this very pass
            positions = self._admission_positions(request)
            if request.swapped:
                hits, blocks = [], self.kv.swap_in_blocks(request.request_id)
            elif not request.in_prompt_phase:  # prompt KV imported (add_prefilled_request)
                hits, blocks = [], self.kv.admission_blocks(positions, [])
            else:
                hits = self.kv.match_prefix(request.request_id, request.prompt_token_ids)
                blocks = self.kv.admission_blocks(positions, hits)
            if not self._has_room(blocks):
                if not (self.priority_preemption and self._preempt_for(request, blocks, victims)):
                    break
                if not request.swapped:  # a victim's release may have made some hits idle
                    blocks = self.kv.admission_blocks(positions, hits)
                    if not self._has_room(blocks):
                        break
            del self.waiting[0]
            self._start_running(request, positions, hits)

    def _admission_positions(self, request: Request) -> int:
        if self.full_reservation:
            return request.max_positions
        if (
            request.output_token_ids
        ):  # resumed after recompute preemption: up to the token in flight
            return request.next_position + 1
        return request.num_prompt_tokens

    def _has_room(self, blocks: int) -> bool:
        if len(self.running) >= self.max_num_seqs:
            return False
        return self.kv.can_admit(blocks, idle=not self.running)

    def _preempt_for(self, request: Request, blocks: int, victims: set[str]) -> bool:
        """Priority policy: preempt strictly lower-priority running requests (lowest first)
        until `request` fits; False when even all of them would not make room."""
        outranked = [r for r in self.running if r.params.priority > request.params.priority]
        seats = self.max_num_seqs - len(self.running) + len(outranked)
        freeable = sum(len(self.kv.tables[r.request_id][0]) for r in outranked) * self.kv.num_planes
        if seats < 1 or not self.kv.can_admit(
            blocks - freeable, idle=len(outranked) == len(self.running)
        ):
            return False
        while not self._has_room(blocks) and outranked:
            victim = pick_victim(outranked)
            outranked.remove(victim)
            self._preempt(victim)
            victims.add(victim.request_id)
        return self._has_room(blocks)

    def _start_running(self, request: Request, positions: int, hits: list) -> None:
        request_id = request.request_id
        if request.swapped:
            moves = self.kv.swap_in(request_id)
            self._transfers.append(KVTransfer(SwapKind.IN, request_id, tuple(moves)))
            request.swapped = False
        else:
            self.kv.allocate(request_id, positions, prefix=hits)
            if self.kv.prefix_cache is not None and request.in_prompt_phase:
                # Prompt positions served by cached pages are complete at every plane.
                cached = len(hits) * self.kv.block_size
                request.num_prefilled_tokens = request.next_chunk_start = cached
                stats = self.kv.prefix_cache.stats
                stats.num_queried_tokens += request.num_prompt_tokens
                stats.num_hit_tokens += cached
                if not request.announced:
                    request.num_cached_prompt_tokens = cached
        request.transition(RequestStatus.RUNNING)
        if request.times.first_scheduled_s is None:
            request.times.first_scheduled_s = time.monotonic()
        self.running.append(request)
        if not request.announced:
            request.announced = True
            params = request.params
            spec = SampleSpec(params.temperature, params.top_p, params.top_k, params.logprobs)
            self._new_requests.append(NewRequestData(request_id, spec, params.seed))

    def _grow_running(self) -> None:
        """Give every decode token about to be written a slot in every plane, oldest request
        first; preempt (lowest priority, latest arrival) when the pool runs dry."""
        if self.full_reservation:
            return
        tables, block_size = self.kv.tables, self.kv.block_size
        # Hot path (every step, every running request): plain attribute arithmetic. A decode
        # token sits at position prompt + outputs - 1; prompt positions exist from admission.
        short = [
            r
            for r in self.running
            if len(tables[r.request_id][0]) * block_size
            < r.num_prompt_tokens + len(r.output_token_ids)
            and r.num_prefilled_tokens == r.num_prompt_tokens
        ]
        for request in short:
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted while an older request grew
            needed = request.next_position + 1
            while not self.kv.grow(request.request_id, needed):
                victim = pick_victim(self.running)
                self._preempt(victim)
                if victim is request:
                    break

    def preempt(self, request_id: str) -> None:
        """Preempt a running request now (tests and operators; the scheduler itself preempts
        when KV runs out or, under the priority policy, for a higher-priority arrival)."""
        request = self.requests[request_id]
        assert request.status is RequestStatus.RUNNING, f"{request_id} is not running"
        self._preempt(request)

    def _preempt(self, victim: Request) -> None:
        """Free (or swap out) the victim's KV and queue it again with its progress."""
        request_id = victim.request_id
        self.running.remove(victim)
        self.decode_policy.on_request_gone(request_id)
        if self.swap_preemption and self.kv.can_swap_out(request_id):
            moves = self.kv.swap_out(request_id)
            self._transfers.append(KVTransfer(SwapKind.OUT, request_id, tuple(moves)))
            victim.swapped = True
            self.memory_stats.num_preemptions_swap += 1
        else:  # recompute (also the fallback when the host pool is full)
            self.kv.free(request_id)
            self._preempted_ids.append(request_id)
            reset_for_recompute(victim)
            self.memory_stats.num_preemptions_recompute += 1
        victim.transition(RequestStatus.WAITING)
        victim.num_preemptions += 1
        bisect.insort(self.waiting, victim, key=_admission_key)

    def _handle(self) -> int:
        self._next_handle += 1
        return self._next_handle

    def schedule(self) -> SchedulerOutput:
        self._admit()
        self._grow_running()
        prompt_requests: list[Request] = []
        decode_requests: list[Request] = []
        replay_requests: list[Request] = []
        for request in self.running:  # one pass; the lists keep admission order
            if request.num_prefilled_tokens < request.num_prompt_tokens:
                prompt_requests.append(request)
            elif request.replay is not None:
                replay_requests.append(request)
            else:
                decode_requests.append(request)
        if self.mixed:
            items = self._mixed_items(prompt_requests, decode_requests, replay_requests)
        else:
            items = self._alternating_items(prompt_requests, decode_requests, replay_requests)
        return self._output(items)

    def _alternating_items(self, prompt_requests, decode_requests, replay_requests):
        """A prompt step or a decode step; alternate when both kinds of work are ready.
        Replay rows (recompute after preemption) ride in decode steps."""
        limit = self.config.scheduler.max_prefill_batches_before_decode
        decode_ready = decode_requests or replay_requests
        if prompt_requests and (not decode_ready or self._prompt_steps_in_a_row < limit):
            work = self.prompt_policy.select(prompt_requests, self.max_rows)
            if work:
                self._prompt_steps_in_a_row += 1
                return [self._prompt_item(w) for w in work]
        self._prompt_steps_in_a_row = 0
        items = self._decode_items(self.decode_policy.select(decode_requests, self.max_rows))
        return items + self._replay_items(replay_requests, self.max_rows - len(items))

    def _mixed_items(self, prompt_requests, decode_requests, replay_requests) -> list[WorkItem]:
        """Every ready decode row first, then replay rows, then whole prompt items until the
        row budget."""
        items = self._decode_items(self.decode_policy.select(decode_requests, self.max_rows))
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

    # ---- async scheduling (rows of step n+1 chosen before update(n)) ------------------------

    def select_ahead(self, inflight: SchedulerOutput) -> list[str] | None:
        """Choose the next step's decode rows while `inflight` still executes, or None when the
        next step needs `inflight`'s results first (then `schedule()` runs after update).

        Only the exit modes that know a loop's exit before its gate is read allow this (the
        config rejects async scheduling with `ouro`): every decode item of `inflight` carries
        `exit_now` True or False. So the requests of the next step are known now: tokens of
        `inflight` that do not exit advance one depth; tokens not in `inflight` keep their
        depth; for tokens exiting in `inflight` the decode policy decides (refill: the
        request's next token keeps the row, dropped at completion if the request finished;
        no_refill: the request leaves the cohort). Prompt work and admissions are never
        planned ahead: with a request in its prompt phase, or a waiting request that could be
        admitted, this returns None. Outputs do not depend on which step a row runs in (batch
        invariance), so they equal synchronous scheduling. The items themselves are built by
        `complete_ahead` after update, from the exit state it records.
        """
        if not self.exit_mode.delayed and self.exit_mode is not ExitMode.TRACE:
            return None
        if self.waiting and self._head_may_be_admitted():
            return None
        leaving = set()
        for item in inflight.items:
            if item.kind is not ItemKind.DECODE:
                return None
            assert item.exit_now is not None, "async scheduling needs exits known a loop ahead"
            if item.exit_now:
                leaving.add(item.request_id)
        decode_requests = []
        for request in self.running:
            if request.num_prefilled_tokens < request.num_prompt_tokens or request.replay:
                return None  # prompt and replay rows are planned by `schedule()` only
            decode_requests.append(request)
        chosen = self.decode_policy.select_ahead(decode_requests, leaving, self.max_rows)
        return [r.request_id for r in chosen] or None

    def _head_may_be_admitted(self) -> bool:
        """Whether `schedule()` could admit the first waiting request now (the same test as
        `_admit`, without side effects); True whenever the priority policy might preempt."""
        request = self.waiting[0]
        if self.priority_preemption:
            return True
        if request.swapped:
            blocks = self.kv.swap_in_blocks(request.request_id)
        else:
            hits = self.kv.match_prefix(request.request_id, request.prompt_token_ids)
            blocks = self.kv.admission_blocks(self._admission_positions(request), hits)
        return self._has_room(blocks)

    def complete_ahead(self, request_ids: list[str]) -> SchedulerOutput | None:
        """The `SchedulerOutput` of rows chosen by `select_ahead`, built after the previous
        step's update from the recorded exit state. Requests finished or aborted since are
        dropped (None if none is left); the output carries the releases and announcements
        pending now."""
        # Decode tokens entering a new block need it in every plane first (incremental KV);
        # growth may preempt, and a preempted request leaves RUNNING.
        self._grow_running()
        requests = [self.requests.get(request_id) for request_id in request_ids]
        running = [
            r
            for r in requests
            if r is not None and r.status is RequestStatus.RUNNING and r.replay is None
        ]
        if not running:
            return None  # pending preemptions and releases travel with the next output
        self._prompt_steps_in_a_row = 0
        return self._output(self._decode_items(running))

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
            if item.kind is ItemKind.REPLAY:
                self._advance_replay(request, item)
                continue
            if item.kind is ItemKind.PROMPT:
                if not self._advance_chunk(request, item):
                    continue
                self.kv.publish_prompt(request.request_id, request.num_prefilled_tokens)
                if not item.first_token:
                    if request.output_token_ids and not request.in_prompt_phase:
                        request.replay = ReplayState.for_request(request)  # recompute resumes
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

    def _advance_replay(self, request: Request, item: WorkItem) -> None:
        replay = request.replay
        assert replay is not None
        replay.advance(item)
        if replay.finished:
            request.replay = None  # the token in flight starts at loop 0 next step

    def _start_decode_token(self, request: Request) -> None:
        trace_loops = request.trace_loops(len(request.output_token_ids))
        if request.token_exit is None:
            request.token_exit = TokenExit(self.exit_mode, request.exit_rule, trace_loops)
        else:
            request.token_exit.reset(trace_loops)
        request.decode_handle = None

    def fail_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Abort requests the executor failed (a step that raised, or a request whose setup
        raised); the engine reports them as failed."""
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
        swapped_ids = {r.request_id for r in self.waiting if r.swapped}
        assert swapped_ids == set(self.kv.host_tables), "swapped requests and host KV differ"
        assert len(self.running) <= self.max_num_seqs
        block_size = self.kv.block_size
        for request in self.running:
            assert request.status is RequestStatus.RUNNING
            covered = len(self.kv.tables[request.request_id][0]) * block_size
            assert covered >= request.num_prompt_tokens, f"{request.request_id} lacks prompt KV"
            # Shared (cached) pages sit behind every position the request will still write.
            shared_end = self.kv.num_shared_pages[request.request_id] * block_size
            assert shared_end <= request.num_prefilled_tokens, "a shared page is still written"
            assert all(chunk.start >= shared_end for chunk in request.prompt_chunks)
            if not request.in_prompt_phase:
                assert request.token_exit is not None and not request.token_exit.exited
            if request.replay is None and not request.in_prompt_phase:
                # The token in flight has a slot in every plane before it is written.
                assert covered >= request.next_position + (request.token_exit.depth > 0)
        for request in self.waiting:
            assert request.status is RequestStatus.WAITING
            assert request.request_id not in self.kv.tables


def _admission_key(request: Request) -> tuple[int, int]:
    return (request.params.priority, request.arrival_order)
