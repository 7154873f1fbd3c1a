"""The hand-off and decode leg of a `PDStream`: moving each exported request to a decode
replica and streaming its outputs from there.

`HandOffs` is an object the `PDStream` (pd_stream.py) owns, with explicit inputs: the pool
(`PDStreamOwner`), the submission's `PDRequests` (where each request runs, which ended, the
torch transport's destinations, prompt texts and token budgets), two questions about the
stream (is the request still wanted, is the stream closed) and the stream's callbacks (put an
output, fail requests, raise an error to the consumer, guard a background leg). It owns the
hand-off bookkeeping itself: the requests in flight between replicas and those aborted while
in flight. The prefill leg calls `on_exported` for each `Exported` item. Per exported request:

- `hand_off` (the one function that moves a state) asks a decode replica to import it; a
  replica that refuses for now (queue full, shutting down) or dies before taking it is retried,
  on any serving decode replica, for up to `HANDOFF_WAIT_S` (every `HANDOFF_RETRY_S`); a
  permanent rejection fails the request;
- with the torch KV transport (`Exported.destination` set) only that destination can import
  it: its death or a transport failure loses the K/V (`ReplicaFailedError`, and the pool falls
  back to the object store), and a descriptor that does not end accepted is dropped on its
  destination (`drop_handoff`) so the pair's order holds;
- once accepted, `decode_stream` on that replica feeds the stream's queue; its death ends the
  request with `ReplicaFailedError`. A request aborted while in flight is aborted right after
  its acceptance.

Streamed hand-offs (`--kv-handoff stream`, `StreamedKV` in pd_kv_stream.py): chunks go to the
decode replica that reserved the request's blocks before its prompt ran; the final hand-off
(`Exported.first_block` > 0) goes there once every chunk write succeeded. If a write failed,
or that replica dies or stops serving before taking it, the request is reserved again on a
serving decode replica and the kept chunks and the final hand-off are replayed there, for up
to `HANDOFF_WAIT_S`; a request that will not be imported where it is reserved (it ended on its
prefill replica, was aborted, failed, or moves whole) releases its reservation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loopserve.distributed.pd_kv_stream import (
    DECODE,
    REPLAYED,
    SKIPPED_BLOCKS_LOST,
    StreamedKV,
)
from loopserve.distributed.placement import PDStreamOwner
from loopserve.distributed.replica_messages import (
    Accepted,
    ChunkSent,
    EngineFailed,
    Exported,
    Rejected,
)
from loopserve.distributed.router import RoutedRequest
from loopserve.engine.async_llm import EngineDeadError, EngineNotReadyError, QueueFullError
from loopserve.outputs import RequestOutput

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)
PREFILL = "prefill"
REPLAY = "replay"  # `_take_over`: the replica holding a streamed K/V failed
HANDOFF_WAIT_S = 30.0  # how long an exported request may wait for a decode replica to take it
HANDOFF_RETRY_S = 0.05


def hand_off(decode_actor: Any, exported: Exported, state_ref: Any, prompt_text: str | None) -> Any:
    """Move one exported request to a decode replica; returns the reference of its answer
    (`Accepted` or `Rejected`). The decode replica's worker fetches the state from Ray's
    object store, never through this process: with its K/V inside, or (torch transport,
    `exported.destination` set) a descriptor whose K/V the replica receives point to point."""
    return decode_actor.import_handoff.remote(state_ref, prompt_text, exported.clock_offset_s)


@dataclass(frozen=True, slots=True)
class Leg:
    """Where a request runs: a replica (by role and index) and that replica's instance."""

    role: str
    replica: int
    instance_id: str | None


@dataclass
class PDRequests:
    """What the legs of one PD submission share about its requests (owned by the stream)."""

    max_tokens: dict[str, int]
    prompt_texts: dict[str, str | None]
    legs: dict[str, Leg] = field(default_factory=dict)  # on a replica (absent: not yet / moving)
    ended: set[str] = field(default_factory=set)  # final output queued
    destinations: dict[str, int] = field(default_factory=dict)  # torch transport: decode rank
    decode_replicas: dict[str, int] = field(default_factory=dict)  # request id -> its decode


