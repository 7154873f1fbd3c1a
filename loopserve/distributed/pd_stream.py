"""`PDStream`: one submission's outputs across its prefill and decode replicas (`--pd`).

An `EngineStream` (engine/client.py: async iteration, `close`, `with`) for a
`PDReplicaPool`. Background legs feed one queue that the consumer reads: the prefill replica's
stream (`EngineReplica.prefill`) and, for each exported request, its hand-off (`hand_off`, the
one function that moves a state to a decode replica) and the decode replica's stream
(`decode_stream`). The consumer sees the same `RequestOutput` sequence a colocated engine
yields (cumulative fields plus deltas, finish reason, metrics from the request's arrival on
the prefill replica). A request that finishes with its first token (max_tokens=1, a stop token
or string) never leaves its prefill replica.

Failure semantics, per request, wherever it is:

- on the prefill replica: as `PoolStream` (a replica failure before any output arrived
  re-routes the submission to another prefill replica, at most `MAX_REROUTES` times; after
  that the stream ends with `ReplicaFailedError`, HTTP 503);
- exported, in flight: a decode replica that refuses it for now (queue full, shutting down) or
  dies before taking it is retried, on any serving decode replica, for up to `HANDOFF_WAIT_S`;
  a request the decode replica takes but cannot fit in its KV cache yet waits there (its K/V
  staged) until blocks free up. Only after that wait, or on a permanent rejection, the stream
  fails;
- on a decode replica: its death ends the stream with `ReplicaFailedError` (503).

With the torch KV transport (`PDReplicaPool.kv_destinations`), the prefill replica sends the
K/V to the decode replica the pool chose at submission and the hand-off carries a descriptor
(`Exported.destination` is set): only that replica can import it, so there is no retrying on
another one. Invariant: every such descriptor reaches its destination as an import or a drop
(`EngineReplica.drop_handoff`, which takes the K/V off the wire in the pair's order); a
hand-off that does not end accepted drops it (aborted, refused, timed out, or a bug), else
the next hand-off from that prefill replica would wait forever for its turn. Its
destination dying, or the transport failing (`Rejected` of kind "KVTransportError"), loses
the K/V: the request fails with `ReplicaFailedError` and the pool falls back to the object
store for later hand-offs.

Closing the stream (client disconnect) aborts each unfinished request where it is: on its
prefill replica, on its decode replica (also when the import is still being answered: the abort
follows the acceptance), or, in flight, by dropping its state before any import (a descriptor:
on its destination, as above). Every replica's KV blocks come back.

Rooms: this module is the stream itself (its state, the prefill leg and the consumer side);
the hand-off and decode legs are `HandOffs` (pd_decode_leg.py), an object it owns; the open
step on a prefill replica is `place_submission` (placement.py), shared with `PoolStream`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from loopserve.distributed.pd_decode_leg import (
    DECODE,
    HANDOFF_RETRY_S,
    HANDOFF_WAIT_S,
    PREFILL,
    HandOffs,
    Leg,
    PDRequests,
    PDStreamOwner,
    hand_off,
)
from loopserve.distributed.placement import place_submission
from loopserve.distributed.pool_stream import MAX_REROUTES, ReplicaFailedError
from loopserve.distributed.replica_messages import ChunkSent, EngineFailed, Exported
from loopserve.distributed.router import RoutedRequest
from loopserve.engine.async_llm import EngineDeadError, GenerateRequest
from loopserve.engine.client import EngineStream
from loopserve.errors import LoopserveError
from loopserve.outputs import RequestOutput

if TYPE_CHECKING:
    from loopserve.distributed.pool_replicas import _Replica

__all__ = [
    "DECODE",
    "HANDOFF_RETRY_S",
    "HANDOFF_WAIT_S",
    "PREFILL",
    "Leg",
    "PDStream",
    "hand_off",
]
logger = logging.getLogger(__name__)


class PDStream(EngineStream):
    """The outputs of one submission across its prefill and decode replicas (an
    `EngineStream`). Background legs (the prefill stream, one hand-off and decode stream per
    exported request) feed one queue that the consumer reads."""

    def __init__(
        self,
        owner: PDStreamOwner,
        requests: list[GenerateRequest],
        routed: list[RoutedRequest],
        prompt_token_ids: list[int] | None,
    ) -> None:
        super().__init__([r.request_id for r in requests])
        self.owner = owner
        self.requests = requests
        self.state = PDRequests(
            max_tokens={r.request_id: r.max_tokens for r in routed},
            prompt_texts={r.request_id: getattr(r.prompt, "text", None) for r in requests},
        )
        # The prefill replica produces one token per request: its outstanding work.
        self._prefill_routed = [RoutedRequest(r.request_id, r.num_prompt_tokens, 1) for r in routed]
        self._prompt_token_ids = prompt_token_ids
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._received_any = False  # some output arrived from a replica (no re-routing then)
        self.replica: int | None = None  # the prefill replica
        self.delivered_any = False  # some output reached the consumer
        self.num_reroutes = 0
        self.handoffs = HandOffs(
            owner,
            self.state,
            wanted=self._unfinished.__contains__,
            closed=lambda: self._closed,
            put=self._put,
            fail=self._fail,
            raise_error=self._queue.put_nowait,
            guarded=self._guarded,
        )

    @property
    def decode_replicas(self) -> dict[str, int]:
        """Request id -> the decode replica that took it."""
        return self.state.decode_replicas

    # ---- the prefill leg ----------------------------------------------------------------

    async def open(self, excluded: set[int]) -> None:
        """Route to a prefill replica and submit; retry on another if the chosen one fails
        first (`place_submission`). Errors as `AsyncLLM.submit`, raised before any output."""
        pool = self.owner
        stream_to = await self.handoffs.kv_stream.reserve(self.requests) if pool.streams_kv else {}

        def start(index: int, replica: _Replica) -> Any:
            self.replica = index
            destinations = pool.kv_destinations(self.request_ids)
            if destinations is not None:  # a streamed request's chunks go where it reserved
                destinations.update({r: self.handoffs.kv_stream.streamed_to[r] for r in stream_to})
            self.state.destinations = destinations or {}
            return replica.actor.prefill.remote(self.requests, destinations, stream_to or None)

        try:
            placed = await self._place(start, excluded)
        except BaseException:
            for request_id in stream_to:
                self.handoffs.release(request_id)
            raise
        leg = Leg(PREFILL, placed.replica, placed.instance_id)
        for request_id in self._unfinished:
            self.state.legs[request_id] = leg
        pool.spawn(self._guarded(self._pump_prefill(placed.generator, leg)))

    async def _place(self, start: Any, excluded: set[int]) -> Any:
        pool = self.owner
        return await place_submission(
            pool,
            serving=lambda: pool.serving_of(PREFILL),
            total=pool.spec.num_prefill,
            what="prefill replica",
            request_ids=self.request_ids,
            routed=self._prefill_routed,
            prompt_token_ids=self._prompt_token_ids,
            excluded=excluded,
            start=start,
        )

    async def _guarded(self, leg_work: Any) -> None:
        """Run a leg; a bug in it ends the stream with an error instead of leaving the consumer
        waiting."""
        try:
            await leg_work
        except asyncio.CancelledError:
            raise
        except Exception as err:
            logger.exception("a leg of requests %s failed", self.request_ids)
            self._queue.put_nowait(EngineDeadError(f"internal error: {err!r}"))

    async def _pump_prefill(self, generator: Any, leg: Leg) -> None:
        import ray

        while True:
            try:
                item = await (await generator.__anext__())
                if isinstance(item, Exported | ChunkSent):
                    state_ref = await generator.__anext__()  # a reference; not fetched here
            except StopAsyncIteration:
                if any(self.state.legs.get(r) == leg for r in self._unfinished - self.state.ended):
                    await self._prefill_failed(leg, "stream ended early", replica_down=False)
                return
            except ray.exceptions.RayActorError as err:  # the replica process is gone
                await self._prefill_failed(leg, f"{type(err).__name__}: {err}", replica_down=True)
                return
            except ray.exceptions.RayError as err:  # this stream only
                await self._prefill_failed(leg, f"{type(err).__name__}: {err}", replica_down=False)
                return
            if isinstance(item, EngineFailed):
                await self._prefill_failed(leg, item.message, replica_down=True)
                return
            if isinstance(item, Exported):
                self.handoffs.on_exported(item, state_ref, leg)
                del state_ref  # the hand-off holds it now; it must not outlive that
            elif isinstance(item, ChunkSent):
                self.handoffs.on_chunk(item, state_ref)
                del state_ref
            else:
                self._received_any = True
                if item.finished:  # ended on the prefill replica: no hand-off
                    self.handoffs.release(item.request_id)
                self._put(item)

    async def _prefill_failed(self, leg: Leg, why: str, *, replica_down: bool) -> None:
        """Re-route if no output arrived yet, else fail the requests still on the replica."""
        pool = self.owner
        stranded = sorted(
            r for r in self._unfinished - self.state.ended if self.state.legs.get(r) == leg
        )
        if self._closed or not stranded:
            return
        if replica_down:
            pool.replica_failed(leg.replica, leg.instance_id, why)
        for request_id in stranded:
            pool.router.finish(request_id)
            self.handoffs.release(request_id)  # a half-streamed K/V is never imported
        if not self._received_any and self.num_reroutes < MAX_REROUTES and pool.is_accepting:
            self.num_reroutes += 1
            logger.warning(
                "re-routing %d requests away from replica %d", len(stranded), leg.replica
            )
            try:
                await self.open(excluded={leg.replica})
                return
            except LoopserveError as err:
                why = f"{why}; re-routing failed: {err}"
        self._fail(stranded, leg, why, replica_down=replica_down)

    def _put(self, output: RequestOutput) -> None:
        # Outstanding work is counted as outputs arrive (not as they are consumed), so it
        # is charged to the replica that produced them, before a hand-off moves the request.
        self.owner.router.progress(output.request_id, len(output.new_token_ids))
        if output.finished:
            self.state.ended.add(output.request_id)
        self._queue.put_nowait(output)

    def _fail(
        self, request_ids: list[str], leg: Leg | None, why: str, *, replica_down: bool
    ) -> None:
        """End the stream with `ReplicaFailedError` (the consumer raises it)."""
        for request_id in request_ids:
            self.state.legs.pop(request_id, None)
        logger.error("requests %s failed: %s", request_ids, why)
        if leg is None:
            message = "no decode replica could take this request in time; retry it"
        else:
            self.owner.replicas[leg.replica].num_failed_requests += len(request_ids)
            if replica_down:
                message = (
                    f"replica {leg.replica} failed while serving this request ({leg.role}); it "
                    "is being restarted, retry the request"
                )
            else:
                message = (
                    f"replica {leg.replica} failed this request ({leg.role}; details are in "
                    "the server log); retry it"
                )
        self._queue.put_nowait(ReplicaFailedError(message))

    # ---- the consumer -------------------------------------------------------------------

    async def _next_item(self) -> RequestOutput:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.owner.metrics.finished.labels(finish_reason="error").inc(len(self._unfinished))
            self._abort_where_they_are(sorted(self._unfinished))
            self._unfinished.clear()
            raise item
        return item

    def _delivered(self, output: RequestOutput) -> None:  # type: ignore[override]
        self.delivered_any = True
        if output.finished:
            self.owner.router.finish(output.request_id)
            self.owner.metrics.observe_finished(output)

    def _release_routing(self) -> None:
        for request_id in self.request_ids:
            self.owner.router.finish(request_id)

    def _abort_where_they_are(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            leg = self.state.legs.get(request_id)
            if leg is not None:
                by_replica.setdefault(leg.replica, []).append(request_id)
            elif request_id in self.handoffs.in_flight:
                self.handoffs.aborting.add(request_id)
        for index, ids in by_replica.items():
            self.owner.replicas[index].actor.abort.remote(ids)

    def abort_unfinished(self, request_ids: list[str] | None = None) -> None:
        """Abort (some of) this stream's unfinished requests where they are; their final
        outputs (finish reason "abort") still arrive through the stream."""
        ids = self._unfinished if request_ids is None else self._unfinished & set(request_ids)
        self._abort_where_they_are(sorted(ids))

    def _closed_with(self, unfinished_ids: list[str]) -> None:
        for request_id in unfinished_ids:
            if request_id not in self.handoffs.in_flight:  # else its hand-off releases it
                self.handoffs.release(request_id)
        if unfinished_ids:
            self._abort_where_they_are(unfinished_ids)
            self.owner.metrics.finished.labels(finish_reason="abort").inc(len(unfinished_ids))
        self._release_routing()
        self.owner.on_stream_closed(self)
