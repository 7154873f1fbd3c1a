"""One step's messages: the `SchedulerOutput` the scheduler builds (its items, decode and
leave rows, table updates, new and released requests, K/V transfers), the executor's own
`BlockTables` kept from its updates, and the `RunnerOutput` it returns. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from loopserve.contracts.kv import KVTransfer, SwapKind, TableUpdate
from loopserve.contracts.rows import (
    DecodeResults,
    DecodeRows,
    LeaveRows,
    SampledToken,
    SampleSpec,
    WorkItem,
)


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """Announces a request to the runner once, before its first item. When its sampling reads
    its tokens (`SampleSpec.needs_history`), the prompt and the outputs it already has (a
    handed-off request) come along. `max_loops`: the request's loop bound (0: the model's
    depth); a family whose prompt positions keep state beyond the core (Huginn's coda K/V)
    reads it. `stable_steps`: the request's argmax-stability steps (None: the engine's)."""

    request_id: str
    sample_spec: SampleSpec
    seed: int | None
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    max_loops: int = 0
    prompt_len: int = 0
    stable_steps: int | None = None  # `SamplingParams.exit_stable_steps`


class RowGroup(NamedTuple):
    """Consecutive rows of one request in a step, read alike for decode rows (kind "decode",
    one row, one depth) and items: what observers, tools and parity tests compare."""

    request_id: str
    kind: str  # "decode", "prompt", "replay"
    token_start: int
    token_count: int
    depth: int
    num_depths: int


class BlockTables:
    """An executor's own copy of the live block tables, kept from the steps' updates
    (`SchedulerOutput.table_updates`), so no step sends whole tables and no executor reads the
    KV manager's lists, which the scheduler may change while a step runs (async scheduling).
    `apply` runs first in every `execute`: it drops the tables of requests that gave up their
    K/V (finished, preempted for recompute, swapped out) and applies the updates."""

    def __init__(self) -> None:
        self.tables: dict[str, tuple[list[int], ...]] = {}

    def __len__(self) -> int:
        return len(self.tables)

    def apply(self, scheduled: SchedulerOutput) -> dict[str, tuple[list[int], ...]]:
        tables = self.tables
        for request_id in scheduled.finished_request_ids + scheduled.preempted_request_ids:
            tables.pop(request_id, None)
        for transfer in scheduled.kv_transfers:
            if transfer.kind is SwapKind.OUT:
                tables.pop(transfer.request_id, None)
        for request_id, keep, new_blocks in scheduled.table_updates:
            if keep == 0:
                tables[request_id] = tuple(list(blocks) for blocks in new_blocks)
                continue
            for plane, blocks in zip(tables[request_id], new_blocks):
                del plane[keep:]
                plane.extend(blocks)
        return tables


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    step_id: int
    # Prompt chunks and replay rows (decode rows are the columns of `decode`).
    items: tuple[WorkItem, ...]
    # The block tables that changed since the last output (`BlockTables` applies them).
    table_updates: tuple[TableUpdate, ...] = ()
    new_requests: tuple[NewRequestData, ...] = ()
    # Requests that left RUNNING since the last `SchedulerOutput` (finished, aborted, failed):
    # the executor drops their generators and in-flight handles before running `items`. This
    # is the only way releases reach the executor.
    finished_request_ids: tuple[str, ...] = ()
    # Preempted for recompute: the executor drops their in-flight hidden states but keeps
    # their sampling generators (the request resumes later under the same id).
    preempted_request_ids: tuple[str, ...] = ()
    kv_transfers: tuple[KVTransfer, ...] = ()
    # (request_id, handle) of speculative positions rolled back since the last output: the
    # executor drops their hidden states (and draft distributions) before running `items`.
    dropped_handles: tuple[tuple[str, int], ...] = ()
    # The decode rows of the step's first core call (they come before `items` in it).
    decode: DecodeRows | None = None
    # Decode tokens that exited earlier and run their leave and sampling this step (coda
    # batching in time); their results are `RunnerOutput.leave`.
    leave: LeaveRows | None = None

    @property
    def num_decode_rows(self) -> int:
        return 0 if self.decode is None else len(self.decode)

    @property
    def num_rows(self) -> int:
        return self.num_decode_rows + sum(item.token_count for item in self.items)

    @property
    def is_empty(self) -> bool:
        return not self.items and self.decode is None and self.leave is None

    def row_groups(self) -> list[RowGroup]:
        """The step's decode rows (first, as in its call) and items as `RowGroup`s (for
        observers and tools; the hot path reads the columns)."""
        groups = []
        if self.decode is not None:
            decode = self.decode
            positions, depths = decode.positions.tolist(), decode.depths.tolist()
            groups += [
                RowGroup(request_id, "decode", position, 1, depth, 1)
                for request_id, position, depth in zip(decode.request_ids, positions, depths)
            ]
        groups += [
            RowGroup(
                item.request_id,
                item.kind.value,
                item.token_start,
                item.token_count,
                item.depth,
                item.num_depths,
            )  # fmt: skip
            for item in self.items
        ]
        return groups


class ItemResult(NamedTuple):
    """One item's result (a NamedTuple: built once per item per step)."""

    request_id: str
    handle: int
    # Hazards read this step: first-token prompt items one per depth of the last prompt
    # position.
    hazards: tuple[float, ...] = ()
    # The executor's exit decision (a replay row's last loop, or the first token's
    # `choose_exit_from_hazards`); the scheduler records it and never re-derives it.
    exited: bool = False
    loops_used: int | None = None
    sampled: SampledToken | None = None
    # Prompt logprobs of an item with `score_ids`: one per score id, in position order.
    prompt_logprobs: tuple[SampledToken, ...] = ()
    # First tokens of the item's `forks`, in their order (None: that follower's sampling
    # failed; it is among the output's `failed_requests`).
    forked: tuple[SampledToken | None, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestFailure:
    """A request that failed alone in the executor: its per-request setup raised (the
    executor kept none of its state and ran none of its rows), or its sampling raised (its
    rows ran, it got no token). The engine core aborts it with `error`."""

    request_id: str
    error: str  # "ExceptionType: message", for the log and the request's output


@dataclass(frozen=True, slots=True)
class RunnerStats:
    """What one step cost its executor: telemetry, kept apart from the results the scheduler
    applies (the engine core adds it to its counters; observers and tools read it)."""

    # Rows of each core call this step ran (atomic prompt steps run several calls).
    rows_per_core_call: tuple[int, ...] = ()
    model_time_s: float = 0.0  # the whole `execute` (tensor building, finalize, sampling too)
    forward_time_s: float = 0.0  # inside the model's prelude / core / gate / coda calls only
    num_early_exits: int = 0  # tokens sampled this step after fewer than D loops
    num_finalize_copies: int = 0  # LAST_EXITED: decode tokens whose K/V was finalized
    num_graph_calls: int = 0  # core calls run through the static bucketed buffers (graphs)
    num_padded_rows: int = 0  # padding rows those calls added to reach their bucket
    # Host<->device copies of the step (`runner.transfers`; counted on CPU too).
    num_h2d_transfers: int = 0
    num_d2h_transfers: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    step_id: int
    results: tuple[ItemResult, ...]
    # Requests that failed alone this step: new requests whose setup raised (their items got
    # empty results), and requests whose sampling raised (their rows ran; no token).
    failed_requests: tuple[RequestFailure, ...] = ()
    # One result per row of `SchedulerOutput.decode` (None when it had no decode rows).
    decode: DecodeResults | None = None
    stats: RunnerStats = RunnerStats()
    # One result per row of `SchedulerOutput.leave` (None when it had none).
    leave: DecodeResults | None = None
