"""What the host reads back of a step's decode rows, and how it becomes their results.

A decode call's exit flags, hazards (a criterion's scores) and where a criterion fired come
back in the step's one read (`DecodeRead`: packed on the device, read with the sampled tokens
or, when a generator must not advance for a row that stays, before sampling). Held tokens'
leaves (coda batching in time) are sampled on the device and read with the step's next copy
out (`PendingLeave`). `decode_results` turns a read and the sampled tokens into the
`DecodeResults` the scheduler applies: a candidate that did not exit drops its token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from loopserve.contracts import DecodeResults, LeaveRows, RequestFailure, SampledToken
from loopserve.exit.columns import EXIT
from loopserve.runner.decode_rows import DecodeSignals
from loopserve.runner.sampler import SampleBatch, read_samples, sampling_failure

# `record(request_ids, token_ids)`: final tokens (-1: none) into their requests' histories.
Record = Callable[[tuple[str, ...], np.ndarray], None]


class DecodeSampled(NamedTuple):
    """Tokens sampled for decode rows: their rows, ids, and log-probabilities where asked."""

    rows: list[int]
    token_ids: list[int]
    logprobs: dict[int, SampledToken]


_NO_HAZARDS: dict[int, np.ndarray] = {}


def no_hazards(num_rows: int) -> np.ndarray:
    """All-NaN hazards for `num_rows` rows, shared and read-only: the column of a call that
    read no signal (one per row count, at most `max_num_seqs` of them)."""
    column = _NO_HAZARDS.get(num_rows)
    if column is None:
        column = np.full(num_rows, np.nan)
        column.flags.writeable = False
        _NO_HAZARDS[num_rows] = column
    return column


class DecodeRead:
    """The decode rows' exit flags, hazards (a criterion's scores) and, for a criterion
    family, where it fired: filled when the device is read."""

    def __init__(self, signals: DecodeSignals) -> None:
        rows = signals.rows
        self.num_rows = len(rows)
        self.exited = rows.exit_code == EXIT  # final unless the gate decides
        self.has_hazards = signals.hazards is not None
        self.hazards = (
            np.full(self.num_rows, np.nan) if self.has_hazards else no_hazards(self.num_rows)
        )
        self.fired: np.ndarray | None = None
        self.gate_decides = signals.exits is not None
        self.has_fired = signals.fired is not None
        self.needs_gate = rows.needs_gate
        # Every row's greedy token, when the graphed step packed them (`DecodeSignals.greedy`).
        self.has_tokens = signals.greedy
        self.tokens: np.ndarray | None = None
        # The read's layout: parts of `width` values, the exits part when `reads_exits`.
        self.width, self.reads_exits = self.num_rows, self.gate_decides
        if signals.packed is not None:  # a graphed step packed them (`DecodeSignals.packed`)
            self.packed: torch.Tensor | None = signals.packed.view(-1)
            self.width, self.reads_exits = signals.packed.shape[1], True
            return
        parts = []
        if signals.exits is not None:
            parts.append(signals.exits.double())
        if signals.hazards is not None:
            parts.append(signals.hazards.double())
        if signals.fired is not None:
            parts.append(signals.fired.double())
        self.packed = torch.cat(parts) if parts else None

    def receive(self, values: list[float]) -> None:
        read = np.array(values)
        n, width, at = self.num_rows, self.width, 0
        if self.reads_exits:
            if self.gate_decides:
                self.exited = read[:n] != 0.0
            at += width
        if self.has_hazards:
            self.hazards[self.needs_gate] = read[at : at + n][self.needs_gate]
            at += width
        if self.has_fired:
            self.fired = read[at : at + n] != 0.0
            at += width
        if self.has_tokens:
            self.tokens = read[at : at + n].astype(np.int64)


def greedy_results(read: DecodeRead) -> DecodeResults:
    """The decode rows' results when every candidate took the argmax the step read with its
    signals (`DecodeRead.tokens`): the exited rows' tokens, -1 elsewhere."""
    assert read.tokens is not None
    token_ids = np.where(read.exited, read.tokens, -1)
    return DecodeResults(read.exited, read.hazards, token_ids, {}, read.fired)


def decode_results(read: DecodeRead, sampled: DecodeSampled) -> DecodeResults:
    """The decode rows' results: their exits and hazards as read, the sampled tokens of the
    rows that exited (-1 elsewhere: a greedy candidate that did not exit drops its token)
    and their log-probabilities."""
    token_ids = np.full(read.num_rows, -1, np.int64)
    token_ids[sampled.rows] = sampled.token_ids
    token_ids[~read.exited] = -1
    logprobs = {row: token for row, token in sampled.logprobs.items() if read.exited[row]}
    return DecodeResults(read.exited, read.hazards, token_ids, logprobs, read.fired)


class PendingLeave:
    """A batch of leaves sampled on the device, its read deferred (`Coda.leave_rows`):
    `tokens` [m] on the device; `results()` once the step's copy out has read it. `record`:
    where the sampled tokens go when some row's sampling reads its history (None: none
    does)."""

    def __init__(
        self, leave: LeaveRows, batch: SampleBatch, failures: dict[int, str], record: Record | None
    ) -> None:
        self.leave, self.batch = leave, batch
        self.failures = failures
        self.record = record
        self.tokens = batch.packed[: len(leave)].long()
        self._read: list[float] | None = None

    def receive(self, values: list[float]) -> None:
        self._read = values

    def results(self) -> tuple[DecodeResults, tuple[RequestFailure, ...]]:
        """One result per row, `exited` False where sampling raised (that request fails
        alone, reported); the tokens recorded in their requests' histories."""
        assert self._read is not None, "the leave batch's samples were never read"
        sampled, with_logprobs, failed = read_samples(self.batch, self._read)
        self.failures.update(failed)
        ids, m = self.leave.request_ids, len(self.leave)
        token_ids = np.array(sampled, np.int64)
        exited = np.ones(m, bool)
        exited[list(self.failures)] = False
        token_ids[~exited] = -1
        if self.record is not None:
            self.record(ids, token_ids)
        logprobs = {row: token for row, token in with_logprobs.items() if exited[row]}
        results = DecodeResults(exited, np.full(m, np.nan), token_ids, logprobs)
        return results, tuple(
            sampling_failure(ids[row], error) for row, error in self.failures.items()
        )
