"""`POST /v1/chat/completions`: messages rendered by the model's chat template, then generated.

The prompt is rendered with the model's chat template and tokenized without extra special tokens
(the template already places them), by the engine's `InputProcessor` in a worker thread. Unless
`ignore_eos` is set, the template family's end-of-turn tokens stop generation. Streaming sends a
`role: "assistant"` delta per choice first, then content deltas, a final chunk with
`finish_reason`, an optional usage chunk and `[DONE]`. Every choice carries `exit_depths` (loops
used per output token).

Tools (`loopserve.text.tools`): the request's `tools` reach the model through its chat
template (or, for a template that does not render tools, the Hermes convention written into
the messages); `tool_choice` `required` or a named function constrains the output to call
blocks with a grammar; the server's tool-call parser turns the answer's call blocks into
`tool_calls` (`finish_reason` `tool_calls`), streamed as one delta per call.
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
from loopserve.server.api_errors import engine_unavailable, failed_output_error
from loopserve.server.output_format import (
    new_logprobs,
    prompt_exit_depths,
    token_text,
    usage,
    vllm_prompt_logprobs,
)
from loopserve.server.protocol_chat import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobAlternative,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
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
from loopserve.server.serving_tools import ChatTools
from loopserve.text.reasoning import ReasoningParser, ReasoningStream, reasoning_token_count
from loopserve.text.tokenizer import Tokenizer


@dataclass
class ChatRun:
    """A chat request submitted to the engine: what its answer's formatting needs (the chat
    completions endpoint's, and the Responses API's, `serving_responses`)."""

    body: ChatCompletionRequest
    response_id: str
    requests: list[GenerateRequest]
    stream: EngineStream
    tokenizer: Tokenizer | None
    reasoning: _Reasoning
    tools: ChatTools
    prompt_ids: list[int]
    loop_class: str | None

    async def deltas(self) -> AsyncIterator[tuple[RequestOutput, ChatDelta | None]]:
        """A one-choice run's outputs that add something, each with its delta split into
        reasoning, content and calls (numbered on; a call `max_tokens` cut sent as cut), for
        the endpoints that write their own stream events (Responses, Messages); an output
        that failed comes with None, and nothing follows it."""
        splitter, call_splitter = self.reasoning.stream(), self.tools.stream()
        num_calls = 0
        async for out in self.stream:
            if out.error is not None:
                yield out, None
                return
            if not (out.new_text or out.new_token_ids or out.finished):
                continue
            delta = self.reasoning.delta(splitter, out.new_text, out.finished)
            delta = self.tools.delta(
                call_splitter, delta, out.finished, num_calls,
                truncated=out.finish_reason == "length",
            )  # fmt: skip
            num_calls += len(delta.tool_calls or ())
            yield out, delta


async def create_chat_completion(
    ctx: ServingContext, raw_body: bytes, http_request: Request
) -> Response:
    body, loop_class = ctx.prepare(parse_body(raw_body, ChatCompletionRequest), http_request)
    run = await start_chat(ctx, body, loop_class, f"chatcmpl-{uuid.uuid4().hex}")
    body, response_id, requests, stream = run.body, run.response_id, run.requests, run.stream
    tokenizer, reasoning, tools, prompt_ids = (
        run.tokenizer,
        run.reasoning,
        run.tools,
        run.prompt_ids,
    )
    if body.stream:
        events = _stream_events(
            ctx, body, response_id, stream, requests, tokenizer, reasoning, tools
        )
        return StreamingResponse(events, media_type="text/event-stream")
    finals = await cancel_on_disconnect(http_request, collect_finals(stream))
    stream.close()
    if finals is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    outputs = [finals[request.request_id] for request in requests]
    messages = [
        tools.message(reasoning.message(out.text), truncated=out.finish_reason == "length")
        for out in outputs
    ]
    response = ChatCompletionResponse(
        id=response_id,
        model=ctx.served_model_name,
        choices=[
            ChatChoice(
                index=index,
                message=messages[index],
                logprobs=logprob_entries(body, tokenizer, out.logprobs or []),
                finish_reason=tools.finish_reason(
                    out.finish_reason, bool(messages[index].tool_calls)
                ),
                stop_reason=out.stop_reason,
                exit_depths=out.exit_depths,
                token_ids=out.token_ids if body.return_token_ids else None,
            )
            for index, out in enumerate(outputs)
        ],
        usage=usage(
            len(prompt_ids),
            sum(out.num_output_tokens for out in outputs),
            outputs[0].metrics.num_cached_prompt_tokens if outputs else 0,
            reasoning.num_tokens([list(out.token_ids) for out in outputs]),
            sum(sum(out.exit_depths) for out in outputs),
        ),
        prompt_logprobs=vllm_prompt_logprobs(tokenizer, outputs[0], body.prompt_logprobs)
        if outputs
        else None,
        prompt_exit_depths=prompt_exit_depths(outputs[0]) if outputs else None,
        loop_class=run.loop_class,
    )
    return JSONResponse(response.model_dump())


async def render_chat(ctx: ServingContext, body: ChatCompletionRequest):
    """A chat request's prompt as the model sees it (chat template, tools): its tokenizer,
    tools and processed input."""
    ctx.check_model(body.model)
    tokenizer = ctx.tokenizer()
    processor = ctx.input_processor()
    tools = ChatTools.of(ctx, body, tokenizer)
    messages, template_tools = tools.render(body)
    processed = await process_text(
        lambda: processor.process_chat(
            messages, add_generation_prompt=body.add_generation_prompt, tools=template_tools
        )
    )
    return tokenizer, tools, processed


async def start_chat(
    ctx: ServingContext, body: ChatCompletionRequest, loop_class: str | None, response_id: str
) -> ChatRun:
    """Render, tokenize and submit a prepared chat request (`ctx.prepare`): its `n` engine
    requests, their stream, and the reasoning and tool parsing of its answers."""
    tokenizer, tools, processed = await render_chat(ctx, body)
    processor = ctx.input_processor()
    constraint = await process_text(lambda: tools.constraint(body, processor))
    prompt_ids = processed.token_ids
    # 0 is a value (a 400 from SamplingParams), not "unset".
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    if max_tokens is None:
        max_tokens = ctx.default_max_tokens(len(prompt_ids))
    stop_ids = () if body.ignore_eos else tokenizer.end_of_turn_token_ids
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    requests = [
        GenerateRequest(
            f"{response_id}-{i}",
            processed,
            sampling_params(
                body,
                max_tokens=max_tokens,
                logprobs=logprobs,
                seed=choice_seed(body.seed, i),
                extra_stop_token_ids=stop_ids,
                stream=body.stream,
                structured=constraint,
                close_objects=ctx.close_json_objects,
            ),
        )
        for i in range(body.n)
    ]
    stream = await submit(ctx, requests, loop_class)
    reasoning = _Reasoning.of(ctx.reasoning_parser, tokenizer, prompt_ids)
    return ChatRun(
        body, response_id, requests, stream, tokenizer, reasoning, tools, prompt_ids, loop_class
    )


class _Reasoning:
    """The server's reasoning parser (`--reasoning-parser`, None: text as written) for one
    chat request: whether its prompt already opened the reasoning block, and the message,
    stream deltas and reasoning-token count of its choices."""

    def __init__(
        self, parser: ReasoningParser | None, tokenizer: Tokenizer | None, started: bool
    ) -> None:
        self.parser, self.tokenizer, self.started = parser, tokenizer, started

    @classmethod
    def of(cls, parser: ReasoningParser | None, tokenizer: Tokenizer | None, prompt_ids):
        started = False
        if parser is not None and tokenizer is not None:  # the template opened the block
            tail = tokenizer.decode(list(prompt_ids[-16:]), skip_special_tokens=False)
            started = tail.rstrip().endswith(parser.start)
        return cls(parser, tokenizer, started)

    def message(self, text: str) -> ChatResponseMessage:
        if self.parser is None:
            return ChatResponseMessage(content=text)
        reasoning, content = self.parser.split(text, started=self.started)
        return ChatResponseMessage(content=content, reasoning_content=reasoning)

    def stream(self) -> ReasoningStream | None:
        return None if self.parser is None else ReasoningStream(self.parser, started=self.started)

    @staticmethod
    def delta(splitter: ReasoningStream | None, new_text: str, finished: bool) -> ChatDelta:
        if splitter is None:
            return ChatDelta(content=new_text)
        reasoning, content = splitter.feed(new_text)
        if finished:
            more_reasoning, more_content = splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if reasoning and not content:
            return ChatDelta(reasoning_content=reasoning)
        return ChatDelta(content=content, reasoning_content=reasoning or None)

    def num_tokens(self, outputs: list[list[int]]) -> int | None:
        """Reasoning tokens of all choices' output token ids (None without a parser: usage
        shows none)."""
        if self.parser is None or self.tokenizer is None:
            return None
        decode = self.tokenizer.decode
        return sum(
            reasoning_token_count(self.parser, decode, ids, started=self.started) for ids in outputs
        )


def logprob_entries(
    body: ChatCompletionRequest, tokenizer: Tokenizer | None, entries: list[TokenLogprob]
) -> ChatLogprobs | None:
    if not body.logprobs:
        return None
    content = []
    for entry in entries:
        token = token_text(tokenizer, entry.token_id)
        top = [
            ChatLogprobAlternative(token=t, logprob=lp, bytes=list(t.encode()))
            for t, lp in ((token_text(tokenizer, tid), lp) for tid, lp in entry.top_logprobs)
        ]
        content.append(
            ChatLogprobEntry(
                token=token, logprob=entry.logprob, bytes=list(token.encode()), top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)


async def _stream_events(
    ctx: ServingContext,
    body: ChatCompletionRequest,
    response_id: str,
    stream: EngineStream,
    requests: list[GenerateRequest],
    tokenizer: Tokenizer | None,
    reasoning: _Reasoning,
    tools: ChatTools,
) -> AsyncIterator[str]:
    created = int(time.time())
    index_of = {request.request_id: i for i, request in enumerate(requests)}
    finals: dict[int, RequestOutput] = {}
    splitters = [reasoning.stream() for _ in requests]
    call_splitters = [tools.stream() for _ in requests]
    num_calls = [0] * len(requests)  # each choice's calls sent so far
    # Each choice's tokens (outputs carry deltas), kept only for the reasoning-token count.
    output_ids: list[list[int]] = [[] for _ in requests]
    loops = [0] * len(requests)  # each choice's loops so far

    def chunk(choices: list[ChatStreamChoice], **extra: object) -> str:
        return sse(
            ChatCompletionChunk(
                id=response_id,
                created=created,
                model=ctx.served_model_name,
                choices=choices,
                **extra,
            )
        )

    try:
        with stream:
            for index in range(len(requests)):
                role = ChatDelta(role="assistant", content="")
                yield chunk([ChatStreamChoice(index=index, delta=role)])
            async for out in stream:
                if out.error is not None:
                    yield sse(failed_output_error(out).body)
                    break
                index = index_of[out.request_id]
                if reasoning.parser is not None:
                    output_ids[index].extend(out.new_token_ids)
                loops[index] += sum(out.new_exit_depths)
                if out.finished:
                    finals[index] = out
                if not (out.new_text or out.new_token_ids or out.finished):
                    continue
                delta = reasoning.delta(splitters[index], out.new_text, out.finished)
                delta = tools.delta(
                    call_splitters[index], delta, out.finished, num_calls[index],
                    truncated=out.finish_reason == "length",
                )  # fmt: skip
                num_calls[index] += len(delta.tool_calls or ())
                choice = ChatStreamChoice(
                    index=index,
                    delta=delta,
                    logprobs=logprob_entries(body, tokenizer, new_logprobs(out)),
                    finish_reason=tools.finish_reason(out.finish_reason, num_calls[index] > 0),
                    stop_reason=out.stop_reason if out.finished else None,
                    exit_depths=out.new_exit_depths,
                    token_ids=out.new_token_ids if body.return_token_ids else None,
                )
                if body.continuous_usage:  # this choice's tokens so far (vLLM semantics)
                    running = usage(
                        len(out.prompt_token_ids), out.num_output_tokens,
                        out.metrics.num_cached_prompt_tokens, loops=loops[index],
                    )  # fmt: skip
                    yield chunk([choice], usage=running)
                    continue
                yield chunk([choice])
            else:
                if body.include_usage:
                    completion_tokens = sum(out.num_output_tokens for out in finals.values())
                    prompt_tokens = len(finals[0].prompt_token_ids) if finals else 0
                    cached = finals[0].metrics.num_cached_prompt_tokens if finals else 0
                    yield chunk(
                        [],
                        usage=usage(
                            prompt_tokens, completion_tokens, cached,
                            reasoning.num_tokens(output_ids), sum(loops),
                        ),
                    )  # fmt: skip
    except (EngineNotReadyError, EngineDeadError) as err:
        yield sse(engine_unavailable(err).body)
    yield SSE_DONE
