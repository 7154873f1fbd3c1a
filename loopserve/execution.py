"""Executing a step: the `Executor` protocol and the semantics every executor shares.

`contracts/` holds the data that crosses the step boundary; this module holds what an
executor promises about it (`Executor`: bookkeeping first, one result per item and per
decode row, per-request setup failures) and the rules both executors (`ModelRunner`,
`SimExecutor`) apply the same way, once: the plane count, the plane of a call, finalize,
the first token and handle lifetime (`StepRules`), and the setup-failure contract
(`set_up_each`, `run_without_failed`). Torch-free.
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from loopserve.contracts import (
    DecodeResults,
    DecodeRows,
    ItemKind,
    ItemResult,
    LeaveRows,
    NewRequestData,
    PromptChunk,
    RequestFailure,
    RunnerOutput,
    SchedulerOutput,
    WorkItem,
)


class Executor(ABC):
    """Runs one step's core calls: `ModelRunner` (tensors) and `SimExecutor` (a cost model).

    Contract: `execute` first applies the bookkeeping of `scheduled` (drop the state of
    `finished_request_ids`, register `new_requests`), then runs `items` and returns one
    `ItemResult` per item, in item order. A `SchedulerOutput` without items is a bookkeeping
    step and returns no results.

    Failures: each new request is set up on its own. If one request's setup raises, the
    executor keeps none of its state, runs none of its rows this step (its items get an
    `ItemResult` with only `request_id` and `handle`), and reports it in
    `RunnerOutput.failed_requests`; the engine core aborts exactly those requests and the rest
    of the step counts as usual. If `execute` itself raises, the engine core fails every
    request of that step (those with items and those announced in `new_requests`); their
    state is released with the next `SchedulerOutput`.
    """

    @abstractmethod
    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput: ...

    @property
    @abstractmethod
    def num_live_handles(self) -> int:
        """In-flight handles (hidden state of work between steps) the executor holds."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook, default no-op
        """Release executor resources; the engine core calls it once, at shutdown."""


def num_planes(layout: str, num_loops: int) -> int:
    """KV planes per position: one per depth under LAST_EXITED, one under SHARED."""
    return 1 if layout == "shared" else num_loops


class HasPromptLoops(Protocol):
    """Anything that carries a request's prompt loop bound (a prompt item, a `Request`)."""

    prompt_loops: int


@dataclass(frozen=True, slots=True)
class StepRules:
    """Executor semantics in one place: the rules `ModelRunner` and `SimExecutor` both apply
    to an item while executing it (planes, finalize, the first token, handle lifetime).

    Call k of a step runs every item with more than k depths, at depth `item.depth + k`."""

    num_loops: int
    shared: bool  # the SHARED layout (one plane)
    # Coda batching in time: a decode row whose loops exit keeps its carried state and is
    # not sampled in its call; its leave and sampling run in a later step's `LeaveRows`.
    defers_leave: bool = False

    @classmethod
    def of(cls, layout: str, num_loops: int, *, defers_leave: bool = False) -> StepRules:
        return cls(num_loops, layout == "shared", defers_leave)

    @property
    def num_planes(self) -> int:
        return 1 if self.shared else self.num_loops

    def plane(self, item: WorkItem, call_index: int) -> int:
        """The plane call `call_index` of the step writes and reads for `item`."""
        return 0 if self.shared else item.depth + call_index

    def finalizes(self, depth: int, exited: bool) -> bool:
        """A decode or replay token exiting after loop `depth`, below full depth, copies its
        K/V of that depth into every deeper plane (LAST_EXITED only)."""
        return exited and not self.shared and depth < self.num_loops - 1

    def final_prompt_depth(self, item: PromptChunk | HasPromptLoops) -> int:
        """The last depth a prompt item's positions run (D - 1, or its request's r - 1); of
        a request (`prompt_loops` 0: the model's D), the last depth its prompt runs."""
        return (item.prompt_loops or self.num_loops) - 1

    def plane_final_depth(self, plane: int, final_depth: int) -> int:
        """The depth after which a prompt position's K/V in `plane` is final, for a prompt
        whose last depth is `final_depth`: plane d's after depth d under LAST_EXITED (no
        later work writes a prompt position); a plane at or past `final_depth`, SHARED's one
        plane (every depth writes it) and a family's once planes (after the loop planes)
        only after the last depth, which writes or finalizes them. A streamed hand-off sends
        each plane's blocks as this says they are final (`engine/kv_stream.py`)."""
        if self.shared or plane >= self.num_planes:
            return final_depth
        return min(plane, final_depth)

    def completes_prompt(self, item: WorkItem) -> bool:
        """A prompt item that runs its positions' final depth this step."""
        return item.kind is ItemKind.PROMPT and item.last_depth == self.final_prompt_depth(item)

    def samples_first_token(self, item: WorkItem) -> bool:
        """The item is its request's last prompt chunk and reaches the last depth this step:
        the first token's exit is chosen from the last position's hazards and sampled."""
        return (
            item.kind is ItemKind.PROMPT
            and item.first_token
            and item.last_depth == self.final_prompt_depth(item)
        )

    def releases_handle(self, item: WorkItem, exited: bool, sampled: bool) -> bool:
        """The item's work ends this step (its handle is released, not kept): a first token
        was sampled, a prompt chunk ran its last depth, or a replay row reached its loop
        count; a speculative row exited."""
        if item.kind is ItemKind.SPEC:  # a draft sample keeps the row's state for its loops
            return exited
        return sampled or self.completes_prompt(item) or (item.kind is ItemKind.REPLAY and exited)


