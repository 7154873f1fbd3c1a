"""`PDStream`: one submission's outputs across its prefill and decode replicas (`--pd`).

The interface of `AsyncLLM`'s `OutputStream` (async iteration, `close`, `with`) for a
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
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loopserve.distributed.pool_stream import MAX_REROUTES, ReplicaFailedError
from loopserve.distributed.replica import Accepted, EngineFailed, Exported, Rejected
from loopserve.distributed.router import RoutedRequest
from loopserve.errors import LoopserveError
from loopserve.outputs import RequestOutput
from loopserve.server.async_engine import (
    EngineDeadError,
    EngineNotReadyError,
    GenerateRequest,
    QueueFullError,
)

if TYPE_CHECKING:
    from loopserve.distributed.pd_pool import PDReplicaPool

logger = logging.getLogger(__name__)
PREFILL, DECODE = "prefill", "decode"
HANDOFF_WAIT_S = 30.0  # how long an exported request may wait for a decode replica to take it
HANDOFF_RETRY_S = 0.05


def hand_off(decode_actor: Any, exported: Exported, state_ref: Any, prompt_text: str | None) -> Any:
    """Move one exported request to a decode replica; returns the reference of its answer
    (`Accepted` or `Rejected`). The decode replica's worker fetches the state from Ray's
    object store, never through this process: with its K/V inside, or (torch transport,
    `exported.destination` set) a descriptor whose K/V the replica receives point to point."""
    return decode_actor.import_handoff.remote(state_ref, prompt_text, exported.clock_offset_s)


@dataclass(frozen=True, slots=True)
class _Leg:
    """Where a request runs: a replica (by role and index) and that replica's instance."""

    role: str
    replica: int
    instance_id: str | None


