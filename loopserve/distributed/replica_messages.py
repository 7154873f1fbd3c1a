"""What `EngineReplica` calls return and yield: results, markers and the gauges it reports.

Plain frozen dataclasses (they cross Ray by pickle), torch-free and Ray-free:

- `Accepted` / `Rejected`: the first item of a submission (`generate`, `prefill`) or the answer
  of `import_handoff`; `Rejected.error()` rebuilds the `LoopserveError` the replica raised.
- `EngineFailed`: the replica's engine died (or shut down) under a stream; `relay` yields it.
- `Exported`: `prefill` handed a request off; the stream's next item is its state.
- `ChunkSent`: `prefill` streams a request's K/V; the stream's next item is the `KVChunk`.
- `ReplicaStats`: what the pool reads per probe (`stats()`); once, it reads the replica's
  `ModelInfo` (engine/client.py) with `info()`.

`relay` turns an engine `OutputStream` into a replica stream's items.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from loopserve.engine.async_llm import (
    EngineDeadError,
    EngineNotReadyError,
    OutputStream,
    QueueFullError,
)
from loopserve.engine.handoff import HandoffState
from loopserve.engine.stats import EngineStats
from loopserve.errors import CapacityError, InvalidRequestError, LoopserveError
from loopserve.outputs import RequestOutput


@dataclass(frozen=True, slots=True)
class Accepted:
    """The replica added every request of the submission."""


@dataclass(frozen=True, slots=True)
class Rejected:
    """The replica refused the submission before doing any work; `error()` rebuilds it."""

    kind: str
    message: str
    param: str | None = None
    retry_after_s: int = 1

    @classmethod
    def of(cls, err: LoopserveError) -> Rejected:
        return cls(
            type(err).__name__,
            getattr(err, "message", str(err)),
            getattr(err, "param", None),
            getattr(err, "retry_after_s", 1),
        )

    def error(self) -> LoopserveError:
        if self.kind == "CapacityError":
            return CapacityError(self.message, self.param)
        if self.kind == "InvalidRequestError":
            return InvalidRequestError(self.message, self.param)
        if self.kind == "QueueFullError":
            return QueueFullError(self.message, self.retry_after_s)
        if self.kind == "EngineDeadError":
            return EngineDeadError(self.message)
        return EngineNotReadyError(self.message)


@dataclass(frozen=True, slots=True)
class EngineFailed:
    """The replica's engine died while the submission ran; the replica must be restarted."""

    message: str


@dataclass(frozen=True, slots=True)
class Exported:
    """`prefill`: the request left this replica; the stream's next item is its `HandoffState`."""

    request_id: str
    num_output_tokens: int  # output tokens it carries (streamed already)
    # The exporter's `time.time() - time.monotonic()`: lets an importer on another node
    # rebase the request's times (monotonic clocks are per machine).
    clock_offset_s: float | None = None
    # The rank the K/V was sent to by the torch transport (the next item is a
    # `KVDescriptor` only that replica can import); None: the state carries its K/V.
    destination: int | None = None
    # A streamed hand-off: its K/V starts at this block of each plane (the earlier ones went
    # as chunks to the replica that reserved them, which alone can import it); 0: whole.
    first_block: int = 0


@dataclass(frozen=True, slots=True)
class ChunkSent:
    """`prefill` with streamed K/V: a chunk of the request's prompt blocks is ready; the
    stream's next item is its `KVChunk` (a separate object, passed on unfetched)."""

    request_id: str
    first_block: int
    num_blocks: int
    # The rank a point-to-point transport sent it to (the next item is a `KVDescriptor`
    # only that replica can take, and must, in its turn); None: the chunk carries its K/V.
    destination: int | None = None
    planes: tuple[int, ...] | None = None  # the chunk's (`KVChunk.planes`; None: every plane)

    @property
    def restarts(self) -> bool:
        """The first chunk of a pass over the prompt from `skip` blocks (plane 0 reaches
        every block first): after a recompute the prefill replica sends everything again."""
        return self.planes is None or 0 in self.planes


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    instance_id: str  # new for every actor (re)start
    is_ready: bool
    is_dead: bool
    num_in_flight: int
    snapshot: EngineStats
    num_exported: int = 0  # requests handed off to a decode replica (prefill role)
    num_imported: int = 0  # requests taken over from a prefill replica (decode role)
    kv_bytes_sent: int = 0  # K/V bytes the replica's KV transport sent (completed sends)
    kv_bytes_received: int = 0  # ... and received (imported or discarded)
    num_kv_chunks_sent: int = 0  # streamed hand-offs' chunks (prefill role)
    num_kv_chunks_received: int = 0  # ... written into reserved blocks (decode role)
    kv_chunk_blocks_received: int = 0  # blocks those chunks carried, summed over their planes
    num_streamed_imports: int = 0  # imports whose K/V came partly as chunks
    # Hand-offs' and chunks' K/V landed before import (decode role, `HandoffKV.land`): on
    # the device, and on the host (pinned: too large for free device memory; or CPU).
    num_kv_landed_device: int = 0
    num_kv_landed_host: int = 0
    num_reserved: int = 0  # reservations waiting for their request (decode role)


async def relay(
    stream: OutputStream,
) -> AsyncIterator[RequestOutput | HandoffState | EngineFailed]:
    """The stream's items; `EngineFailed` last if the engine dies or shuts down under it.
    Leaving early (the consumer went away) aborts what has not finished."""
    with stream:
        try:
            async for item in stream:
                yield item
        except EngineDeadError as err:
            yield EngineFailed(str(err))
        except EngineNotReadyError as err:  # the replica is shutting down
            yield EngineFailed(str(err))
