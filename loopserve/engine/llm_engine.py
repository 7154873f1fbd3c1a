"""`LLMEngine`: loads the model and wires config → KV manager → scheduler → runner → core.

The step loop is `EngineCore` (loopserve/engine/core.py, token ids only) over a `ModelRunner`.
This class adds what sits around it: the model and the memory plan (KV blocks from the byte
budget; both from engine/model_setup.py), the tokenizer, and text at the edges: the `InputProcessor` checks and tokenizes
prompts, the `OutputProcessor` detokenizes, matches stop strings and assembles outputs; a
stop-string hit finishes the request through the core. `step` runs one core step, builds one
`RequestDelta` per request that produced a token or finished (only what is new, `_delta`,
where the reported finish reason is decided) and returns the `RequestOutput`s the output
processor makes of them in each request's `output_kind`. A request whose per-request setup fails in the
runner, or every request of a step whose execution raises, finishes with `abort` and its
`error` set; the engine keeps serving the rest. Statistics: `stats` (a frozen
`EngineStats` snapshot from the core).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

from loopserve.config import EngineConfig, resolve_coda_batching
from loopserve.contracts import SampledToken
from loopserve.engine.build import build_engine_core
from loopserve.engine.handoff import HandoffState, KVChunk
from loopserve.engine.kv_stream import KVStreamOut
from loopserve.engine.model_setup import load_engine_model, reads_logits, size_kv_cache
from loopserve.engine.stats import EngineStats
from loopserve.errors import ConfigError, InvalidRequestError
from loopserve.models.family import once_weight
from loopserve.outputs import RequestDelta, RequestOutput, TokenLogprob
from loopserve.runner.model_runner import ModelRunner
from loopserve.runner.options import RunnerOptions
from loopserve.sampling_params import SamplingParams
from loopserve.scheduler.request import FinishReason, Request, RequestStatus
from loopserve.text.input_processor import InputProcessor, ProcessedPrompt
from loopserve.text.output_processor import OutputProcessor
from loopserve.text.structured import StructuredOutputs
from loopserve.text.tokenizer import Tokenizer, read_chat_template

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.family, self.model, config = load_engine_model(config)
        self.tokenizer = Tokenizer.from_dir(self.model.checkpoint_dir)
        if config.chat_template is not None:
            if self.tokenizer is None:
                raise ConfigError(
                    "chat_template needs a tokenizer; this checkpoint has none (token-id "
                    "prompts only)"
                )
            self.tokenizer.use_chat_template(read_chat_template(config.chat_template))
        self.max_model_len = config.max_model_len or self.model.config.max_position_embeddings
        cache, bytes_per_block, self.inflight_hidden_bytes = size_kv_cache(
            config, self.model, self.max_model_len
        )
        self.config = dataclasses.replace(config, cache=cache)
        family = self.family
        self.num_loops = self.model.num_loops
        self.structured = None  # structured-output checks and matchers (needs a tokenizer)
        if self.tokenizer is not None:
            self.structured = StructuredOutputs(self.tokenizer, self.model.config.vocab_size)
        weight = once_weight(self.model.config)
        defers_leave = resolve_coda_batching(
            self.config, once_weight=weight, reads_logits=reads_logits(self.config, self.model)
        )
        self.core = build_engine_core(
            self.config,
            num_loops=self.num_loops,
            bytes_per_block=bytes_per_block,
            extra_planes=self.model.config.extra_kv_planes,
            prefix_key_by_max_loops=family.prefix_keyed_by_max_loops,
            prompt_loops_by_request=family.prompt_loops_by_request,
            leave_attends=self.model.leave_writes_kv,
            defers_leave=defers_leave,
            once_weight=weight,
            make_executor=lambda kv: ModelRunner(
                self.model,
                RunnerOptions.of(
                    self.config,
                    max_model_len=self.max_model_len,
                    num_host_blocks=kv.host_pool.num_blocks,
                    score_store=kv.prefix_cache is not None,
                    per_request_prompt_loops=family.prompt_loops_by_request,
                    defers_leave=defers_leave,
                ),
                make_matcher=None if self.structured is None else self.structured.matcher,
            ),
        )
        self.scheduler = self.core.scheduler
        self.kv = self.scheduler.kv
        runner = self.core.executor
        assert isinstance(runner, ModelRunner)
        self.runner = runner
        eos = set(self.model.config.eos_token_id)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.input_processor = InputProcessor(
            self.tokenizer,
            vocab_size=self.model.config.vocab_size,
            max_model_len=self.max_model_len,
            structured=self.structured,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._tracked: dict[str, Request] = {}
        self._reported: dict[str, int] = {}  # output tokens already in an output
        self._arrivals = itertools.count()
        # streamed hand-offs out
        self.kv_stream = KVStreamOut(self.kv.block_size, self.kv.num_planes, runner.rules)
        # The last step scheduled nothing, moved no K/V and reported nothing: the next one
        # would do the same until a request, import, chunk or abort arrives (`step`).
        self.stalled = False

    @property
    def stats(self) -> EngineStats:
        """Read-only snapshot of KV usage, queues and step counters (see `EngineStats`)."""
        return self.core.stats()

    def reset_stats(self) -> None:
        """Restart the step counters (benchmarks measure one run at a time)."""
        self.core.reset_counters()

    @classmethod
    def from_engine_args(cls, **engine_args: object) -> LLMEngine:
        return cls(EngineConfig.from_engine_args(**engine_args))

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids); see `InputProcessor.process`."""
        processed = self.input_processor.process(prompt)
        return processed.text, processed.token_ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | ProcessedPrompt,
        params: SamplingParams | None = None,
        *,
        arrival_s: float | None = None,
    ) -> None:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        processed = self.input_processor.process(prompt)
        resolved = params.resolve_loops(self.num_loops)
        self.input_processor.check_request(processed, resolved)
        if request_id in self._tracked:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        request = Request(
            request_id,
            processed.token_ids,
            resolved,
            arrival_order=next(self._arrivals),
            eos_token_ids=self.eos_token_ids,
            arrival_s=arrival_s,
        )
        self.core.add_request(request)
        self._track(request, processed.text)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self._tracked.get(request_id)
        if request is None or self.core.abort_request(request_id) is None:
            return None
        return self._output(request)

    # ---- hand-off (prefill/decode disaggregation) ---------------------------------------

    def can_export(self, request_id: str) -> bool:
        """Whether the request can be handed off now: running, prompt complete at every depth,
        at least one token sampled, and no loop of its next token run yet. Not with async
        scheduling (a step planned ahead may already hold the request's next loop). Under
        coda batching in time a decode token starts in its predecessor's leave step and runs
        loop 0 there, so a request hands off after its first token (as the PD modes do), not
        between later tokens."""
        request = self.scheduler.requests.get(request_id)
        return (
            not self.config.async_scheduling
            and request is not None
            and request.status is RequestStatus.RUNNING
            and not request.in_prompt_phase
            and request.replay is None
            and bool(request.output_token_ids)
            and self.scheduler.token_depth(request_id) == 0
            and not self.runner.inflight.handles_of(request_id)
        )

    def export_request(
        self, request_id: str, *, to_host: bool = True, pending: bool = False
    ) -> HandoffState:
        """Hand the request off: copy its state (K/V of every plane, sampler state, outputs,
        times) and finish it here without an output (its blocks and sampler are released;
        the client's stream continues on the importing engine). `to_host=False` leaves the
        K/V copy on the engine's device (for a transport that sends device memory).
        `pending=True` (to the host) does not wait for the K/V's copy: `kv` is a
        `PendingHostKV` whose `settled()` is the tensor (the serving engine thread exports
        this way, and `OutputStream` settles it off that thread)."""
        if not self.family.handoff:
            raise ConfigError(f"{self.family.name} requests cannot be handed off yet")
        if not self.can_export(request_id):
            raise InvalidRequestError(f"request {request_id!r} cannot be handed off now")
        request = self.scheduler.requests[request_id]
        if self.scheduler.has_pending_copy(request_id):  # a fork's copy of its last block
            self.core.deliver_bookkeeping()
        handle = self.scheduler.kv_handle(request_id)
        first_block = self.kv_stream.finish(request_id, request.num_preemptions)
        kv, generator_state = self.runner.handoff.export_request(
            handle, to_host=to_host, first_block=first_block, pending=pending
        )
        runner_state = self.runner.handoff.export_runner_state(request_id)
        times = request.times
        state = HandoffState(
            request_id=request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids),
            exit_depths=list(request.exit_depths),
            logprobs=list(request.logprobs),
            prompt_logprobs=list(request.prompt_logprobs),
            params=request.params,
            num_planes=self.kv.num_planes,
            block_size=self.kv.block_size,
            num_kv_positions=handle.num_positions,
            kv=kv,
            generator_state=generator_state,
            arrival_s=times.arrival_s,
            first_scheduled_s=times.first_scheduled_s,
            first_token_s=times.first_token_s,
            token_times_s=list(times.token_times_s),
            num_cached_prompt_tokens=request.num_cached_prompt_tokens,
            runner_state=runner_state,
            first_block=first_block,
        )
        # Finished internally as an abort, never reported: the request lives on elsewhere.
        self._untrack(request_id)
        self.output_processor.forget(request_id)
        self.core.finish_request(request, FinishReason.ABORT)
        return state

    def import_request(self, state: HandoffState, *, prompt_text: str | None = None) -> None:
        """Admit a request exported by another engine straight into decode. Its outputs so far
        are counted as already reported (the exporter streamed them)."""
        if (state.num_planes, state.block_size) != (self.kv.num_planes, self.kv.block_size):
            raise InvalidRequestError(
                f"hand-off of {state.request_id!r} has {state.num_planes} planes of block size "
                f"{state.block_size}; this engine has {self.kv.num_planes} of "
                f"{self.kv.block_size}"
            )
        if state.request_id in self._tracked:
            raise InvalidRequestError(
                f"request id {state.request_id!r} is already in use", "request_id"
            )
        request = Request(
            state.request_id,
            list(state.prompt_token_ids),
            state.params,
            arrival_order=next(self._arrivals),
            eos_token_ids=self.eos_token_ids,
            arrival_s=state.arrival_s,
        )
        request.restore_outputs(
            state.output_token_ids,
            state.exit_depths,
            logprobs=state.logprobs,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_prompt_tokens=state.num_cached_prompt_tokens,
            first_scheduled_s=state.first_scheduled_s,
            first_token_s=state.first_token_s,
            token_times_s=state.token_times_s,
        )
        assert state.num_kv_positions == request.next_position, "hand-off K/V does not match"
        self._claim_reservation(state)
        self.runner.handoff.stage_import(
            state.request_id,
            state.kv,  # type: ignore[arg-type]
            state.generator_state,
            runner_state=state.runner_state,
        )
        try:
            self.core.add_imported(request)
        except Exception:
            self.runner.moves.staged_imports.pop(state.request_id, None)
            raise
        self._track(request, prompt_text)
        self.output_processor.mark_reported(self._delta(request, None))

    # ---- streamed hand-off (engine/kv_stream.py) ----------------------------------------

    def stream_export(self, request_id: str, skip_blocks: int = 0) -> None:
        """Hand this request off chunk by chunk: `take_kv_chunks` returns its prompt blocks as
        they complete, from block `skip_blocks` on (the receiver's prefix cache holds the
        earlier ones); `export_request` then carries the rest."""
        if request_id not in self._tracked:
            raise InvalidRequestError(f"unknown request {request_id!r}", "request_id")
        self.kv_stream.start(request_id, skip_blocks)

    def take_kv_chunks(self, *, to_host: bool = True, pending: bool = False) -> list[KVChunk]:
        """The K/V chunks of streamed requests that completed since the last call (call it
        between steps; `to_host=False` leaves the copies on the engine's device; `pending`
        as `export_request`'s)."""
        return self.kv_stream.take(self.scheduler, self.runner, to_host=to_host, pending=pending)

    def reserve_import(
        self, request_id: str, prompt: list[int], params: SamplingParams | None = None
    ) -> int | None:
        """Reserve blocks for a request another engine will hand off chunk by chunk. Returns
        the blocks per plane this engine's prefix cache already holds (the sender skips
        them), or None when they do not fit now (then the request must come whole)."""
        if request_id in self._tracked:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        request = Request(
            request_id,
            list(prompt),
            (params or SamplingParams()).resolve_loops(self.num_loops),
            arrival_order=-1,
            eos_token_ids=self.eos_token_ids,
        )
        return self.scheduler.admission.reserve_import(request)

    def land_kv(self, kv: object) -> object:
        """A hand-off's or chunk's K/V moved toward this engine's device ahead of its import
        (`HandoffKV.land`: on CUDA pinned and copied on a side stream; on CPU only marked
        landed). Thread-safe, unlike the rest of the engine: the serving path runs it in a
        worker thread (`AsyncLLM.land`) while the engine thread steps."""
        return self.runner.handoff.land(kv)

    def write_kv_chunk(self, chunk: KVChunk) -> None:
        """Write a streamed request's chunk into the blocks `reserve_import` reserved (in the
        chunk's planes); blocks this engine's prefix cache supplied are left as they are (a
        chunk replayed to another replica than the one it was cut for may cover some)."""
        reservation = self.scheduler.admission.reserved.get(chunk.request_id)
        if reservation is None or reservation.first_block is not None:
            raise InvalidRequestError(
                f"no reservation waits for K/V of {chunk.request_id!r}", "request_id"
            )
        table = self.kv.tables[chunk.request_id]
        end = chunk.first_block + chunk.num_blocks
        if end > len(table[0]):
            raise InvalidRequestError(
                f"chunk of blocks [{chunk.first_block}, {end}) of {chunk.request_id!r} is "
                f"outside its {len(table[0])} reserved blocks"
            )
        planes = range(len(table)) if chunk.planes is None else chunk.planes
        if not planes or any(not 0 <= p < len(table) for p in planes):
            raise InvalidRequestError(
                f"chunk of {chunk.request_id!r} names planes {chunk.planes}; this engine "
                f"has {len(table)}"
            )
        first = max(chunk.first_block, reservation.num_cached_blocks)
        if first < end:
            ids = [table[p][first:end] for p in planes]
            kv = self.runner.handoff.drop_leading_blocks(
                chunk.kv,  # type: ignore[arg-type]
                chunk.num_blocks,
                first - chunk.first_block,
            )
            self.runner.handoff.write_blocks(chunk.request_id, kv, ids)

    def release_import(self, request_id: str) -> bool:
        """Free a reservation whose request will not come (its sender failed); False when
        there is none (never reserved, already imported, or released)."""
        return self.scheduler.admission.release_reserved(request_id)

    def _claim_reservation(self, state: HandoffState) -> None:
        """Match an arriving hand-off with its reservation: a streamed one (`first_block` > 0)
        needs one; a whole one frees a reservation it makes unnecessary."""
        admission = self.scheduler.admission
        reservation = admission.reserved.get(state.request_id)
        if state.first_block == 0:
            admission.release_reserved(state.request_id)
            return
        if reservation is None:
            raise InvalidRequestError(
                f"streamed hand-off of {state.request_id!r} starts at block "
                f"{state.first_block} without a reservation holding the blocks before it",
                "request_id",
            )
        reservation.first_block = state.first_block

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # ---- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One core step; one `RequestOutput` per request that produced a token or finished
        (none for an unfinished "final_only" request)."""
        result = self.core.step()
        if result.error is not None:
            logger.error("step %d failed", result.scheduled.step_id, exc_info=result.error)
        outputs = []
        for request in result.touched:
            output = self._process(request)
            if output is not None:
                outputs.append(output)
        for request in result.failed:
            output = self._output(request, error=result.errors[request.request_id])
            if output is not None:
                outputs.append(output)
        scheduled = result.scheduled
        self.stalled = scheduled.is_empty and not scheduled.kv_transfers and not outputs
        return outputs

    def _process(self, request: Request) -> RequestOutput | None:
        start = self._reported[request.request_id]
        new_token_ids = request.output_token_ids[start:]
        stop_hit = self.output_processor.detokenize(request.request_id, new_token_ids)
        if stop_hit is not None and not request.is_finished:
            self.core.finish_request(request, FinishReason.STOP)
        return self._output(request, stop_hit=stop_hit, new_token_ids=new_token_ids, start=start)

    def _output(
        self,
        request: Request,
        *,
        error: str | None = None,
        stop_hit: str | None = None,
        new_token_ids: list[int] | None = None,
        start: int | None = None,
    ) -> RequestOutput | None:
        delta = self._delta(request, stop_hit, new_token_ids, start)
        if request.is_finished:
            self._untrack(request.request_id)
        return self.output_processor.make_output(delta, error=error)

    def _delta(
        self,
        request: Request,
        stop_hit: str | None,
        new_token_ids: list[int] | None = None,
        start: int | None = None,
    ) -> RequestDelta:
        """What is new for `request` since its last output (`new_token_ids` from `start`,
        when the caller sliced them already), with the one decision of its reported finish
        reason: "stop" when a stop string hit (also if the same token reached max_tokens),
        else the scheduler's."""
        request_id = request.request_id
        if start is None:
            start = self._reported.get(request_id, 0)
        num_tokens = len(request.output_token_ids)
        self._reported[request_id] = num_tokens
        if new_token_ids is None:
            new_token_ids = request.output_token_ids[start:]
        reason = request.finish_reason
        finish_reason = None if reason is None else reason.value
        if stop_hit is not None and reason is not None:
            finish_reason = FinishReason.STOP.value
        stop_token_id = None
        if reason is FinishReason.STOP and stop_hit is None and num_tokens:
            stop_token_id = request.output_token_ids[-1]
        logprobs = None
        if request.params.logprobs is not None:
            logprobs = _token_logprobs(request.logprobs[start:])
        prompt_logprobs = None
        if start == 0 and request.prompt_logprobs:  # complete once the first token exists
            prompt_logprobs = _token_logprobs(request.prompt_logprobs)
        times = request.times
        return RequestDelta(  # positional, in field order (one per request per step)
            request_id,
            request.prompt_token_ids,
            new_token_ids,
            request.exit_depths[start:num_tokens],
            logprobs,
            times.token_times_s,
            num_tokens,
            finish_reason,
            stop_token_id,
            times.arrival_s,
            times.first_scheduled_s,
            times.first_token_s,
            times.finished_s,
            request.num_cached_prompt_tokens,
            request.num_preemptions,
            prompt_logprobs,
            _spec_counts(request),
        )

    def _track(self, request: Request, prompt_text: str | None) -> None:
        self.output_processor.add_request(
            request.request_id,
            request.prompt_token_ids,
            stop=request.params.stop,
            prompt_text=prompt_text,
            output_kind=request.params.output_kind,
        )
        self._tracked[request.request_id] = request
        self._reported[request.request_id] = 0

    def _untrack(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)
        self._reported.pop(request_id, None)


def _token_logprobs(samples: list[SampledToken]) -> list[TokenLogprob]:
    return [
        TokenLogprob(s.token_id, s.logprob or 0.0, s.top_logprobs, s.rank, s.loops) for s in samples
    ]


def _spec_counts(request: Request) -> tuple[int, int, int, int]:
    stats = request.spec_stats
    return stats.drafted, stats.accepted, stats.rejected, stats.redrafted
