"""What the scheduler and its collaborators share: the request queues and the step's outbox.

`Queues`: every unfinished request by id, the waiting queue (kept in admission order:
priority, then arrival) and the running list (admission order). `StepOutbox`: what the next
`SchedulerOutput` must announce besides its items (new requests, releases, recompute
preemptions, KV transfers), each delivered exactly once by `take`. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loopserve.contracts import (
    DecodeRows,
    KVTransfer,
    LeaveRows,
    NewRequestData,
    SchedulerOutput,
    TableUpdate,
    WorkItem,
)
from loopserve.scheduler.request import Request


@dataclass
class Queues:
    requests: dict[str, Request] = field(default_factory=dict)
    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)


@dataclass
class StepOutbox:
    new_requests: list[NewRequestData] = field(default_factory=list)
    gone_request_ids: list[str] = field(default_factory=list)  # left RUNNING (or staged)
    preempted_ids: list[str] = field(default_factory=list)  # recompute: hidden states go
    transfers: list[KVTransfer] = field(default_factory=list)  # swap / import block moves
    # Rolled-back speculative positions whose runner state goes: (request_id, handle).
    dropped_handles: list[tuple[str, int]] = field(default_factory=list)

    def take(
        self,
        step_id: int,
        items: list[WorkItem],
        decode: DecodeRows | None,
        table_updates: tuple[TableUpdate, ...],
        leave: LeaveRows | None = None,
    ) -> SchedulerOutput:
        out = SchedulerOutput(
            step_id=step_id,
            items=tuple(items),
            table_updates=table_updates,
            new_requests=tuple(self.new_requests),
            finished_request_ids=tuple(self.gone_request_ids),
            preempted_request_ids=tuple(self.preempted_ids),
            kv_transfers=tuple(self.transfers),
            dropped_handles=tuple(self.dropped_handles),
            decode=decode,
            leave=leave,
        )
        self.new_requests.clear()
        self.gone_request_ids.clear()
        self.preempted_ids.clear()
        self.transfers.clear()
        self.dropped_handles.clear()
        return out
