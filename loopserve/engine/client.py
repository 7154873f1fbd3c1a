"""The one face of an engine for the serving layer: `EngineClient`, `EngineStream`, `ModelInfo`.

The HTTP server (`loopserve/server/`) depends on this module only, never on which engine is
behind it. Three implementations exist: `AsyncLLM` (one in-process engine on a background
thread, engine/async_llm.py), `ReplicaPool` (data-parallel Ray replicas) and `PDReplicaPool`
(prefill/decode replicas, both in distributed/).

- `ModelInfo`: what a front end reads about the model (fixed once the engine is loaded).
- `EngineStream`: one submission's outputs, in engine order, until all its requests finish.
  Iterate with `async for`; leaving early (`close()`, `with`, cancellation) aborts what has
  not finished. Subclasses say where the next item comes from (`_next_item`), what a delivered
  output updates (`_delivered`) and what closing does (`_closed_with`); the finishing and
  closing rules are here, once.
- `EngineClient`: lifecycle (`start`, `wait_ready`, `stop_accepting`, `shutdown`), state
  (`is_ready`, `is_dead`, `load_error`, `is_accepting`, `num_in_flight`), `submit` / `abort`,
  `model_info()`, `health()` and `render_metrics()`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from loopserve.engine.handoff import HandoffState
from loopserve.errors import EngineNotReadyError, InvalidRequestError, QueueFullError
from loopserve.outputs import RequestOutput
from loopserve.sampling_params import SamplingParams
from loopserve.text.input_processor import ProcessedPrompt

__all__ = ["EngineClient", "EngineStream", "GenerateRequest", "ModelInfo", "SubmissionGate"]


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One request of a submission."""

    request_id: str
    prompt: str | list[int] | ProcessedPrompt  # the server passes prompts already processed
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the serving layer reads from a loaded engine; picklable (a Ray replica sends it)."""

    tokenizer: Any  # loopserve.text.tokenizer.Tokenizer | None
    max_model_len: int
    num_loops: int
    block_size: int
    kv_positions_per_request_max: int  # KV positions one request can ever hold
    config: Any  # the engine's resolved EngineConfig
    input_processor: Any  # loopserve.text.input_processor.InputProcessor

    @classmethod
    def of(cls, engine: Any) -> ModelInfo:
        """The info of a built `LLMEngine`."""
        return cls(
            tokenizer=engine.tokenizer,
            max_model_len=engine.max_model_len,
            num_loops=engine.num_loops,
            block_size=engine.config.cache.block_size,
            kv_positions_per_request_max=engine.stats.kv_positions_per_request_max,
            config=engine.config,
            input_processor=engine.input_processor,
        )


class EngineStream:
    """One submission's outputs; see the module docstring. An item is a `RequestOutput`, or,
    for a submission made with `export=True`, a `HandoffState` (that request left the engine)
    and, streaming its K/V (`stream_kv`), `KVChunk`s before it."""

    def __init__(self, request_ids: Sequence[str]) -> None:
        self.request_ids = list(request_ids)
        self._unfinished = set(self.request_ids)
        self._closed = False

    # ---- what subclasses say ------------------------------------------------------------

    async def _next_item(self) -> RequestOutput | HandoffState | None:
        """The next item from the source; None: nothing for the consumer, ask again. An
        exception ends the stream (it is closed, then the exception reaches the consumer)."""
        raise NotImplementedError

    def _delivered(self, item: RequestOutput | HandoffState) -> None:
        """Bookkeeping for an item about to reach the consumer (routing, metrics)."""

    def _closed_with(self, unfinished_ids: list[str]) -> None:
        """Closing: abort `unfinished_ids` wherever they run and release what the stream holds."""
        raise NotImplementedError

    # ---- the rules ----------------------------------------------------------------------

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> RequestOutput:  # or a HandoffState, see the class docstring
        while True:
            if self._closed or not self._unfinished:
                raise StopAsyncIteration
            try:
                item = await self._next_item()
            except BaseException:  # cancellation included: leaving early aborts the rest
                self.close()
                raise
            if item is None or item.request_id not in self._unfinished:
                continue
            self._delivered(item)
            if isinstance(item, HandoffState) or getattr(item, "finished", False):
                self._unfinished.discard(item.request_id)
                if not self._unfinished:
                    self.close()
            return item  # type: ignore[return-value]

    def close(self) -> None:
        """Abort what has not finished and release the in-flight slots; idempotent."""
        if not self._closed:
            self._closed = True
            self._closed_with(sorted(self._unfinished))

    def __enter__(self) -> EngineStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class SubmissionGate:
    """What every `EngineClient` applies to submissions: the bound on requests in flight
    (`max_pending_requests`: queued, waiting or running), the accepting flag shutdown clears,
    and draining. Event loop thread only."""

    def __init__(self, max_pending_requests: int) -> None:
        if max_pending_requests < 1:
            raise ValueError(f"max_pending_requests must be >= 1, got {max_pending_requests}")
        self.max_pending_requests = max_pending_requests
        self.accepting = True
        self.stopped_at_s: float | None = None  # the first `stop`: shutdown's clock
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def admit(self, num_requests: int) -> None:
        """Count `num_requests` in flight, or raise before anything was submitted."""
        if not self.accepting:
            raise EngineNotReadyError("the server is shutting down")
        limit = self.max_pending_requests
        if num_requests > limit:  # never admissible: retrying is futile
            raise InvalidRequestError(
                f"this request needs {num_requests} sequences (prompts x n), more than the "
                f"server's limit of {limit} requests in flight (--max-pending-requests)",
                param="n",
            )
        if self.num_in_flight + num_requests > limit:
            raise QueueFullError(
                f"{self.num_in_flight} requests in flight, the limit is {limit}; retry later"
            )
        self.num_in_flight += num_requests
        self._idle.clear()

    def release(self, num_requests: int) -> None:
        self.num_in_flight -= num_requests
        if self.num_in_flight == 0:
            self._idle.set()

    def stop(self) -> None:
        """Refuse new submissions from now on; the first call starts the shutdown clock."""
        self.accepting = False
        if self.stopped_at_s is None:
            self.stopped_at_s = time.monotonic()

    async def drain(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight, at most until `timeout_s` after the first `stop`;
        True when drained."""
        start_s = time.monotonic() if self.stopped_at_s is None else self.stopped_at_s
        remaining_s = max(0.0, timeout_s - (time.monotonic() - start_s))
        try:
            await asyncio.wait_for(self._idle.wait(), remaining_s)
        except asyncio.TimeoutError:
            return False
        return True


