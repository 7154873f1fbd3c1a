"""Decode rows on the device: the runner's half of the persistent decode batch.

A looped model runs each decode token through up to D core calls, one per loop, so the
per-call host work for decode rows must not grow with per-row Python. The scheduler sends a
call's decode rows as columns (`contracts.DecodeRows`); this room turns them into device work
with a constant number of tensor operations per call:

- `DecodeSlots` (`runner/decode_slots.py`) keeps, per request decoding, its in-flight
  token's carried state between loops, its criterion's fields and its device block tables
  per plane, in one slot of device tensors; a call sends only the table entries its rows
  gained.
- `DecodeStep.host_columns` is the host half of every decode call: slots, the table row each
  row reads (`slot * planes + depth`, or `slot` under SHARED), loop-0 rows, new table entries,
  coda candidates (rows whose exit code is not CONTINUE: certain exits, and rows whose gate
  decides, their exit known only on the device) and whether a gate decides some exit.
- Eager calls (`begin` / `after_call`): one staged copy carries those columns, the call
  gathers its inputs (resumed states from their slots, embedded tokens at loop 0), and after
  the core it writes the outputs back, computes hazards, decides exits on the device
  (`exit.columns.decide_exits` in tensor form; for a criterion, its check on the rows the
  plan lets it decide and `decide_criterion_exits` in tensor form) and runs the LAST_EXITED finalize copies of
  exiting rows (`finalize_pairs`: one pair per candidate and deeper plane, built on the
  host, masked by the exits on the device). The decode graphs (`runner/graphs.py`) run the same steps
  inside one captured call from one staged copy.

Nothing is read back here; the coda reads exits, hazards and sampled tokens in one copy
(`runner/coda.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from loopserve.contracts import DecodeRows, LeaveRows
from loopserve.exit.columns import CONTINUE, EXIT, GATE
from loopserve.runner.attention.base import RowSegment
from loopserve.runner.decode_slots import DecodeSlots
from loopserve.runner.loop_calls import LoopCalls
from loopserve.runner.transfers import Transfers


def decode_spans(rows: DecodeRows | LeaveRows, indices) -> list[tuple[str, int, int]]:
    """Where some decode (or leave) rows are (`LoopCalls` spans): (request, position, 1)
    each."""
    ids, positions = rows.request_ids, rows.positions
    return [(ids[r], int(positions[r]), 1) for r in indices]


class FedBack(NamedTuple):
    """Decode rows at loop 0 whose token was sampled this step by a batch of leaves (coda
    batching in time; their host `token_ids` are -1): the rows (host and device) and their
    tokens on the device, in the rows' order. Nothing is read to the host for them."""

    rows: np.ndarray  # int64 [a], decode row indices
    rows_on_device: torch.Tensor  # the same
    tokens: torch.Tensor  # int64 [a]


class HostColumns(NamedTuple):
    """The host half of one decode call (see the module docstring)."""

    slots: np.ndarray  # int64 [n]
    table_index: np.ndarray  # int64 [n]
    starts: np.ndarray  # int64 [m]: rows at loop 0 (embedded from their token)
    update_index: list[int]  # flat `tables` entries gained, and their block ids
    update_value: list[int]
    candidates: np.ndarray  # int64 [c]: coda candidates
    gate_decides: bool


class DecodeInputs(NamedTuple):
    """One call's decode rows on the device (eager calls; the graphs keep their own)."""

    rows: DecodeRows
    slots: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    table_index: torch.Tensor  # [n] int64: the table row each row reads and writes
    hidden: torch.Tensor  # [n, W]: the rows' inputs
    starts: torch.Tensor  # rows at loop 0
    gate_columns: torch.Tensor | None  # [4, n] float64: code, cdf, survival, threshold
    checks: CheckedRows | None  # criterion families: the rows checked (None without such rows)
    candidates: np.ndarray  # coda candidates, on the host
    candidates_on_device: torch.Tensor  # the same, on the device
    gate_decides: bool  # some row's exit is decided by this loop's gate
    finalize: tuple[torch.Tensor, ...] | None  # `FinalizePairs` on the device


