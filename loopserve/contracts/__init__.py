"""The step contracts between scheduler and runner (docs/architecture.md, "Step contract").

One step: the scheduler builds a `SchedulerOutput`; an executor (`loopserve.execution`: the
model runner, or the simulator's priced stand-in) executes it and returns a `RunnerOutput`;
the scheduler applies it. Only ids, counts, depths, block ids and plain numbers cross this
boundary — never tensors, never `Request` objects. Torch-free.

`rows` holds what the rows carry (prompt chunks, replay and speculative rows, the decode and
leave rows' columns and results), `kv` the K/V messages (transfers, table updates, hand-off
handles), `step` the step's two messages and the executor's block tables. Every name is
imported from here.
"""

from loopserve.contracts.kv import KVHandle, KVTransfer, PendingHostKV, SwapKind, TableUpdate
from loopserve.contracts.rows import (
    DecodeResults,
    DecodeRow,
    DecodeRows,
    ItemKind,
    LeaveRows,
    PromptChunk,
    ReplayRow,
    SampledToken,
    SampleSpec,
    SpecRow,
    WorkItem,
)
from loopserve.contracts.step import (
    BlockTables,
    ItemResult,
    NewRequestData,
    RequestFailure,
    RowGroup,
    RunnerOutput,
    RunnerStats,
    SchedulerOutput,
)

__all__ = [
    "BlockTables",
    "DecodeResults",
    "DecodeRow",
    "DecodeRows",
    "ItemKind",
    "ItemResult",
    "KVHandle",
    "KVTransfer",
    "LeaveRows",
    "NewRequestData",
    "PendingHostKV",
    "PromptChunk",
    "ReplayRow",
    "RequestFailure",
    "RowGroup",
    "RunnerOutput",
    "RunnerStats",
    "SampleSpec",
    "SampledToken",
    "SchedulerOutput",
    "SpecRow",
    "SwapKind",
    "TableUpdate",
    "WorkItem",
]
