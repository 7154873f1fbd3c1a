"""The eager core calls of a step: everything a step runs when it does not fit the graphs.

Decode rows (first, staged by `DecodeStep.begin`) and the step's prompt and replay items share
call 0; atomic prompt items run their further depths in calls 1.. . Per call: the rows'
segments and positions, the attention backend's metadata, the core; then for decode rows the
slot write-back, hazards, device exits and finalize copies (`DecodeStep.after_call`), and for
items the first token's hazards and replay finalize copies. Prompt and replay work resumes
from, and is kept under, the runner's in-flight handles (`HandleTable`); the coda
(`runner/coda.py`) ends the step. With prefix caching, every prompt row's last-loop output
is written to the score store at its slot of its plane-0 block, so that a later request
that reuses the page can still score its positions (`PromptChunk.score_cached`).

A family whose leave writes K/V (`leave_writes_kv`: Huginn's coda layers) runs its leave for
every position that completes: a prompt chunk at its last loop (those logits then serve its
first token and its prompt logprobs) and a replay row at its exit. A criterion family reads
no signal on prompt rows, except with `prompt_exits` (`runner/prompt_exits.py`).

`EagerStep` is a collaborator the `ModelRunner` owns, with explicit inputs: the model's calls
(`LoopCalls`), the (timed) hazard function (None for a criterion family), the attention
backend, the decode step, the coda, the transfer helper, the handle table, the step rules,
the score store, the LAST_EXITED finalize of exits and the prompt exits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from loopserve.contracts import ItemKind, SchedulerOutput, WorkItem
from loopserve.execution import StepRules
from loopserve.exit.policies import GateState, criterion_exits, loop_exits
from loopserve.runner.attention.base import PagedAttentionBackend, RowSegment
from loopserve.runner.coda import Coda, CodaOutput
from loopserve.runner.decode_rows import DecodeInputs, DecodeStep
from loopserve.runner.handles import HandleTable
from loopserve.runner.loop_calls import LoopCalls
from loopserve.runner.prompt_exits import PromptExits
from loopserve.runner.spec_criteria import SpecCriteria
from loopserve.runner.swap import InFlight
from loopserve.runner.transfers import Transfers


class EagerResult(NamedTuple):
    coda: CodaOutput
    rows_per_call: list[int]
    num_finalized: int  # replay tokens finalized (decode rows are counted by the runner)


class EagerStep:
    def __init__(
        self,
        *,
        calls: LoopCalls,
        hazards: Callable[[torch.Tensor], torch.Tensor] | None,
        attention: PagedAttentionBackend,
        decode: DecodeStep,
        coda: Coda,
        transfers: Transfers,
        inflight: HandleTable[InFlight],
        rules: StepRules,
        block_size: int,
        finalize_exits: Callable[[list], int],
        score_store: torch.Tensor | None = None,
        prompt_exits: PromptExits | None = None,
        spec_criteria: SpecCriteria | None = None,
        keep_initial_states: bool = False,
    ) -> None:
        """`keep_initial_states`: a prompt item scored at its exit loops keeps its rows'
        state before loop 0 first in its loop outputs (a criterion checks from it:
        `runner/exit_scores.py`)."""
        self.calls = calls
        self.leave_writes_kv = calls.model.leave_writes_kv
        self.finalize_exits = finalize_exits
        self.prompt_exits = prompt_exits
        self.spec_criteria = spec_criteria  # a criterion family's speculative positions
        self.keep_initial_states = keep_initial_states
        self.hazards = hazards
        self.attention = attention
        self.decode = decode
        self.coda = coda
        self.transfers = transfers
        self.inflight = inflight
        self.rules = rules
        self.block_size = block_size
        self.score_store = score_store  # [slots, hidden]: prompt rows' last-loop outputs
        self._num_finalized = 0

    def run(self, scheduled: SchedulerOutput, tables, groups, fed=None) -> EagerResult:
        """The step's core calls run eagerly: decode rows (first) and items share call 0;
        atomic prompt items run their further depths in calls 1.. . `tables`: the runner's
        block tables (`BlockTables`); `fed`: decode rows fed back a leave batch's tokens
        (`decode_rows.FedBack`)."""
        items = scheduled.items
        self._num_finalized = 0
        decode = None
        if scheduled.decode is not None:
            decode = self.decode.begin(scheduled.decode, tables, fed)
        hazards: list[list[float]] = [[] for _ in items]
        last_outputs: list[list[torch.Tensor]] = [[] for _ in items]
        states = self._initial_states(items, hazards, last_outputs)
        if self.spec_criteria is not None:
            fresh = [
                i for i, item in enumerate(items) if item.kind is ItemKind.SPEC and not item.depth
            ]
            if fresh:
                keys = [(items[i].request_id, items[i].handle) for i in fresh]
                self.spec_criteria.start(keys, torch.cat([states[i] for i in fresh]))
        cached_rows = self._cached_rows(items, tables)
        exited = [False] * len(items)
        rows_per_call = []
        decode_signals = None
        prompt_exits = self.prompt_exits
        stopped: dict = {}  # prompt items that exited as one token: item -> (loops, logits)
        if prompt_exits is not None:
            prompt_exits.begin()
            prompt_exits.start(items, states)
            stopped = prompt_exits.exited
        for k in range(max([item.num_depths for item in items] + [1])):
            active = [i for i, item in enumerate(items) if k < item.num_depths and i not in stopped]
            decode_k = decode if k == 0 else None
            if not active and decode_k is None:
                break
            rows_per_call.append(
                sum(items[i].token_count for i in active) + scheduled.num_decode_rows * (k == 0)
            )
            decode_out = self._core_call(tables, items, active, k, states, decode_k, groups)
            if decode_k is not None:
                decode_signals = self.decode.after_call(decode_k, decode_out)
            if prompt_exits is not None:
                self._num_finalized += prompt_exits.check(k, items, active, tables, states)
            self._signals(tables, items, active, states, hazards, last_outputs, exited, k)
            self._store_outputs(tables, items, active, k, states)
        completed = self._completed_prompts(items, states, stopped)
        coda = self.coda(
            items, states, hazards, last_outputs, exited, decode_signals, cached_rows, completed
        )
        return EagerResult(coda, rows_per_call, self._num_finalized)

    def _completed_prompts(self, items, states, stopped) -> dict[int, tuple]:
        """A family whose leave writes K/V: the leave of every prompt chunk that ran its last
        loop, over all its rows, and of every prompt that exited as one token. Item ->
        (logits [rows, vocab], the loops its first token used or None)."""
        if not self.leave_writes_kv:
            return {}
        completed = {i: (logits, loops) for i, (loops, logits) in stopped.items()}
        for i, item in enumerate(items):
            if i in completed or not self.rules.completes_prompt(item):
                continue
            spans = lambda item=item: [(item.request_id, item.token_start, item.token_count)]  # noqa: E731
            completed[i] = (self.calls.leave(states[i], spans), None)
            if self.prompt_exits is not None and not item.first_token:
                # A recomputed prompt that exited as one token ran the loops it used then:
                # its K/V of that loop fills the deeper planes, as on its first pass.
                used = self.rules.final_prompt_depth(item) + 1
                positions = range(item.token_start, item.token_start + item.token_count)
                self.calls.ran(item.request_id, positions, used)
                table = self.calls.tables[item.request_id]
                self.finalize_exits([(table, p, used - 1) for p in positions])
        return completed

    def _initial_states(
        self, items: tuple[WorkItem, ...], hazards, last_outputs
    ) -> list[torch.Tensor]:
        fresh = [i for i, item in enumerate(items) if item.needs_prelude]
        states: list[torch.Tensor | None] = [None] * len(items)
        if fresh:
            token_ids = [t for i in fresh for t in items[i].token_ids]
            spans = lambda: [  # noqa: E731
                (items[i].request_id, items[i].token_start, items[i].token_count) for i in fresh
            ]
            embedded = self.calls.enter(self.transfers.to_device(token_ids), spans)
            for i, chunk in zip(fresh, embedded.split([items[i].token_count for i in fresh])):
                states[i] = chunk
                if self.keep_initial_states and getattr(items[i], "score_rule", None):
                    last_outputs[i].append(chunk)
        for i, item in enumerate(items):
            if states[i] is None:
                resumed = self.inflight.resume(item.handle)
                states[i] = resumed.hidden
                if item.kind is ItemKind.PROMPT and (item.first_token or item.score_rule):
                    # the first token's, or every row's for scoring: earlier depths' outputs
                    hazards[i], last_outputs[i] = resumed.hazards, resumed.loop_outputs
        return states  # type: ignore[return-value]

    def _slots(self, table: list[int], start: int, count: int) -> np.ndarray:
        """KV slots of positions [start, start + count) in `table` (one plane's blocks)."""
        size = self.block_size
        positions = np.arange(start, start + count)
        return np.asarray(table, dtype=np.int64)[positions // size] * size + positions % size

    def _cached_rows(self, items, tables) -> dict[int, torch.Tensor]:
        """Per item with `score_cached`: the stored last-loop outputs of the cached positions
        it scores (one copy of all their slots, one gather)."""
        wanted = [
            i for i, item in enumerate(items) if item.kind is ItemKind.PROMPT and item.score_cached
        ]
        if not wanted:
            return {}
        assert self.score_store is not None, "score_cached without a score store"
        slots = np.concatenate(
            [self._slots(tables[items[i].request_id][0], 0, items[i].score_cached) for i in wanted]
        )
        rows = self.score_store.index_select(0, self.transfers.to_device(slots))
        return dict(zip(wanted, rows.split([items[i].score_cached for i in wanted])))

    def _store_outputs(self, tables, items, active, k, states) -> None:
        """Prompt rows that ran their last loop: their outputs into the score store."""
        if self.score_store is None:
            return
        done = [
            i
            for i in active
            if k == items[i].num_depths - 1 and self.rules.completes_prompt(items[i])
        ]
        if not done:
            return
        slots = np.concatenate(
            [
                self._slots(
                    tables[items[i].request_id][0], items[i].token_start, items[i].token_count
                )
                for i in done
            ]
        )
        rows = torch.cat([states[i] for i in done]) if len(done) > 1 else states[done[0]]
        self.score_store.index_copy_(0, self.transfers.to_device(slots), rows)

    def _core_call(
        self, tables, items, active, k, states, decode: DecodeInputs | None, groups
    ) -> torch.Tensor | None:
        """One eager core call over the decode rows (first) and the active items; returns the
        decode rows' output [n, H] (None without decode rows). `groups`: cascade groups of a
        decode-only call, found by the caller (None: the backend looks itself)."""
        segments = []
        positions: list[int] = []
        for i in active:
            item = items[i]
            table = tables[item.request_id][self.rules.plane(item, k)]
            start, count = item.token_start, item.token_count
            hidden = self.calls.hidden(item.request_id, start, item.depth + k) if count == 1 else ()
            segments.append(RowSegment(table, start, count, hidden))
            positions.extend(range(start, start + count))
        hidden_parts = [states[i] for i in active]
        position_ids = self.transfers.to_device(positions) if positions else None
        if decode is not None:
            segments = self.decode.segments(decode.rows, tables) + segments
            hidden_parts.insert(0, decode.hidden)
            position_ids = (
                decode.positions
                if position_ids is None
                else torch.cat([decode.positions, position_ids])
            )
        attn = self.attention.prepare(segments, prefix_groups=groups)
        hidden = torch.cat(hidden_parts) if len(hidden_parts) > 1 else hidden_parts[0]
        out = self.calls.loop(hidden, position_ids, attn)
        num_decode = 0 if decode is None else len(decode.rows)
        counts = [items[i].token_count for i in active]
        for i, chunk in zip(active, out[num_decode:].split(counts)):
            states[i] = chunk
        return out[:num_decode] if decode is not None else None

    def _signals(self, tables, items, active, states, hazards, last_outputs, exited, k) -> None:
        """Hazards of the first-token prompt rows that need them; replay and speculative
        exits and their finalize copies (and leave, for a family whose leave writes K/V)."""
        spec = [i for i in active if items[i].kind is ItemKind.SPEC]
        if spec:
            self._spec_exits(tables, items, spec, states, hazards, exited)
        gated = [i for i in active if items[i].needs_gate and items[i].kind is not ItemKind.SPEC]
        if gated and self.hazards is not None:  # a criterion reads no signal on prompt rows
            rows = torch.cat([states[i][-1:] for i in gated])
            values = self.hazards(rows).float()  # [gated], on the device

            def receive(read: list[float], gated=gated) -> None:
                for i, value in zip(gated, read):
                    hazards[i].append(value)

            # They ride along with the step's next copy to the host (the first token's exit
            # is chosen after the last depth).
            self.transfers.defer(values, receive)
        finalize, replayed = [], []
        for i in active:
            item = items[i]
            if item.kind is ItemKind.SPEC:
                continue
            if item.kind is ItemKind.PROMPT:
                if item.score_rule is not None:  # every row's output of every loop
                    last_outputs[i].append(states[i])
                elif item.first_token:
                    last_outputs[i].append(states[i][-1:])
                continue
            exited[i] = bool(item.exit_now)  # a replay row's last loop
            if exited[i]:
                replayed.append(i)
            if self.rules.finalizes(item.depth + k, exited[i]):
                finalize.append(item)
        if replayed:
            for i in replayed:
                self.calls.ran(items[i].request_id, [items[i].token_start], items[i].depth + k + 1)
            if self.leave_writes_kv:  # its K/V of the exit loop
                spans = lambda: [(items[i].request_id, items[i].token_start, 1) for i in replayed]  # noqa: E731
                self.calls.leave(torch.cat([states[i] for i in replayed]), spans)
        if finalize:
            self._finalize(tables, finalize, k)

    def _spec_exits(self, tables, items, spec, states, hazards, exited) -> None:
        """Speculative rows (`ItemKind.SPEC`): their hazards (read now: the coda of this step
        samples the rows that exit), exits by their plan (`loop_exits`, as decode rows decide
        them), and the finalize copies of those that exit below full depth."""
        gated = [i for i in spec if items[i].needs_gate]
        values: dict[int, float] = {}
        criteria = self.spec_criteria
        if gated:
            rows = torch.cat([states[i] for i in gated])
            if criteria is None:
                signal = self.hazards(rows).float()
            else:  # 1.0 where the criterion fired (`TokenExit.record`)
                keys = [(items[i].request_id, items[i].handle) for i in gated]
                spans = lambda: [(items[i].request_id, items[i].token_start, 1) for i in gated]  # noqa: E731
                thresholds = [items[i].threshold for i in gated]
                signal = criteria.check(keys, rows, thresholds, spans).float()
            for i, value in zip(gated, self.transfers.to_host(signal)):
                hazards[i].append(value)
                values[i] = value
        finalize = []
        for i in spec:
            item = items[i]
            if criteria is None:
                before = GateState(item.cdf_before, item.survival_before)
                exited[i] = loop_exits(item.exit_now, before, values.get(i), item.threshold)
            else:
                fired = values[i] >= 1.0 if i in values else None
                exited[i] = criterion_exits(item.exit_now, fired)
                if exited[i]:
                    criteria.drop(item.request_id, item.handle)
            if self.rules.finalizes(item.depth, exited[i]):
                finalize.append(item)
        if finalize:
            self._finalize(tables, finalize)

    def _finalize(self, tables, items: list[WorkItem], k: int = 0) -> None:
        """Copy each exited replay or speculative token's K/V of its exit depth (call `k` of
        the step) into every deeper plane (`finalize_exits`, the runner's, which the decode
        rows' prompt exits share: none under the `full` lookup)."""
        exits = [(tables[item.request_id], item.token_start, item.depth + k) for item in items]
        self._num_finalized += self.finalize_exits(exits)
