"""`EngineThread`: the one thread that owns an `LLMEngine` on behalf of `AsyncLLM`.

The thread loads the engine (so the server can answer 503 while it loads), then loops: take the
queued commands (add, abort, stop) and apply them, run one `engine.step()` while work remains,
publish the engine's `EngineStats` snapshot, and hand the step's outputs to the event loop
with one `loop.call_soon_threadsafe` per step. It blocks on a condition variable when idle,
and also, for at most `STALL_WAIT_S`, after a step that ran nothing while requests remain
(`LLMEngine.stalled`: a request waiting for blocks that a reservation holds, a reservation
waiting for its chunks): only a command can change that, and stepping again at once kept a
core busy for as long as it lasted.
Nothing else ever touches the engine, so the engine stays single-threaded.

If a command or a step raises out of the engine (the engine already contains failures of a
single step), the thread dies: pending submissions and every open stream get `EngineDeadError`.
This module knows nothing about HTTP or about how streams are consumed.

Prefill/decode disaggregation uses two more commands: an add with `export=True` hands each of
its requests off as soon as the engine can export it (after the step that sampled its first
token, normally): the thread exports it between steps and delivers the `HandoffState` to the
request's sink in place of further outputs. An `ImportCommand` admits a `HandoffState` exported
by another engine; its outputs then flow like any request's. A streamed hand-off
(engine/kv_stream.py: `AddCommand.stream_kv`) also delivers each `KVChunk` to the request's
sink between steps, as soon as its blocks are complete, before the `HandoffState`; a
`CallCommand` runs a function on the engine between steps (the decode side's reservation,
chunk writes and releases) and returns its result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from loopserve.engine.client import GenerateRequest, ModelInfo
from loopserve.engine.gc_heap import freeze_startup_heap
from loopserve.engine.handoff import HandoffState, KVChunk
from loopserve.engine.metrics import ServingMetrics
from loopserve.engine.stats import EngineStats
from loopserve.errors import EngineDeadError, EngineNotReadyError, LoopserveError
from loopserve.outputs import RequestOutput

if TYPE_CHECKING:  # the engine (and torch) load lazily, so `loopserve --help` stays fast
    from loopserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

# How long a stalled engine waits for a command before it steps again anyway: the bound on a
# missed wake-up, never reached when commands are what unblocks it.
STALL_WAIT_S = 0.05


class OutputSink(Protocol):
    """Where a submission's outputs go; `put` is called on the event loop thread. A
    `HandoffState` arrives only for requests added with `export=True`, as their last item;
    `KVChunk`s before it when their K/V streams (`stream_kv`)."""

    def put(self, item: RequestOutput | HandoffState | KVChunk | BaseException) -> None: ...


@dataclass(slots=True)
class AddCommand:
    """Add all `requests` or none; `done` resolves (or fails) once the engine has decided."""

    requests: Sequence[GenerateRequest]
    sink: OutputSink
    arrival_s: float
    done: concurrent.futures.Future[None]
    export: bool = False  # hand each request off once it can be exported (prefill role)
    # Export the K/V on the engine's device (for a transport that sends device memory).
    export_on_device: bool = False
    # Stream these requests' K/V chunk by chunk: request -> blocks per plane to skip (the
    # receiver's prefix cache holds them). Only with `export`.
    stream_kv: dict[str, int] | None = None


@dataclass(slots=True)
class ImportCommand:
    """Admit a request exported by another engine (decode role); `done` as for `AddCommand`."""

    state: HandoffState
    prompt_text: str | None
    sink: OutputSink
    done: concurrent.futures.Future[None]


@dataclass(slots=True)
class CallCommand:
    """Run `fn(engine)` between steps; `done` gets its result or its exception."""

    fn: Callable[[LLMEngine], object]
    done: concurrent.futures.Future[object]


@dataclass(slots=True)
class AbortCommand:
    request_ids: list[str] | None  # None: every request in flight


@dataclass(slots=True)
class StopCommand:
    """Abort everything in flight and end the thread."""


Command = AddCommand | ImportCommand | CallCommand | AbortCommand | StopCommand
WITH_DONE = (AddCommand, ImportCommand, CallCommand)  # commands a caller waits on


class EngineThread:
    """Runs the engine loop described in the module docstring; see `send` for the commands."""

    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine],
        loop: asyncio.AbstractEventLoop,
        metrics: ServingMetrics,
        on_load_error: Callable[[BaseException], None] | None = None,
        *,
        freeze_heap: bool = False,
    ) -> None:
        """`freeze_heap`: once the engine is loaded, freeze the process's heap
        (`gc_heap.freeze_startup_heap`), for a process that serves until it exits."""
        # An engine is not callable; a factory is.
        self.engine: LLMEngine | None = None if callable(engine) else engine
        self._factory = engine if callable(engine) else None
        self._loop = loop
        self._metrics = metrics
        self._on_load_error = on_load_error
        self._freeze_heap = freeze_heap
        self.snapshot = EngineStats()
        self.model_info: ModelInfo | None = None  # set before `ready`
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.dead_error: BaseException | None = None
        self._closed_error: LoopserveError | None = None  # set once the thread stops for good
        self._commands: deque[Command] = deque()
        self._in_hand: deque[Command] = deque()  # taken from `_commands`, not yet applied
        self._wakeup = threading.Condition()
        self._routes: dict[str, OutputSink] = {}  # this thread only
        # Requests to hand off once exportable (a dict: insertion order); this thread only.
        self._exports: dict[str, bool] = {}  # request -> export its K/V on the device
        self._thread = threading.Thread(target=self._run, name="loopserve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout_s: float) -> bool:
        """Wait for the thread to end; True if it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def send(self, command: Command) -> None:
        """Queue a command; thread-safe. After the thread stopped, an add fails at once."""
        with self._wakeup:
            closed_error = self._closed_error
            if closed_error is None:
                self._commands.append(command)
                self._wakeup.notify()
        if closed_error is not None and isinstance(command, WITH_DONE):
            command.done.set_exception(closed_error)

    def call_on_loop(self, callback: Callable[..., object], *args: object) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop closed under us (process exit): nobody is listening
            logger.debug("event loop closed; dropped %s", getattr(callback, "__name__", callback))

    # ---- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self.engine is None:
                assert self._factory is not None
                self.engine = self._factory()
            self._publish_snapshot(self.engine)
            self.model_info = ModelInfo.of(self.engine)  # read once, on this thread
            if self._freeze_heap:
                frozen = freeze_startup_heap()
                logger.info("froze the start-up heap: %d objects no collection walks", frozen)
            self.ready.set()
        except BaseException as err:
            logger.exception("loading the engine failed")
            self.load_error = err
            self._die(err)
            if self._on_load_error is not None:
                self.call_on_loop(self._on_load_error, err)
            return
        try:
            self._serve(self.engine)
        except BaseException as err:
            logger.exception("the engine thread died")
            self._die(err)

    def _serve(self, engine: LLMEngine) -> None:
        while True:
            if not engine.has_unfinished_requests():
                self._in_hand.extend(self._take_commands(timeout_s=None))
            else:
                self._in_hand.extend(self._take_commands(STALL_WAIT_S if engine.stalled else 0))
            while self._in_hand:
                command = self._in_hand.popleft()
                if isinstance(command, StopCommand):
                    self._abort(engine, None)
                    self._close(EngineNotReadyError("the server has shut down"))
                    return
                if isinstance(command, AddCommand):
                    self._add(engine, command)
                elif isinstance(command, ImportCommand):
                    self._import(engine, command)
                elif isinstance(command, CallCommand):
                    self._call(engine, command)
                else:
                    self._abort(engine, command.request_ids)
            if engine.has_unfinished_requests():
                self._dispatch(engine, engine.step())
                self._send_chunks(engine)
                self._export_ready(engine)
            self._publish_snapshot(engine)

    def _take_commands(self, timeout_s: float | None) -> list[Command]:
        """The queued commands, waiting for one at most `timeout_s` (None: until one comes)."""
        with self._wakeup:
            if not self._commands and timeout_s != 0:
                self._wakeup.wait_for(lambda: bool(self._commands), timeout_s)
            commands = list(self._commands)
            self._commands.clear()
        return commands

    def _add(self, engine: LLMEngine, command: AddCommand) -> None:
        added: list[str] = []
        try:
            for request in command.requests:
                engine.add_request(
                    request.request_id, request.prompt, request.params, arrival_s=command.arrival_s
                )
                added.append(request.request_id)
        except Exception as err:  # a rejection (or a bug) fails the whole submission
            for request_id in added:
                engine.abort_request(request_id)
            command.done.set_exception(err)
            return
        for request_id in added:
            self._routes[request_id] = command.sink
        if command.export:
            self._exports.update(dict.fromkeys(added, command.export_on_device))
            for request_id, skip_blocks in (command.stream_kv or {}).items():
                engine.stream_export(request_id, skip_blocks)
        command.done.set_result(None)

    def _import(self, engine: LLMEngine, command: ImportCommand) -> None:
        try:
            engine.import_request(command.state, prompt_text=command.prompt_text)
        except Exception as err:  # a rejection (or a bug) fails the import
            command.done.set_exception(err)
            return
        self._routes[command.state.request_id] = command.sink
        command.done.set_result(None)

    def _call(self, engine: LLMEngine, command: CallCommand) -> None:
        try:
            result = command.fn(engine)
        except Exception as err:  # the caller's to handle; the engine stays as it was
            command.done.set_exception(err)
            return
        command.done.set_result(result)

    def _send_chunks(self, engine: LLMEngine) -> None:
        """Deliver the K/V chunks (in host memory) that streamed requests completed in this
        step, after the step's outputs; their copies are not waited for here (`OutputStream`
        settles them)."""
        batch: list[tuple[OutputSink, RequestOutput | HandoffState | KVChunk | BaseException]] = []
        for chunk in engine.take_kv_chunks(to_host=True, pending=True):
            sink = self._routes.get(chunk.request_id)
            if sink is not None:
                batch.append((sink, chunk))
        if batch:
            self.call_on_loop(_deliver, batch)

    def _export_ready(self, engine: LLMEngine) -> None:
        """Export every request marked for hand-off that can leave now; each one's sink gets
        its `HandoffState` after the outputs already dispatched (the first token's)."""
        batch: list[tuple[OutputSink, RequestOutput | HandoffState | BaseException]] = []
        for request_id in [r for r in self._exports if engine.can_export(r)]:
            on_device = self._exports.pop(request_id)
            state = engine.export_request(request_id, to_host=not on_device, pending=True)
            sink = self._routes.pop(request_id, None)
            if sink is not None:
                batch.append((sink, state))
        if batch:
            self._publish_snapshot(engine)  # the exported requests' blocks are free again
            self.call_on_loop(_deliver, batch)

    def _abort(self, engine: LLMEngine, request_ids: list[str] | None) -> None:
        if request_ids is None:
            request_ids = list(self._routes)
        outputs = [out for rid in request_ids if (out := engine.abort_request(rid)) is not None]
        self._dispatch(engine, outputs)

    def _dispatch(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """Deliver outputs to their sinks, after publishing the state that produced them
        (so a consumer never sees an output newer than the snapshot)."""
        self._publish_snapshot(engine)
        batch: list[tuple[OutputSink, RequestOutput | HandoffState | BaseException]] = []
        for output in outputs:
            sink = self._routes.get(output.request_id)
            if output.finished:
                self._routes.pop(output.request_id, None)
                self._exports.pop(output.request_id, None)
                self._metrics.observe_finished(output)
            if sink is not None:
                batch.append((sink, output))
        if batch:
            self.call_on_loop(_deliver, batch)

    def _publish_snapshot(self, engine: LLMEngine) -> None:
        self.snapshot = engine.stats  # frozen: safe to read from the event loop

    def _die(self, err: BaseException) -> None:
        self.dead_error = err
        self._close(EngineDeadError(f"the engine died: {err!r}"))

    def _close(self, error: LoopserveError) -> None:
        """Refuse all further commands with `error` and fail whatever still waits."""
        with self._wakeup:
            self._closed_error = error
            pending = [*self._in_hand, *self._commands]
            self._in_hand.clear()
            self._commands.clear()
        self._exports.clear()
        for command in pending:
            if isinstance(command, WITH_DONE) and not command.done.done():
                command.done.set_exception(error)
        sinks = list(dict.fromkeys(self._routes.values()))
        self._routes.clear()
        if sinks:
            self.call_on_loop(_deliver, [(sink, error) for sink in sinks])


def _deliver(
    batch: list[tuple[OutputSink, RequestOutput | HandoffState | KVChunk | BaseException]],
) -> None:
    for sink, item in batch:
        sink.put(item)
