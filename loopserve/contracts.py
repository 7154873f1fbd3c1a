"""The step contracts between scheduler and runner (docs/architecture.md, "Step contract").

One step: the scheduler builds a `SchedulerOutput`; an executor (`loopserve.execution`: the
model runner, or the simulator's priced stand-in) executes it and returns a `RunnerOutput`;
the scheduler applies it. Only ids, counts, depths, block ids and plain numbers cross this boundary — never
tensors, never `Request` objects. Torch-free.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import numpy as np

from loopserve.exit import ExitRule
from loopserve.sampling_params import SamplingParams, StructuredOutput


@dataclass(frozen=True, slots=True)
class SampleSpec:
    """How the executor samples a request's tokens (`SamplingParams`' sampling part).
    `stop_token_ids`: the request's stop tokens (EOS included unless ignored), set only when
    `min_tokens` forbids them for a while."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    num_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    structured: StructuredOutput | None = None  # the output's grammar (a logits mask)

    @classmethod
    def of(cls, params: SamplingParams, stop_token_ids: Iterable[int] = ()) -> SampleSpec:
        """The spec of a request's `params`; `stop_token_ids`: its stop tokens, EOS included
        unless ignored (kept only when `min_tokens` needs them)."""
        return cls(
            params.temperature,
            params.top_p,
            params.top_k,
            params.logprobs,
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
            params.logit_bias,
            params.min_tokens,
            tuple(sorted(stop_token_ids)) if params.min_tokens else (),
            params.structured_output,
        )

    @property
    def needs_history(self) -> bool:
        """The logits adjustments read the request's tokens (prompt or output)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.min_tokens > 0
            or self.structured is not None
        )

    @property
    def adjusts_logits(self) -> bool:
        return self.needs_history or bool(self.logit_bias)


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    # The num_logprobs most likely tokens as (token_id, logprob), best first.
    top_logprobs: tuple[tuple[int, float], ...] = ()
    # 1 + the number of tokens more likely than this one (prompt logprobs; None elsewhere).
    rank: int | None = None
    # The loop whose output scored this prompt position (prompt logprobs; None elsewhere).
    loops: int | None = None


class ItemKind(str, enum.Enum):
    """Kinds of work item: one small type each (`PromptChunk`, `ReplayRow`, `SpecRow`);
    decode tokens are not items: they are `DecodeRows` columns."""

    PROMPT = "prompt"
    REPLAY = "replay"
    SPEC = "spec"


@dataclass(frozen=True, slots=True)
class _Rows:
    """What every item kind has: rows of one request at consecutive positions, run at
    `depth` (and following depths).

    - `num_depths` consecutive loops run inside this step (atomic prompt chunks run all D;
      everything else runs 1). Each loop is one core call shared with the other items.
    - `token_ids` are embedded (prelude) at the first loop when `needs_prelude`; otherwise the
      runner resumes from the hidden state stored under `handle`.
    - `needs_gate`: the runner reports this loop's exit signal for the item."""

    request_id: str
    token_start: int
    token_count: int
    depth: int
    num_depths: int
    handle: int
    needs_prelude: bool
    token_ids: tuple[int, ...] = ()
    needs_gate: bool = False

    @property
    def last_depth(self) -> int:
        return self.depth + self.num_depths - 1


