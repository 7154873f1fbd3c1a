"""`SimExecutor`: a tensor-free stand-in for `ModelRunner` that prices each step on a GPU model.

It honours the runner contract (`loopserve.contracts`) item for item and row for row:
- every item runs `num_depths` consecutive loops; loop k of the step is one core call over
  the items with `k < num_depths` (an atomic prompt step is D calls, a decode step one);
  decode rows (`DecodeRows` columns) ride in the first call, priced with array sums;
- decode rows exit as `exit.columns.decide_exits` decides from their exit codes and the
  synthetic hazards, the rule the runner applies on the device; `needs_gate` rows report a
  hazard;
- a prompt item with `first_token` that reaches depth D-1 picks its first token's loops with
  `choose_exit_from_hazards` (its trace loops, or the hazards of its last position);
- exiting rows run the coda and the sampler and return a synthetic token (id 1 — requests in
  the simulator use `ignore_eos=True` and stop by length);
- hidden state is not stored, but handles are kept in the runner's `HandleTable` (with no
  state), and the requests with a decode token in flight are tracked like the runner's
  decode slots, so that work resuming from state never kept fails loudly, like the runner;
- releases arrive only in `SchedulerOutput.finished_request_ids`;
- per-request setup (a token counter) cannot fail, so `RunnerOutput.failed_requests` is
  always empty.

Exits in the simulator normally come from `exit_mode="trace"` (each request carries an exit
trace drawn from the workload's distribution), so no gate runs. For gated modes the executor
draws a target loop count per token from `exit_dist` and emits hazards 0 before it and 1 from
it on (one loop earlier for the delayed modes), so the exit rule lands on the target.

`model_time_s` of the `RunnerOutput`'s `stats` is simulated GPU seconds from the `CostModel`.

Cascade attention (`cascade=True`, the engine's `cascade_attention` resolved): the runner's
attention backend groups the one-row items of a core call whose block tables (of the plane they
read) start with the same blocks and reads that shared prefix once per group. The executor
applies the same rule (`plan_prefix_groups` over the step's block tables) to each core call
and prices a group's KV read as the prefix once plus each row's own suffix; attention FLOPs
are unchanged (every query still scores every position).
"""

from __future__ import annotations

import random

import numpy as np

from loopserve.contracts import (
    BlockTables,
    DecodeResults,
    DecodeRows,
    ItemKind,
    ItemResult,
    LeaveRows,
    RunnerOutput,
    RunnerStats,
    SampledToken,
    SchedulerOutput,
    SwapKind,
    WorkItem,
)
from loopserve.execution import Executor, StepRules
from loopserve.exit import ExitMode, choose_exit_from_hazards
from loopserve.exit.columns import CONTINUE, EXIT, GATE, decide_criterion_exits, decide_exits
from loopserve.exit.policies import GateState, loop_exits
from loopserve.runner.handles import HandleTable
from loopserve.sim.call_pricing import CallPricer, CallTally, CodaTally, ExecutorStats
from loopserve.sim.cost_model import CostModel
from loopserve.sim.workload import ExitDistribution

SYNTHETIC_TOKEN = SampledToken(1)
PROMPT, REPLAY, SPEC = ItemKind.PROMPT, ItemKind.REPLAY, ItemKind.SPEC
DRAFT_TOKEN_BASE = 100  # a wrong draft after loop j is id 100 + j (the emitted token is 1)


