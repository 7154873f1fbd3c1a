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
- `reserve_imports`, `write_kv_chunk`, `release_imports`: a streamed
  hand-off's extra steps (replica_handoff.py says what each does).
- `prefill(requests, destinations, stream_to)`, `import_handoff(state, prompt_text)`,
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
This module does not route, retry or restart; the pool does. Rooms: this module is the actor
class and its plain generate/offline/abort methods; the prefill/decode and KV transport methods
delegate to its `ReplicaHandoff` (replica_handoff.py, a collaborator with explicit inputs);
the result and marker dataclasses (`Accepted`, `Rejected`, `EngineFailed`, `Exported`,
`ReplicaStats`) are replica_messages.py, re-exported here.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Sequence

from loopserve.distributed.replica_handoff import (
    MAX_SAME_CLOCK_SKEW_S,
    ReplicaHandoff,
    rebase_times,
)
from loopserve.distributed.replica_messages import (
    Accepted,
    EngineFailed,
    Exported,
    Rejected,
    ReplicaStats,
    relay,
)
from loopserve.distributed.transport import (
    KVDescriptor,
    NixlSpec,
    TorchDistSpec,
    TransportStats,
)
from loopserve.engine.async_llm import AsyncLLM, GenerateRequest
from loopserve.engine.client import ModelInfo
from loopserve.engine.handoff import HandoffState, KVChunk
from loopserve.errors import LoopserveError
from loopserve.outputs import RequestOutput
from loopserve.sampling_params import SamplingParams

__all__ = [
    "MAX_SAME_CLOCK_SKEW_S",
    "Accepted",
    "EngineFailed",
    "EngineReplica",
    "Exported",
    "Rejected",
    "ReplicaStats",
    "rebase_times",
]
logger = logging.getLogger(__name__)


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
        self.handoff = ReplicaHandoff(self.engine, started=self._started, add_all=self._add_all)

    def _started(self) -> AsyncLLM:
        """The `AsyncLLM`, started on first use (it needs the actor's running event loop)."""
        if self._llm is None:
            self._llm = AsyncLLM(
                self.engine, max_pending_requests=self._max_pending_requests, freeze_heap=True
            )  # a replica's process serves until the pool stops it
            self._llm.start()
        return self._llm

    async def info(self) -> ModelInfo:
        return ModelInfo.of(self.engine)

    async def stats(self) -> ReplicaStats:
        llm = self._started()
        await llm.wait_ready(timeout_s=0.0)
        handoff = self.handoff
        transport = handoff.kv_transport.stats()
        return ReplicaStats(
            self.instance_id,
            llm.is_ready,
            llm.is_dead,
            llm.num_in_flight,
            llm.snapshot,
            num_exported=handoff.num_exported,
            num_imported=handoff.num_imported,
            kv_bytes_sent=transport.bytes_sent,
            kv_bytes_received=transport.bytes_received,
            num_kv_chunks_sent=handoff.num_chunks_sent,
            num_kv_chunks_received=handoff.num_chunks_received,
            kv_chunk_blocks_received=handoff.chunk_blocks_received,
            num_streamed_imports=handoff.num_streamed_imports,
            num_kv_landed_device=self.engine.runner.handoff.num_landed_device,
            num_kv_landed_host=self.engine.runner.handoff.num_landed_host,
            num_reserved=len(self.engine.scheduler.admission.reserved),
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
        async with contextlib.aclosing(relay(stream)) as items:
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

    async def abort(self, request_ids: list[str]) -> None:
        llm = self._started()
        for request_id in request_ids:
            imported = self.handoff.imported.pop(request_id, None)
            if imported is not None:  # nobody streams it yet: closing the stream aborts it
                imported.close()
            else:
                llm.abort(request_id)

    async def shutdown(self, timeout_s: float) -> None:
        if self._llm is not None:
            await self._llm.shutdown(timeout_s)

    # ---- the prefill/decode roles and the KV transport: `ReplicaHandoff`'s ---------------------

    async def prefill(
        self,
        requests: Sequence[GenerateRequest],
        destinations: dict[str, int] | None = None,
        stream_to: dict[str, int] | None = None,
    ) -> AsyncIterator[object]:
        items = self.handoff.prefill(requests, destinations, stream_to)
        async with contextlib.aclosing(items) as items:
            async for item in items:
                yield item

    async def reserve_imports(self, requests: Sequence[GenerateRequest]) -> object:
        return await self.handoff.reserve_imports(requests)

    async def write_kv_chunk(self, chunk: KVChunk | KVDescriptor) -> int | Rejected:
        return await self.handoff.write_kv_chunk(chunk)

    async def release_imports(self, request_ids: list[str]) -> int:
        return await self.handoff.release_imports(request_ids)

    async def import_handoff(
        self,
        state: HandoffState | KVDescriptor,
        prompt_text: str | None,
        clock_offset_s: float | None = None,
    ) -> Accepted | Rejected:
        return await self.handoff.import_handoff(state, prompt_text, clock_offset_s)

    async def drop_handoff(self, item: HandoffState | KVDescriptor) -> str | None:
        return await self.handoff.drop_handoff(item)

    async def decode_stream(
        self, request_id: str, abort: bool = False
    ) -> AsyncIterator[EngineFailed | RequestOutput]:
        async with contextlib.aclosing(self.handoff.decode_stream(request_id, abort)) as items:
            async for item in items:
                yield item

    def prefill_export(self, request_ids, prompts, params, *, destination: int = 0):
        return self.handoff.prefill_export(request_ids, prompts, params, destination=destination)

    def decode_import(self, *batches) -> list[RequestOutput]:
        return self.handoff.decode_import(*batches)

    def kv_transport_address(self) -> str:
        return self.handoff.kv_transport_address()

    def setup_kv_transport(
        self, kind: str, rank: int, spec: TorchDistSpec | NixlSpec | None
    ) -> None:
        self.handoff.setup_kv_transport(kind, rank, spec)

    def kv_transport_stats(self) -> TransportStats:
        return self.handoff.kv_transport_stats()

    def flush_kv_transport(self, timeout_s: float) -> TransportStats:
        return self.handoff.flush_kv_transport(timeout_s)

    def close_kv_transport(self) -> None:
        self.handoff.close_kv_transport()

    def discard_handoffs(self, *batches) -> int:
        return self.handoff.discard_handoffs(*batches)
