"""The rows of a step: what a prompt chunk, a replay or speculative row, and the decode rows
(columns, one entry per row) carry to the executor, and what comes back for the decode and
leave rows (`DecodeResults`). Torch-free; the columns are numpy arrays."""

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
