"""`HandleTable`: an executor's state of work in flight between steps, by opaque handle.

The scheduler names each piece of paused work (a decode token between loops, a prompt chunk
between depths) with an opaque integer handle; the executor keeps whatever it needs to resume
it under that handle. `ModelRunner` keeps hidden states there, `SimExecutor` keeps nothing
(None) but uses the same table so that resuming from a handle that was never kept fails
loudly in both. Handles are grouped by request, so a release (a request id in
`SchedulerOutput.finished_request_ids`) drops every handle of that request. Torch-free.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import KeysView
from typing import Generic, TypeVar

T = TypeVar("T")


class HandleTable(Generic[T]):
    def __init__(self) -> None:
        self._state: dict[int, T] = {}
        self._handles_of: defaultdict[str, set[int]] = defaultdict(set)

    def keep(self, request_id: str, handle: int, state: T) -> None:
        """Store the state of `handle` until the next step resumes it."""
        self._state[handle] = state
        self._handles_of[request_id].add(handle)

    def resume(self, handle: int) -> T:
        """Take the state of `handle` back; KeyError if the executor never kept it."""
        return self._state.pop(handle)

    def done(self, request_id: str, handle: int) -> None:
        """The work under `handle` completed this step (exited, or its last depth ran)."""
        self._handles_of[request_id].discard(handle)

    def drop(self, request_id: str, handle: int) -> None:
        """`resume` (if kept) and `done` in one call, discarding the state: for an executor
        that keeps no state worth taking back."""
        self._state.pop(handle, None)
        self._handles_of[request_id].discard(handle)

    def release(self, request_id: str) -> list[int]:
        """Drop every handle of a request that left; returns the handles dropped."""
        handles = list(self._handles_of.pop(request_id, ()))
        for handle in handles:
            self._state.pop(handle, None)
        return handles

    def handles_of(self, request_id: str) -> frozenset[int]:
        return frozenset(self._handles_of.get(request_id, ()))

    def __contains__(self, handle: int) -> bool:
        return handle in self._state

    def kept(self) -> KeysView[int]:
        """A live read-only view of the kept handles (`handle in view` costs no Python call:
        executors check it once per item)."""
        return self._state.keys()

    def __len__(self) -> int:
        return len(self._state)

    def states(self) -> list[T]:
        return list(self._state.values())
