"""Other APIs served as the chat completion they mean (`/v1/responses`, `/v1/messages`).

Each front end turns its request into chat fields (`chat_fields()`), and `answer_as_chat`
validates, prepares and starts them as `/v1/chat/completions` does, then either streams
(the front end's own events over the `ChatRun`) or collects the one output and the
assistant message it makes. The chat path's 400s name chat fields: they are renamed to the
fields of the API the request came in (`renames`). `as_chat_request` is the validation
alone (a Messages token count renders the prompt without running it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from loopserve.outputs import RequestOutput
from loopserve.server.api_errors import ApiError, renamed
from loopserve.server.protocol_chat import ChatCompletionRequest, ChatResponseMessage
from loopserve.server.serving_chat import ChatRun, start_chat
from loopserve.server.serving_common import (
    ServingContext,
    cancel_on_disconnect,
    collect_finals,
    validation_error,
)


@dataclass(frozen=True)
class ChatAnswer:
    """A finished request run as a chat completion: its run, its one output, and the
    assistant message that output makes (reasoning split off, tool calls parsed, a call cut
    at `max_tokens` kept as a call)."""

    run: ChatRun
    output: RequestOutput
    message: ChatResponseMessage


async def answer_as_chat(
    ctx: ServingContext,
    chat_fields: dict,
    http_request: Request,
    response_id: str,
    renames: dict[str, str],
    events: Callable[[ChatRun], AsyncIterator[str]] | None,
) -> Response | ChatAnswer:
    """Run another API's request as a chat completion: its event stream (`events(run)`,
    when the request streams), else its `ChatAnswer`; 499 when the client left meanwhile.
    400s name the request's own fields (`renames`: chat field -> its API's)."""
    try:
        body, loop_class = ctx.prepare(as_chat_request(chat_fields), http_request)
        run = await start_chat(ctx, body, loop_class, response_id)
        if events is not None:
            return StreamingResponse(events(run), media_type="text/event-stream")
        finals = await cancel_on_disconnect(http_request, collect_finals(run.stream))
    except ApiError as err:
        raise renamed(err, renames) from None
    run.stream.close()
    if finals is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    out = finals[run.requests[0].request_id]
    truncated = out.finish_reason == "length"
    return ChatAnswer(
        run, out, run.tools.message(run.reasoning.message(out.text), truncated=truncated)
    )


def as_chat_request(chat_fields: dict) -> ChatCompletionRequest:
    """Another API's request as the chat completion request it means (its 400s name chat
    fields; the caller renames them)."""
    try:
        return ChatCompletionRequest.model_validate(chat_fields)
    except ValidationError as err:
        raise validation_error(err) from None
