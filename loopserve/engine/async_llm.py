"""`AsyncLLM`: the asyncio face of the synchronous `LLMEngine`, for the HTTP server.

One dedicated `EngineThread` owns the engine and runs its loop, so model work never blocks the
event loop and the engine stays single-threaded. Coroutines never touch the engine: they queue
commands and read their outputs from per-submission asyncio queues that the thread feeds.

A submission (`submit`) adds one or more requests atomically — all are added or none, and a
rejection (`InvalidRequestError`, `CapacityError`, `QueueFullError`, `EngineNotReadyError`) is
raised before any output is read — and returns an `OutputStream`. Closing a stream early
(client disconnect, cancellation) aborts its unfinished requests so their KV blocks return to
the pool. If the engine thread dies, the engine is marked dead and every open stream raises
`EngineDeadError`. `shutdown` drains within a timeout, then aborts the rest.

For prefill/decode disaggregation (a Ray replica in the prefill or decode role),
`submit(..., export=True)` hands each request off once it can be exported (after its first
token): its stream then yields the request's `HandoffState` as its last item instead of further
outputs; `submit_import(state)` continues such a request here and streams its outputs. With
`stream_kv` the K/V leaves in `KVChunk`s before the state (engine/kv_stream.py), and `call`
runs the decode side's reservations and chunk writes on the engine thread.

This module does not speak HTTP; the serving modules map its errors to status codes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from loopserve.contracts import PendingHostKV
from loopserve.engine.client import (
    EngineStream,
    GenerateRequest,
    ModelInfo,
    SubmissionGate,
    wait_ready,
)
from loopserve.engine.engine_thread import (
    AbortCommand,
    AddCommand,
    CallCommand,
    EngineThread,
    ImportCommand,
    StopCommand,
)
from loopserve.engine.handoff import HandoffState, KVChunk
from loopserve.engine.metrics import ServingMetrics
from loopserve.engine.stats import EngineStats
from loopserve.errors import (
    EngineDeadError,
    EngineNotReadyError,
    QueueFullError,
)
from loopserve.outputs import RequestOutput
from loopserve.sampling_params import SamplingParams
from loopserve.text.input_processor import InputProcessor, ProcessedPrompt
from loopserve.text.tokenizer import Tokenizer

if TYPE_CHECKING:  # the engine (and torch) load lazily, so `loopserve --help` stays fast
    from loopserve.engine.llm_engine import LLMEngine

T = TypeVar("T")
Landable = TypeVar("Landable", HandoffState, KVChunk)
__all__ = [
    "AsyncLLM",
    "EngineDeadError",
    "EngineNotReadyError",
    "GenerateRequest",
    "OutputStream",
    "QueueFullError",
]
logger = logging.getLogger(__name__)


class OutputStream(EngineStream):
    """The outputs of one submission to an `AsyncLLM` (see `EngineStream`); the engine thread
    feeds its queue through `put`."""

    def __init__(self, owner: AsyncLLM, request_ids: list[str]) -> None:
        super().__init__(request_ids)
        self.owner = owner
        self._queue: asyncio.Queue[RequestOutput | HandoffState | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | HandoffState | BaseException) -> None:
        """Called on the event loop thread, on behalf of the engine thread."""
        self._queue.put_nowait(item)

    async def _next_item(self) -> RequestOutput | HandoffState:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, HandoffState | KVChunk) and isinstance(item.kv, PendingHostKV):
            # The engine thread exported it without waiting for its copy to host memory.
            kv = item.kv
            tensor = kv.tensor if kv.done is None else await asyncio.to_thread(kv.settled)
            item = dataclasses.replace(item, kv=tensor)
        return item

    def _closed_with(self, unfinished_ids: list[str]) -> None:
        self.owner._on_stream_closed(self, unfinished_ids)


class SubmitGenerate:
    """`generate` for any front end with `submit(requests) -> stream` (`AsyncLLM`, and the
    Ray replica pool that stands in for it)."""

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Submit one request (raising its validation errors now) and return its outputs."""
        stream = await self.submit([GenerateRequest(request_id, prompt, params)])

        async def outputs() -> AsyncIterator[RequestOutput]:
            with stream:
                async for output in stream:
                    yield output

        return outputs()


