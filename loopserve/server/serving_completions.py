"""`POST /v1/completions`: prompts in, text completions out (whole or as SSE chunks).

A body may carry one prompt or a batch (strings or token-id lists); every prompt gets `n`
independent samples, and choice `prompt_index * n + sample_index` answers it. All samples are
submitted at once, so a rejection of any of them is a 400 before any work is done. Prompts are
checked and tokenized by the engine's `InputProcessor` in a worker thread, off the event loop.
Each choice carries `exit_depths` (loops used per output token); streaming chunks carry the new
ones.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from loopserve.engine.client import EngineStream, GenerateRequest
from loopserve.errors import EngineDeadError, EngineNotReadyError
from loopserve.outputs import RequestOutput, TokenLogprob
from loopserve.server.api_errors import ApiError, engine_unavailable, failed_output_error
from loopserve.server.output_format import (
    completion_logprobs,
    new_logprobs,
    prompt_exit_depths,
    usage,
    vllm_prompt_logprobs,
)
from loopserve.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from loopserve.server.serving_common import (
    SSE_DONE,
    ServingContext,
    cancel_on_disconnect,
    choice_seed,
    collect_finals,
    parse_body,
    process_text,
    sampling_params,
    sse,
    submit,
)
from loopserve.text.input_processor import ProcessedPrompt
from loopserve.text.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 16


@dataclass
class _Choice:
    """Per-choice state: which prompt it answers and what the client has seen so far."""

    request: GenerateRequest
    prompt_index: int
    echo_text: str
    text_offset: int = 0
    sent_echo: bool = False


async def create_completion(
    ctx: ServingContext, raw_body: bytes, http_request: Request
) -> Response:
    body, loop_class = ctx.prepare(parse_body(raw_body, CompletionRequest), http_request)
    ctx.check_model(body.model)
    prompts = _prompt_list(body.prompt)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    if max_tokens == 0 and body.echo:  # score only: run the prompt, report no new token
        max_tokens = 1
    params = [
        sampling_params(
            body,
            max_tokens=max_tokens,
            logprobs=body.logprobs,
            seed=choice_seed(body.seed, i),
            stream=body.stream,
            # echo + logprobs: the prompt's tokens come back scored too (legacy OpenAI shape)
            prompt_logprobs=body.logprobs if body.echo else None,
            close_objects=ctx.close_json_objects,
        )
        for i in range(body.n)
    ]
    tokenizer = ctx.tokenizer()
    processor = ctx.input_processor()
    processed = await process_text(lambda: [processor.process(prompt) for prompt in prompts])
    choices = [
        _Choice(
            GenerateRequest(f"{response_id}-{p * body.n + i}", prompt, params[i]),
            p,
            _echo_text(tokenizer, prompt) if body.echo else "",
        )
        for p, prompt in enumerate(processed)
        for i in range(body.n)
    ]
    stream = await submit(ctx, [choice.request for choice in choices], loop_class)
    if body.stream:
        events = _stream_events(ctx, body, response_id, stream, choices, tokenizer)
        return StreamingResponse(events, media_type="text/event-stream")
    finals = await cancel_on_disconnect(http_request, collect_finals(stream))
    stream.close()
    if finals is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    outputs = [finals[choice.request.request_id] for choice in choices]
    score_only = body.echo and body.max_tokens == 0
    response = CompletionResponse(
        id=response_id,
        model=ctx.served_model_name,
        choices=[
            _choice(
                body,
                index,
                choice.echo_text + ("" if score_only else out.text),
                out,
                tokenizer,
                _echoed_entries(body, out) + ([] if score_only else list(out.logprobs or [])),
                0,
                score_only=score_only,
            )
            for index, (choice, out) in enumerate(zip(choices, outputs))
        ],
        usage=_usage(choices, outputs, score_only=score_only),
        loop_class=loop_class,
    )
    return JSONResponse(response.model_dump())


def _prompt_list(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]  # one prompt of token ids
    return list(prompt)  # type: ignore[arg-type]


def _echo_text(tokenizer: Tokenizer | None, prompt: ProcessedPrompt) -> str:
    if prompt.text is not None:
        return prompt.text
    return "" if tokenizer is None else tokenizer.decode(prompt.token_ids)


def _echoed_entries(body: CompletionRequest, out: RequestOutput) -> list[TokenLogprob]:
    """With echo + logprobs: the prompt's tokens as logprob entries, the first one unscored
    (`null`, as the legacy OpenAI API reports it); else nothing."""
    if not (body.echo and body.logprobs is not None and out.prompt_logprobs):
        return []
    first = TokenLogprob(out.prompt_token_ids[0], None)  # type: ignore[arg-type]
    top = body.logprobs  # the engine may have scored more alternatives (`prompt_logprobs`)
    return [
        first,
        *(
            TokenLogprob(entry.token_id, entry.logprob, entry.top_logprobs[:top], entry.rank)
            for entry in out.prompt_logprobs[1:]
            if entry is not None
        ),
    ]


def _choice(
    body: CompletionRequest,
    index: int,
    text: str,
    out: RequestOutput,
    tokenizer: Tokenizer | None,
    logprob_entries: list[TokenLogprob] | None,
    text_offset: int,
    *,
    delta: bool = False,
    score_only: bool = False,
) -> CompletionChoice:
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(tokenizer, logprob_entries or [], text_offset)
    return CompletionChoice(
        index=index,
        text=text,
        logprobs=logprobs,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason if out.finished and not score_only else None,
        exit_depths=[] if score_only else out.new_exit_depths if delta else out.exit_depths,
        token_ids=([] if score_only else out.new_token_ids if delta else out.token_ids)
        if body.return_token_ids
        else None,
        prompt_logprobs=None
        if delta
        else vllm_prompt_logprobs(tokenizer, out, body.prompt_logprobs),
        prompt_exit_depths=None if delta else prompt_exit_depths(out),
    )


def _usage(
    choices: list[_Choice],
    outputs: list[RequestOutput],
    *,
    score_only: bool = False,
    loops: int | None = None,
) -> UsageInfo:
    """`loops`: the choices' loops (streamed outputs carry only their deltas); None: the
    outputs' exit depths."""
    prompt_tokens = {c.prompt_index: len(out.prompt_token_ids) for c, out in zip(choices, outputs)}
    cached = {}  # per prompt: its first choice's cache hits (the prompt is counted once)
    for c, out in zip(choices, outputs):
        cached.setdefault(c.prompt_index, out.metrics.num_cached_prompt_tokens)
    if loops is None:
        loops = sum(sum(out.exit_depths) for out in outputs)
    return usage(
        sum(prompt_tokens.values()),
        0 if score_only else sum(out.num_output_tokens for out in outputs),
        sum(cached.values()),
        loops=0 if score_only else loops,
    )


