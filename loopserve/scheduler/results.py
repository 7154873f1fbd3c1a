"""Applying a step's results: the `Scheduler`'s `update`.

`ResultApplier` is a collaborator the `Scheduler` owns, with explicit inputs: the queues, the
decode table and policy, the step rules, the prompt groups, the KV manager, the outbox, the
speculator and admission, and the scheduler's `finish` (the one place a request's finish
reason is set). It applies what the executor decided and never re-derives it: each decode
row's loop (hazards, depth, delayed commitments), the exits (appending their sampled tokens,
or holding them for a batched leave under coda batching in time), held rows' leaves, prompt
chunks (first tokens, a prompt group's forks, recompute resuming as replay), replay items and
speculating requests' emitted tokens; then it starts each continuing request's next token.
It counts the tokens and loops a step appended (`step_tokens`, `step_loops`: the engine's
counters read them). Torch-free.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import numpy as np

from loopserve.contracts import (
    DecodeResults,
    DecodeRows,
    ItemKind,
    ItemResult,
    KVTransfer,
    LeaveRows,
    PromptChunk,
    RunnerOutput,
    SchedulerOutput,
    SwapKind,
    WorkItem,
)
from loopserve.execution import StepRules
from loopserve.scheduler.admission import Admission, admission_key
from loopserve.scheduler.decode_table import DecodeTable
from loopserve.scheduler.groups import PromptGroups
from loopserve.scheduler.kv_cache import KVCacheManager
from loopserve.scheduler.policies import DecodePolicy
from loopserve.scheduler.queues import Queues, StepOutbox
from loopserve.scheduler.request import FinishReason, ReplayState, Request, RequestState
from loopserve.scheduler.speculator import Speculator


class ResultApplier:
    """Applies one step's results for the `Scheduler` (see the module docstring)."""

    def __init__(
        self,
        *,
        rules: StepRules,
        queues: Queues,
        decode: DecodeTable,
        decode_policy: DecodePolicy,
        groups: PromptGroups,
        kv: KVCacheManager,
        outbox: StepOutbox,
        speculator: Speculator,
        admission: Admission,
        max_num_seqs: int,
        finish: Callable[[Request, FinishReason], None],
    ) -> None:
        self.rules = rules
        self.queues = queues
        self.decode = decode
        self.decode_policy = decode_policy
        self.groups = groups
        self.kv = kv
        self.outbox = outbox
        self.speculator = speculator
        self.admission = admission
        self.max_num_seqs = max_num_seqs
        self.finish = finish
        self.step_tokens = self.step_loops = 0  # appended by the last `update`

    def update(self, scheduled: SchedulerOutput, output: RunnerOutput) -> list[Request]:
        """Apply one step's results; returns the requests that produced a token or finished."""
        now = time.monotonic()
        touched: list[Request] = []
        # Tokens appended this step and their loops (a speculating request may append
        # several in one step): the engine's counters read them.
        self.step_tokens = self.step_loops = 0
        if len(output.results) != len(scheduled.items):
            raise RuntimeError(
                f"step {scheduled.step_id}: {len(scheduled.items)} items, "
                f"{len(output.results)} results"
            )
        if scheduled.leave is not None:  # before the decode rows: the tokens come in order
            if output.leave is None or len(output.leave.exited) != len(scheduled.leave):
                raise RuntimeError(f"step {scheduled.step_id}: leave rows without results")
            self._apply_leave(scheduled.leave, output.leave, now, touched)
        if scheduled.decode is not None:
            if output.decode is None or len(output.decode.exited) != len(scheduled.decode):
                raise RuntimeError(f"step {scheduled.step_id}: decode rows without results")
            self._apply_decode(scheduled.decode, output.decode, now, touched)
        spec_results: dict[str, list] = {}
        for item, result in zip(scheduled.items, output.results):  # results come in item order
            if result.handle != item.handle:
                raise RuntimeError(f"step {scheduled.step_id}: results out of item order")
            followers = []
            if isinstance(item, PromptChunk) and item.forks:
                followers = self.groups.take_sealed(item.request_id)
            request = self.queues.requests.get(result.request_id)
            if request is None:
                if followers:  # their first tokens stand; they queue to recompute
                    self._fork(None, item, result, followers, now, touched)
                continue  # aborted while the step ran; released with the next output
            if item.kind is ItemKind.REPLAY:
                self._advance_replay(request, item)
                continue
            if item.kind is ItemKind.SPEC:
                spec_results.setdefault(request.request_id, []).append((item, result))
                continue
            if result.prompt_logprobs:  # chunks reach the last depth in position order
                request.prompt_logprobs.extend(result.prompt_logprobs)
            if not request.advance_chunk(item, request.prompt_loops):
                assert not followers, "a first-token item completes its prompt"
                continue
            self.kv.publish_prompt(request.request_id, request.num_prefilled_tokens)
            if not item.first_token:
                if request.output_token_ids and not request.in_prompt_phase:
                    request.replay = ReplayState.for_request(request)  # recompute resumes
                    if request.replay is not None:
                        request.transition(RequestState.REPLAYING)
                    else:  # nothing to replay: the token in flight starts at loop 0
                        self._start_decoding(request)
                continue
            assert result.sampled is not None and result.loops_used is not None
            if followers:  # before the leader's token, which may finish it
                self._fork(request, item, result, followers, now, touched)
            if self._append_first(request, result.sampled, result.loops_used, now, touched):
                self._start_decoding(request)
        for request_id, results in spec_results.items():
            request = self.queues.requests.get(request_id)
            if request is not None:
                self._apply_spec(request, results, now, touched)
        return touched

    def _apply_decode(
        self, rows_run: DecodeRows, results: DecodeResults, now: float, touched: list[Request]
    ) -> None:
        """Record one loop of each decode row (hazards, depth, delayed commitments) in the
        table; append the tokens that exited and start their requests' next tokens."""
        decode = self.decode
        rows = decode.lookup(rows_run.request_ids)
        live = rows >= 0  # a row whose request left while the step ran is skipped
        if live.all():  # the common case: no copies of the columns
            decode.exit.record(rows, rows_run.needs_gate, results.hazards, results.fired)
            exits = results.exited.nonzero()[0]  # indices into `rows_run`
        else:
            fired = None if results.fired is None else results.fired[live]
            decode.exit.record(rows[live], rows_run.needs_gate[live], results.hazards[live], fired)
            exits = (results.exited & live).nonzero()[0]
        if not len(exits):
            return
        self.decode_policy.on_token_exits(decode, rows[exits])
        if self.rules.defers_leave:  # sampled later, with a batch of leaves
            decode.hold(rows[exits])
            return
        self._append_exits(exits, rows[exits], results, rows_run.depths, now, touched)

    def _apply_leave(
        self, rows_run: LeaveRows, results: DecodeResults, now: float, touched: list[Request]
    ) -> None:
        """Append the tokens of held rows whose leave ran and start their next tokens (those
        started ahead get their fed-back token). A row not sampled (its request failed) is
        left as it is; the engine aborts its request."""
        decode = self.decode
        rows = decode.lookup(rows_run.request_ids)
        live = rows >= 0  # a row whose request left while the step ran is skipped
        sampled = (results.exited & live).nonzero()[0]
        ahead = decode.awaiting[rows[sampled]]
        decode.awaiting[rows[sampled]] = False
        decode.token_id[rows[sampled[ahead]]] = results.token_ids[sampled[ahead]]
        self._append_exits(
            sampled, rows[sampled], results, rows_run.depths, now, touched, started=ahead
        )

    def _append_exits(
        self,
        exits: np.ndarray,
        rows: np.ndarray,
        results: DecodeResults,
        depths: np.ndarray,
        now: float,
        touched: list[Request],
        started: np.ndarray | None = None,
    ) -> None:
        """Append the sampled tokens of result rows `exits` (table rows `rows`, each exited
        after loop `depths[i]`) and start their requests' next tokens (except where
        `started`: their next tokens started ahead, `LeaveBatcher.start`)."""
        decode = self.decode
        tokens = results.token_ids[exits].tolist()
        loops = (depths[exits] + 1).tolist()  # loops each token ran
        self.step_tokens += len(tokens)
        self.step_loops += sum(loops)
        aheads = [False] * len(tokens) if started is None else started.tolist()
        logprobs = results.logprobs
        continuing: list[int] = []
        continuing_requests: list[Request] = []
        for i, row, token, loops_used, ahead in zip(
            exits.tolist(), rows.tolist(), tokens, loops, aheads
        ):
            request = decode.requests[row]
            assert request is not None
            sampled = logprobs.get(i) if logprobs else None
            reason = request.append_token(token, loops_used, now, sampled)
            touched.append(request)
            if reason is not None:
                self.finish(request, reason)
            elif not ahead:
                continuing.append(row)
                continuing_requests.append(request)
        decode.start_tokens(continuing, continuing_requests)

    def _fork(
        self,
        leader: Request | None,
        item: PromptChunk,
        result: ItemResult,
        followers: list[Request],
        now: float,
        touched: list[Request],
    ) -> None:
        """Start the followers of `leader`'s prompt from their first tokens (`result.forked`,
        in the item's `forks` order): each forks the leader's prompt K/V when a seat and its
        blocks are free, else queues to recompute (`leader` None: it left during the step).
        A follower without a token (the leader's item ran nothing: its setup failed) queues
        as a new request and runs its own prompt."""
        by_id = dict(zip(item.forks, result.forked))
        tokenless = [f for f in followers if by_id.get(f.request_id) is None]
        new_leader = self.groups.regroup(tokenless)  # they run the prompt after all
        if new_leader is not None:
            bisect.insort(self.queues.waiting, new_leader, key=admission_key)
        for follower in followers:
            sampled = by_id.get(follower.request_id)
            if sampled is None:
                continue
            forked = leader is not None and self._try_fork(leader, follower)
            if not forked:
                bisect.insort(self.queues.waiting, follower, key=admission_key)
            assert result.loops_used is not None
            self.groups.stats.num_unforked += not forked
            if self._append_first(follower, sampled, result.loops_used, now, touched) and forked:
                self._start_decoding(follower)

    def _append_first(
        self, request: Request, sampled, loops_used: int, now: float, touched: list[Request]
    ) -> bool:
        """Append a request's first token (from its prompt's last position); False when that
        finished it."""
        reason = request.append_token(sampled.token_id, loops_used, now, sampled)
        self.step_tokens += 1
        self.step_loops += loops_used
        touched.append(request)
        if reason is not None:
            self.finish(request, reason)
            return False
        return True

    def _try_fork(self, leader: Request, follower: Request) -> bool:
        """Give `follower` the leader's prompt K/V (shared blocks, its last block copied) and a
        seat, when both are free; False (nothing changed) otherwise."""
        num_positions = leader.num_prompt_tokens
        reserve = follower.max_positions if self.admission.full_reservation else 0
        blocks = self.kv.fork_blocks(num_positions, reserve)
        if len(self.queues.running) >= self.max_num_seqs or not self.kv.can_admit(
            blocks, idle=False
        ):
            return False
        moves = self.kv.fork(leader.request_id, follower.request_id, num_positions, reserve)
        if moves:
            transfer = KVTransfer(SwapKind.FORK, follower.request_id, tuple(moves))
            self.outbox.transfers.append(transfer)
        follower.num_prefilled_tokens = follower.next_chunk_start = num_positions
        follower.num_cached_prompt_tokens = num_positions  # computed by its leader
        follower.transition(RequestState.RUNNING)
        self.decode.add(follower)
        self.queues.running.append(follower)
        self.groups.stats.num_forked += 1
        return True

    def _advance_replay(self, request: Request, item: WorkItem) -> None:
        replay = request.replay
        assert replay is not None
        replay.advance(item)
        if replay.finished:
            request.replay = None  # the token in flight starts at loop 0 next step
            request.transition(RequestState.RUNNING)
            self._start_decoding(request)

    def _apply_spec(
        self, request: Request, results: list, now: float, touched: list[Request]
    ) -> None:
        """Append the tokens a speculating request's positions made final this step."""
        emitted = self.speculator.apply(request, results)
        if not emitted:
            return
        touched.append(request)
        for sampled, loops_used in emitted:
            reason = request.append_token(sampled.token_id, loops_used, now, sampled)
            self.step_tokens += 1
            self.step_loops += loops_used
            if reason is not None:
                self.finish(request, reason)
                return
        assert request.spec is not None and request.spec.positions, "speculation ran dry"

    def _start_decoding(self, request: Request) -> None:
        """The request's next token (its last output, fed back) starts at loop 0: a decode row
        of the table, or a fresh speculative pipeline."""
        if request.speculative:
            self.speculator.start(request)
        else:
            self.decode.start_token(request)
