"""Self-speculative decoding: a request's decode positions as a pipeline of drafted tokens.

A looped model carries its own draft model, its first loops. Loop j of position p reads only
plane j of positions <= p (LAST_EXITED) and p's token id, so once a position has run `d`
loops (`draft_loops`), the coda of its loop d-1 output gives a draft of the next token, and
the next position can start its loop 0 on that draft in the next step, while this position
runs its deeper loops: the two rows share core calls, one depth apart, like the chunks of a
wavefront prompt. When this position exits (its own exit rule, unchanged), its sample is the
real next token: if it equals the draft (greedy), or passes the speculative-sampling test
(`runner/coda.py`), every loop the next position ran on the draft is exactly a loop it would
run anyway, and it goes on; otherwise that position and everything after it is dropped
(rolled back) and the next position restarts at loop 0 on the real token.

Progressive drafts: every later loop of the drafting position that does not exit drafts
again; when a deeper loop's draft differs, the next position restarts on it at once instead
of at the exit. Sampling: a deeper loop keeps the draft by the speculative-sampling rule
from the earlier loop's distribution to its own (`runner/coda.py`), so the draft the exit
verifies follows the deepest loop's distribution, which the exit's test uses: exact.

`Speculation` keeps a request's positions in flight, oldest first. The oldest is always
verified (its token is final); up to `num_tokens` younger positions run on drafts (or on
samples of positions that are themselves unverified). A position that exits before loop d
needs no draft: its sample is its real next token, as in plain decoding. Tokens are emitted
in order as their positions exit and become verified, several in one step when younger
positions already exited. Outputs equal plain decoding (greedy: tokens and exit depths) or
its distribution (sampling).

A family whose leave attends to earlier positions (Huginn's coda layers keep once-plane K/V)
reads there what older positions' leaves wrote, and a position's leave K/V is final only at
its exit (every check before rewrites it). So, with `leave_waits`, a position whose loop
would run its leave for the exit rule waits until every older position has exited: under
"exit" a loop that may exit (the latent criteria, whose check reads only states), under
"check" also a loop whose criterion is checked (the criteria that read logits). Its other
loops, and draft leaves (a draft need not be exact: its verification is), run as above. It
then checks and exits exactly as plain decoding would; the overlap is the loops before its
first such loop (`min_loops`, or under `criterion_delayed` with a latent criterion every
loop but the exit one).

Rolled-back positions need no clean-up in the K/V: a restarted position writes each plane
before any later position reads it (the lag above), and the scheduler frees blocks beyond
the positions still in flight. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from loopserve.contracts import ItemResult, SampledToken, SpecRow, WorkItem
from loopserve.exit.policies import LoopPlan, TokenExit


@dataclass(slots=True)
class SpecPosition:
    """One decode position in flight: it runs `token_id` through its loops."""

    position: int
    token_id: int
    verified: bool  # its token is final (else a draft, or the sample of an unverified one)
    exit: TokenExit
    handle: int
    drafted: bool  # its token is a draft (counted as accepted when verified)
    child: bool = False  # the next position runs on this one's draft or sample
    out: SampledToken | None = None  # its sample, once it exited
    loops: int = 0


@dataclass(slots=True)
class SpecStats:
    """Per request: drafts made, drafts verified equal to the real token, drafts rejected at
    verification, and drafts replaced by a deeper loop's different draft before it."""

    drafted: int = 0
    accepted: int = 0
    rejected: int = 0
    redrafted: int = 0