class HandOffs:
    """The hand-off and decode legs of one `PDStream`'s requests; see the module docstring."""

    def __init__(
        self,
        owner: PDStreamOwner,
        requests: PDRequests,
        *,
        wanted: Callable[[str], bool],
        closed: Callable[[], bool],
        put: Callable[[RequestOutput], None],
        fail: Callable[..., None],  # (request_ids, leg, why, *, replica_down)
        raise_error: Callable[[BaseException], None],
        guarded: Callable[[Coroutine[Any, Any, None]], Coroutine[Any, Any, None]],
    ) -> None:
        self.owner = owner
        self.requests = requests
        self._wanted = wanted
        self._closed = closed
        self._put = put
        self._fail = fail
        self._raise = raise_error
        self._guarded = guarded
        self.kv_stream = StreamedKV(owner)  # streamed hand-offs' reservations and chunks
        self.in_flight: set[str] = set()  # exported, not yet taken by a decode replica
        self.aborting: set[str] = set()  # in flight when aborted: abort once taken

    def on_exported(self, exported: Exported, state_ref: Any, leg: Leg) -> None:
        pool = self.owner
        request_id = exported.request_id
        pool.replicas[leg.replica].num_handoffs += 1
        pool.router.finish(request_id)
        self.requests.legs.pop(request_id, None)
        if exported.destination is None and request_id in self.requests.destinations:
            pool.fall_back(f"prefill replica {leg.replica} could not send {request_id!r}")
        if self._closed() or not self._wanted(request_id):
            # Aborted meanwhile: dropping the reference frees the state (a descriptor is
            # dropped on its destination).
            self._drop(exported, state_ref)
            return
        if exported.first_block == 0:
            self.release(request_id)  # moves whole
        self.in_flight.add(request_id)
        remaining = max(0, self.requests.max_tokens[request_id] - exported.num_output_tokens)
        pool.spawn(self._guarded(self._hand_off(exported, state_ref, remaining)))

    # ---- streamed hand-offs (pd_kv_stream.py) --------------------------------------------

    def on_chunk(self, sent: ChunkSent, chunk_ref: Any) -> None:
        if sent.destination is None and (self._closed() or not self._wanted(sent.request_id)):
            return  # (a point-to-point chunk must still reach its destination)
        self.kv_stream.on_chunk(sent, chunk_ref)

    def release(self, request_id: str) -> None:
        """The request will not be imported where its K/V streams (see `StreamedKV`)."""
        self.kv_stream.release(request_id)

    async def _hand_off_streamed(
        self, exported: Exported, state_ref: Any, remaining_tokens: int
    ) -> bool:
        """Hand off a request whose K/V streamed: to the reserving replica once its chunks are
        written there, else replayed to a serving decode replica (`StreamedKV.replay`), for
        up to `HANDOFF_WAIT_S`."""
        request_id = exported.request_id
        if exported.destination is not None:  # chunks went point to point: there or nowhere
            if await self.kv_stream.ready(request_id) != exported.destination:
                return self._lost(exported, "its K/V chunks did not reach its decode replica")
            return await self._take_over(exported, state_ref, remaining_tokens) is True
        deadline_s = time.monotonic() + HANDOFF_WAIT_S
        while True:
            if await self.kv_stream.ready(request_id) is not None:
                taken = await self._take_over(exported, state_ref, remaining_tokens, deadline_s)
                if taken is not REPLAY:
                    return bool(taken)
            while True:  # the reserving replica failed (or a write there): replay
                if self._closed():
                    self.in_flight.discard(request_id)
                    return False
                if time.monotonic() > deadline_s:
                    self.in_flight.discard(request_id)
                    why = "hand-off failed: no decode replica could take its streamed K/V"
                    self._fail([request_id], None, why, replica_down=True)
                    return False
                outcome = await self.kv_stream.replay(request_id)
                if outcome == REPLAYED:
                    break
                if outcome == SKIPPED_BLOCKS_LOST:
                    why = "the serving decode replicas lack prompt blocks its stream skipped"
                    return self._lost(exported, why)
                await asyncio.sleep(HANDOFF_RETRY_S)

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
            if exported.first_block:
                accepted = await self._hand_off_streamed(exported, state_ref, remaining_tokens)
            else:
                accepted = await self._take_over(exported, state_ref, remaining_tokens) is True
        finally:
            if not accepted:
                self._drop(exported, state_ref)
                self.release(exported.request_id)
        del state_ref  # taken: the decode replica holds the request (and Ray frees the state)
        if accepted:
            await self._stream_taken(exported.request_id)

    async def _take_over(
        self,
        exported: Exported,
        state_ref: Any,
        remaining_tokens: int,
        deadline_s: float | None = None,
    ) -> bool | str:
        """Get the exported request taken by a decode replica; True once one accepted it
        (then `_stream_taken` follows), False when the request ended otherwise, `REPLAY` when
        the replica holding its streamed K/V failed."""
        import ray

        pool = self.owner
        request_id = exported.request_id
        if deadline_s is None:
            deadline_s = time.monotonic() + HANDOFF_WAIT_S
        why = "no decode replica is serving"
        while True:
            if self._closed():
                self.in_flight.discard(request_id)
                return False
            if time.monotonic() > deadline_s:
                self.in_flight.discard(request_id)
                self._fail([request_id], None, f"hand-off failed: {why}", replica_down=True)
                return False
            candidates = pool.serving_of(DECODE)
            required = self._required(exported)
            if required is not None:  # its K/V went there: no other replica
                if required not in candidates:
                    return self._required_failed(exported, "its decode replica stopped serving")
                candidates = [required]
            if not candidates:
                await asyncio.sleep(HANDOFF_RETRY_S)
                continue
            index = pool.router.choose(candidates, None).replica
            replica = pool.replicas[index]
            leg = Leg(DECODE, index, replica.instance_id)
            pool.router.assign(index, [RoutedRequest(request_id, 0, remaining_tokens)])
            try:
                prompt_text = self.requests.prompt_texts[request_id]
                answer = await hand_off(replica.actor, exported, state_ref, prompt_text)
            except ray.exceptions.RayActorError as err:  # died before taking it: retry
                pool.router.finish(request_id)
                pool.replica_failed(index, leg.instance_id, err)
                why = f"decode replica {index} failed: {type(err).__name__}"
                if required is not None:
                    return self._required_failed(exported, why)
                await asyncio.sleep(HANDOFF_RETRY_S)  # the state is kept for the next try
                continue
            except ray.exceptions.RayError as err:
                pool.router.finish(request_id)
                self.in_flight.discard(request_id)
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
                self.in_flight.discard(request_id)
                self._raise(error)
                return False
            assert isinstance(answer, Accepted), answer
            self.kv_stream.taken(request_id)
            replica.num_handoffs += 1
            self.in_flight.discard(request_id)
            self.requests.legs[request_id] = leg
            self.requests.decode_replicas[request_id] = index
            return True

    def _required(self, exported: Exported) -> int | None:
        """The one decode replica that can import this hand-off (its K/V, or the streamed
        part of it, went there), or None: any."""
        if exported.destination is not None:
            return exported.destination
        if exported.first_block:
            return self.kv_stream.reserved.get(exported.request_id, -1)  # -1: not reserved
        return None

    def _required_failed(self, exported: Exported, why: str) -> bool | str:
        """The replica that alone could import the hand-off is gone: a streamed one is
        replayed elsewhere, a point-to-point one is lost."""
        if exported.destination is None:
            return REPLAY
        return self._lost(exported, why)

    def _lost(self, exported: Exported, why: str, *, replica_down: bool = True) -> bool:
        """Its K/V (or a streamed part of it) cannot reach a decode replica any more: fail the
        request."""
        request_id = exported.request_id
        self.in_flight.discard(request_id)
        self.aborting.discard(request_id)
        if not self._closed() and self._wanted(request_id):
            where = exported.destination
            if where is None:
                where = self.kv_stream.streamed_to[request_id]
            leg = Leg(DECODE, where, None)
            self._fail([request_id], leg, f"hand-off lost: {why}", replica_down=replica_down)
        return False

    async def _stream_taken(self, request_id: str) -> None:
        """Stream the outputs of a request a decode replica accepted (abort it there if the
        stream was closed or the request aborted while it was in flight)."""
        leg = self.requests.legs.get(request_id)
        if leg is None:  # failed meanwhile (the stream already ended with an error)
            return
        replica = self.owner.replicas[leg.replica]
        if self._closed():
            replica.actor.abort.remote([request_id])
            return
        abort = request_id in self.aborting  # aborted in flight: its final output comes next
        self.aborting.discard(request_id)
        generator = replica.actor.decode_stream.remote(request_id, abort)
        await self._pump_decode(generator, leg, request_id)

    async def _pump_decode(self, generator: Any, leg: Leg, request_id: str) -> None:
        import ray

        while True:
            try:
                item = await (await generator.__anext__())
            except StopAsyncIteration:
                if request_id not in self.requests.ended:  # a bug: never leave the consumer waiting
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

    def _decode_failed(self, leg: Leg, request_id: str, why: str, replica_down: bool) -> None:
        # After the consumer left, a failure may be the abort racing the stream; the probe
        # notices real deaths.
        if self._closed() or not self._wanted(request_id):
            return
        if replica_down:
            self.owner.replica_failed(leg.replica, leg.instance_id, why)
        self.requests.legs.pop(request_id, None)
        self._fail([request_id], leg, why, replica_down=replica_down)