def run_without_failed(
    scheduled: SchedulerOutput,
    failures: tuple[RequestFailure, ...],
    run: Callable[[SchedulerOutput], RunnerOutput],
) -> RunnerOutput:
    """The `Executor` failure contract for setup failures: run the step (`run`, its
    bookkeeping already applied) without the items of the failed requests; those items get
    results with only `request_id` and `handle`, so results stay one per item, in order."""
    failed_ids = {failure.request_id for failure in failures}
    kept = tuple(item for item in scheduled.items if item.request_id not in failed_ids)
    decode, kept_rows = _without(scheduled.decode, failed_ids)
    leave, kept_leave = _without(scheduled.leave, failed_ids)
    output = run(dataclasses.replace(scheduled, items=kept, decode=decode, leave=leave))
    ran = iter(output.results)
    results = tuple(
        ItemResult(item.request_id, item.handle) if item.request_id in failed_ids else next(ran)
        for item in scheduled.items
    )
    return dataclasses.replace(
        output,
        results=results,
        decode=_scattered(scheduled.decode, output.decode, kept_rows),
        leave=_scattered(scheduled.leave, output.leave, kept_leave),
        failed_requests=failures + output.failed_requests,
    )


def _without(
    rows: DecodeRows | LeaveRows | None, failed_ids: set[str]
) -> tuple[DecodeRows | LeaveRows | None, np.ndarray | None]:
    """Decode or leave rows without the failed requests' (None when none is left), and the
    indices kept. (A handed-off request decodes in the step that announces it.)"""
    if rows is None:
        return None, None
    kept = np.array(
        [i for i, rid in enumerate(rows.request_ids) if rid not in failed_ids], np.int64
    )
    return (rows.take(kept) if len(kept) else None), kept


def _scattered(
    rows: DecodeRows | LeaveRows | None, ran: DecodeResults | None, kept: np.ndarray | None
) -> DecodeResults | None:
    """One result per row of `rows`: those that ran at their indices, empty elsewhere."""
    if rows is None:
        return None
    if ran is None or kept is None:
        return DecodeResults.empty(len(rows))
    return ran.scatter(kept, len(rows))


def set_up_each(
    new_requests,
    setup: Callable[[NewRequestData], None],
    drop: Callable[[str], None],
    log: logging.Logger,
) -> tuple[RequestFailure, ...]:
    """Run an executor's per-request `setup` for each new request; a request whose setup
    raises is dropped (`drop`: none of its state kept), logged and reported, alone."""
    failures = []
    for new in new_requests:
        try:
            setup(new)
        except Exception as err:  # fails this request only; reported, not swallowed
            log.exception("setup of request %s failed", new.request_id)
            drop(new.request_id)
            failures.append(RequestFailure(new.request_id, f"{type(err).__name__}: {err}"))
    return tuple(failures)
