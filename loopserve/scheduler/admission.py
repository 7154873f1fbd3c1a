"""Admission and KV memory: which waiting requests start, how running requests grow, and
preemption (recompute or swap) when KV runs out or a higher-priority request arrives.

`Admission` is a collaborator the `Scheduler` owns, with explicit inputs: the KV manager,
the shared `Queues` and `StepOutbox` (queues.py), the `DecodeTable` (a row per running
request: given at admission, freed when it leaves RUNNING), the memory settings of the
config and the `MemoryStats` it counts into.
Admission goes by (priority, arrival) and never lets a later request jump
ahead; incremental allocation gives a request its prompt's blocks at admission and one more
block per plane when a decode token enters a new block; the victim of a preemption is the
lowest priority, then the latest arrival. Torch-free.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from loopserve.config import EngineConfig
from loopserve.contracts import KVTransfer, NewRequestData, SampleSpec, SwapKind
from loopserve.errors import InvalidRequestError
from loopserve.scheduler.decode_table import DecodeTable
from loopserve.scheduler.kv_cache import KVCacheManager
from loopserve.scheduler.preemption import pick_victim, reset_for_recompute
from loopserve.scheduler.queues import Queues, StepOutbox
from loopserve.scheduler.request import Request, RequestState, RequestStatus


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


@dataclass
class ImportReservation:
    """Blocks a streamed KV import holds before its request arrives (`Admission.reserve_import`):
    its table is allocated (the executor learns it at admission). `num_cached_blocks` blocks per
    plane come from this engine's prefix cache (the sender skips them); `first_block` is the
    first block per plane the final hand-off's K/V carries (set when the request arrives)."""

    num_cached_blocks: int
    first_block: int | None = None


def admission_key(request: Request) -> tuple[int, int]:
    """Waiting-queue order: priority (lower first), then arrival."""
    return (request.params.priority, request.arrival_order)


