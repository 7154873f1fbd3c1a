"""`ReplicaPool`: N engine replicas on Ray behind the interface of one `AsyncLLM`.

The HTTP server uses a pool in place of its single `AsyncLLM` when `--data-parallel-size` is
above 1: the same `start` / `wait_ready` / `submit` (returning a stream of `RequestOutput`s) /
`abort` / `stop_accepting` / `shutdown`, the same errors, the same `metrics.render`. Each
replica is an `EngineReplica` Ray actor (one GPU each on CUDA, one CPU and a fixed number of
torch threads on CPU). Outputs flow back through Ray streaming generators; closing a stream
early (client disconnect) aborts its unfinished requests on their replica.

Routing is the `Router`'s (least outstanding tokens, or prompt prefix). Failure semantics:

- a replica whose actor dies (or whose engine dies) is marked restarting at once; no new
  submission goes to it;
- a submission none of whose outputs reached the consumer yet is re-submitted to another
  serving replica (at most `MAX_REROUTES` times), so requests that had not started are not lost;
- a submission that already delivered outputs ends with `ReplicaFailedError` (HTTP 503; a
  stream ends with an error event);
- Ray restarts the actor (`max_restarts`); a probe per replica notices the new instance once its
  engine is loaded and puts it back into rotation (its prefix table entries are dropped);
- `health()` is "ok" with every replica serving, "degraded" with some, and the pool is not
  ready with none. A replica whose restarts are exhausted stays "dead".

The first replica to finish loading failing (for example a bad checkpoint) is a load error
(`load_error`, `on_load_error`), as with `AsyncLLM`.

Composition: a pool is a `ReplicaSet` (pool_replicas.py: starting, probing, restarts,
health, given the pool's `Roles`), a `Router` (router.py) and `PoolMetrics`, owned here and
handed to the set as explicit inputs; this module is the submission side (admission limits,
tokenizing, streams, in-flight count, draining at shutdown, the engine view). One
submission's stream is a `PoolStream` (pool_stream.py, re-routing and the 503 live there; its
open step is placement.py's). `PDReplicaPool` (pd_pool.py, `--pd`) is this pool with prefill
and decode `PDRoles`, its own stream type and a KV transport that listens to the set's
failures and restarts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence

from loopserve.distributed.metrics import PoolMetrics, PoolSnapshot
from loopserve.distributed.pool_replicas import (
    DEFAULT_MAX_RESTARTS,
    PROBE_INTERVAL_S,
    PROBE_TIMEOUT_S,
    PoolConfig,
    ReplicaSet,
    ReplicaState,
    Roles,
    _Replica,
)
from loopserve.distributed.pool_stream import MAX_REROUTES, PoolStream, ReplicaFailedError
from loopserve.distributed.router import RoutedRequest, Router
from loopserve.engine.async_llm import (
    GenerateRequest,
    SubmitGenerate,
)
from loopserve.engine.client import EngineStream, ModelInfo, SubmissionGate, wait_ready
from loopserve.text.input_processor import ProcessedPrompt

__all__ = [
    "DEFAULT_MAX_RESTARTS",
    "MAX_REROUTES",
    "PROBE_INTERVAL_S",
    "PROBE_TIMEOUT_S",
    "PoolConfig",
    "PoolStream",
    "ReplicaFailedError",
    "ReplicaPool",
    "ReplicaSet",
    "ReplicaState",
    "Roles",
    "_Replica",
]
logger = logging.getLogger(__name__)
ABORT_GRACE_S = 2.0  # at shutdown, for aborted streams to end before the replicas stop


class ReplicaPool(SubmitGenerate):
    """N `EngineReplica` actors behind the `EngineClient` interface; see the module
    docstring. `stream_type` follows one submission (`PDReplicaPool` sets its own)."""

    stream_type: type[EngineStream] = PoolStream

    def __init__(
        self,
        engine_args: dict[str, object],
        config: PoolConfig,
        *,
        on_load_error: Callable[[BaseException], None] | None = None,
        roles: Roles | None = None,
    ) -> None:
        block_size = int(engine_args.get("block_size") or 16)  # type: ignore[arg-type]
        self.router = Router(config.num_replicas, config.routing, block_size=block_size)
        self.metrics = PoolMetrics()
        self.replica_set = ReplicaSet(
            engine_args,
            config,
            router=self.router,
            metrics=self.metrics,
            roles=roles or Roles(),
            on_load_error=on_load_error,
        )
        self.engine_args = self.replica_set.engine_args
        self.config = config
        self.gate = SubmissionGate(config.max_pending_requests)
        self._streams: set[PoolStream] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start_task: asyncio.Task[None] | None = None

    # ---- state --------------------------------------------------------------------------

    @property
    def replicas(self) -> list[_Replica]:
        return self.replica_set.replicas

    @property
    def num_replicas(self) -> int:
        return self.replica_set.num_replicas

    @property
    def info(self) -> ModelInfo | None:
        return self.replica_set.info

    @property
    def load_error(self) -> BaseException | None:
        return self.replica_set.load_error

    @property
    def is_ready(self) -> bool:
        return self.replica_set.is_ready

    @property
    def is_dead(self) -> bool:
        return self.replica_set.is_dead

    @property
    def snapshot(self) -> PoolSnapshot:
        return self.replica_set.snapshot

    def serving_replicas(self) -> list[int]:
        return self.replica_set.serving_replicas()

    def role_of(self, index: int) -> str | None:
        return self.replica_set.roles.role_of(index)

    def replica_failed(self, index: int, instance_id: str | None, why: object) -> None:
        self.replica_set.replica_failed(index, instance_id, why)

    def health(self) -> dict[str, object]:
        return self.replica_set.health()

    async def refresh_stats(self) -> None:
        await self.replica_set.refresh_stats()

    async def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Wait until the pool takes submissions; False if loading failed or timed out."""
        return await wait_ready(self, timeout_s)  # type: ignore[arg-type]

    async def wait_serving(self, num_replicas: int, timeout_s: float) -> bool:
        """Wait until `num_replicas` replicas serve; False on timeout."""
        return await self.replica_set.wait_serving(num_replicas, timeout_s)

    def check_usable(self) -> None:
        """Raise the engine errors of a pool that cannot take a submission now."""
        self.replica_set.check_usable()

    @property
    def is_accepting(self) -> bool:
        return self.gate.accepting

    @property
    def streams(self) -> list[PoolStream]:
        """The open streams (a copy)."""
        return list(self._streams)

    @property
    def num_in_flight(self) -> int:
        return self.gate.num_in_flight

    def model_info(self) -> ModelInfo:
        """What the serving layer reads from an engine (tokenizer, limits), from replica 0."""
        self.check_usable()
        assert self.info is not None
        return self.info

    def render_metrics(self) -> str:
        return self.metrics.render(
            self.snapshot, num_in_flight=self.num_in_flight, is_ready=self.is_ready
        )

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Start Ray (or join `ray_address`) and the replicas in the background; idempotent."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._start_task = asyncio.ensure_future(self._start())

    async def _start(self) -> None:
        await self.replica_set.start()

    def stop_accepting(self, *, abort_after_s: float | None = None) -> None:
        """As `AsyncLLM.stop_accepting`: refuse new submissions; optionally abort the rest
        `abort_after_s` from now."""
        self.gate.stop()
        if abort_after_s is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(
                self._loop.call_later, abort_after_s, self._abort_all_streams
            )

    def _abort_all_streams(self) -> None:
        for stream in list(self._streams):
            stream.abort_unfinished()

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, let in-flight requests finish until `timeout_s` after the first
        `stop_accepting`, abort the rest, stop the replicas and (if we started it) Ray."""
        self.stop_accepting()
        if not await self.gate.drain(timeout_s):
            logger.warning("aborting %d requests still in flight", self.gate.num_in_flight)
            self._abort_all_streams()
            await self.gate.drain(timeout_s + ABORT_GRACE_S)  # their "abort" outputs
        if self._start_task is not None:
            self._start_task.cancel()
        await self.replica_set.stop()

    # ---- requests -----------------------------------------------------------------------

    async def submit(self, requests: Sequence[GenerateRequest]) -> PoolStream:
        """Route `requests` (all to one replica) and return their output stream; errors as
        `AsyncLLM.submit`, raised before any output."""
        self.check_usable()
        self.gate.admit(len(requests))
        try:  # tokenized here (the server already did; in a worker thread otherwise), once:
            # routing needs the token ids and the replicas take the processed prompts as is.
            if not all(isinstance(r.prompt, ProcessedPrompt) for r in requests):
                requests = await asyncio.to_thread(self._processed, requests)
                self.check_usable()
        except BaseException:
            self.gate.release(len(requests))
            raise
        prompts = [r.prompt for r in requests]
        prompt_ids = prompts[0].token_ids if prompts else None
        routed = [
            RoutedRequest(r.request_id, len(p.token_ids), r.params.max_tokens)
            for r, p in zip(requests, prompts)
        ]
        stream = self.stream_type(self, list(requests), routed, prompt_ids)
        self._streams.add(stream)
        try:
            await stream.open(excluded=set())
        except BaseException:
            stream.close()
            raise
        return stream

    def abort(self, request_id: str) -> None:
        for stream in list(self._streams):
            if request_id in stream.request_ids:
                stream.abort_unfinished([request_id])

    def _processed(self, requests: Sequence[GenerateRequest]) -> list[GenerateRequest]:
        assert self.info is not None
        processor = self.info.input_processor
        return [
            r
            if isinstance(r.prompt, ProcessedPrompt)
            else dataclasses.replace(r, prompt=processor.process(r.prompt))
            for r in requests
        ]

    def on_stream_closed(self, stream: PoolStream) -> None:
        self._streams.discard(stream)
        self.gate.release(len(stream.request_ids))
