"""What the completions and chat handlers share: parsing, submission, collecting, SSE.

`ServingContext` is the per-app state: the `EngineClient`, the served model name and the
limits. Prompt text work (chat templates, tokenization) goes through the engine's
`InputProcessor` in a worker thread (`process_text`), never on the event loop, so a huge
prompt does not stall `/health` or other streams. Every failure a handler can report becomes
an `ApiError` (`server/api_errors.py` decides the status codes; `api_server` renders it);
what an output writes besides its text is `server/output_format.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from loopserve.engine.client import EngineClient, EngineStream, GenerateRequest, ModelInfo
from loopserve.errors import (
    EngineDeadError,
    EngineNotReadyError,
    InvalidRequestError,
    QueueFullError,
)
from loopserve.outputs import RequestOutput
from loopserve.sampling_params import SamplingParams, StructuredOutput
from loopserve.server.api_errors import ApiError, engine_unavailable, failed_output_error
from loopserve.server.args import DEFAULT_CHAT_MAX_TOKENS
from loopserve.server.loop_classes import LoopClasses
from loopserve.server.middleware import sent_api_key
from loopserve.server.protocol import (
    SamplingRequest,
)
from loopserve.text.input_processor import InputProcessor, check_stop_strings
from loopserve.text.reasoning import ReasoningParser
from loopserve.text.tokenizer import Tokenizer
from loopserve.text.tools import HermesToolParser

ModelT = TypeVar("ModelT", bound=BaseModel)
T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"
logger = logging.getLogger(__name__)


@dataclass
class ServingContext:
    client: EngineClient
    served_model_name: str
    allow_client_priority: bool = False
    default_max_tokens_cap: int = DEFAULT_CHAT_MAX_TOKENS
    # Looped-model fields for requests that leave them unset (`--request-defaults`).
    request_defaults: dict[str, object] = field(default_factory=dict)
    # Moves chat answers' reasoning into `reasoning_content` (`--reasoning-parser`).
    reasoning_parser: ReasoningParser | None = None
    # `--loop-classes`: named loop budgets (None: the server has none).
    loop_classes: LoopClasses | None = None
    # `--json-schema-closed`: every JSON schema's objects closed unless they say otherwise.
    close_json_objects: bool = False
    # Reads tool calls from chat answers that offered tools (`--tool-call-parser`).
    tool_call_parser: HermesToolParser | None = None
    # `/tokenize` and `/detokenize` work runs here, apart from the pool that tokenizes the
    # prompts of generation requests: huge `/tokenize` bodies cannot hold those up.
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenize-endpoint")
    )

    def with_defaults(self, body: ModelT) -> ModelT:
        """`body` with `request_defaults` filling the fields it leaves unset."""
        unset = {k: v for k, v in self.request_defaults.items() if getattr(body, k) is None}
        return body.model_copy(update=unset) if unset else body

    def prepare(self, body: ModelT, http_request) -> tuple[ModelT, str | None]:
        """(`body` with its loop class's fields and then `request_defaults` filling the
        fields it leaves unset, its class's name or None). A client-set priority needs
        `--allow-client-priority`; otherwise the class's priority applies."""
        if "priority" in body.model_fields_set and body.priority != 0:  # type: ignore[attr-defined]
            if not self.allow_client_priority:
                raise ApiError(
                    400,
                    "priority is disabled on this server (start it with --allow-client-priority)",
                    param="priority",
                )
        loop_class = None
        if self.loop_classes is not None:
            try:
                loop_class = self.loop_classes.pick(
                    body.loop_class, sent_api_key(http_request.headers)
                )  # type: ignore[attr-defined]
            except InvalidRequestError as err:
                raise ApiError(400, err.message, param=err.param) from None
        elif body.loop_class is not None:  # type: ignore[attr-defined]
            raise ApiError(
                400, "this server has no loop classes (see --loop-classes)", param="loop_class"
            )
        if loop_class is not None:
            update = {k: v for k, v in loop_class.loop_fields().items()
                      if getattr(body, k) is None}  # fmt: skip
            if "priority" not in body.model_fields_set:
                update["priority"] = loop_class.priority
            body = body.model_copy(update=update)
        return self.with_defaults(body), None if loop_class is None else loop_class.name

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        return default_max_tokens(self.model_info(), num_prompt_tokens, self.default_max_tokens_cap)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise ApiError(
                404,
                f"the model `{model}` does not exist; this server serves "
                f"`{self.served_model_name}`",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )

    def model_info(self) -> ModelInfo:
        try:
            return self.client.model_info()
        except (EngineNotReadyError, EngineDeadError) as err:
            raise engine_unavailable(err) from err

    def tokenizer(self) -> Tokenizer | None:
        return self.model_info().tokenizer

    def input_processor(self) -> InputProcessor:
        return self.model_info().input_processor


async def process_text(work: Callable[[], T], pool: ThreadPoolExecutor | None = None) -> T:
    """Run prompt text work (templating, tokenization) in a worker thread (of `pool`, else the
    event loop's default executor); its rejections (`InvalidRequestError`, including
    `CapacityError`) become 400s."""
    try:
        if pool is None:
            return await asyncio.to_thread(work)
        return await asyncio.get_running_loop().run_in_executor(pool, work)
    except InvalidRequestError as err:
        raise ApiError(400, err.message, param=err.param) from None


def parse_body(raw: bytes, model_cls: type[ModelT]) -> ModelT:
    """Validate a JSON body; malformed JSON and invalid fields are 400s naming the field."""
    try:
        return model_cls.model_validate_json(raw)
    except ValidationError as err:
        raise validation_error(err) from None


def validation_error(err: ValidationError) -> ApiError:
    """The 400 of a request model's failed validation, naming the field."""
    errors = err.errors()
    if errors[0]["type"] == "json_invalid":
        return ApiError(400, f"malformed JSON body: {errors[0]['msg']}")
    # Of a union's failed branches, the deepest one says the most ("should be 'text'").
    first = max(errors, key=lambda error: len(error["loc"]))
    path = [str(p) for p in first["loc"] if not _is_union_tag(p)]
    param = path[0] if path else None
    where = ".".join(path) or "body"
    if param == "prompt":
        message = (
            "prompt must be a string, a list of token ids, or a list of strings "
            "or of token-id lists"
        )
    elif first["type"] == "extra_forbidden":
        message = f"unsupported field '{where}'"
    else:
        message = f"invalid value for '{where}': {first['msg'].removeprefix('Value error, ')}"
    return ApiError(400, message, param=param)


def _is_union_tag(loc_part: str | int) -> bool:
    """pydantic names the union member that failed (`str`, `list[int]`) inside `loc`."""
    if isinstance(loc_part, int):
        return False
    return "[" in loc_part or loc_part in ("str", "int", "float", "bool", "none")


def sampling_params(
    request: SamplingRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    seed: int | None,
    extra_stop_token_ids: tuple[int, ...] = (),
    stream: bool = False,
    prompt_logprobs: int | None = None,
    structured: StructuredOutput | None = None,
    close_objects: bool = False,
) -> SamplingParams:
    """`SamplingParams` for one choice; its validation errors (and the stop-string limits)
    become 400s naming the field. A streamed choice asks for "delta" outputs (per-chunk work
    independent of the stream's length), any other for its final output only. The engine
    scores the prompt with the larger of `prompt_logprobs` (the caller's: completions' echo)
    and the request's own vLLM field. `structured`: a constraint of the server's own (an
    enforced tool call) in place of the request's; `close_objects`: the server's
    `--json-schema-closed`."""
    if request.prompt_logprobs is not None:
        if stream:
            raise ApiError(
                400, "prompt_logprobs is not supported with stream", param="prompt_logprobs"
            )
        own = request.prompt_logprobs  # a negative value: SamplingParams names it
        prompt_logprobs = max(prompt_logprobs or 0, own) if own >= 0 else own
    fields: dict[str, object] = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_loops": request.min_loops,
        "exit_threshold": request.exit_threshold,
        "exit_stable_steps": request.exit_stable_steps,
        "brownout_floor": request.brownout_floor,
        "max_tokens": max_tokens,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "min_tokens": request.min_tokens,
        "prompt_logprobs_loop": request.prompt_logprobs_loop,
        "speculative": request.speculative,
    }
    try:
        fields["structured_output"] = structured or request.structured_output(close_objects)
        params = SamplingParams(
            **{name: value for name, value in fields.items() if value is not None},
            max_loops=request.max_loops,
            seed=seed,
            stop=tuple(request.stop_strings),
            stop_token_ids=(*(request.stop_token_ids or ()), *extra_stop_token_ids),
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            priority=request.priority,
            output_kind="delta" if stream else "final_only",
            prompt_logprobs=prompt_logprobs,
            logit_bias=request.logit_bias_ids,
        )
        check_stop_strings(params.stop)
        return params
    except InvalidRequestError as err:
        raise ApiError(400, err.message, param=err.param) from None


