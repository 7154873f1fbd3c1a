"""`POST /v1/responses`: OpenAI's Responses API over the chat completions path.

The request (`protocol_responses.ResponsesRequest`) becomes the chat completion request it
means (instructions and input items as messages, function tools, `text.format` as
`response_format`) and runs exactly as `/v1/chat/completions` runs it (`serving_chat.start_chat`:
the chat template, tools, reasoning parser, loop classes and defaults); only the answer's
shape differs. The answer's output items: a `reasoning` item when the server's reasoning parser
found some, a `message` with one `output_text` part when there is text (or nothing else), and
a `function_call` item per call the tool-call parser found. A response cut by
`max_output_tokens` has status `incomplete`. Streaming sends OpenAI's events in order
(`response.created`, `response.in_progress`, each item's `output_item.added`, its deltas, its
`done` events, then `response.completed` or `response.incomplete`), each with its
`sequence_number`; a call arrives whole, in one arguments delta. Like chat completions, the
response adds `exit_depths` (loops per output token) and `usage.output_loops`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from loopserve.errors import EngineDeadError, EngineNotReadyError
from loopserve.outputs import RequestOutput
from loopserve.server.api_errors import engine_unavailable, failed_output_error
from loopserve.server.output_format import new_logprobs
from loopserve.server.protocol_responses import CHAT_TO_RESPONSES_PARAM, ResponsesRequest
from loopserve.server.serving_as_chat import answer_as_chat
from loopserve.server.serving_chat import ChatRun, logprob_entries
from loopserve.server.serving_common import ServingContext, parse_body


async def create_response(ctx: ServingContext, raw_body: bytes, http_request: Request) -> Response:
    request = parse_body(raw_body, ResponsesRequest)
    response_id = f"resp_{uuid.uuid4().hex}"
    shape = _Shape(ctx, request, response_id)
    # The chat path's 400s name its fields: renamed to the Responses fields they came from
    # (at validation, at submission, and for a request that fails on its input as it runs).
    events = (lambda run: _events(run, shape)) if request.stream else None
    answer = await answer_as_chat(
        ctx, request.chat_fields(), http_request, response_id, CHAT_TO_RESPONSES_PARAM, events
    )
    if isinstance(answer, Response):
        return answer
    run, out, message = answer.run, answer.output, answer.message
    items = []
    if message.reasoning_content:
        items.append(shape.reasoning_item(message.reasoning_content))
    if message.content or not message.tool_calls:
        logprobs = _entries(run, out.logprobs or [])
        items.append(shape.message_item(message.content or "", logprobs=logprobs))
    items += [
        shape.call_item(call.id, call.function["name"], call.function["arguments"])
        for call in message.tool_calls or ()
    ]
    return JSONResponse(shape.response(items, out, run))


def _entries(run: ChatRun, logprobs) -> list[dict[str, Any]]:
    """Token log-probabilities in the Responses shape (chat's entries: token, logprob,
    bytes, top_logprobs), or none when the request did not include them."""
    entries = logprob_entries(run.body, run.tokenizer, logprobs)
    return [] if entries is None else [entry.model_dump() for entry in entries.content]


class _Shape:
    """The Responses API's objects for one response."""

    def __init__(self, ctx: ServingContext, request: ResponsesRequest, response_id: str) -> None:
        self.ctx, self.request, self.id = ctx, request, response_id
        self.created_at = int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"

    def message_item(
        self, text: str, status: str = "completed", logprobs: list | None = None
    ) -> dict[str, Any]:
        content = [self.text_part(text, logprobs)] if status == "completed" else []
        return {"type": "message", "id": self.message_id, "status": status,
                "role": "assistant", "content": content}  # fmt: skip

    @staticmethod
    def text_part(text: str, logprobs: list | None = None) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}

    def reasoning_item(self, text: str | None, status: str = "completed") -> dict[str, Any]:
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "content": content,
                "status": status}  # fmt: skip

    def call_item(
        self, call_id: str, name: str, arguments: str, status="completed"
    ) -> dict[str, Any]:
        item = {"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id,
                "name": name, "arguments": arguments, "status": status}  # fmt: skip
        namespace = self.request.namespace_of(name)
        if namespace is not None:
            item["namespace"] = namespace
        return item

    def response(
        self,
        output: list,
        out: RequestOutput | None = None,
        run: ChatRun | None = None,
        token_ids: list[int] | None = None,
        exit_depths: list[int] | None = None,
    ) -> dict[str, Any]:
        """The response object: in progress (`out` None) or finished, with `out`'s tokens
        and loops (or, for a stream's last delta, all of them: `token_ids`, `exit_depths`)."""
        request = self.request
        status, incomplete, usage, depths = "in_progress", None, None, None
        if out is not None and run is not None:
            status = "incomplete" if out.finish_reason == "length" else "completed"
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
            ids = list(out.token_ids) if token_ids is None else token_ids
            depths = list(out.exit_depths) if exit_depths is None else exit_depths
            usage = {
                "input_tokens": len(run.prompt_ids),
                "input_tokens_details": {"cached_tokens": out.metrics.num_cached_prompt_tokens},
                "output_tokens": out.num_output_tokens,
                "output_tokens_details": {"reasoning_tokens": run.reasoning.num_tokens([ids]) or 0},
                "total_tokens": len(run.prompt_ids) + out.num_output_tokens,
                "output_loops": sum(depths),
            }
        text_format = {"type": "text"}
        if request.text is not None and request.text.format is not None:
            text_format = request.text.format.model_dump(by_alias=True, exclude_none=True)
        tool_choice: Any = request.tool_choice or "auto"
        if not isinstance(tool_choice, str):
            tool_choice = tool_choice.model_dump()
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": None, "incomplete_details": incomplete,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "model": self.ctx.served_model_name, "output": output,
            "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": None,
            "temperature": request.temperature, "top_p": request.top_p,
            "tool_choice": tool_choice,
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or ()],
            "text": {"format": text_format}, "truncation": "disabled", "store": False,
            "metadata": request.metadata or {}, "usage": usage, "exit_depths": depths,
        }  # fmt: skip