@dataclass(frozen=True, slots=True)
class PromptChunk(_Rows):
    """A chunk of prompt positions.

    - It runs `prompt_loops` loops in all (0: the model's D; a family whose prompt K/V
      depends on the request's loop bound, Huginn, runs the request's r): its final depth
      is `prompt_loops - 1`.
    - With `first_token` it holds the last prompt position: after the final depth the runner
      picks the first output token's loops with `exit_rule` over that row's loop outputs (or
      `trace_loops`), then samples it.
    - With `score_ids` (a request that asked for prompt logprobs, on the item that reaches
      the last depth) it scores its rows: row i's last-loop output gives the log-probability
      of `score_ids[i]`, the prompt token after it (the last prompt position has none), with
      `score_top` alternatives. With `score_rule` (on every depth's item of such a chunk), the
      runner keeps every loop's output of the chunk's rows, and row i is scored from the loop
      `score_rule` picks over that row's exit signals instead. With `score_cached` > 0 (the
      first chunk after prefix-cache hits), `score_ids` start at position 0: positions
      [0, score_cached) are scored from the runner's score store (their last-loop outputs,
      written when their page was computed), then the item's rows.
    - With `forks` (on the `first_token` item that runs the final depth): requests with the same prompt and loop settings
      that share this prompt's computation (`scheduler/groups.py`). The runner samples each
      one's first token from the same logits row, with its own sampler (announced by then),
      and hands each its runner state of the prompt (`ItemResult.forked`); their K/V comes by
      the scheduler's `KVTransfer(FORK)` after this step."""

    kind: ClassVar[ItemKind] = ItemKind.PROMPT
    first_token: bool = False
    forks: tuple[str, ...] = ()
    exit_rule: ExitRule | None = None
    trace_loops: int | None = None
    score_ids: tuple[int, ...] = ()
    score_top: int = 0
    score_rule: ExitRule | None = None
    score_cached: int = 0
    prompt_loops: int = 0


@dataclass(frozen=True, slots=True)
class ReplayRow(_Rows):
    """Recompute after preemption: one already-generated token re-run at its position through
    the loops it really used, finalize included, with no coda and no sampling (the token is
    known). `exit_now`: this is the token's last loop (its finalize copy follows)."""

    kind: ClassVar[ItemKind] = ItemKind.REPLAY
    exit_now: bool = False


@dataclass(frozen=True, slots=True)
class SpecRow(_Rows):
    """Self-speculative decoding: one decode position of a request whose next positions may
    already run on drafted tokens. It runs one loop per step; its exit follows the plan
    fields (`exit_now` True: exit, False: continue, None: the gate decides with
    `cdf_before`, `survival_before`, `threshold`); the coda samples it at its exit, and with
    `draft` at this loop when it does not exit (the draft of the next token).
    `verify_token` (>= 0): the token the next position already runs on, drafted from this
    row (sampling: the row's exit sample is the speculative-sampling accept/reject test)."""

    kind: ClassVar[ItemKind] = ItemKind.SPEC
    exit_now: bool | None = False
    cdf_before: float = 0.0
    survival_before: float = 1.0
    threshold: float = 1.0
    draft: bool = False
    verify_token: int = -1


# A unit of schedulable work other than a decode row: one of the three kinds.
WorkItem = PromptChunk | ReplayRow | SpecRow


