"""`LLMEngine`: loads the model and wires config → KV manager → scheduler → runner.

`add_request` validates and queues; `step` runs schedule → execute → update once and returns
one `RequestOutput` per request that produced a token or finished this step (cumulative
fields plus the step's delta). Text is detokenized incrementally; stop strings finish a
request here, after the scheduler's token-level stops. A step whose execution raises fails
only the requests it carried; the engine keeps serving the rest.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from loopserve.config import EngineConfig, max_inflight_rows, resolve_dtype, resolve_num_blocks
from loopserve.errors import CapacityError, InvalidRequestError
from loopserve.models import load_model
from loopserve.outputs import RequestMetrics, RequestOutput, TokenLogprob
from loopserve.runner.model_runner import ModelRunner
from loopserve.sampling_params import SamplingParams
from loopserve.scheduler.kv_cache import KVCacheManager
from loopserve.scheduler.request import FinishReason, Request
from loopserve.scheduler.scheduler import Scheduler
from loopserve.text.detokenizer import IncrementalDetokenizer
from loopserve.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "default"


@dataclass
class EngineStats:
    num_steps: int = 0
    num_core_calls: int = 0
    num_rows: int = 0
    num_output_tokens: int = 0
    num_loops: int = 0  # sum of loops used over output tokens
    model_time_s: float = 0.0  # the runner's whole `execute`
    forward_time_s: float = 0.0  # inside model calls only (see `RunnerOutput`)
    step_time_s: float = 0.0

    @property
    def mean_rows_per_core_call(self) -> float:
        return self.num_rows / self.num_core_calls if self.num_core_calls else 0.0

    @property
    def mean_loops_per_token(self) -> float:
        return self.num_loops / self.num_output_tokens if self.num_output_tokens else 0.0

    @property
    def host_overhead_share(self) -> float:
        """Share of step time outside the model forward: scheduling, engine bookkeeping, and the
        runner's tensor building, finalize copies and sampling."""
        return 1.0 - self.forward_time_s / self.step_time_s if self.step_time_s else 0.0

    @property
    def runner_host_share(self) -> float:
        """The part of `host_overhead_share` spent inside the runner around the forward."""
        runner_s = self.model_time_s - self.forward_time_s
        return runner_s / self.step_time_s if self.step_time_s else 0.0