class SimExecutor(Executor):
    def __init__(
        self,
        cost_model: CostModel,
        *,
        layout: str = "last_exited",
        exit_mode: str = "trace",
        exit_dist: ExitDistribution | None = None,
        seed: int = 0,
        kv_block_bytes: int = 0,
        cascade: bool = False,
        block_size: int = 16,
        coda_every_loop: bool = False,
        draft_stable_dist: tuple[float, ...] | None = None,
        defers_leave: bool = False,
        imports_on_device: bool = False,
        graphed: bool = False,
    ) -> None:
        """`draft_stable_dist` (self-speculative decoding): P(s = j), j = 0..D-1, where s is the
        first loop from which the coda's argmax stays the token the position emits; a draft
        sampled after loop j is right iff j >= s (s is drawn once per position, seeded, and
        not capped at an early exit: pessimistic for exits before it). `kv_block_bytes`: one block of one plane, to price swap copies over the host link;
        `cascade`: price cascade attention (groups over `block_size`-position blocks);
        `coda_every_loop`: decode rows run the coda and lm_head after every loop (an exit
        criterion that reads the next-token distribution, e.g. Huginn's KL); `defers_leave`:
        coda batching in time (exited decode rows are priced no coda; `LeaveRows` are);
        `imports_on_device`: a hand-off's K/V landed in device memory (a link that writes
        GPU memory: NVLink, RDMA as NIXL over VRAM does), so its import is a copy within HBM
        like a fork's; otherwise it landed in host memory and crosses the host link.
        `graphed`: decode-only steps run the captured step (`runner/graphs.py`), whose
        parts run over every decode row of the call: the leave (lm_head, and a family's
        coda layers) and the argmax when some row is a coda candidate, a family's prelude
        layers when some row starts a token; eager calls run them over those rows only."""
        self.cost = cost_model
        self.graphed = graphed
        self.coda_every_loop = coda_every_loop
        self._prompt_len: dict[str, int] = {}
        self._coda = CodaTally()
        self.cascade = cascade
        self.num_loops = cost_model.shape.num_loops
        if draft_stable_dist is not None and len(draft_stable_dist) != self.num_loops:
            raise ValueError(
                f"draft_stable_dist has {len(draft_stable_dist)} entries; the model has "
                f"{self.num_loops} loops"
            )
        self.draft_stable_dist = draft_stable_dist
        self.rules = StepRules.of(layout, self.num_loops, defers_leave=defers_leave)
        self.shared = self.rules.shared
        self.exit_mode = ExitMode(exit_mode)
        if self.exit_mode.uses_gate and exit_dist is None:
            raise ValueError(f"exit_mode {exit_mode!r} needs an exit_dist to draw hazards from")
        self.exit_dist = exit_dist
        self.seed = seed
        self.kv_block_bytes = kv_block_bytes
        self.imports_on_device = imports_on_device
        self._prewritten: dict[str, int] = {}  # streamed hand-offs: bytes written as chunks
        self._swap_s = 0.0  # this step's swap copies
        self.stats = ExecutorStats()
        self.pricer = CallPricer(cost_model, self.stats, shared=self.shared, block_size=block_size)
        self._step_finalized = 0  # this step's finalized decode tokens
        self._handles: HandleTable[None] = HandleTable()
        self.block_tables = BlockTables()  # kept from the steps' updates (cascade pricing)
        self._kept = self._handles.kept()  # live view, for the per-item membership check
        self._decoding: set[str] = set()  # requests with decode state (the runner's slots)
        self._num_sampled: dict[str, int] = {}
        self._targets: dict[tuple[str, int], int] = {}

    # ---- bookkeeping ----------------------------------------------------------------------

    def _apply_bookkeeping(self, scheduled: SchedulerOutput) -> None:
        self.block_tables.apply(scheduled)
        for request_id in scheduled.finished_request_ids:
            self._handles.release(request_id)
            self._decoding.discard(request_id)
            self._targets.pop((request_id, self._num_sampled.pop(request_id, 0)), None)
            self._prompt_len.pop(request_id, None)
        for request_id, handle in scheduled.dropped_handles:  # rolled-back speculation
            self._handles.drop(request_id, handle)
        for new in scheduled.new_requests:
            self._num_sampled[new.request_id] = 0
            self._prompt_len[new.request_id] = new.prompt_len
        for request_id in scheduled.preempted_request_ids:  # recompute: hidden states dropped
            self._handles.release(request_id)
            self._decoding.discard(request_id)
        # Swapped requests keep their handles: their hidden states wait on the host.
        self._swap_s = 0.0
        for transfer in scheduled.kv_transfers:
            num_bytes = len(transfer.block_moves) * self.kv_block_bytes
            if transfer.kind is SwapKind.IMPORT:  # only what no streamed chunk wrote yet
                num_bytes = max(0, num_bytes - self._prewritten.pop(transfer.request_id, 0))
                self._swap_s += self._import_s(num_bytes)
                if not self.imports_on_device:
                    self.stats.swapped_blocks += len(transfer.block_moves)
                continue
            if transfer.kind is SwapKind.FORK:  # device to device
                self._swap_s += self._hbm_copy_s(num_bytes)
                continue
            self.stats.swapped_blocks += len(transfer.block_moves)
            self._swap_s += num_bytes / self.cost.device.effective_host_link
        self.stats.swap_time_s += self._swap_s
        self.stats.max_copy_s = max(self.stats.max_copy_s, self._swap_s)

    def _import_s(self, num_bytes: int) -> float:
        """A hand-off's K/V copied into this replica's blocks: within HBM (a read and a write)
        when it landed in device memory, else over the host link."""
        if self.imports_on_device:
            return self._hbm_copy_s(num_bytes)
        return num_bytes / self.cost.device.effective_host_link

    def _hbm_copy_s(self, num_bytes: int) -> float:
        """A copy within device memory: a read and a write of HBM."""
        return 2 * num_bytes / self.cost.device.effective_bandwidth

    def write_streamed(self, request_id: str, num_bytes: int) -> float:
        """A streamed hand-off's chunk, written into this decode replica's reserved blocks as
        it lands (outside any step, as `LLMEngine.write_kv_chunk` is); returns the seconds it
        holds the replica. The request's import then copies only what is left."""
        self._prewritten[request_id] = self._prewritten.get(request_id, 0) + num_bytes
        seconds = self._import_s(num_bytes)
        self.stats.streamed_write_s += seconds
        self.stats.max_copy_s = max(self.stats.max_copy_s, seconds)
        return seconds

    @property
    def num_live_handles(self) -> int:
        return len(self._handles) + len(self._decoding)

    # ---- synthetic gate -------------------------------------------------------------------

    def _hazard(self, request_id: str, token_index: int, depth: int) -> float:
        """0 before the token's target loop count, 1 from it (a step function of depth)."""
        key = (request_id, token_index)
        target = self._targets.get(key)
        if target is None:
            assert self.exit_dist is not None
            rng = random.Random(f"{self.seed}:{request_id}:{token_index}")
            target = rng.choices(range(1, self.num_loops + 1), weights=self.exit_dist.probs)[0]
            self._targets[key] = target
        crossing_loops = depth + (2 if self.exit_mode.delayed else 1)
        return 1.0 if crossing_loops >= target else 0.0

    # ---- execution ------------------------------------------------------------------------

    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        self._apply_bookkeeping(scheduled)
        items = scheduled.items
        if scheduled.is_empty:
            return RunnerOutput(scheduled.step_id, (), stats=RunnerStats(model_time_s=self._swap_s))
        num_calls = max([item.num_depths for item in items] + [1])
        # Per-call totals by item depth count: an item with n depths runs in calls 0..n-1, and
        # its rows, context and KV traffic are the same at every depth (prelude only at 0).
        tallies = [CallTally() for _ in range(num_calls + 1)]
        results = []
        coda_rows = num_early = 0
        self._step_finalized = 0
        self._coda = coda = CodaTally()
        decode_results = None
        if scheduled.decode is not None:
            decode_results, coda_rows, num_early = self._run_decode(
                scheduled.decode, tallies[1], graphed=self.graphed and not items
            )
        leave_results = None
        if scheduled.leave is not None:
            leave_results, num_leave_early = self._run_leave(scheduled.leave)
            coda_rows += len(scheduled.leave)
            num_early += num_leave_early
        for item in items:
            result, sampled = self._run_item(item, tallies[item.num_depths])
            results.append(result)
            if sampled:
                coda_rows += 1 + len(result.forked)  # a prompt group's followers sample too
                num_early += result.loops_used < self.num_loops  # type: ignore[operator]
        rows_per_call, core_s = self.pricer.price(tallies, self.block_tables.tables)
        coda_s = (
            coda.checks_s
            + self.cost.coda(
                coda.head_rows,
                layer_rows=coda.layer_rows,
                kv_read_positions=coda.kv_read,
                attention_pairs=coda.pairs,
            ).time_s
        )
        sampling_s = self.cost.sampling(coda_rows).time_s
        stats = self.stats
        stats.num_steps += 1
        stats.core_time_s += core_s
        stats.coda_time_s += coda_s
        stats.sampling_time_s += sampling_s
        stats.coda_rows += coda_rows
        stats.num_early_exits += num_early
        stats.num_finalize_copies += self._step_finalized
        step_stats = RunnerStats(
            rows_per_call,
            model_time_s=core_s + coda_s + sampling_s + self._swap_s,
            forward_time_s=core_s + coda_s,
            num_early_exits=num_early,
            num_finalize_copies=self._step_finalized,
        )
        return RunnerOutput(
            scheduled.step_id, tuple(results), decode=decode_results, stats=step_stats,
            leave=leave_results,
        )  # fmt: skip

    def _run_leave(self, rows: LeaveRows) -> tuple[DecodeResults, int]:
        """Held tokens' leave, priced as a coda over their rows (sampling is priced with
        the step's other sampled rows); (results, early exits)."""
        m = len(rows)
        for request_id in rows.request_ids:
            assert request_id in self._decoding, f"{request_id}: a leave without decode state"
        context = int(rows.positions.sum()) + m
        if not self.coda_every_loop:
            self._coda.add(m, m, context, context)
        token_ids = np.full(m, SYNTHETIC_TOKEN.token_id, np.int64)
        results = DecodeResults(np.ones(m, bool), np.full(m, np.nan), token_ids)
        return results, int(np.count_nonzero(rows.depths + 1 < self.num_loops))

    def _run_decode(
        self, rows: DecodeRows, tally: CallTally, *, graphed: bool = False
    ) -> tuple[DecodeResults, int, int]:
        """Exits, hazards and pricing of a call's decode rows (one loop each; `graphed`: as
        the captured step runs them); (results, rows sampled, early exits)."""
        n, depths = len(rows), rows.depths
        decoding = self._decoding
        for request_id, depth in zip(rows.request_ids, depths.tolist()):
            if request_id not in decoding:
                assert depth == 0, f"{request_id}: resumes a decode token the runner never kept"
                decoding.add(request_id)
        tally.has_decode = True
        tally.rows += n
        first = depths == 0
        num_first = int(np.count_nonzero(first))
        # The captured prelude's layers run over every row; only rows that start read the
        # once plane's K/V (the others one position).
        graphed_prelude = graphed and num_first and self.cost.shape.prelude_layers
        tally.prelude_rows += n if graphed_prelude else num_first
        first_context = int(rows.positions[first].sum()) + num_first
        tally.prelude_kv_read += first_context
        tally.prelude_pairs += first_context
        context = int(rows.positions.sum()) + n  # each row reads positions 0..its own
        tally.kv_read += context
        tally.pairs += context
        if self.coda_every_loop:  # the criterion's coda over every row, every loop
            self._coda.checks_s += self.cost.coda(
                n, kv_read_positions=context, attention_pairs=context
            ).time_s
        if self.cascade:
            tally.singles += zip(rows.request_ids, depths.tolist(), rows.positions.tolist())
        hazards = np.full(n, np.nan)
        for i in np.flatnonzero(rows.needs_gate).tolist():
            request_id = rows.request_ids[i]
            index = self._num_sampled[request_id]
            hazards[i] = self._hazard(request_id, index, int(depths[i]))
        exited = rows.exit_code == EXIT
        # the synthetic signal is a step function: 1.0 stands for "the criterion fired"
        fired = hazards >= 1.0 if self.exit_mode.reads_criterion else None
        if (rows.exit_code == GATE).any() and fired is not None:
            exited = decide_criterion_exits(rows.exit_code, fired)
        elif (rows.exit_code == GATE).any():
            exited = decide_exits(
                rows.exit_code, rows.cdf_before, rows.survival_before, hazards, rows.threshold
            )
        if not self.shared:  # finalize copies into the planes deeper than the exit
            finalized = exited & (depths < self.num_loops - 1)
            tally.finalize += int((self.num_loops - 1 - depths[finalized]).sum())
            self._step_finalized += int(np.count_nonzero(finalized))
        for i in np.flatnonzero(exited).tolist():
            request_id = rows.request_ids[i]
            self._targets.pop((request_id, self._num_sampled[request_id]), None)
            self._num_sampled[request_id] += 1
        if self.rules.defers_leave:  # sampled with a later step's leave rows
            return DecodeResults(exited, hazards, np.full(n, -1, np.int64), fired=fired), 0, 0
        token_ids = np.where(exited, SYNTHETIC_TOKEN.token_id, -1).astype(np.int64)
        num_left = num_exits = int(np.count_nonzero(exited))  # the rows whose leave runs
        context = int(rows.positions[exited].sum()) + num_exits  # read by the coda layers
        candidates = rows.exit_code != CONTINUE
        if graphed and candidates.any():  # the captured leave runs over every row; only the
            # candidates read the once plane's K/V (the others one position)
            num_left = n
            context = int(rows.positions[candidates].sum()) + int(np.count_nonzero(candidates))
        if not self.coda_every_loop:
            self._coda.add(num_left, num_left, context, context)
        num_early = int(np.count_nonzero(exited & (depths + 1 < self.num_loops)))
        return DecodeResults(exited, hazards, token_ids, fired=fired), num_left, num_early

    def _run_item(self, item: WorkItem, tally: CallTally) -> tuple[ItemResult, int]:
        """Exit decision, coda and handle bookkeeping of one prompt or replay item; adds its
        rows to `tally`."""
        request_id, handle = item.request_id, item.handle
        if item.needs_prelude:
            tally.prelude_rows += item.token_count
            tally.prelude_kv_read += item.token_start + item.token_count
            tally.prelude_pairs += (
                item.token_count * item.token_start + item.token_count * (item.token_count + 1) // 2
            )
        else:
            assert handle in self._kept, (
                f"{request_id}: resumes from handle {handle} the runner never kept"
            )
        count, start = item.token_count, item.token_start
        tally.rows += count
        if count == 1 and self.cascade:
            tally.singles.append((request_id, item.depth, start))
        if item.kind in (REPLAY, SPEC):  # one decode position, one loop
            tally.has_decode = True
            tally.kv_read += start + 1
            tally.pairs += start + 1
            if item.kind is SPEC:  # a speculative position: its own exit, drafts
                result = self._spec_result(item)
            else:  # recompute: a known token through its recorded loops
                result = ItemResult(request_id, handle, (), bool(item.exit_now))
            if self.rules.finalizes(item.depth, result.exited):
                tally.finalize += self.num_loops - 1 - item.depth
            if result.sampled is not None:  # its lm_head (and coda layers at an exit)
                self._coda.add(1, int(result.exited), start + 1, start + 1)
            elif result.exited:  # a replayed token's coda layers (their K/V), no lm_head
                self._coda.add(0, 1, start + 1, start + 1)
        else:
            tally.has_prompt = True
            tally.kv_read += start + count  # the chunk streams its context once
            tally.pairs += count * start + count * (count + 1) // 2
            result = self._prompt_result(item)
            if item.last_depth == self.num_loops - 1:  # every position's coda layers
                pairs = count * start + count * (count + 1) // 2
                self._coda.add(0, count, start + count, pairs)
        # No hidden state to carry: a handle stays kept (None) from its first loop until its
        # work completes, instead of the runner's resume-then-keep each step.
        if self.rules.releases_handle(item, result.exited, result.sampled is not None):
            self._handles.drop(request_id, handle)  # (kept unless it started this step)
        elif item.needs_prelude:
            self._handles.keep(request_id, handle, None)
        if item.kind is SPEC:  # its tokens are counted as the scheduler emits them
            return result, int(result.exited)
        if result.sampled is None:
            return result, 0
        self._coda.head_rows += 1  # the sampled position's lm_head
        if result.loops_used is not None and result.loops_used < self.num_loops:
            self._coda.add(0, 1, start + count, start + count)  # an early-exit first token
        self._targets.pop((request_id, self._num_sampled[request_id]), None)
        self._num_sampled[request_id] += 1
        return result, 1

    def _spec_result(self, item: WorkItem) -> ItemResult:
        """A speculative position's loop: its exit by its plan over the synthetic hazards (its
        token index from its position); a draft when it drafts: the emitted token (id 1) if
        the loop is at or past the position's stable loop, else an id of that loop (100 + j:
        a deeper wrong draft differs too); at its exit, id 1."""
        request_id, position = item.request_id, item.token_start
        index = position - self._prompt_len[request_id] + 1
        hazard = self._hazard(request_id, index, item.depth) if item.needs_gate else None
        exited = loop_exits(
            item.exit_now, GateState(item.cdf_before, item.survival_before), hazard, item.threshold
        )
        hazards = () if hazard is None else (hazard,)
        if exited:
            self._targets.pop((request_id, index), None)
            return ItemResult(
                request_id, item.handle, hazards, True, item.depth + 1, SYNTHETIC_TOKEN
            )
        sampled = None
        if item.draft:
            assert self.draft_stable_dist is not None, "speculation needs draft_stable_dist"
            rng = random.Random(f"{self.seed}:spec:{request_id}:{position}")
            stable = rng.choices(range(self.num_loops), weights=self.draft_stable_dist)[0]
            right = item.depth >= stable
            sampled = SYNTHETIC_TOKEN if right else SampledToken(DRAFT_TOKEN_BASE + item.depth)
        return ItemResult(request_id, item.handle, hazards, False, None, sampled)

    def _prompt_result(self, item: WorkItem) -> ItemResult:
        depths = range(item.depth, item.last_depth + 1)
        gated = item.first_token and item.needs_gate
        hazards = tuple(self._hazard(item.request_id, 0, d) for d in depths) if gated else ()
        if not self.rules.samples_first_token(item):
            return ItemResult(item.request_id, item.handle, hazards)
        assert item.exit_rule is not None
        all_hazards = None
        if item.needs_gate:
            all_hazards = [self._hazard(item.request_id, 0, d) for d in range(self.num_loops)]
        loops = choose_exit_from_hazards(
            self.exit_mode, item.exit_rule, all_hazards, item.trace_loops
        )
        for request_id in item.forks:  # a prompt group's followers: first tokens sampled
            self._num_sampled[request_id] += 1
        forked = (SYNTHETIC_TOKEN,) * len(item.forks)
        return ItemResult(
            item.request_id, item.handle, hazards, True, loops, SYNTHETIC_TOKEN, forked=forked
        )