class DecodeRow(NamedTuple):
    """One row of `DecodeRows`, read out as values (tests and tools; the hot path uses the
    columns). `exit_code` is `loopserve.exit.columns.EXIT`, `CONTINUE` or `GATE`."""

    request_id: str
    position: int
    depth: int
    token_id: int
    exit_code: int
    needs_gate: bool
    cdf_before: float
    survival_before: float
    threshold: float


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """The decode rows of one core call, as columns: row i runs loop `depths[i]` of the token
    in flight of `request_ids[i]`, at `positions[i]` (the persistent decode batch; a
    scheduler plans these with a few array operations instead of one `WorkItem` per row).

    - The token is embedded (prelude) at depth 0 from `token_ids[i]` (the request's last
      output token, fed back); at deeper loops the executor resumes the request's own decode
      state (the hidden state it kept when the previous loop of this token ran). Decode rows
      have no handles: an executor keeps one decode state per request, released with the
      request (finished, preempted, swapped out).
    - `exit_code[i]` (`loopserve.exit.columns`): EXIT runs the coda after this loop, CONTINUE
      does not, GATE lets this loop's gate decide (exit iff `cdf_before + hazard *
      survival_before >= threshold`). `needs_gate[i]`: the row reports this loop's hazard.
    - Decode rows come first in their core call, before the step's other items.
    """

    request_ids: tuple[str, ...]
    positions: np.ndarray  # int64 [n]
    depths: np.ndarray  # int64 [n]
    token_ids: np.ndarray  # int64 [n]
    exit_code: np.ndarray  # int8 [n]
    needs_gate: np.ndarray  # bool [n]
    cdf_before: np.ndarray  # float64 [n]
    survival_before: np.ndarray  # float64 [n]
    threshold: np.ndarray  # float64 [n]

    def __len__(self) -> int:
        return len(self.request_ids)

    @classmethod
    def continuing(cls, request_ids: tuple[str, ...], positions, depths, token_ids) -> DecodeRows:
        """Rows that continue after this loop and read no gate (tools, measurements)."""
        n = len(request_ids)
        return cls(
            tuple(request_ids),
            np.asarray(positions, np.int64),
            np.asarray(depths, np.int64),
            np.asarray(token_ids, np.int64),
            np.zeros(n, np.int8),
            np.zeros(n, bool),
            np.zeros(n),
            np.ones(n),
            np.ones(n),
        )

    def row(self, i: int) -> DecodeRow:
        return DecodeRow(
            self.request_ids[i],
            int(self.positions[i]),
            int(self.depths[i]),
            int(self.token_ids[i]),
            int(self.exit_code[i]),
            bool(self.needs_gate[i]),
            float(self.cdf_before[i]),
            float(self.survival_before[i]),
            float(self.threshold[i]),
        )

    def rows(self) -> list[DecodeRow]:
        return [self.row(i) for i in range(len(self))]

    def take(self, index: np.ndarray) -> DecodeRows:
        """The rows `index` (in that order)."""
        return DecodeRows(
            tuple(self.request_ids[i] for i in index),
            *(getattr(self, name)[index] for name in _COLUMNS),
        )