class Admission:
    """Admission, growth and preemption for the `Scheduler` (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        kv: KVCacheManager,
        queues: Queues,
        outbox: StepOutbox,
        decode: DecodeTable,
        memory_stats: MemoryStats,
    ) -> None:
        sched = config.scheduler
        self.kv = kv
        self.queues = queues
        self.outbox = outbox
        self.decode = decode
        self.memory_stats = memory_stats
        self.max_num_seqs = sched.max_num_seqs
        self.full_reservation = config.cache.kv_reservation == "full"
        self.swap_preemption = sched.preemption_mode == "swap"
        self.priority_preemption = sched.scheduling_policy == "priority"
        # The prompt exits as one token (Huginn's `prompt_exits`): recompute replays it
        # through the loops it used.
        self.prompt_exits = config.exit.prompt_exits
        self.reserved: dict[str, ImportReservation] = {}  # streamed KV imports

    # ---- streamed KV imports ----------------------------------------------------------------

    def reserve_import(self, request: Request) -> int | None:
        """Allocate the blocks a request handed off chunk by chunk will need (its prompt and
        first token, or its whole reservation) before its K/V arrives; its prompt's cached
        pages serve its first blocks. Returns how many blocks per plane the prefix cache
        supplied (the sender skips them), or None when the blocks do not fit now (the hand-off
        then moves whole). `request` is not queued: it arrives later (`add_imported`)."""
        request_id = request.request_id
        if request_id in self.reserved or request_id in self.queues.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        positions = (
            request.max_positions if self.full_reservation else request.num_prompt_tokens + 1
        )
        hits = self.kv.match_prefix(
            request_id, request.prompt_token_ids, max_loops=request.exit_rule.max_loops
        )
        if not self.kv.can_admit(
            self.kv.admission_blocks(positions, hits), idle=not self.queues.running
        ):
            self.kv.forget(request_id)
            return None
        self.kv.allocate(request_id, positions, prefix=hits)
        self.kv.hold_table(request_id)
        self.kv.mark_unscored(request_id)  # its K/V arrive by copy
        self.reserved[request_id] = ImportReservation(len(hits))
        return len(hits)

    def release_reserved(self, request_id: str) -> bool:
        """Free a reservation's blocks (its request never came, or finished before admission);
        False when there is none."""
        if self.reserved.pop(request_id, None) is None:
            return False
        self.kv.free(request_id)
        self.kv.forget(request_id)
        return True

    def _import_blocks(self, request: Request, positions: int) -> int:
        """Free blocks an imported request's admission consumes (none of a reservation's)."""
        if request.request_id in self.reserved:
            return self.kv.blocks_to_grow(request.request_id, positions)
        return self.kv.admission_blocks(positions, [])

    def admit(self) -> None:
        """Admit waiting requests in (priority, arrival) order while seats and KV allow; past
        the first that does not fit, later requests never jump ahead, except an import into
        a reservation (streamed hand-off): its blocks are held already, so admitting it
        takes no block the ones ahead wait for, and holding it back could wait forever (the
        first may wait for exactly the blocks that reservation holds)."""
        victims: set[str] = set()
        waiting = self.queues.waiting
        index = 0  # 0: the head; past it, only imports into a reservation are admitted
        while index < len(waiting):
            request = waiting[index]
            if request.request_id in victims:  # preempted by this very pass
                if index == 0:
                    break
                index += 1
                continue
            if index > 0 and not (request.pending_import and request.request_id in self.reserved):
                index += 1
                continue
            positions = self._admission_positions(request)
            if request.swapped:
                hits, blocks = [], self.kv.swap_in_blocks(request.request_id)
            elif request.pending_import:
                hits, blocks = [], self._import_blocks(request, positions)
            else:
                hits = self._prefix_hits(request)
                blocks = self.kv.admission_blocks(positions, hits)
            if not self._has_room(blocks):
                if index > 0 or not (
                    self.priority_preemption and self._preempt_for(request, blocks, victims)
                ):
                    index += 1
                    continue
                # A victim's release may have made some hits idle.
                if not (request.swapped or request.pending_import):
                    blocks = self.kv.admission_blocks(positions, hits)
                    if not self._has_room(blocks):
                        index += 1
                        continue
            del waiting[index]
            self._start_running(request, positions, hits)

    def _prefix_hits(self, request: Request) -> list:
        """Cached pages the request can reuse. A request that asked for prompt logprobs
        scores every prompt position: at the last loop it reuses scored pages only (their
        positions are scored from the runner's score store); at the exit rule's loops none
        (the store holds last-loop outputs only; its own pages are still published)."""
        params = request.params
        if params.prompt_logprobs is None:
            return self.kv.match_prefix(
                request.request_id,
                request.prompt_token_ids,
                max_loops=request.exit_rule.max_loops,
            )
        if params.prompt_logprobs_loop != "last":
            return []
        return self.kv.match_prefix(
            request.request_id,
            request.prompt_token_ids,
            scored_only=True,
            max_loops=request.exit_rule.max_loops,
        )

    def _admission_positions(self, request: Request) -> int:
        if self.full_reservation:
            return request.max_positions
        if (
            request.output_token_ids
        ):  # resumed after recompute preemption: up to the token in flight
            return request.next_position + 1
        return request.num_prompt_tokens

    def _has_room(self, blocks: int) -> bool:
        if len(self.queues.running) >= self.max_num_seqs:
            return False
        return self.kv.can_admit(blocks, idle=not self.queues.running)

    def _preempt_for(self, request: Request, blocks: int, victims: set[str]) -> bool:
        """Priority policy: preempt strictly lower-priority running requests (lowest first)
        until `request` fits; False when even all of them would not make room."""
        outranked = [r for r in self.queues.running if r.params.priority > request.params.priority]
        seats = self.max_num_seqs - len(self.queues.running) + len(outranked)
        freeable = sum(len(self.kv.tables[r.request_id][0]) for r in outranked) * self.kv.num_planes
        if seats < 1 or not self.kv.can_admit(
            blocks - freeable, idle=len(outranked) == len(self.queues.running)
        ):
            return False
        while not self._has_room(blocks) and outranked:
            victim = pick_victim(outranked)
            outranked.remove(victim)
            self.preempt(victim)
            victims.add(victim.request_id)
        return self._has_room(blocks)

    def _start_running(self, request: Request, positions: int, hits: list) -> None:
        request_id = request.request_id
        if request.swapped:
            moves = self.kv.swap_in(request_id)
            self.outbox.transfers.append(KVTransfer(SwapKind.IN, request_id, tuple(moves)))
        elif request.pending_import:
            reservation = self.reserved.pop(request_id, None)
            first = cached = 0
            if reservation is None:
                table = self.kv.allocate(request_id, positions)
            else:  # streamed: blocks before `first` were written as they arrived
                grown = self.kv.grow(request_id, positions)  # (not inside the assert: -O)
                assert grown, "admitted without room"
                self.kv.resend_table(request_id)
                table = self.kv.tables[request_id]
                first = reservation.first_block or 0
                cached = reservation.num_cached_blocks  # pages of this cache: left as they are
            self.kv.mark_unscored(request_id)  # its K/V arrive by copy
            # The blocks the hand-off carries: of the written positions, from `first` on.
            blocks = self.kv.blocks_per_plane(request.next_position) - first
            moves = tuple(
                (p * blocks + i, plane[first + i])
                for p, plane in enumerate(table)
                for i in range(blocks)
                if first + i >= cached
            )
            self.outbox.transfers.append(KVTransfer(SwapKind.IMPORT, request_id, moves))
        else:
            self.kv.allocate(request_id, positions, prefix=hits)
            if self.kv.prefix_cache is not None:
                # Prompt positions served by cached pages are complete at every plane.
                cached = len(hits) * self.kv.block_size
                request.num_prefilled_tokens = request.next_chunk_start = cached
                request.num_hit_positions = cached
                stats = self.kv.prefix_cache.stats
                stats.num_queried_tokens += request.num_prompt_tokens
                stats.num_hit_tokens += cached
                if not request.num_preemptions:  # its first admission (a prompt group's
                    request.num_cached_prompt_tokens = cached  # follower may be announced)
        importing = request.pending_import
        request.transition(RequestState.REPLAYING if request.replay else RequestState.RUNNING)
        self.decode.add(request)
        if importing and not request.speculative:  # its next token decodes from loop 0
            self.decode.start_token(request)
        else:  # swapped out between two loops of a token: it resumes there
            self.decode.unpark(request)
        if request.times.first_scheduled_s is None:
            request.times.first_scheduled_s = time.monotonic()
        self.queues.running.append(request)
        self.announce(request)

    def announce(self, request: Request) -> None:
        """Tell the executor about the request (its sampler) once, in the next output."""
        if request.announced:
            return
        request.announced = True
        spec = SampleSpec.of(request.params, request.stop_token_ids)
        history: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        if spec.needs_history:  # the prompt, and the outputs of a handed-off request
            history = (tuple(request.prompt_token_ids), tuple(request.output_token_ids))
        self.outbox.new_requests.append(
            NewRequestData(
                request.request_id,
                spec,
                request.params.seed,
                *history,
                request.exit_rule.max_loops,
                len(request.prompt_token_ids),
                request.params.exit_stable_steps,
            )
        )

    def grow_running(self) -> None:
        """Give every decode token about to be written a slot in every plane, oldest request
        first; preempt (lowest priority, latest arrival) when the pool runs dry."""
        if self.full_reservation:
            return
        # Hot path (every step): only a token about to write the first position of a block
        # can need one (prompt positions, and the rest of a block, exist already).
        decode = self.decode
        for row in decode.rows_entering_a_block(self.kv.block_size).tolist():
            request = decode.requests[row]
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # preempted while an older request grew
            needed = int(decode.position[row]) + 1  # (a token started ahead: one further)
            while not self.kv.grow(request.request_id, needed):
                victim = pick_victim(self.queues.running)
                self.preempt(victim)
                if victim is request:
                    break

    def preempt(self, victim: Request) -> None:
        """Free (or swap out) the victim's KV and queue it again with its progress."""
        request_id = victim.request_id
        self.queues.running.remove(victim)
        # A request still to score prompt positions from cached pages recomputes instead:
        # the score store rows of those pages do not travel with a swap.
        swap = (
            self.swap_preemption
            and self.kv.can_swap_out(request_id)
            and not victim.scores_cached_positions
        )
        if swap:  # its token in flight resumes where it stopped
            self.decode.park(victim)
        # Speculative positions in flight are dropped: the last final token restarts at loop 0
        # when the request runs again (the scheduler starts it).
        if victim.spec is not None:
            self.outbox.dropped_handles += [(request_id, p.handle) for p in victim.spec.positions]
            victim.spec = None
        self.decode.remove(request_id)
        if swap:
            moves = self.kv.swap_out(request_id)
            self.outbox.transfers.append(KVTransfer(SwapKind.OUT, request_id, tuple(moves)))
            victim.transition(RequestState.WAITING_SWAPPED)
            self.memory_stats.num_preemptions_swap += 1
        else:  # recompute (also the fallback when the host pool is full)
            self.kv.free(request_id)
            self.outbox.preempted_ids.append(request_id)
            reset_for_recompute(victim)
            if self.prompt_exits and victim.exit_depths:
                victim.prompt_loops = victim.exit_depths[0]
            victim.transition(RequestState.WAITING)
            self.memory_stats.num_preemptions_recompute += 1
        victim.num_preemptions += 1
        bisect.insort(self.queues.waiting, victim, key=admission_key)

    def head_may_be_admitted(self) -> bool:
        """Whether `schedule()` could admit the first waiting request now (the same test as
        `admit`, without side effects); True whenever the priority policy might preempt."""
        request = self.queues.waiting[0]
        if self.priority_preemption:
            return True
        if request.swapped:
            blocks = self.kv.swap_in_blocks(request.request_id)
        elif request.pending_import:
            blocks = self._import_blocks(request, self._admission_positions(request))
        else:
            hits = self._prefix_hits(request)
            blocks = self.kv.admission_blocks(self._admission_positions(request), hits)
        return self._has_room(blocks)
