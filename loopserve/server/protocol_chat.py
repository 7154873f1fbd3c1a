"""The chat completions part of the OpenAI protocol (`server/protocol.py` has what the
endpoints share): the messages of a history, the request (with OpenAI's fields that ask
nothing of generation here), and the response, its choices and its stream chunks. Responses
add `exit_depths` (loops used per output token) to every choice."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_serializer, model_validator

from loopserve.errors import InvalidRequestError
from loopserve.server.protocol import (
    PromptLogprobs,
    SamplingRequest,
    UsageInfo,
    _Request,
    _without_unset,
)
from loopserve.server.protocol_tools import (
    DeltaToolCall,
    NamedToolChoice,
    ResponseToolCall,
    ToolCall,
    ToolDefinition,
)


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """A message of the history. An assistant message may carry `tool_calls` (its content
    may then be null); a `tool` message answers one call (`tool_call_id`)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # what the openai SDK echoes back from an assistant message

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("tool_call_id belongs to tool messages, and every one has it")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template reads it (`loopserve.text.tools.render`)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def nothing_stored(store: bool | None, what: str) -> bool | None:
    """OpenAI's `store`: false or null only (this server keeps no `what`)."""
    if store:
        raise ValueError(f"this server does not store {what}: send false or leave it out")
    return store


def metadata_within_sizes(metadata: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's `metadata` limits on keys and values (its 16 pairs are the field's length)."""
    for key, value in (metadata or {}).items():
        if len(key) > 64 or len(value) > 512:
            raise ValueError("keys are at most 64 characters and values at most 512")
    return metadata


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = Field(default=None, min_length=1)  # OpenAI's rule
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI fields that ask nothing of generation on this server, accepted as OpenAI
    # documents them: `store` (False or null: this server keeps no completions, so true is
    # a 400), `metadata` (tags for stored completions: at most 16 string pairs, keys of at
    # most 64 characters, values of at most 512), `safety_identifier` and
    # `prompt_cache_key` (identifiers OpenAI uses for abuse monitoring and cache routing;
    # prefix caching here needs no key), `service_tier` ("auto" or "default": the one tier).
    store: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default"] | None = None

    @field_validator("store")
    @classmethod
    def _nothing_is_stored(cls, store: bool | None) -> bool | None:
        return nothing_stored(store, "completions")

    @field_validator("metadata")
    @classmethod
    def _metadata_sizes(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        return metadata_within_sizes(metadata)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        return self

    def check_tools(self) -> None:
        """OpenAI's rules for `tools` and `tool_choice`, each a 400 naming the parameter."""
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise InvalidRequestError("tools name a function twice", param="tools")
        for tool in self.tools or ():
            parameters = tool.function.parameters
            if parameters is not None and parameters.get("type", "object") != "object":
                raise InvalidRequestError(
                    f"tools: the parameters of {tool.function.name!r} must be an object schema",
                    param="tools",
                )
        choice = self.tool_choice
        if choice is not None and choice != "none" and not names:
            raise InvalidRequestError(
                "tool_choice needs tools: it is only allowed when tools are specified",
                param="tool_choice",
            )
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidRequestError(
                f"tool_choice names {choice.function.name!r}, which is not in tools",
                param="tool_choice",
            )
        if self.forced_tool() is not False and self.structured_output() is not None:
            raise InvalidRequestError(
                "tool_choice 'required' or a named function already constrains the output: "
                "give no response_format or guided_* with it",
                param="tool_choice",
            )

    def offers_tools(self) -> bool:
        """The model is told about tools (some are given and tool_choice is not 'none')."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_tool(self) -> str | None | bool:
        """False: calls are not enforced (`auto`, `none`, no tools); None: some call is
        (`required`); a name: that function's call is."""
        if not self.tools:
            return False
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return None if self.tool_choice == "required" else False


# ---- responses ---------------------------------------------------------------------------


class ChatLogprobAlternative(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(ChatLogprobAlternative):
    top_logprobs: list[ChatLogprobAlternative] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the message is only tool calls (OpenAI's shape)
    # The reasoning a `--reasoning-parser` moved out of `content` (absent without one).
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None  # absent without calls

    @model_serializer(mode="wrap")
    def _reasoning_only_when_set(self, handler):
        return _without_unset(handler(self), ("reasoning_content", "tool_calls"))


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    exit_depths: list[int] = Field(default_factory=list)
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, for the request's one prompt
    prompt_exit_depths: list[int | None] | None = None  # the loops that scored it
    loop_class: str | None = None  # the request's loop class (`--loop-classes`)

    @model_serializer(mode="wrap")
    def _class_only_when_set(self, handler):
        return _without_unset(handler(self), ("loop_class",))


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # with `--reasoning-parser`
    tool_calls: list[DeltaToolCall] | None = None  # with tools

    @model_serializer(mode="wrap")
    def _role_only_when_set(self, handler):
        # OpenAI sends the role in the first delta only; later deltas carry no role key
        # (never "role": null, which some clients reject); likewise the reasoning and calls.
        return _without_unset(handler(self), ("role", "reasoning_content", "tool_calls"))


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token id (as completions)
    exit_depths: list[int] = Field(default_factory=list)
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
