"""The driver's side of streamed hand-offs (`--kv-handoff stream`) for one `PDStream`.

Per request of the submission:

- `reserve`: before the prompt runs, a serving decode replica reserves its blocks
  (`EngineReplica.reserve_imports`): the one with the fewest streamed hand-offs in flight,
  then the least loaded (`Router.choose_handoff`: concurrent streams share a replica's link).
  It says how many blocks per plane its prefix cache holds already (the prefill replica skips
  them: `skips`). A request it has no room for, or
  every request when no decode replica answers, hands off whole.
- `on_chunk`: each chunk the prefill replica yields (`ChunkSent`, then the `KVChunk` as a
  separate Ray object) is kept by reference (not fetched here) and written, by reference, into
  the reservation (`write_kv_chunk`). Chunks sent again from the start (the prefill replica
  recomputed the prompt after a preemption) replace the kept ones.
- `ready`: the final hand-off (`Exported.first_block` > 0) may go to the reserving replica
  once every chunk write there succeeded.
- `replay`: when a write failed or the reserving replica died or stopped serving, the request
  is reserved again on a serving decode replica (the restarted one, or another), every kept
  chunk is written there, and the final hand-off goes there. Impossible when that replica's
  prefix cache holds fewer of the prompt's first blocks than the first one did (those blocks
  were never sent), and with chunks sent point to point (`nixl`: a chunk's bytes are read
  once, by its destination): then the request fails with the retry error. A point-to-point
  chunk always goes to its destination, whatever became of the request, so that replica
  takes it off the wire in its turn.
- `release`: a request that will not be imported where it is reserved (it ended on its
  prefill replica, was aborted, failed, or hands off whole) frees its reservation and the
  kept chunks; an accepted import took the reservation (`taken`).

Failures of a release are ignored: the replica died, and its blocks with it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from loopserve.distributed.replica_messages import ChunkSent, Rejected

if TYPE_CHECKING:
    from loopserve.distributed.placement import PDStreamOwner

logger = logging.getLogger(__name__)
DECODE = "decode"
REPLAYED, NO_ROOM, SKIPPED_BLOCKS_LOST = "replayed", "no room", "skipped blocks lost"


class StreamedKV:
    """The reservations, kept chunks and chunk writes of one submission's streamed hand-offs
    (see the module docstring)."""

    def __init__(self, owner: PDStreamOwner) -> None:
        self.owner = owner
        self.reserved: dict[str, int] = {}  # request -> the decode replica holding its blocks
        self.streamed_to: dict[str, int] = {}  # ... the last one (kept after release)
        self.skips: dict[str, int] = {}  # request -> blocks per plane the prefill side skips
        self.submitted: dict[str, Any] = {}  # request -> its `GenerateRequest`
        self.chunks: dict[str, list[Any]] = {}  # request -> its chunks' references, in order
        self.writes: dict[str, list[asyncio.Task[bool]]] = {}  # into the current reservation
        self.num_replays = 0

    async def reserve(self, requests: list[Any]) -> dict[str, int]:
        """Reserve blocks for `requests` before their prompts run; request -> blocks per plane
        to skip (see the module docstring)."""
        reserved = await self._reserve_on_decode(requests)
        for request in requests:
            if request.request_id in reserved:
                self.skips[request.request_id] = reserved[request.request_id]
                self.submitted[request.request_id] = request
        return reserved

    async def _reserve_on_decode(self, requests: list[Any]) -> dict[str, int]:
        import ray

        pool = self.owner
        candidates = pool.serving_of(DECODE)
        if not candidates:
            return {}
        index = pool.router.choose_handoff(candidates)
        replica = pool.replicas[index]
        try:
            skips = await replica.actor.reserve_imports.remote(requests)
        except ray.exceptions.RayError as err:
            logger.warning("reserving on decode replica %d failed: %r", index, err)
            if isinstance(err, ray.exceptions.RayActorError):  # out of rotation until back
                pool.replica_failed(index, replica.instance_id, err)
            return {}
        if isinstance(skips, Rejected):
            return {}
        reserved = {}
        for request, skip in zip(requests, skips, strict=True):
            if skip is not None:
                self.reserved[request.request_id] = self.streamed_to[request.request_id] = index
                reserved[request.request_id] = skip
        pool.router.begin_handoffs(index, len(reserved))
        return reserved

    def streams(self, request_id: str) -> bool:
        return request_id in self.skips

    def on_chunk(self, sent: ChunkSent, chunk_ref: Any) -> None:
        """Keep a chunk (by reference) and write it into the request's reservation. A chunk
        sent point to point goes to its destination whatever became of the request: that
        replica must take it off the wire in its turn (then drops it if nothing is reserved)."""
        request_id = sent.request_id
        if sent.destination is not None:
            self._write(request_id, sent.destination, chunk_ref, track=request_id in self.skips)
            return
        if request_id not in self.skips:
            return  # released: ended, aborted, or handing off whole
        kept = self.chunks.setdefault(request_id, [])
        if kept and sent.first_block == self.skips[request_id] and sent.restarts:
            kept.clear()  # sent again from the start: the recomputed K/V replaces it
        kept.append(chunk_ref)
        index = self.reserved.get(request_id)
        if index is not None:
            self._write(request_id, index, chunk_ref)

    def _write(self, request_id: str, index: int, chunk_ref: Any, *, track: bool = True) -> None:
        answer = self.owner.replicas[index].actor.write_kv_chunk.remote(chunk_ref)
        task = self.owner.spawn(self._written(answer, index))
        if track:
            self.writes.setdefault(request_id, []).append(task)  # type: ignore[arg-type]

    async def _written(self, answer_ref: Any, index: int) -> bool:
        import ray

        try:
            answer = await answer_ref
        except ray.exceptions.RayError:
            return False
        if isinstance(answer, Rejected) and answer.kind == "KVTransportError":
            self.owner.fall_back(f"decode replica {index}: {answer.message}")
        return not isinstance(answer, Rejected)

    async def ready(self, request_id: str) -> int | None:
        """The replica holding the request's reservation once every chunk write there
        succeeded; None when there is none or a write failed (then `replay`)."""
        index = self.reserved.get(request_id)
        if index is None:
            return None
        results = await asyncio.gather(*self.writes.get(request_id, []), return_exceptions=True)
        if self.reserved.get(request_id) != index or not all(r is True for r in results):
            return None
        return index

    async def replay(self, request_id: str) -> str:
        """Reserve the request again on a serving decode replica and write every kept chunk
        there: `REPLAYED`, `NO_ROOM` (try again later) or `SKIPPED_BLOCKS_LOST`."""
        self._unreserve(request_id)
        reserved = await self._reserve_on_decode([self.submitted[request_id]])
        if request_id not in reserved:
            return NO_ROOM
        if reserved[request_id] < self.skips[request_id]:
            self._unreserve(request_id)
            return SKIPPED_BLOCKS_LOST
        self.num_replays += 1
        index = self.reserved[request_id]
        logger.warning("replaying the streamed K/V of %r to decode replica %d", request_id, index)
        for chunk_ref in self.chunks.get(request_id, []):
            self._write(request_id, index, chunk_ref)
        return REPLAYED

    def taken(self, request_id: str) -> None:
        """The import on the reserving replica took the reservation."""
        self._forget_reservation(request_id)
        self.release(request_id)

    def release(self, request_id: str) -> None:
        """Forget the request's streamed hand-off: free its reservation (if any) and the kept
        chunks; idempotent."""
        self._unreserve(request_id)
        self.chunks.pop(request_id, None)
        self.skips.pop(request_id, None)
        self.submitted.pop(request_id, None)

    def _unreserve(self, request_id: str) -> None:
        index = self._forget_reservation(request_id)
        self.writes.pop(request_id, None)
        if index is not None:
            self.owner.replicas[index].actor.release_imports.remote([request_id])

    def _forget_reservation(self, request_id: str) -> int | None:
        """Drop the request's reservation from the bookkeeping (the router's count of
        streamed hand-offs in flight included); the replica that held it, or None."""
        index = self.reserved.pop(request_id, None)
        if index is not None:
            self.owner.router.end_handoff(index)
        return index