def default_max_tokens(
    info: ModelInfo, num_prompt_tokens: int, cap: int = DEFAULT_CHAT_MAX_TOKENS
) -> int:
    """Chat's `max_tokens` when the client gives none: what fits in the context and in the KV
    cache, capped at `cap` (`--default-max-tokens`) because admission reserves the worst case."""
    kv_positions = info.kv_positions_per_request_max
    fits = min(info.max_model_len - num_prompt_tokens, kv_positions + 1 - num_prompt_tokens)
    return max(1, min(fits, cap))


def choice_seed(seed: int | None, sample_index: int) -> int | None:
    """Sample i of a request with a seed uses seed + i, so n > 1 is reproducible."""
    return None if seed is None else seed + sample_index


async def submit(
    ctx: ServingContext, requests: list[GenerateRequest], loop_class: str | None = None
) -> EngineStream:
    """Submit all requests of one HTTP call (of `loop_class`, counted per class in
    /metrics), mapping rejections to HTTP errors. Priorities were checked by `prepare`."""
    metrics = getattr(ctx.client, "metrics", None)
    if loop_class is not None and metrics is not None:
        for request in requests:
            metrics.request_classes[request.request_id] = loop_class
    try:
        return await _submit(ctx, requests)
    except ApiError:
        if metrics is not None:  # not submitted: nothing will finish under the class
            for request in requests:
                metrics.request_classes.pop(request.request_id, None)
        raise


