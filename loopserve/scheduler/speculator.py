"""`Speculator`: the scheduler's collaborator for requests that decode speculatively.

It starts a request's pipeline of positions (`speculation.Speculation`) when its next token
is due, gives every position in flight its K/V before a step (dropping drafts rather than
preempting anyone for them), applies a step's results of a request's positions (its draft
statistics summed engine-wide, rolled-back blocks freed and rolled-back handles handed to
the executor through the `StepOutbox`), and checks a request's pipeline invariants. The
`Scheduler` appends the tokens it returns. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable

from loopserve.contracts import SampledToken, SampleSpec
from loopserve.exit import ExitMode
from loopserve.exit.policies import CRITERIA_READING_LOGITS, TokenExit
from loopserve.scheduler.admission import Admission
from loopserve.scheduler.kv_cache import KVCacheManager
from loopserve.scheduler.preemption import pick_victim
from loopserve.scheduler.queues import Queues, StepOutbox
from loopserve.scheduler.request import Request, RequestStatus
from loopserve.scheduler.speculation import SpecStats, Speculation


def speculates(request: Request) -> bool:
    """Whether a request may decode speculatively: it asked for it (`SamplingParams.speculative`)
    and its sampling reads nothing but its logits (no penalties, bias, min_tokens, grammar or
    log-probabilities: a draft would have to read tokens that are not final yet)."""
    params = request.params
    spec = SampleSpec.of(params, request.stop_token_ids)
    return params.speculative and not spec.adjusts_logits and params.logprobs is None


def leave_waits(exit_mode: ExitMode, criterion: str, leave_attends: bool) -> str:
    """`Speculation.leave_waits` for a family: "" when its leave attends to no earlier
    position; else "check" when its criterion's check runs the leave (the criteria that read
    logits), "exit" when only an exit does."""
    if not leave_attends:
        return ""
    reads = exit_mode.reads_criterion and criterion in CRITERIA_READING_LOGITS
    return "check" if reads else "exit"


class Speculator:
    def __init__(
        self,
        *,
        num_tokens: int,
        draft_loops: int,
        exit_mode: ExitMode,
        kv: KVCacheManager,
        queues: Queues,
        admission: Admission,
        outbox: StepOutbox,
        new_handle: Callable[[], int],
        leave_waits: str = "",
    ) -> None:
        self.num_tokens = num_tokens  # K (0: speculation off)
        self.leave_waits = leave_waits  # `Speculation.leave_waits`
        self.draft_loops = draft_loops  # d
        self.exit_mode = exit_mode
        self.kv = kv
        self.queues = queues
        self.admission = admission
        self.outbox = outbox
        self._handle = new_handle
        self.stats = SpecStats()  # every request's draft statistics, summed

    def _token_exit(self, request: Request) -> Callable[[int], TokenExit]:
        """The exit state machine of the request's token at a decode position."""
        offset = request.num_prompt_tokens - 1

        def exit_of(position: int) -> TokenExit:
            return TokenExit(
                self.exit_mode, request.exit_rule, request.trace_loops(position - offset)
            )

        return exit_of

    def start(self, request: Request) -> None:
        """The request's next token (its last output, fed back) starts a fresh pipeline."""
        spec = Speculation(self.num_tokens, self.draft_loops, self.leave_waits)
        spec.start(
            request.next_position,
            request.output_token_ids[-1],
            self._token_exit(request),
            self._handle(),
        )
        request.spec = spec

    def grow(self) -> None:
        """K/V for every position in flight of each speculating request, oldest request first
        (a request swapped in or handed off starts its pipeline here): drafted positions are
        dropped rather than preempt anyone; the verified one grows like a decode token
        (preempting when the pool runs dry)."""
        kv, running = self.kv, self.queues.running
        decoding = [
            r for r in running if r.speculative and r.replay is None and not r.in_prompt_phase
        ]
        for request in decoding:
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted while an older request grew
            if request.spec is None:  # swapped in, or handed off: restart at loop 0
                self.start(request)
            spec = request.spec
            assert spec is not None
            request_id = request.request_id
            if not kv.grow(request_id, spec.max_position + 1):
                spec.roll_back(1)  # the drafts
                self._hand_over_dropped(request)
                while not kv.grow(request_id, spec.max_position + 1):
                    victim = pick_victim(running)
                    self.admission.preempt(victim)
                    if victim is request:
                        break
            if request.status is RequestStatus.RUNNING and not self.admission.full_reservation:
                kv.shrink(request_id, spec.max_position + 1)

    def _hand_over_dropped(self, request: Request) -> None:
        """Hand the handles of the request's rolled-back positions to the executor."""
        spec = request.spec
        if spec is not None and spec.dropped:
            rid = request.request_id
            self.outbox.dropped_handles.extend((rid, handle) for handle in spec.dropped)
            spec.dropped.clear()

    def apply(self, request: Request, results: list) -> list[tuple[SampledToken, int]]:
        """Apply one step's results of the request's positions; returns the tokens that became
        final, in order, with their loops used (none for a request preempted since)."""
        spec = request.spec
        if spec is None:
            return []
        mine = request.spec_stats
        before = (mine.drafted, mine.accepted, mine.rejected, mine.redrafted)
        emitted = spec.apply(
            results,
            exit_of=self._token_exit(request),
            new_handle=self._handle,
            max_position=request.max_positions - 1,
            stop_token_ids=request.stop_token_ids,
            stats=mine,
        )
        total = self.stats
        total.drafted += mine.drafted - before[0]
        total.accepted += mine.accepted - before[1]
        total.rejected += mine.rejected - before[2]
        total.redrafted += mine.redrafted - before[3]
        self._hand_over_dropped(request)
        if not self.admission.full_reservation:  # rolled-back positions' blocks go back now
            self.kv.shrink(request.request_id, spec.max_position + 1)
        return emitted

    def check(self, request: Request, covered: int) -> None:
        """A decoding speculative request's pipeline invariants (`covered`: positions its
        K/V blocks hold)."""
        spec, request_id = request.spec, request.request_id
        assert spec is not None and spec.positions
        assert spec.positions[0].verified and spec.positions[0].out is None
        # Positions that ran a loop have their slot (new ones get it when scheduled).
        ran = [p.position for p in spec.positions if p.exit.depth > 0]
        assert covered >= max(ran, default=-1) + 1, f"{request_id} lacks KV"
        if not self.admission.full_reservation:  # no block beyond those in flight
            keep = max(
                self.kv.blocks_per_plane(spec.max_position + 1),
                self.kv.num_cached_pages[request_id],
            )
            assert covered <= keep * self.kv.block_size, f"{request_id} kept blocks"
        positions = [p.position for p in spec.positions]
        assert positions == list(range(positions[0], positions[0] + len(positions)))
        # At most K positions on unconfirmed tokens: K + 1 rows fit every call.
        assert spec.num_unverified <= self.num_tokens