@dataclass
class Speculation:
    num_tokens: int  # K: unverified positions in flight at most
    draft_loops: int  # d
    # "" (the leave reads no earlier position), "exit" or "check": see the module's text.
    leave_waits: str = ""
    positions: list[SpecPosition] = field(default_factory=list)
    # Handles of positions rolled back since the scheduler last collected them: the
    # executor drops their state (`SchedulerOutput.dropped_handles`).
    dropped: list[int] = field(default_factory=list)

    def start(
        self, position: int, token_id: int, exit_of: Callable[[int], TokenExit], handle: int
    ) -> None:
        """The request's next decode token (final) starts at loop 0 (a fresh pipeline)."""
        self.positions = [SpecPosition(position, token_id, True, exit_of(position), handle, False)]

    @property
    def num_unverified(self) -> int:
        return sum(not p.verified for p in self.positions)

    def items(
        self, request_id: str, max_position: int, allow_drafts: bool = True
    ) -> list[WorkItem]:
        """One loop of every position that may run now: a position runs loop j once every
        older position still running has run it (so what it reads of them exists).
        `max_position`: the last position the request may feed; `allow_drafts`: False lets
        the positions in flight finish without new drafts."""
        items: list[WorkItem] = []
        frontier = None  # min next loop over older positions still running
        for i, pos in enumerate(self.positions):
            if pos.out is not None:
                continue
            depth = pos.exit.depth
            if frontier is not None and depth >= frontier:
                break
            older_running = frontier is not None
            frontier = depth if frontier is None else min(frontier, depth)
            plan = pos.exit.plan()
            if older_running and self._leave_waits(plan):
                continue  # its leave would read an older position's non-final leave K/V
            # From loop d-1 on, every loop that does not exit drafts again (a deeper loop's
            # draft is likelier right); a changed draft replaces the next position.
            can_draft = (
                allow_drafts
                and depth >= self.draft_loops - 1
                and plan.exit_now is not True
                and pos.position + 1 <= max_position
                and (pos.child or self.num_unverified < self.num_tokens)
            )
            child = self.positions[i + 1] if pos.child else None
            items.append(
                SpecRow(
                    request_id,
                    pos.position,
                    1,
                    depth,
                    1,
                    pos.handle,
                    depth == 0,
                    (pos.token_id,) if depth == 0 else (),
                    plan.needs_gate,
                    plan.exit_now,
                    plan.state_before.cdf,
                    plan.state_before.survival,
                    plan.threshold,
                    draft=can_draft,
                    verify_token=-1 if child is None else child.token_id,
                )
            )
        return items

    def _leave_waits(self, plan: LoopPlan) -> bool:
        """Whether this loop runs the leave for the exit rule, under `leave_waits`."""
        if not self.leave_waits:
            return False
        return plan.exit_now is not False or (self.leave_waits == "check" and plan.needs_gate)

    def apply(
        self,
        results: list[tuple[WorkItem, ItemResult]],
        *,
        exit_of: Callable[[int], TokenExit],
        new_handle: Callable[[], int],
        max_position: int,
        stop_token_ids: frozenset[int],
        stats: SpecStats,
    ) -> list[tuple[SampledToken, int]]:
        """Apply one step's results of this request's positions (in position order); returns
        the tokens that became final, in order, with their loops used."""
        index = {pos.handle: pos for pos in self.positions}
        for item, result in results:
            pos = index.get(item.handle)
            if pos is None or pos not in self.positions:
                continue  # rolled back earlier in this step
            hazard = result.hazards[0] if result.hazards else None
            pos.exit.record(hazard, result.exited)
            sampled = result.sampled
            if sampled is None:
                continue
            at = self.positions.index(pos)
            if result.exited:
                pos.out, pos.loops = sampled, pos.exit.loops_used
                if pos.child:
                    child = self.positions[at + 1]
                    if child.token_id == sampled.token_id:
                        continue  # the next position ran on the right token
                    if child.drafted:
                        stats.rejected += 1
                    self.roll_back(at + 1)
                if sampled.token_id in stop_token_ids or pos.position + 1 > max_position:
                    continue  # nothing after it, if it is final
                if not pos.verified and self.num_unverified >= self.num_tokens:
                    continue  # its next position starts when it becomes final (`_emit`)
                verified = pos.verified
                drafted = False
            else:  # a draft of the next token
                if pos.child:
                    if self.positions[at + 1].token_id == sampled.token_id:
                        continue  # the draft stands
                    stats.redrafted += 1
                    self.roll_back(at + 1)  # a deeper loop changed its mind
                if self.num_unverified >= self.num_tokens or sampled.token_id in stop_token_ids:
                    continue  # (a drafted stop token: the real one ends the request, or not)
                verified, drafted = False, True
                stats.drafted += 1
            pos.child = True
            self.positions.append(
                SpecPosition(
                    pos.position + 1,
                    sampled.token_id,
                    verified,
                    exit_of(pos.position + 1),
                    new_handle(),
                    drafted,
                )
            )
        return self._emit(stats, exit_of, new_handle, max_position, stop_token_ids)

    def roll_back(self, start: int) -> None:
        """Drop the positions from index `start` on (their handles go to `dropped`)."""
        self.dropped += [pos.handle for pos in self.positions[start:]]
        del self.positions[start:]
        if start > 0:
            self.positions[start - 1].child = False

    def _emit(
        self, stats: SpecStats, exit_of, new_handle, max_position: int, stop_token_ids
    ) -> list[tuple[SampledToken, int]]:
        """Pop the verified positions that exited, in order; their children become verified
        (a position whose next one was held back by the K bound starts it now)."""
        emitted = []
        while self.positions and self.positions[0].out is not None:
            pos = self.positions.pop(0)
            assert pos.verified, "the oldest position in flight runs on a final token"
            out = pos.out
            emitted.append((out, pos.loops))
            if self.positions:
                child = self.positions[0]
                if not child.verified:
                    child.verified = True
                    stats.accepted += child.drafted
            elif out.token_id not in stop_token_ids and pos.position + 1 <= max_position:
                nxt = pos.position + 1
                self.positions.append(
                    SpecPosition(nxt, out.token_id, True, exit_of(nxt), new_handle(), False)
                )
        # Unverified children of verified positions are verified only by their parent's exit.
        return emitted

    @property
    def max_position(self) -> int:
        """The furthest position in flight (-1: none)."""
        return self.positions[-1].position if self.positions else -1