class _Tracked:
    """Engine-side view of a request: prompt text and its detokenizer."""

    __slots__ = ("request", "prompt", "detokenizer", "text", "stop_reason")

    def __init__(self, request: Request, prompt: str | None, detokenizer) -> None:
        self.request = request
        self.prompt = prompt
        self.detokenizer = detokenizer
        self.text = ""
        self.stop_reason: str | int | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config = resolve_dtype(config)
        model_path = config.model or str(DEFAULT_MODEL_DIR)
        self.model = load_model(model_path, dtype=config.dtype, device=config.device)
        self.tokenizer = Tokenizer.from_dir(self.model.checkpoint_dir)
        bytes_per_block = ModelRunner.kv_bytes_per_block(
            self.model, config.cache.block_size, self.model.lm_head.weight.dtype
        )
        free = None
        if config.device.startswith("cuda"):
            free = torch.cuda.mem_get_info()[0]
        element_size = self.model.lm_head.weight.element_size()
        inflight_rows = max_inflight_rows(config, self.model.num_loops)
        self.inflight_hidden_bytes = inflight_rows * self.model.config.hidden_size * element_size
        cache = resolve_num_blocks(
            config.cache,
            bytes_per_block=bytes_per_block,
            free_bytes=free,
            reserved_bytes=self.inflight_hidden_bytes,
        )
        self.config = dataclasses.replace(config, cache=cache)
        self.num_loops = self.model.num_loops
        self.max_model_len = config.max_model_len or self.model.config.max_position_embeddings
        num_planes = 1 if cache.layout == "shared" else self.num_loops
        self.kv = KVCacheManager(cache.num_blocks, cache.block_size, num_planes)
        self.scheduler = Scheduler(self.config, num_loops=self.num_loops, kv=self.kv)
        self.runner = ModelRunner(
            self.model,
            num_blocks=cache.num_blocks,
            block_size=cache.block_size,
            layout=cache.layout,
            exit_mode=self.config.exit.mode,
            lookahead_seed=self.config.exit.lookahead_seed,
            attention_backend=self.config.attention_backend,
        )
        eos = set(self.model.config.eos_token_id)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.stats = EngineStats()
        self._tracked: dict[str, _Tracked] = {}
        self._arrivals = itertools.count()

    @classmethod
    def from_engine_args(cls, **engine_args: object) -> LLMEngine:
        return cls(EngineConfig.from_engine_args(**engine_args))

    # ---- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer; pass prompt token ids", "prompt"
                )
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids out of range [0, {vocab}): {bad[:5]}", "prompt"
            )
        return None, list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        arrival_s: float | None = None,
    ) -> None:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        text, token_ids = self.tokenize(prompt)
        if not token_ids:
            raise InvalidRequestError("prompt must contain at least one token", "prompt")
        resolved = params.resolve_loops(self.num_loops)
        total = len(token_ids) + resolved.max_tokens
        if total > self.max_model_len:
            raise CapacityError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({resolved.max_tokens}) = {total} "
                f"exceeds the maximum context length {self.max_model_len}",
                param="max_tokens",
            )
        if request_id in self._tracked:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        request = Request(
            request_id,
            token_ids,
            resolved,
            arrival_order=next(self._arrivals),
            eos_token_ids=self.eos_token_ids,
            arrival_s=arrival_s,
        )
        self.scheduler.add_request(request)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, token_ids, stop=resolved.stop)
        self._tracked[request_id] = _Tracked(request, text, detok)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        tracked = self._tracked.get(request_id)
        if tracked is None or self.scheduler.abort_request(request_id) is None:
            return None
        self._release_gone()
        return self._output(tracked, [], final=True)

    def _release_gone(self) -> None:
        """Drop runner state (generators, hidden handles) of requests that left."""
        for request_id in self.scheduler.drain_gone_request_ids():
            self.runner.release_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_waiting + self.scheduler.num_running

    # ---- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start_s = time.perf_counter()
        scheduled = self.scheduler.schedule()
        try:
            output = self.runner.execute(scheduled)
        except Exception as err:  # a failed step fails its own requests, not the engine
            logger.exception("step %d failed", scheduled.step_id)
            return self._fail_step(scheduled, err)
        touched = self.scheduler.update(scheduled, output)
        self.stats.num_steps += 1
        self.stats.num_core_calls += len(output.rows_per_core_call)
        self.stats.num_rows += sum(output.rows_per_core_call)
        self.stats.model_time_s += output.model_time_s
        self.stats.forward_time_s += output.forward_time_s
        outputs = [self._process(request) for request in touched]
        self._release_gone()
        self.stats.step_time_s += time.perf_counter() - start_s
        return outputs

    def _fail_step(self, scheduled, err: Exception) -> list[RequestOutput]:
        ids = list(dict.fromkeys(item.request_id for item in scheduled.items))
        outputs = []
        failed = self.scheduler.fail_requests(ids)
        self._release_gone()
        for request in failed:
            tracked = self._tracked[request.request_id]
            outputs.append(
                self._output(tracked, [], final=True, error=f"{type(err).__name__}: {err}")
            )
        return outputs

    def _process(self, request: Request) -> RequestOutput:
        tracked = self._tracked[request.request_id]
        token = request.output_token_ids[-1]
        self.stats.num_output_tokens += 1
        self.stats.num_loops += request.exit_depths[-1]
        new_text = ""
        if tracked.detokenizer is not None:
            update = tracked.detokenizer.add_token(token)
            new_text = update.new_text
            tracked.text += new_text
            if update.stop_hit is not None:
                tracked.stop_reason = update.stop_hit
                if request.is_finished:
                    request.finish_reason = FinishReason.STOP  # the stop string wins
                else:
                    self.scheduler.finish(request, FinishReason.STOP)
        if request.finish_reason is FinishReason.STOP and tracked.stop_reason is None:
            tracked.stop_reason = token
        return self._output(tracked, [token], final=request.is_finished, new_text=new_text)

    def _output(
        self,
        tracked: _Tracked,
        new_ids: list[int],
        *,
        final: bool,
        new_text: str = "",
        error: str | None = None,
    ) -> RequestOutput:
        request = tracked.request
        if final:
            if tracked.detokenizer is not None and not isinstance(tracked.stop_reason, str):
                tail = tracked.detokenizer.finish()
                tracked.text += tail
                new_text += tail
            self._tracked.pop(request.request_id, None)
        times = request.times
        logprobs = None
        if request.params.logprobs is not None:
            logprobs = [
                TokenLogprob(s.token_id, s.logprob or 0.0, s.top_logprobs) for s in request.logprobs
            ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=tracked.text,
            exit_depths=list(request.exit_depths),
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            metrics=RequestMetrics(
                times.arrival_s,
                times.first_scheduled_s,
                times.first_token_s,
                times.finished_s,
                tuple(times.token_times_s),
            ),
            logprobs=logprobs,
            new_token_ids=list(new_ids),
            new_text=new_text,
            new_exit_depths=request.exit_depths[-len(new_ids) :] if new_ids else [],
            stop_reason=tracked.stop_reason,
            error=error,
        )
