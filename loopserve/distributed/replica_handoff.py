"""The prefill/decode roles of `EngineReplica`: hand-offs in serving and offline, and the
replica's end of the KV transport.

`ReplicaHandoff` is a collaborator the `EngineReplica` (replica.py) owns, with explicit
inputs: the replica's `LLMEngine`, a function that returns its `AsyncLLM` (started on first
use) and its all-or-nothing batch add; the replica's Ray methods of these roles delegate to
it. Its state (the KV transport endpoint, imported requests not streamed yet, the reorder
buffer, export/import counts) is this room's. What each method does is in replica.py's module
docstring; in short:

- serving (`PDReplicaPool`): `prefill` streams like `generate` but hands each request off
  (`Exported`, then its `HandoffState`, or a `KVDescriptor` when the torch transport sent the
  K/V); `import_handoff` takes one; `decode_stream` streams it on; `drop_handoff` receives and
  drops a descriptor's K/V that will not be imported;
- streamed hand-offs (`--kv-handoff stream`, engine/kv_stream.py): `reserve_imports` reserves
  a decode replica's blocks before the prompt runs, `prefill` yields `ChunkSent` and the
  `KVChunk` as prompt blocks complete, `write_kv_chunk` writes one into the reserved blocks,
  `release_imports` frees reservations whose request will not come;
- offline (`DisaggregatedEngines`): `prefill_export` / `decode_import`;
- the KV transport (`loopserve.distributed.transport`): `setup_kv_transport`,
  `kv_transport_stats`, `flush_kv_transport`, `close_kv_transport`, `discard_handoffs`.

`rebase_times` moves an imported request's times onto this machine's monotonic clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from loopserve.distributed.handoff_order import HandoffInbox
from loopserve.distributed.replica_messages import (
    Accepted,
    ChunkSent,
    EngineFailed,
    Exported,
    Rejected,
    relay,
)
from loopserve.distributed.torch_transport import make_kv_transport
from loopserve.distributed.transport import (
    POINT_TO_POINT,
    KVDescriptor,
    KVTransport,
    KVTransportError,
    NixlSpec,
    RayObjectStoreTransport,
    TorchDistSpec,
    TransportStats,
    free_rendezvous_address,
)
from loopserve.engine.async_llm import AsyncLLM, GenerateRequest, OutputStream
from loopserve.engine.handoff import HandoffState, KVChunk
from loopserve.errors import LoopserveError
from loopserve.outputs import RequestOutput
from loopserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class ReplicaHandoff:
    """The prefill/decode roles of one replica; see the module docstring."""

    def __init__(
        self,
        engine: Any,
        *,
        started: Callable[[], AsyncLLM],
        add_all: Callable[..., list[str] | Rejected],
    ) -> None:
        """`engine`: the replica's `LLMEngine`; `started()`: its `AsyncLLM`, started on first
        use; `add_all(request_ids, prompts, params)`: add a batch all or nothing."""
        self.engine = engine
        self._started = started
        self._add_all = add_all
        self.kv_transport: KVTransport = RayObjectStoreTransport(rank=0)
        self.num_exported = 0
        self.num_imported = 0
        self.num_chunks_sent = 0  # streamed hand-offs (prefill role)
        self.num_chunks_received = 0
        self.chunk_blocks_received = 0
        self.num_streamed_imports = 0
        self.imported: dict[str, OutputStream] = {}  # imported, `decode_stream` not called yet
        self._inbox: HandoffInbox | None = None  # point-to-point hand-offs (decode role)

    # ---- serving: prefill, hand-off, decode ---------------------------------------------

    async def prefill(
        self,
        requests: Sequence[GenerateRequest],
        destinations: dict[str, int] | None = None,
        stream_to: dict[str, int] | None = None,
    ) -> AsyncIterator[
        Accepted
        | Rejected
        | EngineFailed
        | RequestOutput
        | Exported
        | HandoffState
        | KVDescriptor
        | ChunkSent
        | KVChunk
    ]:
        """As `generate`, but each request is handed off once it can be (see the module
        docstring): `Exported`, then its `HandoffState` (or, sent to `destinations[id]` by the
        torch transport, its `KVDescriptor`), end its part of the stream. A request in
        `stream_to` (request -> blocks per plane its decode replica holds already) streams its
        K/V: `ChunkSent`, then the `KVChunk`, for each run of prompt blocks as it completes;
        its `HandoffState` then carries the rest (`Exported.first_block`)."""
        llm = self._started()
        await llm.wait_ready()
        try:
            # The torch transport sends device memory: keep the K/V there when it will be used.
            on_device = self.kv_transport.wants_device_kv and bool(destinations)
            stream = await llm.submit(
                requests, export=True, export_on_device=on_device, stream_kv=stream_to
            )
        except LoopserveError as err:
            yield Rejected.of(err)
            return
        yield Accepted()
        async with contextlib.aclosing(relay(stream)) as items:
            async for item in items:
                if isinstance(item, KVChunk):
                    self.num_chunks_sent += 1
                    sent = self._send(item, (destinations or {}).get(item.request_id))
                    destination = sent.dst_rank if isinstance(sent, KVDescriptor) else None
                    yield ChunkSent(
                        item.request_id, item.first_block, item.num_blocks, destination,
                        item.planes,
                    )  # fmt: skip
                    yield sent
                elif isinstance(item, HandoffState):
                    self.num_exported += 1
                    offset_s = time.time() - time.monotonic()
                    sent = self._send(item, (destinations or {}).get(item.request_id))
                    destination = sent.dst_rank if isinstance(sent, KVDescriptor) else None
                    num_tokens = len(item.output_token_ids)
                    yield Exported(
                        item.request_id, num_tokens, offset_s, destination, item.first_block
                    )
                    yield sent
                else:
                    yield item

    # ---- serving: the decode side of a streamed hand-off --------------------------------

    async def reserve_imports(
        self, requests: Sequence[GenerateRequest]
    ) -> list[int | None] | Rejected:
        """Reserve blocks for requests a prefill replica will stream here (one per request:
        the blocks per plane this replica's prefix cache holds already, which the sender
        skips, or None when it has no room now: that request's hand-off then moves whole)."""
        llm = self._started()
        await llm.wait_ready()
        processor = self.engine.input_processor
        try:
            processed = await asyncio.to_thread(
                lambda: [processor.process(r.prompt).token_ids for r in requests]  # type: ignore[arg-type]
            )

            def reserve(engine: Any) -> list[int | None]:
                skips: list[int | None] = []
                for request, token_ids in zip(requests, processed, strict=True):
                    try:
                        skips.append(
                            engine.reserve_import(request.request_id, token_ids, request.params)
                        )
                    except LoopserveError:  # (an id in use) it comes whole, or is refused then
                        skips.append(None)
                return skips

            skips = await llm.call(reserve)
        except LoopserveError as err:
            return Rejected.of(err)
        return skips

    async def write_kv_chunk(self, chunk: KVChunk | KVDescriptor) -> int | Rejected:
        """Write a streamed chunk into its reserved blocks; the blocks per plane written, or
        `Rejected` (no reservation: released meanwhile). A chunk sent point to point (its
        `KVDescriptor`) is received first, in its turn per source, also when its reservation
        is gone (so that later hand-offs from that source pair up); a transport failure is
        `Rejected` of kind "KVTransportError"."""
        llm = self._started()
        if isinstance(chunk, KVDescriptor):
            try:
                chunk = await self._handoff_inbox().receiver.take(chunk)
            except KVTransportError as err:
                return Rejected.of(err)
        chunk = await llm.land(chunk)  # off the engine thread (`AsyncLLM.land`)
        try:
            await llm.call(lambda engine: engine.write_kv_chunk(chunk))
        except LoopserveError as err:
            return Rejected.of(err)
        self.num_chunks_received += 1
        planes = self.engine.kv.num_planes if chunk.planes is None else len(chunk.planes)
        self.chunk_blocks_received += chunk.num_blocks * planes
        return chunk.num_blocks

    async def release_imports(self, request_ids: list[str]) -> int:
        """Free the reservations of requests that will not come (ended on their prefill
        replica, or it failed); how many there were."""
        llm = self._started()
        if llm.is_dead:
            return 0
        released = await llm.call(lambda engine: sum(engine.release_import(r) for r in request_ids))
        return int(released)

    def _send(
        self, state: HandoffState | KVChunk, destination: int | None
    ) -> HandoffState | KVChunk | KVDescriptor:
        """The point-to-point transport's descriptor of `state` sent to `destination`, or
        `state` as is (its K/V through the object store) without a destination, without a
        point-to-point transport, or when the transport refuses (it failed: the pool falls
        back)."""
        if destination is None or self.kv_transport.kind not in POINT_TO_POINT:
            return _on_host(state)
        try:
            return self.kv_transport.send(state, destination)  # type: ignore[arg-type]
        except KVTransportError as err:
            logger.error("hand-off %r goes by the object store: %s", state.request_id, err)
            return _on_host(state)

    async def import_handoff(
        self,
        state: HandoffState | KVDescriptor,
        prompt_text: str | None,
        clock_offset_s: float | None = None,
    ) -> Accepted | Rejected:
        """Import a request a prefill replica exported (`decode_stream` then streams it): it
        waits here, K/V staged, until this engine's KV cache has room. A plain call, not a
        stream, so Ray releases the state's object once it is imported. `clock_offset_s`: the
        exporter's (`Exported.clock_offset_s`), to rebase the request's times here. A
        `KVDescriptor` is received first (in send order per source); a transport failure is
        `Rejected` of kind "KVTransportError" (the K/V is lost)."""
        llm = self._started()
        await llm.wait_ready()
        inbox = None
        if isinstance(state, KVDescriptor):
            try:
                inbox = self._handoff_inbox()
                state = await inbox.take(state)
            except KVTransportError as err:
                return Rejected.of(err)
        state = rebase_times(state, clock_offset_s)
        try:
            stream = await llm.submit_import(state, prompt_text)
        except LoopserveError as err:  # a received state stays in the inbox for the retry
            return Rejected.of(err)
        if inbox is not None:
            inbox.imported(state.request_id)
        self.imported[state.request_id] = stream
        self.num_imported += 1
        self.num_streamed_imports += state.first_block > 0
        return Accepted()

    async def drop_handoff(self, item: HandoffState | KVDescriptor) -> str | None:
        """A hand-off that will not be imported (its request was aborted in flight): a
        descriptor's K/V is received and dropped in its turn, so later hand-offs from the same
        source still pair up; a state with its K/V needs nothing. Returns the transport's
        error message if that failed (then the pool falls back), else None."""
        if not isinstance(item, KVDescriptor):
            return None
        if self.kv_transport.kind not in POINT_TO_POINT:
            return None  # restarted since: the group is gone, nothing pairs up any more
        try:
            await self._handoff_inbox().drop(item)
        except KVTransportError as err:
            logger.error("dropping hand-off %r failed: %s", item.request_id, err)
            return str(err)
        return None

    def _handoff_inbox(self) -> HandoffInbox:
        if self._inbox is None:
            self._inbox = HandoffInbox(self.kv_transport)
        return self._inbox

    async def decode_stream(
        self, request_id: str, abort: bool = False
    ) -> AsyncIterator[EngineFailed | RequestOutput]:
        """The outputs of a request `import_handoff` took, as `generate` streams them;
        `EngineFailed` if this replica does not hold it (restarted since the import). `abort`:
        abort it now (its final output, reason "abort", still comes)."""
        stream = self.imported.pop(request_id, None)
        if stream is None:
            yield EngineFailed(f"request {request_id!r} is not on this replica (restarted?)")
            return
        if abort:
            self._started().abort(request_id)
        async with contextlib.aclosing(relay(stream)) as items:
            async for item in items:
                yield item

    # ---- offline disaggregation (DisaggregatedEngines) ----------------------------------

    def prefill_export(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[str | list[int]],
        params: Sequence[SamplingParams],
        *,
        destination: int = 0,
    ) -> tuple[int | Rejected, list[HandoffState | KVDescriptor | RequestOutput]]:
        """The offline prefill role: run each request's prompt and first token, then export
        it (`LLMEngine.export_request`) and send it with the KV transport to the replica of
        rank `destination`. A request that finished with its first token (a stop token, or
        `max_tokens=1`) returns its final `RequestOutput` instead. Returns (number of requests
        handed off, what `kv_transport.send` returned and the outputs, in the given order),
        or (the first request's rejection, []) when one is rejected (then nothing ran). Two
        values so that Ray can return them as two objects (`num_returns=2`): the caller reads
        the small one and passes the other on by reference. A transport that fails raises
        (`KVTransportError`): before any work when it failed earlier, else mid-batch, when the
        requests already exported are gone from this replica (the offline `generate` fails
        as a whole)."""
        engine = self.engine
        transport = self.kv_transport
        transport.check_usable()  # a broken transport fails the call before any work
        added = self._add_all(request_ids, prompts, params)
        if isinstance(added, Rejected):
            return added, []
        done: dict[str, HandoffState | KVDescriptor | RequestOutput] = {}
        while len(done) < len(added):
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = output
            for request_id in added:
                if request_id not in done and engine.can_export(request_id):
                    state = engine.export_request(request_id, to_host=not transport.wants_device_kv)
                    done[request_id] = transport.send(state, destination)
        items = [done[request_id] for request_id in added]
        return sum(not isinstance(item, RequestOutput) for item in items), items

    def decode_import(
        self, *batches: list[HandoffState | KVDescriptor | RequestOutput]
    ) -> list[RequestOutput]:
        """The offline decode role: receive every hand-off of `batches` (outputs of
        `prefill_export`, passed as Ray object refs) with the KV transport, import them and
        decode them to completion; final outputs (finished ones from the prefill side pass
        through) in the given order."""
        engine = self.engine
        items = [item for batch in batches for item in batch]
        finished: dict[str, RequestOutput] = {}
        handoffs = [item for item in items if not isinstance(item, RequestOutput)]
        for item in items:
            if isinstance(item, RequestOutput):
                finished[item.request_id] = item
        for state in self.kv_transport.receive_many(handoffs):
            engine.import_request(state)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[item.request_id] for item in items]

    # ---- KV transport (loopserve.distributed.transport) ---------------------------------

    def kv_transport_address(self) -> str:
        """A rendezvous address on this replica's node (called on rank 0)."""
        return free_rendezvous_address()

    def setup_kv_transport(
        self, kind: str, rank: int, spec: TorchDistSpec | NixlSpec | None
    ) -> None:
        """Replace this replica's endpoint (the previous one is closed); blocks until every
        rank of a torch group joined."""
        self.kv_transport.close()
        self._inbox = None
        self.kv_transport = make_kv_transport(kind, rank, spec)

    def kv_transport_stats(self) -> TransportStats:
        return self.kv_transport.stats()

    def flush_kv_transport(self, timeout_s: float) -> TransportStats:
        return self.kv_transport.flush(timeout_s)

    def close_kv_transport(self) -> None:
        """Close the endpoint; hand-offs go through the object store again."""
        self.kv_transport.close()
        self._inbox = None
        self.kv_transport = RayObjectStoreTransport(rank=0)

    def discard_handoffs(self, *batches: list[HandoffState | KVDescriptor]) -> int:
        """Receive and drop hand-offs that will not be imported (aborted before import), so
        that later ones from the same sender pair up; returns how many."""
        items = [item for batch in batches for item in batch]
        self.kv_transport.discard_many(items)
        return len(items)