class CheckedRows(NamedTuple):
    """The decode rows whose criterion a call checks (`needs_gate`: GATE rows under
    `criterion`, CONTINUE rows under `criterion_delayed`), and the rows it leaves for them
    when the criterion reads logits: the coda candidates and the checked rows, once each."""

    left: np.ndarray  # rows left (sorted), on the host
    rows: torch.Tensor  # the checked rows
    left_rows: torch.Tensor  # `left` on the device
    checked_in_left: torch.Tensor  # where the checked rows are among `left`
    candidates_in_left: torch.Tensor  # where the coda candidates are among `left`


class DecodeSignals(NamedTuple):
    """A decode call's outputs and signals, on the device, not read yet, with what the coda
    needs of the call (eager and graphed calls alike)."""

    rows: DecodeRows
    out: torch.Tensor  # [n, H]
    hazards: torch.Tensor | None  # [n] float32, when some row needs its gate
    exits: torch.Tensor | None  # [n] bool, when the gate decides some row's exit
    candidates: np.ndarray  # coda candidates, on the host
    candidates_on_device: torch.Tensor  # the same, on the device
    positions: torch.Tensor | None = None  # [n] on the device (eager calls)
    # The candidates' logits when the call computed them already (a criterion that reads
    # logits checks its rows from the leave of every candidate), else None.
    logits: torch.Tensor | None = None
    fired: torch.Tensor | None = None  # [n] bool: criterion families, where it fired
    # A graphed call's signals as the host reads them, packed by the step itself: float64
    # [parts, bucket], the exits of every row, then its hazards and where it fired (each
    # when present), then its greedy token (`greedy`), the call's rows first.
    packed: torch.Tensor | None = None
    # A graphed call that ran the leave of every row: their logits [n, vocab] (the coda
    # takes its candidates' rows), and `packed` ends with every row's argmax.
    row_logits: torch.Tensor | None = None
    greedy: bool = False


def decide_exits_on_device(
    code: torch.Tensor,
    cdf: torch.Tensor,
    survival: torch.Tensor,
    threshold: torch.Tensor,
    hazards: torch.Tensor,
) -> torch.Tensor:
    """`exit.columns.decide_exits` on device tensors (float64 columns, float32 hazards)."""
    folded = cdf + hazards.double() * survival
    return (code == EXIT) | ((code == GATE) & (folded >= threshold))


def finalize_pairs(
    tables: torch.Tensor,
    *,
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    keep: torch.Tensor | None,
    block_size: int,
    finalize: Callable[[torch.Tensor, torch.Tensor], None],
) -> None:
    """LAST_EXITED finalize copies with device data only. Pair i copies the slot of table row
    `src_rows[i]` (the row's plane of its depth) at block `blocks[i]`, offset `offsets[i]`,
    into the same place of table row `dst_rows[i]` (a deeper plane of the same request); the
    slots come from the device tables. A pair not kept (`keep[i]` False: its row did not
    exit, or the plane is not deeper) copies a slot onto itself, a no-op the copy kernels
    skip, so the pairs need no host data about which rows exit. `keep` None: every pair."""
    src = tables[src_rows, blocks] * block_size + offsets
    dst = tables[dst_rows, blocks] * block_size + offsets
    finalize(src, dst if keep is None else torch.where(keep, dst, src))


class FinalizePairs(NamedTuple):
    """The finalize pairs of an eager call's candidates below full depth, on the host: one
    per candidate and deeper plane (`finalize_pairs`), and the row of each."""

    rows: np.ndarray
    src_rows: np.ndarray
    dst_rows: np.ndarray
    blocks: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, rows: DecodeRows, candidates, slots, table_index, num_planes, block_size,
           stride):  # fmt: skip
        depths = rows.depths[candidates]
        counts = np.maximum(num_planes - 1 - depths, 0)  # none under SHARED
        pair_rows = np.repeat(candidates, counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)  # each row's first pair
        planes = np.repeat(depths + 1, counts) + (np.arange(len(pair_rows)) - first)
        positions = rows.positions[pair_rows]
        return cls(
            pair_rows,
            table_index[pair_rows],
            slots[pair_rows] * stride + planes,
            positions // block_size,
            positions % block_size,
        )