async def _submit(ctx: ServingContext, requests: list[GenerateRequest]) -> EngineStream:
    try:
        return await ctx.client.submit(requests)
    except InvalidRequestError as err:  # includes CapacityError
        raise ApiError(400, err.message, param=err.param) from None
    except QueueFullError as err:
        raise ApiError(
            429,
            str(err),
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(err.retry_after_s)},
        ) from None
    except (EngineNotReadyError, EngineDeadError) as err:
        raise engine_unavailable(err) from None


async def collect_finals(stream: EngineStream) -> dict[str, RequestOutput]:
    """Drain a stream to the final output of each request; engine failures raise ApiError, and
    so does a submission whose requests were all aborted before producing a token (503 during
    shutdown, else 500)."""
    finals: dict[str, RequestOutput] = {}
    with stream:
        try:
            async for output in stream:
                if output.error is not None:
                    raise failed_output_error(output)
                if output.finished:
                    finals[output.request_id] = output
        except (EngineNotReadyError, EngineDeadError) as err:
            raise engine_unavailable(err) from None
    if finals and all(o.finish_reason == "abort" and not o.token_ids for o in finals.values()):
        if not stream.owner.is_accepting:
            raise ApiError(
                503,
                "the server shut down before this request produced any output",
                type="server_error",
                code="shutting_down",
            )
        error_id = uuid.uuid4().hex[:16]
        logger.error(
            "the engine aborted requests %s before they produced output (error id %s)",
            sorted(finals),
            error_id,
        )
        raise ApiError(
            500,
            f"the engine aborted this request before it produced any output (error id "
            f"{error_id}; details are in the server log)",
            type="server_error",
            code="aborted",
        )
    return finals


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work` until it finishes or the client disconnects (then cancel it, return None).

    Cancelling closes the work's output stream, which aborts its requests.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(payload: BaseModel | dict) -> str:
    """One server-sent event carrying `payload` as JSON."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
