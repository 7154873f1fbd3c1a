"""`LLMEngine`: loads the model and wires config → KV manager → scheduler → runner → core.

The step loop is `EngineCore` (loopserve/engine/core.py, token ids only) over a `ModelRunner`.
This class adds what sits around it: loading the model and tokenizer, the memory plan (KV
blocks from the byte budget), and text at the edges: the `InputProcessor` checks and tokenizes
prompts, the `OutputProcessor` detokenizes, matches stop strings and assembles outputs; a
stop-string hit finishes the request through the core (`_finish_on_stop_string`). `step` runs
one core step and returns one `RequestOutput` per request that produced a token or finished
(cumulative fields plus the step's delta). A request whose per-request setup fails in the
runner, or every request of a step whose execution raises, finishes with `abort` and its
`error` set; the engine keeps serving the rest. Statistics: `stats` (a frozen
`EngineStats` snapshot from the core).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from pathlib import Path

import torch

from loopserve.config import EngineConfig, max_inflight_rows, resolve_dtype, resolve_num_blocks
from loopserve.engine.core import EngineCore
from loopserve.engine.stats import EngineStats
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
        self.kv = KVCacheManager.from_config(
            self.config, num_planes=num_planes, bytes_per_block=bytes_per_block
        )
        self.scheduler = Scheduler(self.config, num_loops=self.num_loops, kv=self.kv)
        self.runner = ModelRunner(
            self.model,
            num_blocks=cache.num_blocks,
            block_size=cache.block_size,
            layout=cache.layout,
            exit_mode=self.config.exit.mode,
            lookahead_seed=self.config.exit.lookahead_seed,
            num_host_blocks=self.kv.host_pool.num_blocks,
            attention_backend=self.config.attention_backend,
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
        self.core = EngineCore(self.scheduler, self.runner)
        self._tracked: dict[str, Request] = {}
        self._arrivals = itertools.count()

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
        self.output_processor.add_request(request, processed.text)
        self._tracked[request_id] = request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self._tracked.get(request_id)
        if request is None or self.core.abort_request(request_id) is None:
            return None
        return self._output(request)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.core.num_unfinished_requests

    # ---- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        result = self.core.step()
        if result.error is not None:
            logger.error("step %d failed", result.scheduled.step_id, exc_info=result.error)
        outputs = [self._process(request) for request in result.touched]
        for request in result.failed:
            outputs.append(self._output(request, error=result.errors[request.request_id]))
        return outputs

    def _process(self, request: Request) -> RequestOutput:
        stop = self.output_processor.detokenize(request)
        if stop is not None:
            self._finish_on_stop_string(request)
        return self._output(request)

    def _finish_on_stop_string(self, request: Request) -> None:
        """The one place a stop string finishes a request: through the scheduler, reason STOP.
        A request the scheduler already finished on the same token keeps its reason."""
        if not request.is_finished:
            self.core.finish_request(request, FinishReason.STOP)

    def _output(self, request: Request, *, error: str | None = None) -> RequestOutput:
        if request.is_finished:
            self._tracked.pop(request.request_id, None)
        return self.output_processor.make_output(request, error=error)
