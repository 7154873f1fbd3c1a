"""`LLM`: the offline Python API — a batch of prompts in, `RequestOutput`s out, in order."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tqdm.auto import tqdm

from loopserve.engine.llm_engine import LLMEngine
from loopserve.errors import InvalidRequestError
from loopserve.outputs import RequestOutput
from loopserve.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """`LLM(model, **engine_args).generate(prompts, params)`; engine args are the flat config
    names (`dtype`, `device`, `block_size`, `layout`, `max_num_seqs`, `mode`, `exit_mode`, ...)."""

    def __init__(
        self, model: str | None = None, *, data_parallel_size: int = 1, **engine_args: object
    ) -> None:
        """`data_parallel_size` > 1 runs that many engine replicas as Ray actors (one GPU each
        on CUDA) and splits each `generate` batch across them; `engine` is then None."""
        self._counter = 0
        self._replicas = None
        if data_parallel_size > 1:
            from loopserve.distributed.offline import DataParallelEngines

            self.engine = None
            self._replicas = DataParallelEngines(
                {"model": model, **engine_args}, data_parallel_size
            )
        else:
            self.engine = LLMEngine.from_engine_args(model=model, **engine_args)

    @property
    def tokenizer(self):
        if self._replicas is not None:
            return self._replicas.info.tokenizer
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidRequestError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts"
                )
        if self._replicas is not None:
            ids = [f"llm-{self._counter + i}" for i in range(len(prompt_list))]
            self._counter += len(ids)
            return self._replicas.generate(ids, prompt_list, params_list)
        # Only final outputs are read here: the engine need not assemble any other.
        params_list = [
            dataclasses.replace(p, output_kind="final_only")
            if isinstance(p, SamplingParams) and p.output_kind == "cumulative"
            else p
            for p in params_list
        ]
        ids = []
        try:
            for prompt, params in zip(prompt_list, params_list):
                request_id = f"llm-{self._counter}"
                self._counter += 1
                self.engine.add_request(request_id, prompt, params)
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # leave the engine clean when one prompt is rejected
                self.engine.abort_request(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while len(finished) < len(ids):
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(p, int) for p in prompts):
        return [list(prompts)]  # one prompt of token ids
    if isinstance(prompts, (list, tuple)):
        return [p if isinstance(p, str) else list(p) for p in prompts]
    raise InvalidRequestError(
        "prompts must be a string, a token-id list, or a list of those", "prompt"
    )