MAX_SAME_CLOCK_SKEW_S = 1e-3  # two readings of one machine's clocks differ by less


def rebase_times(state: HandoffState, exporter_offset_s: float | None) -> HandoffState:
    """`state` with its times moved onto this process's monotonic clock, when the exporter's
    clock differs (another machine): through wall-clock time, so as exact as the two machines'
    wall clocks agree. On the same machine (offsets within `MAX_SAME_CLOCK_SKEW_S`) or without
    an offset, `state` as is."""
    if exporter_offset_s is None:
        return state
    shift_s = exporter_offset_s - (time.time() - time.monotonic())
    if abs(shift_s) < MAX_SAME_CLOCK_SKEW_S:
        return state

    def moved(t: float | None) -> float | None:
        return None if t is None else t + shift_s

    return dataclasses.replace(
        state,
        arrival_s=state.arrival_s + shift_s,
        first_scheduled_s=moved(state.first_scheduled_s),
        first_token_s=moved(state.first_token_s),
        token_times_s=[t + shift_s for t in state.token_times_s],
    )


def _on_host(state: HandoffState | KVChunk) -> HandoffState | KVChunk:
    """`state` with its K/V in host memory (the object store path), copied there if it was
    exported on a GPU for the torch transport."""
    kv = state.kv
    if getattr(kv, "is_cuda", False):
        return dataclasses.replace(state, kv=kv.cpu())  # type: ignore[union-attr]
    return state