class AsyncLLM(SubmitGenerate):
    """Owns one `LLMEngine` and runs it in a background thread; see the module docstring.

    `engine` is either a built engine or a zero-argument factory called on the engine thread.
    `max_pending_requests` bounds the requests in flight (queued, waiting or running); beyond it
    `submit` raises `QueueFullError`. `on_load_error` is called on the event loop if the
    factory raises. `freeze_heap`: once the engine is loaded, freeze the process's heap so
    that garbage collections skip it (`engine/gc_heap.py`), for a process that serves until
    it exits (`loopserve serve`, a Ray replica); off by default, since it is process-wide.
    """

    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        *,
        max_pending_requests: int = 1024,
        on_load_error: Callable[[BaseException], None] | None = None,
        freeze_heap: bool = False,
    ) -> None:
        self._engine_or_factory = engine
        self._freeze_heap = freeze_heap
        self.gate = SubmissionGate(max_pending_requests)
        self.max_pending_requests = max_pending_requests
        self._on_load_error = on_load_error
        self.metrics = ServingMetrics()
        self._thread: EngineThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- state --------------------------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        return self._thread is not None and self._thread.ready.is_set() and not self.is_dead

    @property
    def is_dead(self) -> bool:
        return self._thread is not None and self._thread.dead_error is not None

    @property
    def load_error(self) -> BaseException | None:
        return None if self._thread is None else self._thread.load_error

    @property
    def snapshot(self) -> EngineStats:
        return EngineStats() if self._thread is None else self._thread.snapshot

    @property
    def is_accepting(self) -> bool:
        """False once shutdown began (`stop_accepting`)."""
        return self.gate.accepting

    @property
    def num_in_flight(self) -> int:
        return self.gate.num_in_flight

    @property
    def engine(self) -> LLMEngine:
        """The loaded engine; only its read-only attributes may be used outside its thread."""
        self._check_usable()
        assert self._thread is not None and self._thread.engine is not None
        return self._thread.engine

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def model_info(self) -> ModelInfo:
        self._check_usable()
        assert self._thread is not None and self._thread.model_info is not None
        return self._thread.model_info

    def health(self) -> dict[str, object]:
        if self.is_ready:
            return {"status": "ok"}
        return {"status": "dead" if self.is_dead else "loading"}

    def render_metrics(self) -> str:
        return self.metrics.render(
            self.snapshot, num_in_flight=self.num_in_flight, is_ready=self.is_ready
        )

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (loading the engine if needed); idempotent."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = EngineThread(
            self._engine_or_factory, self._loop, self.metrics, self._on_load_error,
            freeze_heap=self._freeze_heap,
        )  # fmt: skip
        self._thread.start()

    async def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Wait until the engine is loaded; False if it died or the wait timed out."""
        return await wait_ready(self, timeout_s)

    def stop_accepting(self, *, abort_after_s: float | None = None) -> None:
        """New submissions raise `EngineNotReadyError` from now on; in-flight ones continue,
        and with `abort_after_s`, are aborted that long from now (their streams then end with
        finish reason "abort"). Safe to call from a signal handler. The first call starts the
        shutdown clock of `shutdown`.
        """
        self.gate.stop()
        if abort_after_s is not None and self._thread is not None and self._loop is not None:
            abort_all = AbortCommand(None)
            self._thread.call_on_loop(
                self._loop.call_later, abort_after_s, self._thread.send, abort_all
            )

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, let in-flight requests finish until `timeout_s` after the first
        `stop_accepting`, abort the rest, and join the engine thread."""
        self.stop_accepting()
        if self._thread is None:
            return
        if not self.is_dead and not await self.gate.drain(timeout_s):
            logger.warning("aborting %d requests still in flight", self.gate.num_in_flight)
        self._thread.send(StopCommand())
        if not await asyncio.to_thread(self._thread.join, max(timeout_s, 1.0)):
            logger.error("engine thread did not stop in time")

    # ---- requests -----------------------------------------------------------------------

    async def submit(
        self,
        requests: Sequence[GenerateRequest],
        *,
        export: bool = False,
        export_on_device: bool = False,
        stream_kv: dict[str, int] | None = None,
    ) -> OutputStream:
        """Add `requests` atomically and return their output stream.

        Raises `InvalidRequestError`/`CapacityError` from the engine, `QueueFullError`,
        `EngineNotReadyError` or `EngineDeadError`, always before any output is produced.
        Prompts not yet processed (strings, token ids) go through the engine's input processor
        in a worker thread first, so neither this event loop nor the engine thread tokenizes.
        `export`: hand each request off once it can be exported (see the module docstring);
        `export_on_device`: its K/V stays on the engine's device (a transport sends it from
        there) instead of being copied to host memory; `stream_kv` (with `export`): stream
        these requests' K/V chunk by chunk (request -> blocks per plane the receiver holds
        already): the stream yields each `KVChunk` as it completes, before the
        `HandoffState` that carries the rest (engine/kv_stream.py).
        """
        self._check_usable()
        if not all(isinstance(r.prompt, ProcessedPrompt) for r in requests):
            requests = await asyncio.to_thread(_processed, self.engine.input_processor, requests)
            self._check_usable()
        stream = self._open_stream([r.request_id for r in requests])
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        assert self._thread is not None
        self._thread.send(
            AddCommand(
                list(requests),
                stream,
                time.monotonic(),
                done,
                export,
                export_on_device,
                stream_kv if export else None,
            )
        )
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            stream.close()  # also covers cancellation after the engine thread added them
            raise
        return stream

    async def land(self, item: Landable) -> Landable:
        """`item` (a `HandoffState` or `KVChunk`) with its K/V landed toward the engine's
        device (`LLMEngine.land_kv`), in a worker thread: the engine thread steps meanwhile
        instead of copying the link's bytes in the step that admits the request."""
        kv = await asyncio.to_thread(self.engine.land_kv, item.kv)
        return item if kv is item.kv else dataclasses.replace(item, kv=kv)

    async def submit_import(self, state: HandoffState, prompt_text: str | None) -> OutputStream:
        """Continue a request another engine exported (its K/V landed first: `land`); errors
        as `submit`, before any output."""
        self._check_usable()
        state = await self.land(state)
        self._check_usable()
        stream = self._open_stream([state.request_id])
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        assert self._thread is not None
        self._thread.send(ImportCommand(state, prompt_text, stream, done))
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            stream.close()
            raise
        return stream

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result (or
        raise its exception): the decode side of a streamed hand-off reserves blocks, writes
        chunks and releases reservations this way."""
        self._check_usable()
        done: concurrent.futures.Future[object] = concurrent.futures.Future()
        assert self._thread is not None
        self._thread.send(CallCommand(fn, done))
        return await asyncio.wrap_future(done)  # type: ignore[return-value]

    def _open_stream(self, request_ids: list[str]) -> OutputStream:
        """A stream for `request_ids`, counted in flight; raises when they may not be added."""
        assert self._thread is not None
        self.gate.admit(len(request_ids))
        return OutputStream(self, request_ids)

    def abort(self, request_id: str) -> None:
        """Abort one request; thread-safe, applied by the engine thread between steps."""
        if self._thread is not None:
            self._thread.send(AbortCommand([request_id]))

    def _on_stream_closed(self, stream: OutputStream, unfinished_ids: list[str]) -> None:
        if unfinished_ids and self._thread is not None:
            self._thread.send(AbortCommand(unfinished_ids))
        self.gate.release(len(stream.request_ids))

    def _check_usable(self) -> None:
        if self._thread is not None and self._thread.dead_error is not None:
            raise EngineDeadError(f"the engine died: {self._thread.dead_error!r}")
        if not self.is_ready:
            raise EngineNotReadyError("the model is still loading")


def _processed(
    processor: InputProcessor, requests: Sequence[GenerateRequest]
) -> list[GenerateRequest]:
    """`requests` with every prompt run through `processor`."""
    return [
        r
        if isinstance(r.prompt, ProcessedPrompt)
        else dataclasses.replace(r, prompt=processor.process(r.prompt))
        for r in requests
    ]