async def _stream_events(
    ctx: ServingContext,
    body: CompletionRequest,
    response_id: str,
    stream: EngineStream,
    choices: list[_Choice],
    tokenizer: Tokenizer | None,
) -> AsyncIterator[str]:
    created = int(time.time())
    index_of = {choice.request.request_id: i for i, choice in enumerate(choices)}
    finals: dict[int, RequestOutput] = {}
    score_only = body.echo and body.max_tokens == 0
    loops = [0] * len(choices)  # each choice's loops so far (outputs carry deltas)
    try:
        with stream:
            async for out in stream:
                if out.error is not None:
                    yield sse(failed_output_error(out).body)
                    break
                index = index_of[out.request_id]
                loops[index] += sum(out.new_exit_depths)
                choice = choices[index]
                text = "" if score_only else out.new_text
                entries = [] if score_only else new_logprobs(out)
                if not choice.sent_echo:
                    text, choice.sent_echo = choice.echo_text + text, True
                    entries = _echoed_entries(body, out) + entries
                if out.finished:
                    finals[index] = out
                if not (text or out.new_token_ids or out.finished):
                    continue
                chunk_choice = _choice(
                    body, index, text, out, tokenizer, entries, choice.text_offset, delta=True,
                    score_only=score_only,
                )  # fmt: skip
                if chunk_choice.logprobs is not None:
                    choice.text_offset += sum(len(t) for t in chunk_choice.logprobs.tokens)
                running = None
                if body.continuous_usage:  # this choice's tokens so far (vLLM semantics)
                    running = usage(
                        len(out.prompt_token_ids), out.num_output_tokens,
                        out.metrics.num_cached_prompt_tokens, loops=loops[index],
                    )  # fmt: skip
                yield sse(
                    CompletionResponse(
                        id=response_id,
                        created=created,
                        model=ctx.served_model_name,
                        choices=[chunk_choice],
                        usage=running,
                    )
                )
            else:
                if body.include_usage:
                    outputs = [finals[i] for i in range(len(choices))]
                    yield sse(
                        CompletionResponse(
                            id=response_id,
                            created=created,
                            model=ctx.served_model_name,
                            choices=[],
                            usage=_usage(choices, outputs, score_only=score_only, loops=sum(loops)),
                        )
                    )
    except (EngineNotReadyError, EngineDeadError) as err:
        yield sse(engine_unavailable(err).body)
    yield SSE_DONE