READY_POLL_S = 0.01


async def wait_ready(client: EngineClient, timeout_s: float | None = None) -> bool:
    """The wait every client's `wait_ready` is: poll until `client` is ready (True) or dead
    (False), or until `timeout_s` passed (False)."""
    deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
    while not client.is_ready and not client.is_dead:
        if deadline_s is not None and time.monotonic() > deadline_s:
            return False
        await asyncio.sleep(READY_POLL_S)
    return client.is_ready


class EngineClient(Protocol):
    """What the HTTP server needs from an engine (one engine, or a pool of replicas)."""

    @property
    def is_ready(self) -> bool:
        """Loaded and alive (for a pool: at least one replica serves)."""
        ...

    @property
    def is_dead(self) -> bool: ...

    @property
    def load_error(self) -> BaseException | None: ...

    @property
    def is_accepting(self) -> bool:
        """False once shutdown began."""
        ...

    @property
    def num_in_flight(self) -> int: ...

    def start(self) -> None:
        """Start loading and serving; idempotent. Called on the event loop."""
        ...

    async def wait_ready(self, timeout_s: float | None = None) -> bool: ...

    def stop_accepting(self, *, abort_after_s: float | None = None) -> None: ...

    async def shutdown(self, timeout_s: float = 5.0) -> None: ...

    async def submit(self, requests: Sequence[GenerateRequest]) -> EngineStream:
        """Add all requests or none; rejections raise before any output is read."""
        ...

    def abort(self, request_id: str) -> None: ...

    def model_info(self) -> ModelInfo:
        """Raises `EngineNotReadyError` / `EngineDeadError` while there is no usable engine."""
        ...

    def health(self) -> dict[str, object]:
        """The `/health` body: {"status": "ok" | "loading" | "dead" | "degraded", ...}."""
        ...

    def render_metrics(self) -> str:
        """The Prometheus text exposition of this client's metrics and engine gauges."""
        ...
