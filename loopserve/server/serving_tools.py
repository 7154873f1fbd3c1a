"""Tool calling for one chat request (`POST /v1/chat/completions`): its messages and tools
for the chat template, the grammar of an enforced call, and its answers' calls, whole or
per streamed choice. The text rules live in `loopserve.text.tools`; this is the server's
side of them (docs/serving.md, "Tool calling")."""

from __future__ import annotations

from loopserve.errors import InvalidRequestError
from loopserve.sampling_params import StructuredOutput
from loopserve.server.api_errors import ApiError
from loopserve.server.protocol_chat import ChatCompletionRequest, ChatDelta, ChatResponseMessage
from loopserve.server.protocol_tools import DeltaToolCall, ResponseToolCall
from loopserve.server.serving_common import ServingContext
from loopserve.text import tools as tool_text
from loopserve.text.tokenizer import Tokenizer


class ChatTools:
    """Tool calling for one chat request: its messages and tools for the template, the
    grammar of an enforced call, and its answers' calls (whole, or per streamed choice)."""

    def __init__(self, parser, names: list[str], native: bool, specials) -> None:
        self.parser = parser  # None: no calls are read (no tools offered)
        self.names = names
        self.native = native
        self.specials = specials

    @classmethod
    def of(cls, ctx: ServingContext, body: ChatCompletionRequest, tokenizer: Tokenizer | None):
        try:
            body.check_tools()
        except InvalidRequestError as err:
            raise ApiError(400, err.message, param=err.param) from None
        forced = body.forced_tool() is not False
        parser = None
        if body.offers_tools():
            parser = ctx.tool_call_parser
            if forced:  # the grammar writes Hermes blocks whatever the server reads
                parser = parser or tool_text.PARSERS["hermes"]
            elif parser is None:
                raise ApiError(
                    400,
                    "tool_choice 'auto' needs a tool-call parser; this server runs with "
                    "--tool-call-parser none (use 'required' or a named function, or 'none')",
                    param="tool_choice",
                )
        native = tokenizer is not None and tool_text.template_reads_tools(tokenizer.chat_template)
        names = [tool.function.name for tool in body.tools or ()]
        specials = tokenizer.special_texts if tokenizer is not None else ()
        return cls(parser, names, native, specials)

    def render(self, body: ChatCompletionRequest):
        """(messages, the template's `tools`) of the request."""
        raw = [message.template_dict() for message in body.messages]
        if self.native:  # the template renders the calls: they must not forge a turn
            for index, message in enumerate(raw):
                text = str(message.get("tool_calls", ""))
                if any(special in text for special in self.specials):
                    raise ApiError(
                        400,
                        f"messages[{index}].tool_calls spells a special token",
                        param="messages",
                    )
        listed = None
        if body.offers_tools():
            listed = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
        try:
            return tool_text.render(raw, listed, native=self.native)
        except InvalidRequestError as err:
            raise ApiError(400, err.message, param=err.param) from None

    def constraint(self, body: ChatCompletionRequest, processor) -> StructuredOutput | None:
        """The grammar of an enforced call (`required`, a named function), checked against
        the tokenizer (a schema llguidance cannot compile is a 400 naming `tools`)."""
        forced = body.forced_tool()
        if forced is False:
            return None
        listed = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
        grammar = tool_text.call_grammar(listed, forced, parallel=body.parallel_tool_calls)
        constraint = StructuredOutput(grammar=grammar)
        if processor.structured is None:
            raise ApiError(400, "enforced tool calls need the model's tokenizer", param="tools")
        try:
            processor.structured.check(constraint, param="tools")
        except InvalidRequestError as err:
            raise ApiError(400, err.message, param=err.param) from None
        return constraint

    def message(
        self, message: ChatResponseMessage, *, truncated: bool = False
    ) -> ChatResponseMessage:
        """The message with its content's call blocks made `tool_calls` (`truncated`: the
        output was cut at `max_tokens`; a call it cut keeps its arguments so far)."""
        if self.parser is None or message.content is None:
            return message
        content, calls = self.parser.parse(message.content, self.names, truncated=truncated)
        if not calls:
            return message
        listed = [ResponseToolCall(**call.openai()) for call in calls]
        return message.model_copy(update={"content": content, "tool_calls": listed})

    def stream(self) -> tool_text.ToolCallStream | None:
        return None if self.parser is None else self.parser.stream(self.names)

    @staticmethod
    def finish_reason(reason: str | None, called: bool) -> str | None:
        """OpenAI's `tool_calls` for an answer that stopped after calling."""
        return "tool_calls" if called and reason == "stop" else reason

    @staticmethod
    def delta(
        splitter, delta: ChatDelta, finished: bool, first_index: int, *, truncated: bool = False
    ) -> ChatDelta:
        """`delta` with its content's call blocks taken out, and the calls completed in it
        (numbered from `first_index`; `truncated`: the output was cut at `max_tokens`, and a
        call it cut is sent with its arguments so far)."""
        if splitter is None:
            return delta
        content, calls = splitter.feed(delta.content or "")
        if finished:
            rest, cut = splitter.finish(truncated=truncated)
            content, calls = content + rest, calls + cut
        if not calls:
            return delta.model_copy(update={"content": content})
        listed = [
            DeltaToolCall(index=first_index + i, **call.openai()) for i, call in enumerate(calls)
        ]
        return delta.model_copy(update={"content": content or None, "tool_calls": listed})