_COLUMNS = (
    "positions", "depths", "token_ids", "exit_code", "needs_gate", "cdf_before",
    "survival_before", "threshold",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class LeaveRows:
    """Decode tokens whose loops exited in an earlier call and whose leave (the family's coda
    and the lm_head) and sampling run now: coda batching in time (`StepRules.defers_leave`).
    Row i is the token in flight of `request_ids[i]` at `positions[i]`; it exited after loop
    `depths[i]` and the executor kept its carried state since. A request has at most one
    such row; it runs no loop in the step (it is in no `DecodeRows` of it)."""

    request_ids: tuple[str, ...]
    positions: np.ndarray  # int64 [m]
    depths: np.ndarray  # int64 [m]: the loop each token exited after

    def __len__(self) -> int:
        return len(self.request_ids)

    def take(self, index: np.ndarray) -> LeaveRows:
        """The rows `index` (in that order)."""
        return LeaveRows(
            tuple(self.request_ids[i] for i in index), self.positions[index], self.depths[index]
        )


@dataclass(frozen=True, slots=True)
class DecodeResults:
    """One result per row of a step's `DecodeRows`, as columns, in row order.

    `exited[i]`: the token exited after this loop (the executor decided it: `exit_code`, or
    the gate); it was sampled unless its request failed (`RunnerOutput.failed_requests`).
    `hazards[i]`: this loop's hazard where the row `needs_gate`, else NaN. `token_ids[i]`:
    the sampled token of an exited row. `logprobs`: row -> its `SampledToken` (the token id,
    its log-probability and top alternatives) for exited rows whose request asked for
    log-probabilities. Under a convergence criterion `hazards[i]` is the criterion's score and
    `fired[i]` whether it fired (False where the row read no signal); the scheduler commits a
    `criterion_delayed` exit from it (None: the signal is a hazard).

    Under coda batching in time (`StepRules.defers_leave`) an exited decode row is not
    sampled in its call: `exited[i]` is True and `token_ids[i]` is -1; its token comes with
    the `RunnerOutput.leave` results of the later step whose `LeaveRows` carry it. Leave
    results use the same columns, one per leave row: `exited` True where sampled (False:
    its request failed), `token_ids` and `logprobs`, `hazards` NaN."""

    exited: np.ndarray  # bool [n]
    hazards: np.ndarray  # float64 [n]
    token_ids: np.ndarray  # int64 [n]
    logprobs: dict[int, SampledToken] = field(default_factory=dict)
    fired: np.ndarray | None = None  # bool [n]

    @classmethod
    def empty(cls, num_rows: int) -> DecodeResults:
        """No row exited, no hazard read, nothing sampled (rows that ran nothing)."""
        return cls(
            np.zeros(num_rows, bool),
            np.full(num_rows, np.nan),
            np.full(num_rows, -1, np.int64),
        )

    def sampled(self, i: int) -> SampledToken:
        """Row i's sampled token (an exited row)."""
        return self.logprobs.get(i) or SampledToken(int(self.token_ids[i]))

    def scatter(self, index: np.ndarray, num_rows: int) -> DecodeResults:
        """These results placed at rows `index` of `num_rows` rows (the others ran nothing)."""
        full = DecodeResults.empty(num_rows)
        full.exited[index] = self.exited
        full.hazards[index] = self.hazards
        full.token_ids[index] = self.token_ids
        logprobs = {int(index[i]): token for i, token in self.logprobs.items()}
        fired = None
        if self.fired is not None:
            fired = np.zeros(num_rows, bool)
            fired[index] = self.fired
        return DecodeResults(full.exited, full.hazards, full.token_ids, logprobs, fired)


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


class SwapKind(str, enum.Enum):
    OUT = "out"  # device -> host; the request's in-flight hidden states go to the host too
    IN = "in"  # host -> device; hidden states come back
    # A handed-off request (prefill/decode disaggregation): pairs (index in the K/V the
    # runner staged for it, device block); no hidden states move.
    IMPORT = "import"
    # A prompt group's fork (scheduler/groups.py): pairs (leader's device block, the
    # follower's device block): the leader's partly written last prompt block, every plane,
    # copied before either request writes it again; no hidden states move.
    FORK = "fork"


@dataclass(frozen=True)
class PendingHostKV:
    """A K/V export still being copied to host memory (`SwapSpace.export_blocks` with
    `pending=True`): on CUDA a pinned tensor that a non-blocking copy fills, whole once the
    event `done` has completed; on CPU a finished copy (`done` None). `settled()` is the
    tensor once whole: it waits for `done`, so it is called off the engine thread
    (`OutputStream` does). Torch-free here: `tensor` is a torch.Tensor, `done` a CUDA event."""

    tensor: object
    done: object = None

    def settled(self) -> object:
        if self.done is not None:
            self.done.synchronize()  # type: ignore[attr-defined]
        return self.tensor


@dataclass(frozen=True, slots=True)
class KVTransfer:
    """Swap one request: copy `block_moves` (src, dst) pairs of whole blocks (all planes) and
    move its in-flight hidden states. Transfers run in order, before the step's core calls."""

    kind: SwapKind
    request_id: str
    block_moves: tuple[tuple[int, int], ...]


class RowGroup(NamedTuple):
    """Consecutive rows of one request in a step, read alike for decode rows (kind "decode",
    one row, one depth) and items: what observers, tools and parity tests compare."""

    request_id: str
    kind: str  # "decode", "prompt", "replay"
    token_start: int
    token_count: int
    depth: int
    num_depths: int


class TableUpdate(NamedTuple):
    """How one request's block tables changed since the last `SchedulerOutput` (as vLLM's
    `new_block_ids`): keep the first `keep` blocks of every plane the executor holds for it
    (0: a new table, which replaces any it held), then append `new_blocks[p]` to plane p."""

    request_id: str
    keep: int
    new_blocks: tuple[tuple[int, ...], ...]


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


@dataclass(frozen=True, slots=True)
class KVHandle:
    """The K/V a request holds, as the engine passes it on (a hand-off export): opaque above
    the executor, which reads the block ids of each plane and the positions written."""

    request_id: str
    block_tables: tuple[list[int], ...]  # one block-id list per plane
    num_positions: int  # positions [0, num_positions) are written