class DecodeStep:
    """The decode half of a runner step over `DecodeSlots`; explicit inputs: the model's
    calls (`LoopCalls`), the (timed) hazard function, the attention backend's `finalize`,
    the transfer helper, the layout's plane count and whether exits finalize (not under the
    `full` lookup)."""

    def __init__(
        self,
        slots: DecodeSlots,
        *,
        calls: LoopCalls,
        hazards: Callable[[torch.Tensor], torch.Tensor],
        finalize: Callable[[torch.Tensor, torch.Tensor], None],
        transfers: Transfers,
        num_planes: int,
        finalizes: bool = True,
    ) -> None:
        self.slots = slots
        self.calls = calls
        self.hazards = hazards
        self.finalize = finalize
        self.transfers = transfers
        self.num_planes = num_planes
        self.finalizes = finalizes

    def host_columns(self, rows: DecodeRows, block_tables) -> HostColumns:
        slots = self.slots.assign(rows)
        depths, codes = rows.depths, rows.exit_code
        stride = self.slots.stride
        table_index = slots * stride + depths if self.num_planes > 1 else slots * stride
        index, values = self.slots.table_updates(
            slots, rows.positions, rows.request_ids, block_tables
        )
        return HostColumns(
            slots,
            table_index,
            (depths == 0).nonzero()[0],
            index,
            values,
            (codes != CONTINUE).nonzero()[0],
            bool((codes == GATE).any()),
        )

    def begin(self, rows: DecodeRows, block_tables, fed: FedBack | None = None) -> DecodeInputs:
        """Stage an eager call's decode rows (one copy) and gather their inputs (`fed`: rows
        whose loop-0 token comes from this step's leave batch, on the device)."""
        host = self.host_columns(rows, block_tables)
        n, starts = len(rows), host.starts
        parts = [host.slots, rows.positions, host.table_index, starts, rows.token_ids[starts]]
        parts += [np.array(host.update_index, np.int64), np.array(host.update_value, np.int64)]
        if fed is not None:  # where those rows are among the rows that start
            parts.append(np.searchsorted(starts, fed.rows))
        candidates = host.candidates if self.finalizes else np.zeros(0, np.int64)
        pairs = FinalizePairs.of(
            rows, candidates, host.slots, host.table_index, self.num_planes,
            self.slots.block_size, self.slots.stride,
        )  # fmt: skip
        parts += [host.candidates, *pairs]
        checks = self.slots.criterion is not None and bool(rows.needs_gate.any())
        if host.gate_decides or checks:
            columns = (rows.exit_code.astype(np.float64), rows.cdf_before,
                       rows.survival_before, rows.threshold)  # fmt: skip
            parts.append(np.concatenate(columns).view(np.int64))
        if checks:  # the checked rows, and the rows left for them (candidates among them)
            checked = rows.needs_gate.nonzero()[0]
            left = np.union1d(host.candidates, checked)
            parts += [checked, left, np.searchsorted(left, checked)]
            parts.append(np.searchsorted(left, host.candidates))
        staged = self.transfers.to_device(np.concatenate(parts))  # the call's one copy in
        views = iter(staged.split([len(part) for part in parts]))
        slots_t, positions_t, table_index_t, starts_t, tokens_t, index_t, values_t = (
            next(views) for _ in range(7)
        )
        if fed is not None:
            tokens_t.index_copy_(0, next(views), fed.tokens)
        cand_t = next(views)
        pairs_t = tuple(next(views) for _ in range(5))  # rows, src, dst, blocks, offsets
        staged_gate = host.gate_decides or checks
        gate_t = next(views).view(torch.float64).view(4, n) if staged_gate else None
        checked_t = CheckedRows(left, *(next(views) for _ in range(4))) if checks else None
        if host.update_index:
            self.slots.tables.view(-1).index_copy_(0, index_t, values_t)
        if len(starts):
            spans = lambda: decode_spans(rows, starts.tolist())  # noqa: E731  # host array
            every = len(starts) == n
            entered = self.calls.enter(
                tokens_t, spans, lambda: positions_t if every else positions_t[starts_t]
            )
        if len(starts) == n:  # every row starts a token
            hidden = entered
        else:
            hidden = self.slots.hidden.index_select(0, slots_t)
            if len(starts):
                hidden.index_copy_(0, starts_t, entered)
        finalize = pairs_t if len(pairs.rows) else None
        return DecodeInputs(
            rows, slots_t, positions_t, table_index_t, hidden, starts_t, gate_t, checked_t,
            host.candidates, cand_t, host.gate_decides, finalize,
        )  # fmt: skip

    def segments(self, rows: DecodeRows, block_tables) -> list[RowSegment]:
        """The rows as attention segments (eager calls): each row's plane table, one row
        (under the `full` lookup, with the earlier positions it may not attend)."""
        planes = rows.depths if self.num_planes > 1 else np.zeros(len(rows), np.int64)
        positions = rows.positions.tolist()  # host array
        planes_list = planes.tolist()  # host array
        tables = [block_tables[request_id] for request_id in rows.request_ids]
        if self.calls.full_lookup:
            hidden = self.calls.hidden
            depths = rows.depths.tolist()  # host array
            return [
                RowSegment(table[plane], position, 1, hidden(rid, position, depth))
                for table, plane, position, rid, depth in zip(
                    tables, planes_list, positions, rows.request_ids, depths
                )
            ]
        return [
            RowSegment(table[plane], position, 1)
            for table, plane, position in zip(tables, planes_list, positions)
        ]

    def after_call(self, inputs: DecodeInputs, out: torch.Tensor) -> DecodeSignals:
        """Slots, hazards, exits and finalize copies of the call's decode rows [n, H]."""
        self.slots.hidden.index_copy_(0, inputs.slots, out)
        logits = fired = None
        if self.slots.criterion is not None:
            hazards, exits, logits, fired = self._criterion(inputs, out)
        else:
            hazards = self.hazards(out).float() if inputs.rows.needs_gate.any() else None
            exits = None
            if inputs.gate_decides:
                assert hazards is not None and inputs.gate_columns is not None
                exits = decide_exits_on_device(*inputs.gate_columns, hazards)
        if inputs.finalize is not None:
            pair_rows, src_rows, dst_rows, blocks, offsets = inputs.finalize
            finalize_pairs(
                self.slots.tables,
                src_rows=src_rows,
                dst_rows=dst_rows,
                blocks=blocks,
                offsets=offsets,
                keep=None if exits is None else exits[pair_rows],
                block_size=self.slots.block_size,
                finalize=self.finalize,
            )
        return DecodeSignals(
            inputs.rows,
            out,
            hazards,
            exits,
            inputs.candidates,
            inputs.candidates_on_device,
            inputs.positions,
            logits,
            fired,
        )

    def _criterion(self, inputs: DecodeInputs, out: torch.Tensor):
        """A criterion family's signals: tokens that start take their criterion from their
        initial state; the rows whose plan reads the signal (`needs_gate`) are checked (a
        criterion that reads logits takes them from one leave over those rows and the coda
        candidates, which the coda then samples from); GATE rows exit where it fires (code
        EXIT rows exit anyway; a `criterion_delayed` row that fires exits after its next
        loop, which the scheduler plans from `fired`). Returns (scores float64 [n], NaN where
        unchecked; exits bool [n] when the criterion decides some exit, else None; the
        candidates' logits or None; fired bool [n], False where unchecked)."""
        criterion = self.slots.criterion
        assert criterion is not None
        rows, calls = inputs.rows, self.calls
        if len(inputs.starts):
            initial = calls.model.latent(inputs.hidden.index_select(0, inputs.starts))
            criterion.start(inputs.slots.index_select(0, inputs.starts), initial)
        checks = inputs.checks
        if checks is None:
            return None, None, None, None
        code, _, _, threshold = inputs.gate_columns  # type: ignore[misc]
        logits = checked_logits = None
        if criterion.needs_logits:
            spans = lambda: decode_spans(rows, checks.left.tolist())  # noqa: E731  # host array
            left = calls.leave(
                out.index_select(0, checks.left_rows),
                spans,
                lambda: inputs.positions.index_select(0, checks.left_rows),
            )
            checked_logits = left.index_select(0, checks.checked_in_left)
            same = len(checks.left) == len(inputs.candidates)  # every checked row a candidate
            logits = left if same else left.index_select(0, checks.candidates_in_left)
        fires, values = criterion.check(
            inputs.slots.index_select(0, checks.rows),
            calls.model.latent(out.index_select(0, checks.rows)),
            checked_logits,
            threshold.index_select(0, checks.rows),
        )
        n = len(rows)
        scores = torch.full((n,), float("nan"), dtype=torch.float64, device=out.device)
        scores.index_copy_(0, checks.rows, values)
        fired = torch.zeros(n, dtype=torch.bool, device=out.device)
        fired.index_copy_(0, checks.rows, fires)
        exits = (code == EXIT) | ((code == GATE) & fired) if inputs.gate_decides else None
        return scores, exits, logits, fired
