"""The scheduler: owns request progress and turns it into one core-call plan per step.

Each step: admit waiting requests (priority, then arrival) while sequences and KV allow;
then either a prompt step (the prompt policy's items: atomic chunks run all D loops, per-depth
and wavefront items one loop) or a decode step (one core call over the decode policy's rows
of the `DecodeTable`, each token at its own depth, planned as columns). When both kinds of
work are ready, steps alternate (`max_prefill_batches_before_decode` prompt steps, then one
decode call). With `mixed_prefill_decode` every step is one core call: decode rows first,
then whole prompt items until `max_num_batched_tokens`. `update()` applies the executor's
results: depth +1, the exits the executor decided (recorded, never re-derived), first
tokens, stop checks. Requests that leave RUNNING are announced to the executor in the next
`SchedulerOutput.finished_request_ids`. Torch-free. `EngineCore` drives it.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Iterable

from loopserve.config import EngineConfig
from loopserve.contracts import (
    KVHandle,
    LeaveRows,
    PromptChunk,
    RunnerOutput,
    SchedulerOutput,
)
from loopserve.errors import CapacityError, InvalidRequestError
from loopserve.execution import StepRules
from loopserve.exit import ExitMode
from loopserve.scheduler.admission import Admission, MemoryStats, admission_key
from loopserve.scheduler.ahead import AheadPlanner
from loopserve.scheduler.brownout import Brownout
from loopserve.scheduler.decode_table import DecodeTable
from loopserve.scheduler.groups import PromptGroups
from loopserve.scheduler.items import ItemBuilder, StepWork
from loopserve.scheduler.kv_cache import KVCacheManager
from loopserve.scheduler.leave_batch import LeaveBatcher
from loopserve.scheduler.policies import (
    PROMPT_POLICIES,
    DecodePolicy,
    NoRefillPolicy,
    PromptPolicy,
    RefillPolicy,
)
from loopserve.scheduler.queues import Queues, StepOutbox
from loopserve.scheduler.request import (
    FinishReason,
    Request,
    RequestState,
    RequestStatus,
)
from loopserve.scheduler.results import ResultApplier
from loopserve.scheduler.speculator import Speculator, leave_waits, speculates


class Scheduler:
    """Owns request progress and its collaborators: `Admission` (admission.py: admission,
    KV growth, preemption, swap, import), `ItemBuilder` (items.py: the step's work items) and
    `AheadPlanner` (ahead.py: async planning) and `ResultApplier` (results.py: `update`). They
    share the `Queues` and the `StepOutbox` (queues.py); this class admits, finishes requests
    and builds outputs."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        num_loops: int,
        kv: KVCacheManager,
        prompt_loops_by_request: bool = False,
        leave_attends: bool = False,
        defers_leave: bool = False,
        once_weight: float = 0.0,
    ) -> None:
        """`prompt_loops_by_request`: prompts run the request's loop bound (`max_loops`)
        instead of the model's D (a family whose prompt K/V depends on it: Huginn);
        `leave_attends`: the family's leave attends to earlier positions' leave K/V
        (Huginn's coda layers), so a speculative position's leave waits for older exits;
        `defers_leave`: coda batching in time (`scheduler/leave_batch.py`), with the
        family's once-per-token weight in loops (`once_weight`)."""
        self.config = config
        self.num_loops = num_loops
        self.prompt_loops_by_request = prompt_loops_by_request
        self.kv = kv
        self.exit_mode = ExitMode(config.exit.mode)
        self.max_num_seqs = config.scheduler.max_num_seqs
        self._next_handle = 0
        self._step_id = 0
        self._build_policies(defers_leave=defers_leave, once_weight=once_weight)
        self._build_collaborators(leave_attends=leave_attends)

    def _build_policies(self, *, defers_leave: bool, once_weight: float) -> None:
        """What the config decides once: the executors' step rules, the decode, prompt,
        coda-batching and brownout policies."""
        config, sched, num_loops = self.config, self.config.scheduler, self.num_loops
        # What the executors decide.
        self.rules = StepRules.of(config.cache.layout, num_loops, defers_leave=defers_leave)
        self.leaver = LeaveBatcher(
            enabled=defers_leave,
            once_weight=once_weight,
            max_wait=sched.coda_batch_max_wait,
            min_rows=sched.coda_batch_min_rows,
        )
        self.decode_policy: DecodePolicy = (
            RefillPolicy() if sched.mode == "refill" else NoRefillPolicy()
        )
        # SHARED runs prompts position-major: a position is final before later ones read it.
        chunk_size = 1 if config.cache.layout == "shared" else sched.prefill_chunk_size
        self.mixed = sched.mixed_prefill_decode  # prefill_mode is then per_depth or wavefront
        # A prompt that exits as one token (`prompt_exits`) runs whole: never cut to fit.
        fill = sched.fill_prompt_chunks and not config.exit.prompt_exits
        self.prompt_policy: PromptPolicy = PROMPT_POLICIES[sched.prefill_mode](
            chunk_size, num_loops, self._handle, fill=fill
        )
        self.brownout = Brownout(
            sched.brownout_waiting_high, sched.brownout_waiting_low, sched.brownout_step_loops,
            sched.brownout_max_level, sched.brownout_dwell_steps,
        )  # fmt: skip

    def _build_collaborators(self, *, leave_attends: bool) -> None:
        """The shared state (`Queues`, `StepOutbox`, `DecodeTable`, memory counters, prompt
        groups) and the collaborators over it: `Admission`, `ItemBuilder`, `Speculator`,
        `AheadPlanner`."""
        config, sched, kv = self.config, self.config.scheduler, self.kv
        self.queues = Queues()
        self.outbox = StepOutbox()
        self.decode = DecodeTable(self.max_num_seqs, exit_mode=self.exit_mode)
        self.decode.brownout = self.brownout.enabled
        self.memory_stats = MemoryStats()
        # One prefill for requests with the same prompt (scheduler/groups.py); not when
        # initial states are drawn (each request's prompt K/V depends on its seed).
        self.groups = PromptGroups(sched.share_prompts and config.init_scale == 0)
        self.admission = Admission(
            config,
            kv=kv,
            queues=self.queues,
            outbox=self.outbox,
            decode=self.decode,
            memory_stats=self.memory_stats,
        )
        self.items = ItemBuilder(
            prompt_policy=self.prompt_policy,
            decode_policy=self.decode_policy,
            decode=self.decode,
            max_rows=sched.max_num_batched_tokens,
            max_prompt_steps_in_a_row=sched.max_prefill_batches_before_decode,
            exit_mode=self.exit_mode,
            num_loops=self.num_loops,
            shared=config.cache.layout == "shared",
            new_handle=self._handle,
            memory_stats=self.memory_stats,
            num_running=lambda: len(self.running),
            speculative_max_seqs=sched.speculative_max_seqs,
        )
        # Self-speculative decoding (scheduler/speculator.py); K = 0: off.
        self.speculator = Speculator(
            num_tokens=sched.speculative_tokens,
            draft_loops=sched.draft_loops,
            exit_mode=self.exit_mode,
            kv=kv,
            queues=self.queues,
            admission=self.admission,
            outbox=self.outbox,
            new_handle=self._handle,
            leave_waits=leave_waits(self.exit_mode, config.exit.criterion, leave_attends),
        )
        self.results = ResultApplier(
            rules=self.rules,
            queues=self.queues,
            decode=self.decode,
            decode_policy=self.decode_policy,
            groups=self.groups,
            kv=kv,
            outbox=self.outbox,
            speculator=self.speculator,
            admission=self.admission,
            max_num_seqs=self.max_num_seqs,
            finish=self.finish,
        )
        self.ahead = AheadPlanner(
            exit_mode=self.exit_mode,
            queues=self.queues,
            decode=self.decode,
            decode_policy=self.decode_policy,
            admission=self.admission,
            items=self.items,
            output=self._output,
        )

    @property
    def requests(self) -> dict[str, Request]:
        """Every unfinished request by id (the shared `Queues`)."""
        return self.queues.requests

    @property
    def waiting(self) -> list[Request]:
        return self.queues.waiting

    @property
    def running(self) -> list[Request]:
        return self.queues.running

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
        request.speculative = self.speculator.num_tokens > 0 and speculates(request)
        request.prompt_loops = self.num_loops
        if self.prompt_loops_by_request:
            request.prompt_loops = min(self.num_loops, request.exit_rule.max_loops)
        self.requests[request.request_id] = request
        if self.groups.join(request):
            return  # it follows a request with the same prompt: forked from its prefill
        # Kept sorted on insertion: admission order is (priority, arrival).
        bisect.insort(self.waiting, request, key=admission_key)

    def add_imported(self, request: Request) -> None:
        """Queue a request handed off by another engine (prefill/decode disaggregation): its
        prompt is complete and its outputs so far are recorded; its K/V is staged in the
        executor. Admission allocates blocks for the written positions plus the token in flight
        and sends a `KVTransfer(IMPORT)`; then it decodes its next token from loop 0. The
        simulated cluster (loopserve/sim/cluster.py) hands requests to decode replicas the same
        way and prices the transfer itself."""
        if not request.output_token_ids or request.status is not RequestStatus.WAITING:
            raise InvalidRequestError(
                f"request {request.request_id!r}: a handed-off request carries its sampled "
                "tokens and has not started here",
                "request_id",
            )
        request.num_prefilled_tokens = request.next_chunk_start = request.num_prompt_tokens
        request.transition(RequestState.IMPORTING)  # its next token starts at admission
        self.add_request(request)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        self.finish(request, FinishReason.ABORT)
        return request

    def finish(self, request: Request, reason: FinishReason) -> None:
        """The one place a request's finish reason is set; finishing it again is a no-op (the
        engine reports "stop" for a stop string that the max_tokens token completed)."""
        if request.is_finished:
            return
        following = request.request_id in self.groups.leader_of
        for leader in self.groups.leave(request):  # a leader's group gets a new leader
            bisect.insort(self.waiting, leader, key=admission_key)
        if following:  # waiting for its fork; announced once its leader's last step is planned
            if request.announced:
                self.outbox.gone_request_ids.append(request.request_id)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
            if request.swapped:
                self.kv.drop_swapped(request.request_id)
            # Preempted earlier: the runner still holds its sampler; or imported: the runner
            # holds its staged K/V and generator state (and a streamed one, its blocks).
            if request.announced or request.pending_import:
                self.outbox.gone_request_ids.append(request.request_id)
                self.admission.release_reserved(request.request_id)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.kv.free(request.request_id)
            self.outbox.gone_request_ids.append(request.request_id)
        self.kv.forget(request.request_id)
        self.decode.remove(request.request_id)
        self.decode.forget(request.request_id)
        request.transition(RequestState.FINISHED)
        request.finish_reason = reason
        request.times.finished_s = time.monotonic()
        del self.requests[request.request_id]

    def has_pending_releases(self) -> bool:
        """True when requests left RUNNING since the last `SchedulerOutput` was built."""
        return bool(self.outbox.gone_request_ids)

    def has_pending_copy(self, request_id: str) -> bool:
        """True when a K/V copy into the request's blocks (a prompt group's fork, a swap-in,
        an import) waits in the outbox for the next output: its K/V is not all there yet."""
        return any(transfer.request_id == request_id for transfer in self.outbox.transfers)

    def return_releases(self, request_ids: Iterable[str]) -> None:
        """Put back releases whose bookkeeping-only output the executor failed to apply; the
        next `SchedulerOutput` carries them again."""
        self.outbox.gone_request_ids[:0] = list(request_ids)

    def schedule_releases(self) -> SchedulerOutput:
        """A bookkeeping-only output (no items) carrying the pending releases."""
        return self._output(StepWork([], None))

    def _output(self, work: StepWork, leave: LeaveRows | None = None) -> SchedulerOutput:
        """The next `SchedulerOutput`: the step's work plus every pending announcement,
        release, preemption and KV transfer (each delivered exactly once)."""
        self._step_id += 1
        items = work.items
        seats = self.max_num_seqs - len(self.running)
        for i, item in enumerate(items):
            if isinstance(item, PromptChunk) and self.rules.samples_first_token(item):
                followers, new_leader = self.groups.seal(item.request_id, seats)
                if new_leader is not None:  # the followers without a seat: a group of their own
                    bisect.insort(self.waiting, new_leader, key=admission_key)
                if followers:
                    seats -= len(followers)
                    items[i] = self._seal_forks(item, followers)
        updates = self.kv.take_table_updates()
        return self.outbox.take(self._step_id, items, work.decode, updates, leave)

    def _seal_forks(self, item: PromptChunk, followers: list[Request]) -> PromptChunk:
        """The leader's last prompt position runs this step: its followers' first tokens are
        sampled with it (announced now, so the executor has their samplers)."""
        now = time.monotonic()
        for follower in followers:
            self.admission.announce(follower)
            if follower.times.first_scheduled_s is None:
                follower.times.first_scheduled_s = now
        return dataclasses.replace(item, forks=tuple(f.request_id for f in followers))

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or len(self.groups))

    @property
    def num_waiting(self) -> int:
        """Waiting requests, followers of a prompt group included."""
        return len(self.waiting) + len(self.groups)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- scheduling ---------------------------------------------------------------------

    def _handle(self) -> int:
        self._next_handle += 1
        return self._next_handle

    def schedule(self) -> SchedulerOutput:
        if self.brownout.enabled:  # overload: the budget of tokens that start from now on
            self.brownout.observe(len(self.waiting))
            self.decode.brownout_cut = self.brownout.cut
        self.admission.admit()
        leave = self.leaver.start(self.decode)  # before growth: tokens started ahead need
        self.admission.grow_running()  # their blocks
        if leave is not None:  # without the requests growth preempted
            leave = self.leaver.still_held(self.decode, leave)
        if self.speculator.num_tokens:
            self.speculator.grow()
        prompt_requests: list[Request] = []
        replay_requests: list[Request] = []
        spec_requests: list[Request] = []
        if len(self.running) > self.decode.num_ready:  # not every request is decoding
            for request in self.running:  # one pass; the lists keep admission order
                if request.num_prefilled_tokens < request.num_prompt_tokens:
                    prompt_requests.append(request)
                elif request.replay is not None:
                    replay_requests.append(request)
                elif request.speculative:
                    spec_requests.append(request)
        if self.mixed:
            work = self.items.mixed(prompt_requests, replay_requests, spec_requests)
        else:
            work = self.items.alternating(prompt_requests, replay_requests, spec_requests)
        return self._output(work, leave)

    # ---- applying results -----------------------------------------------------------------

    def update(self, scheduled: SchedulerOutput, output: RunnerOutput) -> list[Request]:
        """Apply one step's results (`ResultApplier.update`); returns the requests that
        produced a token or finished."""
        return self.results.update(scheduled, output)

    @property
    def step_tokens(self) -> int:
        """Tokens the last `update` appended (a speculating request may append several)."""
        return self.results.step_tokens

    @property
    def step_loops(self) -> int:
        """Loops the tokens the last `update` appended ran, summed."""
        return self.results.step_loops

    def token_depth(self, request_id: str) -> int | None:
        """The loop the request's decode token in flight runs next (None: no token in
        flight: waiting, in its prompt, replaying, or finished; or a speculating request with
        more than its verified position in flight)."""
        request = self.requests.get(request_id)
        spec = None if request is None else request.spec
        if spec is not None:
            return spec.positions[0].exit.depth if len(spec.positions) == 1 else None
        return self.decode.depth_of(request_id)

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
        self.decode.check_invariants()
        self.groups.check_invariants(self.requests)
        running_ids = {r.request_id for r in self.running}
        reserved = self.admission.reserved  # streamed imports: blocks before the request
        assert running_ids | set(reserved) == set(self.kv.tables), "KV owners differ"
        assert not running_ids & set(reserved), "a running request still holds a reservation"
        assert running_ids == set(self.decode.row_of), "running requests and decode rows differ"
        swapped_ids = {r.request_id for r in self.waiting if r.swapped}
        assert swapped_ids == set(self.kv.host_tables), "swapped requests and host KV differ"
        assert len(self.running) <= self.max_num_seqs
        block_size = self.kv.block_size
        for request in self.running:
            assert request.status is RequestStatus.RUNNING
            covered = len(self.kv.tables[request.request_id][0]) * block_size
            assert covered >= request.num_prompt_tokens, f"{request.request_id} lacks prompt KV"
            # Shared (cached) pages sit behind every position the request will still write.
            cached_end = self.kv.num_cached_pages[request.request_id] * block_size
            assert cached_end <= request.num_prefilled_tokens, "a cached page is still written"
            assert all(chunk.start >= cached_end for chunk in request.prompt_chunks)
            depth = self.decode.depth_of(request.request_id)
            decoding = request.replay is None and not request.in_prompt_phase
            if self.decode.is_held(request.request_id):  # exited; its leave comes
                assert decoding and self.rules.defers_leave, f"{request.request_id} held"
                assert covered >= request.next_position + 1
                continue
            if request.speculative and decoding:
                assert depth is None
                self.speculator.check(request, covered)
                continue
            assert (depth is not None) == decoding, f"{request.request_id}: token in flight?"
            if depth is not None:
                # The token in flight has a slot in every plane before it is written.
                assert covered >= request.next_position + (depth > 0)
        for request in self.waiting:
            assert request.status is RequestStatus.WAITING
            assert request.request_id not in self.kv.tables or request.request_id in reserved

    def kv_handle(self, request_id: str) -> KVHandle:
        """The K/V a running request holds: every position written so far, on every plane."""
        request = self.requests[request_id]
        return KVHandle(request_id, self.kv.tables[request_id], request.next_position)

    # ---- collaborators' entry points ---------------------------------------------------------

    def preempt(self, request_id: str) -> None:
        """Preempt a running request now (tests and operators; the scheduler itself preempts
        when KV runs out or, under the priority policy, for a higher-priority arrival)."""
        request = self.requests[request_id]
        assert request.status is RequestStatus.RUNNING, f"{request_id} is not running"
        self.admission.preempt(request)

    def select_ahead(self, inflight: SchedulerOutput) -> list[str] | None:
        """See `AheadPlanner.select_ahead`."""
        return self.ahead.select_ahead(inflight)

    def complete_ahead(self, request_ids: list[str]) -> SchedulerOutput | None:
        """See `AheadPlanner.complete_ahead`."""
        return self.ahead.complete_ahead(request_ids)
