"""`EngineReplica`: one engine replica, run as a Ray actor by `ReplicaPool`.

The class is plain Python (no Ray import), so this module loads without Ray; the pool wraps it
with `ray.remote`. Inside the actor process it owns an `LLMEngine` driven by an `AsyncLLM`
(the same engine thread the single-engine server uses) and exposes async methods:

- `generate(requests)`: an async generator, consumed by the pool as a Ray streaming generator.
  It first yields `Accepted`, or one `Rejected` carrying the submission's error (invalid,
  capacity, queue full, not ready), then each `RequestOutput` as the engine produces it, and
  ends when every request finished. If the engine dies underneath it yields `EngineFailed`.
- `abort(request_ids)`: abort requests (client disconnects, shutdown).
- `generate_batch(...)`: the offline loop over a share of `LLM.generate`'s batch (a replica
  used offline never starts its `AsyncLLM`).
- `prefill(requests, destinations)`, `import_handoff(state, prompt_text)`,
  `decode_stream(request_id)`, `drop_handoff(item)`: the serving prefill/decode roles
  (`PDReplicaPool`). `prefill` streams like `generate`, but each request's part ends once it
  is handed off (normally after its first token): `Exported`, then, as the next item, its
  `HandoffState` (a separate object, so the pool passes its reference on without fetching the
  K/V); a request that finishes first never hands off. With a torch KV transport and a
  destination rank for the request (`destinations`), the K/V goes out with `send` and the
  next item is the `KVDescriptor` instead (`Exported.destination` says so); if the transport
  refuses, the full state as before. `import_handoff` takes one `HandoffState` or
  `KVDescriptor` (`Accepted` or `Rejected`; a descriptor is received in send order per source
  through `HandoffInbox`, which keeps a received state for a retried import after a
  rejection); `decode_stream` then streams that request's further outputs; `drop_handoff`
  receives and drops the K/V of a descriptor that will not be imported (an aborted request),
  so later hand-offs from that source still pair up.
- `prefill_export(...)` / `decode_import(*batches)`: the offline prefill/decode
  disaggregation roles (`DisaggregatedEngines`): prompt and first token on one replica, the
  exported `HandoffState`s through the replica's KV transport (`kv_transport`: Ray's object
  store by default, or torch.distributed point to point), decode on another.
- `setup_kv_transport` / `kv_transport_stats` / `flush_kv_transport` / `close_kv_transport`
  / `discard_handoffs`: the replica's end of `loopserve.distributed.transport` (the driver
  calls them through `connect_kv_transport` and `KVTransportGroup`).
- `info()`: what the serving layer reads from an engine (tokenizer, context length, KV size).
- `stats()`: gauges for routing metrics and health, plus this actor instance's id, so the pool
  notices a restart.

The engine is built in `__init__`, so a model that fails to load fails the actor's creation.
This module does not route, retry or restart; the pool does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from loopserve.distributed.handoff import HandoffState
from loopserve.distributed.handoff_order import HandoffInbox
from loopserve.distributed.transport import (
    KVDescriptor,
    KVTransport,
    KVTransportError,
    RayObjectStoreTransport,
    TorchDistSpec,
    TransportStats,
    free_rendezvous_address,
    make_kv_transport,
)
from loopserve.errors import CapacityError, InvalidRequestError, LoopserveError
from loopserve.outputs import RequestOutput
from loopserve.sampling_params import SamplingParams
from loopserve.server.async_engine import (
    AsyncLLM,
    EngineDeadError,
    EngineNotReadyError,
    EngineSnapshot,
    GenerateRequest,
    OutputStream,
    QueueFullError,
)

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """What the serving layer reads from an engine, fetched once per replica."""

    tokenizer: Any  # loopserve.text.tokenizer.Tokenizer | None (pickled)
    max_model_len: int
    num_loops: int
    block_size: int
    kv_positions_per_request_max: int
    config: Any  # the engine's resolved EngineConfig
    input_processor: Any  # loopserve.text.input_processor.InputProcessor (pickled)


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    instance_id: str  # new for every actor (re)start
    is_ready: bool
    is_dead: bool
    num_in_flight: int
    snapshot: EngineSnapshot
    num_exported: int = 0  # requests handed off to a decode replica (prefill role)
    num_imported: int = 0  # requests taken over from a prefill replica (decode role)
    kv_bytes_sent: int = 0  # K/V bytes the replica's KV transport sent (completed sends)
    kv_bytes_received: int = 0  # ... and received (imported or discarded)


class EngineReplica:
    """See the module docstring. `torch_threads` sets torch's intra-op threads (CPU)."""

    def __init__(
        self,
        engine_args: dict[str, object],
        *,
        torch_threads: int | None = None,
        max_pending_requests: int = 1024,
    ) -> None:
        import torch

        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        from loopserve.engine.llm_engine import LLMEngine

        self.instance_id = uuid.uuid4().hex
        self.engine = LLMEngine.from_engine_args(**engine_args)
        self._max_pending_requests = max_pending_requests
        self._llm: AsyncLLM | None = None
        self.kv_transport: KVTransport = RayObjectStoreTransport(rank=0)
        self._num_exported = 0
        self._num_imported = 0
        self._imported: dict[str, OutputStream] = {}  # imported, `decode_stream` not called yet
        self._inbox: HandoffInbox | None = None  # point-to-point hand-offs (decode role)

    def _started(self) -> AsyncLLM:
        """The `AsyncLLM`, started on first use (it needs the actor's running event loop)."""
        if self._llm is None:
            self._llm = AsyncLLM(self.engine, max_pending_requests=self._max_pending_requests)
            self._llm.start()
        return self._llm

    async def info(self) -> ReplicaInfo:
        engine = self.engine
        return ReplicaInfo(
            tokenizer=engine.tokenizer,
            max_model_len=engine.max_model_len,
            num_loops=engine.num_loops,
            block_size=engine.config.cache.block_size,
            kv_positions_per_request_max=engine.stats.kv_positions_per_request_max,
            config=engine.config,
            input_processor=engine.input_processor,
        )

    async def stats(self) -> ReplicaStats:
        llm = self._started()
        await llm.wait_ready(timeout_s=0.0)
        transport = self.kv_transport.stats()
        return ReplicaStats(
            self.instance_id,
            llm.is_ready,
            llm.is_dead,
            llm.num_in_flight,
            llm.snapshot,
            num_exported=self._num_exported,
            num_imported=self._num_imported,
            kv_bytes_sent=transport.bytes_sent,
            kv_bytes_received=transport.bytes_received,
        )

    async def generate(
        self, requests: Sequence[GenerateRequest]
    ) -> AsyncIterator[Accepted | Rejected | EngineFailed | RequestOutput]:
        llm = self._started()
        await llm.wait_ready()
        try:
            stream = await llm.submit(requests)
        except LoopserveError as err:
            yield Rejected.of(err)
            return
        yield Accepted()
        async with contextlib.aclosing(_relay(stream)) as items:
            async for item in items:
                yield item

    async def prefill(
        self, requests: Sequence[GenerateRequest], destinations: dict[str, int] | None = None
    ) -> AsyncIterator[
        Accepted | Rejected | EngineFailed | RequestOutput | Exported | HandoffState | KVDescriptor
    ]:
        """As `generate`, but each request is handed off once it can be (see the module
        docstring): `Exported`, then its `HandoffState` (or, sent to `destinations[id]` by the
        torch transport, its `KVDescriptor`), end its part of the stream."""
        llm = self._started()
        await llm.wait_ready()
        try:
            stream = await llm.submit(requests, export=True)
        except LoopserveError as err:
            yield Rejected.of(err)
            return
        yield Accepted()
        async with contextlib.aclosing(_relay(stream)) as items:
            async for item in items:
                if isinstance(item, HandoffState):
                    self._num_exported += 1
                    offset_s = time.time() - time.monotonic()
                    sent = self._send(item, (destinations or {}).get(item.request_id))
                    destination = sent.dst_rank if isinstance(sent, KVDescriptor) else None
                    num_tokens = len(item.output_token_ids)
                    yield Exported(item.request_id, num_tokens, offset_s, destination)
                    yield sent
                else:
                    yield item

    def _send(self, state: HandoffState, destination: int | None) -> HandoffState | KVDescriptor:
        """The torch transport's descriptor of `state` sent to `destination`, or `state` as
        is (its K/V through the object store) without a destination, without a torch
        transport, or when the transport refuses (it failed: the pool falls back)."""
        if destination is None or self.kv_transport.kind != "torch":
            return state
        try:
            return self.kv_transport.send(state, destination)
        except KVTransportError as err:
            logger.error("hand-off %r goes by the object store: %s", state.request_id, err)
            return state

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
        self._imported[state.request_id] = stream
        self._num_imported += 1
        return Accepted()

    async def drop_handoff(self, item: HandoffState | KVDescriptor) -> str | None:
        """A hand-off that will not be imported (its request was aborted in flight): a
        descriptor's K/V is received and dropped in its turn, so later hand-offs from the same
        source still pair up; a state with its K/V needs nothing. Returns the transport's
        error message if that failed (then the pool falls back), else None."""
        if not isinstance(item, KVDescriptor):
            return None
        if self.kv_transport.kind != "torch":
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
        stream = self._imported.pop(request_id, None)
        if stream is None:
            yield EngineFailed(f"request {request_id!r} is not on this replica (restarted?)")
            return
        if abort:
            self._started().abort(request_id)
        async with contextlib.aclosing(_relay(stream)) as items:
            async for item in items:
                yield item

    def generate_batch(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[str | list[int]],
        params: Sequence[SamplingParams],
    ) -> list[RequestOutput] | Rejected:
        """The offline loop (`LLM.generate`) over this replica's share of a batch: final outputs
        in the given order, or the first request's rejection (then nothing ran)."""
        engine = self.engine
        added = self._add_all(request_ids, prompts, params)
        if isinstance(added, Rejected):
            return added
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(added):
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[request_id] for request_id in added]

    def _add_all(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[str | list[int]],
        params: Sequence[SamplingParams],
    ) -> list[str] | Rejected:
        """Add a batch all or nothing: the ids added, or the first rejection (the requests
        added before it are aborted again)."""
        added: list[str] = []
        try:
            for request_id, prompt, sp in zip(request_ids, prompts, params):
                self.engine.add_request(request_id, prompt, sp)
                added.append(request_id)
        except LoopserveError as err:
            for request_id in added:
                self.engine.abort_request(request_id)
            return Rejected.of(err)
        return added

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

    def setup_kv_transport(self, kind: str, rank: int, spec: TorchDistSpec | None) -> None:
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

    async def abort(self, request_ids: list[str]) -> None:
        llm = self._started()
        for request_id in request_ids:
            imported = self._imported.pop(request_id, None)
            if imported is not None:  # nobody streams it yet: closing the stream aborts it
                imported.close()
            else:
                llm.abort(request_id)

    async def shutdown(self, timeout_s: float) -> None:
        if self._llm is not None:
            await self._llm.shutdown(timeout_s)


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


async def _relay(
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