async def _events(run: ChatRun, shape: _Shape) -> AsyncIterator[str]:
    """The stream's events: items open when their first text (or call) arrives and close at
    the end, in the order they opened."""
    sequence = 0
    output: list[dict[str, Any]] = []  # finished items, in output order
    open_items: dict[str, int] = {}  # "reasoning"/"message" -> output index
    texts = {"reasoning": "", "message": ""}
    # Log-probabilities: every token's (for the done events), and those not yet sent on a
    # text delta (a token whose text went to reasoning or a call, or is held back).
    all_logprobs: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []

    def event(kind: str, **fields: Any) -> str:
        nonlocal sequence
        sequence += 1
        data = json.dumps({"type": kind, "sequence_number": sequence - 1, **fields})
        return f"event: {kind}\ndata: {data}\n\n"

    def open_item(kind: str) -> list[str]:
        if kind in open_items:
            return []
        index = len(output) + len(open_items)
        open_items[kind] = index
        if kind == "reasoning":
            item = shape.reasoning_item(None, "in_progress")
            return [event("response.output_item.added", output_index=index, item=item)]
        item = shape.message_item("", "in_progress")
        part = shape.text_part("")
        return [
            event("response.output_item.added", output_index=index, item=item),
            event("response.content_part.added", item_id=shape.message_id, output_index=index,
                  content_index=0, part=part),
        ]  # fmt: skip

    def close_item(kind: str) -> list[str]:
        if kind not in open_items:
            return []
        index, text = open_items.pop(kind), texts[kind]
        if kind == "reasoning":
            item = shape.reasoning_item(text)
            done = [event("response.reasoning_text.done", item_id=shape.reasoning_id,
                          output_index=index, content_index=0, text=text)]  # fmt: skip
        else:
            item = shape.message_item(text, logprobs=all_logprobs)
            part = shape.text_part(text, all_logprobs)
            done = [
                event("response.output_text.done", item_id=shape.message_id, output_index=index,
                      content_index=0, text=text, logprobs=all_logprobs),
                event("response.content_part.done", item_id=shape.message_id, output_index=index,
                      content_index=0, part=part),
            ]  # fmt: skip
        output.insert(min(index, len(output)), item)
        return [*done, event("response.output_item.done", output_index=index, item=item)]

    def text_delta(kind: str, text: str) -> list[str]:
        """`text` added to the reasoning or message item (opened on its first text)."""
        lines = open_item(kind)
        texts[kind] += text
        if kind == "reasoning":
            name, item_id, extra = "response.reasoning_text.delta", shape.reasoning_id, {}
        else:
            name, item_id = "response.output_text.delta", shape.message_id
            extra = {"logprobs": pending[:]}
            pending.clear()
        index = open_items[kind]
        return [*lines, event(name, item_id=item_id, output_index=index, content_index=0,
                              delta=text, **extra)]  # fmt: skip

    final: RequestOutput | None = None
    token_ids: list[int] = []
    exit_depths: list[int] = []
    try:
        with run.stream:
            yield event("response.created", response=shape.response([]))
            yield event("response.in_progress", response=shape.response([]))
            async for out, delta in run.deltas():
                if delta is None:
                    error = failed_output_error(out).info
                    yield event("error", code=error.code, message=error.message, param=None)
                    return
                token_ids += out.new_token_ids
                exit_depths += out.new_exit_depths
                entries = _entries(run, new_logprobs(out))
                all_logprobs += entries
                pending += entries
                if out.finished:
                    final = out
                lines: list[str] = []
                if delta.reasoning_content:
                    lines += text_delta("reasoning", delta.reasoning_content)
                if delta.content or delta.tool_calls:
                    lines += close_item("reasoning")
                if delta.content:
                    lines += text_delta("message", delta.content)
                for call in delta.tool_calls or ():
                    lines += _call_events(shape, event, call.id, call.function, output, open_items)
                for line in lines:
                    yield line
            for kind in ("reasoning", "message"):
                for line in close_item(kind):
                    yield line
            if not output:  # nothing was said: an empty message, as the whole response has
                for line in open_item("message") + close_item("message"):
                    yield line
            assert final is not None
            response = shape.response(output, final, run, token_ids, exit_depths)
            yield event(f"response.{response['status']}", response=response)
    except (EngineNotReadyError, EngineDeadError) as err:
        info = engine_unavailable(err).info
        yield event("error", code=info.code, message=info.message, param=None)


def _call_events(shape, event, call_id, function, output, open_items) -> list[str]:
    """One whole call's item: added, its arguments in one delta, done."""
    index = len(output) + len(open_items)
    name, arguments = function["name"], function["arguments"]
    item_id = f"fc_{call_id}"
    added = shape.call_item(call_id, name, "", "in_progress")
    done = shape.call_item(call_id, name, arguments)
    output.append(done)
    return [
        event("response.output_item.added", output_index=index, item=added),
        event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
              delta=arguments),
        event("response.function_call_arguments.done", item_id=item_id, output_index=index,
              name=name, arguments=arguments),
        event("response.output_item.done", output_index=index, item=done),
    ]  # fmt: skip
