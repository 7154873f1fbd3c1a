"""`LLMEngine`: loads the model and wires config → KV manager → scheduler → runner.

`add_request` validates and queues; `step` runs schedule → execute → update once and returns
one `RequestOutput` per request that produced a token or finished this step (cumulative
fields plus the step's delta). Text stays at the edges: the `InputProcessor` checks and
tokenizes prompts, the `OutputProcessor` detokenizes, matches stop strings and assembles
outputs; a stop-string hit finishes the request through the scheduler
(`_finish_on_stop_string`). A step whose execution raises fails only the requests it carried;
the engine keeps serving the rest.
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
from loopserve.errors import InvalidRequestError
from loopserve.models import load_model
from loopserve.outputs import RequestOutput
from loopserve.runner.model_runner import ModelRunner
from loopserve.sampling_params import SamplingParams
from loopserve.scheduler.kv_cache import KVCacheManager
from loopserve.scheduler.request import FinishReason, Request
from loopserve.scheduler.scheduler import Scheduler
from loopserve.text.input_processor import InputProcessor, ProcessedPrompt
from loopserve.text.output_processor import OutputProcessor
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
        )
        eos = set(self.model.config.eos_token_id)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.input_processor = InputProcessor(
            self.tokenizer,
            vocab_size=self.model.config.vocab_size,
            max_model_len=self.max_model_len,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = EngineStats()
        self._tracked: dict[str, Request] = {}
        self._arrivals = itertools.count()

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
        self.scheduler.add_request(request)
        self.output_processor.add_request(request, processed.text)
        self._tracked[request_id] = request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self._tracked.get(request_id)
        if request is None or self.scheduler.abort_request(request_id) is None:
            return None
        self._release_gone()
        return self._output(request)

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
            outputs.append(self._output(request, error=f"{type(err).__name__}: {err}"))
        return outputs

    def _process(self, request: Request) -> RequestOutput:
        self.stats.num_output_tokens += 1
        self.stats.num_loops += request.exit_depths[-1]
        stop = self.output_processor.detokenize(request)
        if stop is not None:
            self._finish_on_stop_string(request)
        return self._output(request)

    def _finish_on_stop_string(self, request: Request) -> None:
        """The one place a stop string finishes a request: through the scheduler, reason STOP.
        A request the scheduler already finished on the same token keeps its reason."""
        if not request.is_finished:
            self.scheduler.finish(request, FinishReason.STOP)

    def _output(self, request: Request, *, error: str | None = None) -> RequestOutput:
        if request.is_finished:
            self._tracked.pop(request.request_id, None)
        return self.output_processor.make_output(request, error=error)
