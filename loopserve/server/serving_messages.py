"""`POST /v1/messages`: Anthropic's Messages API over the chat completions path.

The request (`protocol_messages.MessagesRequest`) becomes the chat completion request it means
and runs exactly as `/v1/chat/completions` runs it (`serving_chat.start_chat`); only the
answer's shape differs. Its `content`: a `thinking` block when the server's reasoning parser
found some (`signature` empty: nothing is signed), a `text` block when there is text, and a
`tool_use` block per call (`input` the call's arguments; a call `max_tokens` cut, whose
arguments are not JSON yet, is left out). `stop_reason`: `end_turn`, `stop_sequence` (with
`stop_sequence`), `tool_use` or `max_tokens`. Streaming sends Anthropic's events
(`message_start`, per block `content_block_start`, its deltas and `content_block_stop`, then
`message_delta` with the stop reason and `message_stop`); a call arrives whole, in one
`input_json_delta`. The message adds `exit_depths` (loops per output token) and
`usage.output_loops`. Errors keep this server's OpenAI shape.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from loopserve.errors import EngineDeadError, EngineNotReadyError
from loopserve.outputs import RequestOutput
from loopserve.server.api_errors import ApiError, engine_unavailable, failed_output_error, renamed
from loopserve.server.protocol_messages import (
    CHAT_TO_MESSAGES_PARAM,
    CountTokensRequest,
    MessagesRequest,
)
from loopserve.server.serving_as_chat import answer_as_chat, as_chat_request
from loopserve.server.serving_chat import ChatRun, render_chat
from loopserve.server.serving_common import ServingContext, parse_body


async def create_message(ctx: ServingContext, raw_body: bytes, http_request: Request) -> Response:
    request = parse_body(raw_body, MessagesRequest)
    message_id = f"msg_{uuid.uuid4().hex}"
    events = (lambda run: _events(ctx, run, message_id)) if request.stream else None
    answer = await answer_as_chat(
        ctx, request.chat_fields(), http_request, message_id, CHAT_TO_MESSAGES_PARAM, events
    )
    if isinstance(answer, Response):
        return answer
    run, out, message = answer.run, answer.output, answer.message
    content: list[dict[str, Any]] = []
    if message.reasoning_content:
        content.append(_thinking(message.reasoning_content))
    if message.content:
        content.append({"type": "text", "text": message.content})
    content += [
        block
        for call in message.tool_calls or ()
        if (block := _tool_use(call.id, call.function["name"], call.function["arguments"]))
    ]
    stop_reason, stop_sequence = _stop(out, called=bool(message.tool_calls))
    return JSONResponse({
        **_message(ctx, message_id, content),
        "stop_reason": stop_reason, "stop_sequence": stop_sequence,
        "usage": _usage(run, out, out.num_output_tokens, sum(out.exit_depths)),
        "exit_depths": list(out.exit_depths),
    })  # fmt: skip


async def count_tokens(ctx: ServingContext, raw_body: bytes) -> dict[str, int]:
    """`POST /v1/messages/count_tokens`: the prompt's tokens as the request would run it
    (chat template, system, tools)."""
    request = parse_body(raw_body, CountTokensRequest)
    try:
        _, _, processed = await render_chat(ctx, as_chat_request(request.chat_fields()))
    except ApiError as err:
        raise renamed(err, CHAT_TO_MESSAGES_PARAM) from None
    return {"input_tokens": len(processed.token_ids)}


def _message(ctx: ServingContext, message_id: str, content: list) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant",
            "model": ctx.served_model_name, "content": content}  # fmt: skip


def _thinking(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any] | None:
    """A call as a `tool_use` block (its id as Anthropic spells them), or None when its
    arguments are not a JSON object (`max_tokens` cut it)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    return {"type": "tool_use", "id": "toolu_" + call_id.removeprefix("call_"), "name": name,
            "input": value}  # fmt: skip


def _stop(out: RequestOutput, *, called: bool) -> tuple[str, str | None]:
    if out.finish_reason == "length":
        return "max_tokens", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return ("tool_use" if called else "end_turn"), None


def _usage(run: ChatRun, out: RequestOutput | None, output_tokens: int, loops: int) -> dict:
    cached = 0 if out is None else out.metrics.num_cached_prompt_tokens
    return {"input_tokens": len(run.prompt_ids) - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
            "output_loops": loops}  # fmt: skip


async def _events(ctx: ServingContext, run: ChatRun, message_id: str) -> AsyncIterator[str]:
    """The stream's events: a block opens when its first text (or call) arrives and closes
    when another kind begins or the message ends."""
    index = -1  # the open block's index
    open_kind: str | None = None  # "thinking" / "text"
    num_calls = 0

    def event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    def close() -> list[str]:
        nonlocal open_kind
        if open_kind is None:
            return []
        open_kind = None
        return [event("content_block_stop", index=index)]

    def text(kind: str, piece: str) -> list[str]:
        nonlocal index, open_kind
        lines = []
        if open_kind != kind:
            lines += close()
            index, open_kind = index + 1, kind
            start = _thinking("") if kind == "thinking" else {"type": "text", "text": ""}
            lines.append(event("content_block_start", index=index, content_block=start))
        delta = ({"type": "thinking_delta", "thinking": piece} if kind == "thinking"
                 else {"type": "text_delta", "text": piece})  # fmt: skip
        return [*lines, event("content_block_delta", index=index, delta=delta)]

    def call(call_id: str, function: dict[str, str]) -> list[str]:
        nonlocal index
        block = _tool_use(call_id, function["name"], function["arguments"])
        if block is None:  # cut by max_tokens: not a call yet
            return []
        index += 1
        partial = json.dumps(block["input"], ensure_ascii=False)
        return [*close(),
                event("content_block_start", index=index, content_block={**block, "input": {}}),
                event("content_block_delta", index=index,
                      delta={"type": "input_json_delta", "partial_json": partial}),
                event("content_block_stop", index=index)]  # fmt: skip

    final: RequestOutput | None = None
    num_tokens, loops = 0, 0
    try:
        with run.stream:
            start = {**_message(ctx, message_id, []), "stop_reason": None,
                     "stop_sequence": None, "usage": _usage(run, None, 0, 0)}  # fmt: skip
            yield event("message_start", message=start)
            async for out, delta in run.deltas():
                if delta is None:
                    error = failed_output_error(out).info
                    yield event("error", error={"type": error.type, "message": error.message})
                    return
                num_tokens += len(out.new_token_ids)
                loops += sum(out.new_exit_depths)
                if out.finished:
                    final = out
                lines: list[str] = []
                if delta.reasoning_content:
                    lines += text("thinking", delta.reasoning_content)
                if delta.content:
                    lines += text("text", delta.content)
                for made in delta.tool_calls or ():
                    num_calls += 1
                    lines += call(made.id, made.function)
                for line in lines:
                    yield line
            for line in close():
                yield line
            assert final is not None
            stop_reason, stop_sequence = _stop(final, called=num_calls > 0)
            yield event("message_delta",
                        delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        usage=_usage(run, final, num_tokens, loops))  # fmt: skip
            yield event("message_stop")
    except (EngineNotReadyError, EngineDeadError) as err:
        info = engine_unavailable(err).info
        yield event("error", error={"type": info.type, "message": info.message})