class PDStream:
    """The outputs of one submission across its prefill and decode replicas; the interface of
    `OutputStream`. Background legs (the prefill stream, one hand-off and decode stream per
    exported request) feed one queue that the consumer reads."""

    def __init__(
        self,
        owner: PDReplicaPool,
        requests: list[GenerateRequest],
        routed: list[RoutedRequest],
        prompt_token_ids: list[int] | None,
    ) -> None:
        self.owner = owner
        self.requests = requests
        self.request_ids = [r.request_id for r in requests]
        self._max_tokens = {r.request_id: r.max_tokens for r in routed}
        # The prefill replica produces one token per request: its outstanding work.
        self._prefill_routed = [RoutedRequest(r.request_id, r.num_prompt_tokens, 1) for r in routed]
        self._prompt_texts = {r.request_id: getattr(r.prompt, "text", None) for r in requests}
        self._prompt_token_ids = prompt_token_ids
        self._unfinished = set(self.request_ids)
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._legs: dict[str, _Leg] = {}  # requests on a replica (absent: not opened, in flight)
        self._in_flight: set[str] = set()  # exported, not yet taken by a decode replica
        self._aborting: set[str] = set()  # in flight when aborted: abort once taken
        self._ended: set[str] = set()  # final output queued
        self._received_any = False  # some output arrived from a replica (no re-routing then)
        self._destinations: dict[str, int] = {}  # torch transport: request id -> decode rank
        self.replica: int | None = None  # the prefill replica
        self.decode_replicas: dict[str, int] = {}  # request id -> its decode replica
        self.delivered_any = False  # some output reached the consumer
        self.num_reroutes = 0
        self._closed = False

    # ---- the prefill leg ----------------------------------------------------------------

    async def open(self, excluded: set[int]) -> None:
        """Route to a prefill replica and submit; retry on another if the chosen one fails
        first. Errors as `AsyncLLM.submit`, raised before any output."""
        import ray

        pool = self.owner
        while True:
            candidates = [r for r in pool.serving_of(PREFILL) if r not in excluded]
            if not candidates:
                raise EngineNotReadyError(
                    f"no prefill replica can take this request right now "
                    f"({len(pool.serving_of(PREFILL))} of {pool.spec.num_prefill} serving)"
                )
            decision = pool.router.choose(candidates, self._prompt_token_ids)
            replica = pool.replicas[decision.replica]
            pool.router.assign(decision.replica, self._prefill_routed, self._prompt_token_ids)
            leg = _Leg(PREFILL, decision.replica, replica.instance_id)
            self.replica = decision.replica
            destinations = pool.kv_destinations(self.request_ids)
            self._destinations = destinations or {}
            generator = replica.actor.prefill.remote(self.requests, destinations)
            try:
                first = await (await generator.__anext__())
            except ray.exceptions.RayActorError as err:  # the replica is down: try another
                self._release_routing()
                pool.replica_failed(decision.replica, leg.instance_id, err)
                excluded.add(decision.replica)
                continue
            except (ray.exceptions.RayError, StopAsyncIteration) as err:  # a bug, not a death
                self._release_routing()
                logger.error("replica %d failed a submission: %r", decision.replica, err)
                raise EngineDeadError(f"replica {decision.replica} failed: {err!r}") from None
            except asyncio.CancelledError:  # the replica adds them anyway: take them back
                replica.actor.abort.remote(self.request_ids)
                raise
            if isinstance(first, Rejected):
                self._release_routing()
                raise first.error()
            assert isinstance(first, Accepted), first
            replica.num_routed += len(self.requests)
            replica.num_prefix_hits += int(decision.prefix_hit)
            for request_id in self._unfinished:
                self._legs[request_id] = leg
            pool.spawn(self._guarded(self._pump_prefill(generator, leg)))
            return

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

    async def _pump_prefill(self, generator: Any, leg: _Leg) -> None:
        import ray

        while True:
            try:
                item = await (await generator.__anext__())
                if isinstance(item, Exported):
                    state_ref = await generator.__anext__()  # a reference; not fetched here
            except StopAsyncIteration:
                if any(self._legs.get(r) == leg for r in self._unfinished - self._ended):
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
                self._on_exported(item, state_ref, leg)
                del state_ref  # the hand-off holds it now; it must not outlive that
            else:
                self._received_any = True
                self._put(item)

    async def _prefill_failed(self, leg: _Leg, why: str, *, replica_down: bool) -> None:
        """Re-route if no output arrived yet, else fail the requests still on the replica."""
        pool = self.owner
        stranded = sorted(r for r in self._unfinished - self._ended if self._legs.get(r) == leg)
        if self._closed or not stranded:
            return
        if replica_down:
            pool.replica_failed(leg.replica, leg.instance_id, why)
        for request_id in stranded:
            pool.router.finish(request_id)
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

    # ---- the hand-off and the decode leg ------------------------------------------------

    def _on_exported(self, exported: Exported, state_ref: Any, leg: _Leg) -> None:
        pool = self.owner
        request_id = exported.request_id
        pool.replicas[leg.replica].num_handoffs += 1
        pool.router.finish(request_id)
        self._legs.pop(request_id, None)
        if exported.destination is None and request_id in self._destinations:
            pool.fall_back(f"prefill replica {leg.replica} could not send {request_id!r}")
        if self._closed or request_id not in self._unfinished:
            # Aborted meanwhile: dropping the reference frees the state (a descriptor is
            # dropped on its destination).
            self._drop(exported, state_ref)
            return
        self._in_flight.add(request_id)
        remaining = max(0, self._max_tokens[request_id] - exported.num_output_tokens)
        pool.spawn(self._guarded(self._hand_off(exported, state_ref, remaining)))

    def _drop(self, exported: Exported, state_ref: Any) -> None:
        """A hand-off that will not be imported: a descriptor is dropped on its destination
        (keeping the pair's order); a state with its K/V is freed with its reference."""
        if exported.destination is None:
            return
        actor = self.owner.replicas[exported.destination].actor
        self.owner.spawn(self._dropped(exported, actor.drop_handoff.remote(state_ref)))

    async def _dropped(self, exported: Exported, answer_ref: Any) -> None:
        """Wait for a drop's answer: a transport failure there makes the pool fall back; a
        replica that died meanwhile drops nothing (its group is gone: the pool falls back
        when it notices the death)."""
        import ray

        try:
            error = await answer_ref
        except ray.exceptions.RayError as err:
            logger.warning("dropping hand-off %r failed: %r", exported.request_id, err)
            return
        if error is not None:
            self.owner.fall_back(f"decode replica {exported.destination}: {error}")

    async def _hand_off(self, exported: Exported, state_ref: Any, remaining_tokens: int) -> None:
        """Get the exported request taken by a decode replica (retrying as the module
        docstring says), then stream its outputs. A descriptor that does not end accepted
        is dropped on its destination, whatever ended the attempt."""
        accepted = False
        try:
            accepted = await self._take_over(exported, state_ref, remaining_tokens)
        finally:
            if not accepted:
                self._drop(exported, state_ref)
        del state_ref  # taken: the decode replica holds the request (and Ray frees the state)
        if accepted:
            await self._stream_taken(exported.request_id)

    async def _take_over(self, exported: Exported, state_ref: Any, remaining_tokens: int) -> bool:
        """Get the exported request taken by a decode replica; True once one accepted it
        (then `_stream_taken` follows), False when the request ended otherwise."""
        import ray

        pool = self.owner
        request_id = exported.request_id
        deadline_s = time.monotonic() + HANDOFF_WAIT_S
        why = "no decode replica is serving"
        while True:
            if self._closed:
                self._in_flight.discard(request_id)
                return False
            if time.monotonic() > deadline_s:
                self._in_flight.discard(request_id)
                self._fail([request_id], None, f"hand-off failed: {why}", replica_down=True)
                return False
            candidates = pool.serving_of(DECODE)
            if exported.destination is not None:  # its K/V went there: no other replica
                if exported.destination not in candidates:
                    return self._lost(exported, "its decode replica stopped serving")
                candidates = [exported.destination]
            if not candidates:
                await asyncio.sleep(HANDOFF_RETRY_S)
                continue
            index = pool.router.choose(candidates, None).replica
            replica = pool.replicas[index]
            leg = _Leg(DECODE, index, replica.instance_id)
            pool.router.assign(index, [RoutedRequest(request_id, 0, remaining_tokens)])
            try:
                prompt_text = self._prompt_texts[request_id]
                answer = await hand_off(replica.actor, exported, state_ref, prompt_text)
            except ray.exceptions.RayActorError as err:  # died before taking it: retry
                pool.router.finish(request_id)
                pool.replica_failed(index, leg.instance_id, err)
                why = f"decode replica {index} failed: {type(err).__name__}"
                if exported.destination is not None:
                    return self._lost(exported, why)
                await asyncio.sleep(HANDOFF_RETRY_S)  # the state is kept for the next try
                continue
            except ray.exceptions.RayError as err:
                pool.router.finish(request_id)
                self._in_flight.discard(request_id)
                self._fail([request_id], leg, f"{type(err).__name__}: {err}", replica_down=False)
                return False
            if isinstance(answer, Rejected) and answer.kind == "KVTransportError":
                pool.router.finish(request_id)
                pool.fall_back(f"decode replica {index}: {answer.message}")
                why = f"receiving its K/V failed: {answer.message}"
                return self._lost(exported, why, replica_down=False)
            if isinstance(answer, Rejected):
                pool.router.finish(request_id)
                error = answer.error()
                if isinstance(error, QueueFullError | EngineNotReadyError | EngineDeadError):
                    why = f"decode replica {index}: {error}"
                    await asyncio.sleep(HANDOFF_RETRY_S)
                    continue
                self._in_flight.discard(request_id)
                self._queue.put_nowait(error)
                return False
            assert isinstance(answer, Accepted), answer
            replica.num_handoffs += 1
            self._in_flight.discard(request_id)
            self._legs[request_id] = leg
            self.decode_replicas[request_id] = index
            return True

    def _lost(self, exported: Exported, why: str, *, replica_down: bool = True) -> bool:
        """A descriptor's K/V cannot reach a decode replica any more: fail the request."""
        request_id = exported.request_id
        self._in_flight.discard(request_id)
        self._aborting.discard(request_id)
        if not self._closed and request_id in self._unfinished:
            leg = _Leg(DECODE, exported.destination, None)  # type: ignore[arg-type]
            self._fail([request_id], leg, f"hand-off lost: {why}", replica_down=replica_down)
        return False

    async def _stream_taken(self, request_id: str) -> None:
        """Stream the outputs of a request a decode replica accepted (abort it there if the
        stream was closed or the request aborted while it was in flight)."""
        leg = self._legs.get(request_id)
        if leg is None:  # failed meanwhile (the stream already ended with an error)
            return
        replica = self.owner.replicas[leg.replica]
        if self._closed:
            replica.actor.abort.remote([request_id])
            return
        abort = request_id in self._aborting  # aborted in flight: its final output comes next
        self._aborting.discard(request_id)
        generator = replica.actor.decode_stream.remote(request_id, abort)
        await self._pump_decode(generator, leg, request_id)

    async def _pump_decode(self, generator: Any, leg: _Leg, request_id: str) -> None:
        import ray

        while True:
            try:
                item = await (await generator.__anext__())
            except StopAsyncIteration:
                if request_id not in self._ended:  # a bug: never leave the consumer waiting
                    self._decode_failed(leg, request_id, "stream ended early", False)
                return
            except ray.exceptions.RayActorError as err:
                self._decode_failed(leg, request_id, f"{type(err).__name__}: {err}", True)
                return
            except ray.exceptions.RayError as err:
                self._decode_failed(leg, request_id, f"{type(err).__name__}: {err}", False)
                return
            if isinstance(item, EngineFailed):
                self._decode_failed(leg, request_id, item.message, True)
                return
            self._put(item)

    def _put(self, output: RequestOutput) -> None:
        # Outstanding work is counted as outputs arrive (not as they are consumed), so it
        # is charged to the replica that produced them, before a hand-off moves the request.
        self.owner.router.progress(output.request_id, len(output.new_token_ids))
        if output.finished:
            self._ended.add(output.request_id)
        self._queue.put_nowait(output)

    def _decode_failed(self, leg: _Leg, request_id: str, why: str, replica_down: bool) -> None:
        # After the consumer left, a failure may be the abort racing the stream; the probe
        # notices real deaths.
        if self._closed or request_id not in self._unfinished:
            return
        if replica_down:
            self.owner.replica_failed(leg.replica, leg.instance_id, why)
        self._legs.pop(request_id, None)
        self._fail([request_id], leg, why, replica_down=replica_down)

    def _fail(
        self, request_ids: list[str], leg: _Leg | None, why: str, *, replica_down: bool
    ) -> None:
        """End the stream with `ReplicaFailedError` (the consumer raises it)."""
        for request_id in request_ids:
            self._legs.pop(request_id, None)
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

    def __aiter__(self) -> PDStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._closed or not self._unfinished:
                raise StopAsyncIteration
            try:
                item = await self._queue.get()
            except asyncio.CancelledError:
                self.close()
                raise
            if isinstance(item, BaseException):
                self.owner.metrics.finished.labels(finish_reason="error").inc(len(self._unfinished))
                self._abort_where_they_are(sorted(self._unfinished))
                self._unfinished.clear()
                self.close()
                raise item
            if item.request_id in self._unfinished:
                return self._deliver(item)

    def _deliver(self, output: RequestOutput) -> RequestOutput:
        self.delivered_any = True
        if output.finished:
            self.owner.router.finish(output.request_id)
            self.owner.metrics.observe_finished(output)
            self._unfinished.discard(output.request_id)
            if not self._unfinished:
                self.close()
        return output

    def _release_routing(self) -> None:
        for request_id in self.request_ids:
            self.owner.router.finish(request_id)

    def _abort_where_they_are(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            leg = self._legs.get(request_id)
            if leg is not None:
                by_replica.setdefault(leg.replica, []).append(request_id)
            elif request_id in self._in_flight:
                self._aborting.add(request_id)
        for index, ids in by_replica.items():
            self.owner.replicas[index].actor.abort.remote(ids)

    def abort_unfinished(self, request_ids: list[str] | None = None) -> None:
        """Abort (some of) this stream's unfinished requests where they are; their final
        outputs (finish reason "abort") still arrive through the stream."""
        ids = self._unfinished if request_ids is None else self._unfinished & set(request_ids)
        self._abort_where_they_are(sorted(ids))

    def close(self) -> None:
        """Abort what has not finished and release the in-flight slots; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._unfinished:
            self._abort_where_they_are(sorted(self._unfinished))
            self.owner.metrics.finished.labels(finish_reason="abort").inc(len(self._unfinished))
        self._release_routing()
        self.owner._on_stream_closed(self)  # type: ignore[arg-type]

    def __enter__(self) -> PDStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
